"""The knowledge graph: entities, relations and mentions, how names resolve, how the graph is
written, read and searched, and the reference MCP memory server's graph kept on top of it."""

"""The knowledge graph: entities, time-bounded relations and the mentions that link them to
episodes (docs/graph.md).

    rules      the pure decisions: names and their keys, resolution, cardinality, edge placement
    entities   its I/O: upserts, relate / unrelate, mentions, reads, what an erasure takes
    retrieve   the `graph` retriever: episodes reached through the entities a query names
    reference  the reference MCP memory server's graph, kept on the real entities and relations

The SQL is the store's (store/graph.py).
"""

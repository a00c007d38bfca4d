"""The MCP face of engram: memory tools and the reference memory server's knowledge-graph tools
over the official `mcp` SDK, standalone (`engram mcp`) or mounted in a multi-tenant ASGI host.
The reference's graph lives in engram's knowledge graph (`engram.graph.reference`).

    server   the tools, `build_server(resolve)` and `serve(...)`
    wire     what the tools send and receive, and the translation from engram's types
    mount    stateless streamable HTTP for a host that picks the Memory per request
"""

from .server import TRANSPORTS, build_server, current_request, serve

__all__ = ["TRANSPORTS", "build_server", "current_request", "serve"]

"""The MCP server inside a multi-tenant ASGI host (the REST service mounts it at /mcp).

It runs the SDK's streamable HTTP transport in stateless mode: every POST is a complete
exchange, so any host process behind a load balancer can answer any call. Each tool call asks
the host's `resolve(request)` for the Memory of the request it came in on; authentication
stays with the host, which wraps `app` in its own guard.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.types import ASGIApp

from .. import Memory
from .server import build_server, current_request


class Mount:
    def __init__(self, resolve: Callable[[Request | None], Memory],
                 may_write_rules: Callable[[Request | None], bool] | None = None) -> None:
        allowed = None if may_write_rules is None else (
            lambda: may_write_rules(current_request()))
        self.server = build_server(lambda: resolve(current_request()), may_write_rules=allowed)
        # Host checks guard a server bound to localhost from DNS rebinding; a mounted server sits
        # behind whatever host name the service is given, and the host authenticates every call.
        self.server.streamable_http_app(
            streamable_http_path="/mcp", stateless_http=True, json_response=True,
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
        self.app: ASGIApp = StreamableHTTPASGIApp(self.server.session_manager)

    def lifespan(self) -> AbstractAsyncContextManager[None]:
        """The transport's task group: entered for as long as the host serves."""
        return self.server.session_manager.run()

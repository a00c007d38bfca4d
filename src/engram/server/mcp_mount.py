"""The MCP server (engram.mcp) inside the REST service, at /mcp, behind the same bearer keys.

It runs the SDK's streamable HTTP transport in stateless mode: every POST is a complete
exchange, so any service process behind a load balancer can answer any call. Each tool call
resolves the caller's tenant `Memory` from the request it came in on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
from mcp.server.transport_security import TransportSecuritySettings
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import EngramError, InvalidInput
from ..mcp import build_server, current_request
from ..memory import Memory
from .auth import Authenticator, Principal
from .errors import ServiceError, classify
from .ratelimit import RateLimiter, retry_after_header
from .tenants import Tenants

PRINCIPAL = "engram.principal"  # the ASGI scope key the bearer key's principal is kept under


class MCPMount:
    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants
        self.server = build_server(self._resolve)
        # Host checks guard a server bound to localhost from DNS rebinding; this one refuses
        # every call without an API key instead, and sits behind whatever host name it is given.
        self.server.streamable_http_app(
            streamable_http_path="/mcp", stateless_http=True, json_response=True,
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
        self.handler = StreamableHTTPASGIApp(self.server.session_manager)

    @classmethod
    def create(cls, tenants: Tenants) -> MCPMount:
        return cls(tenants)

    def lifespan(self) -> AbstractAsyncContextManager[None]:
        return self.server.session_manager.run()

    def _resolve(self) -> Memory:
        request = current_request()
        principal = request.scope.get(PRINCIPAL) if request is not None else None
        if not isinstance(principal, Principal):  # unreachable through asgi(): it always sets one
            raise InvalidInput("an MCP call reached engram without an authenticated principal")
        return self.tenants.get(principal.tenant)

    def asgi(self, auth: Authenticator, limiter: RateLimiter) -> ASGIApp:
        return _Guard(self.handler, auth, limiter)


class _Guard:
    """Bearer auth and the tenant's rate limit in front of the MCP transport."""

    def __init__(self, app: Callable[..., Any], auth: Authenticator, limiter: RateLimiter) -> None:
        self.app = app
        self.auth = auth
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["engram.route"] = "/mcp"
        header = dict(scope["headers"]).get(b"authorization")
        try:
            principal = self.auth(header.decode("latin-1") if header is not None else None)
            wait = self.limiter.take(principal.bucket)
            if wait > 0:
                raise ServiceError(429, "rate_limited", "rate limit reached; retry later",
                                   {"Retry-After": retry_after_header(wait)})
        except ServiceError as exc:
            await _error(send, exc.status, exc.code, exc.message, exc.headers)
            return
        except EngramError as exc:  # the key store is down
            status, code, headers = classify(exc)
            await _error(send, status, code, str(exc), headers)
            return
        scope[PRINCIPAL] = principal
        await self.app(scope, receive, send)


async def _error(send: Send, status: int, code: str, message: str, headers: dict[str, str]) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})

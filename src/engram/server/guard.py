"""Bearer auth and the tenant's rate limit in front of a raw ASGI app that FastAPI does not
route (the MCP endpoint), refusing in the service's JSON error shape.

The authenticated principal is left in the ASGI scope under `PRINCIPAL`, where the app's
`resolve` finds the tenant.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import EngramError, InvalidInput
from .auth import Authenticator, Principal, require_writer
from .errors import ServiceError, classify
from .ratelimit import Limiter, retry_after_header

PRINCIPAL = "engram.principal"  # the ASGI scope key the bearer key's principal is kept under


def principal_of(scope: Any) -> Principal:
    """The principal `Guard` authenticated for this request's ASGI scope."""
    principal = scope.get(PRINCIPAL) if scope is not None else None
    if not isinstance(principal, Principal):  # unreachable behind Guard: it always sets one
        raise InvalidInput("a call reached engram without an authenticated principal")
    return principal


def authorization(values: list[str]) -> str | None:
    """The one Authorization header of a request. Two are refused (400): REST and /mcp, and any
    proxy in front, must never read different keys from the same request."""
    if len(values) > 1:
        raise ServiceError(400, "bad_request", "the request has more than one Authorization header")
    return values[0] if values else None


class Guard:
    def __init__(self, app: ASGIApp, auth: Authenticator, limiter: Limiter, *, route: str) -> None:
        self.app = app
        self.auth = auth
        self.limiter = limiter
        self.route = route  # what the metrics label this route with

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["engram.route"] = self.route
        try:
            principal = self.auth(authorization(
                [v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"authorization"]))
            # the MCP tools read and write through one endpoint: a read-only key gets none
            require_writer(principal, "the MCP endpoint")
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

"""What a web page can make a browser send, refused before any route runs.

Any page a user opens can send a "simple" cross-site request (a form's `text/plain` or
url-encoded POST, no preflight) to a service on the user's machine, and a page served from a
name the attacker points at 127.0.0.1 (DNS rebinding) reads the answers. So:
- every request with a body must say `application/json` (or `application/x-ndjson` for an
  import): anything else is 415, and a browser cannot send JSON cross-site without a CORS
  preflight, which this service never grants;
- with auth off (`engram serve --no-auth`), the `Host` must name a loopback address
  (`localhost`, 127.0.0.0/8, ::1), and a browser's `Origin`, when sent, must be one too:
  anything else is 403.
"""

from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

BODY_TYPES = frozenset({"application/json", "application/x-ndjson"})
# The console's own forms (/ui): a form post is what a browser sends cross-site without asking,
# which is why each carries the console's CSRF token and the console checks it.
CONSOLE_TYPES = frozenset({"application/x-www-form-urlencoded"})
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def is_loopback(host: str) -> bool:
    """Is this host name or address (optionally in brackets) the machine itself?"""
    name = host.strip().lower().removeprefix("[").removesuffix("]")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str:
    """The host of a `Host` header (`name`, `name:port`, `[v6]:port`), without the port."""
    header = header.strip()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class BrowserGuard:
    """Refuses what a hostile page could make a browser send (see the module docstring).
    `local_only` (auth off) adds the Host and Origin checks."""

    def __init__(self, app: ASGIApp, *, local_only: bool) -> None:
        self.app = app
        self.local_only = local_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = [(k.lower(), v.decode("latin-1")) for k, v in scope["headers"]]
        refusal = self._refusal(scope, dict(headers))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, code, message = refusal
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, scope: Scope, headers: dict[bytes, str]) -> tuple[int, str, str] | None:
        if self.local_only:
            host = headers.get(b"host", "")
            if not is_loopback(host_of(host)):
                return (403, "host_not_allowed", "this service runs without authentication and "
                        f"answers only to a loopback Host (localhost, 127.0.0.1, ::1), not {host!r:.100}")
            origin = headers.get(b"origin")
            if origin is not None and not is_loopback(urlsplit(origin).hostname or ""):
                return (403, "origin_not_allowed", "this service runs without authentication and "
                        "answers no request sent by another site's page")
        if scope["method"] in WRITE_METHODS:
            ctype = headers.get(b"content-type", "").split(";", 1)[0].strip().lower()
            has_body = headers.get(b"content-length", "0") != "0" or b"transfer-encoding" in headers
            path = scope.get("path", "")
            allowed = CONSOLE_TYPES if path == "/ui" or path.startswith("/ui/") else BODY_TYPES
            if (has_body or ctype) and ctype not in allowed:
                return (415, "unsupported_media_type", "a request body must be application/json "
                        f"(application/x-ndjson for an import), not {ctype or 'untyped'!r:.100}")
        return None

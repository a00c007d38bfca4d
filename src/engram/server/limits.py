"""What one request may cost: the body size limit (413) and the service's limit settings.

The body is read before the app sees it, up to the limit and no further, so an oversized
upload is refused after at most `max_body_bytes` bytes whatever its Content-Length claims.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass(frozen=True)
class ServiceLimits:
    max_body_bytes: int = 1_048_576  # 1 MiB: 32k characters of text fit many times over
    rate: float = 50.0               # requests per second per tenant, sustained
    burst: int = 100                 # requests a tenant may make at once
    # Buckets in the database, shared by every service process over it (`engram serve` turns
    # this on); off, each process keeps its own and N processes allow N times the rate.
    shared: bool = False

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024 or self.rate <= 0 or self.burst < 1:
            raise ValueError("max_body_bytes must be >= 1024, rate > 0, burst >= 1")


EMBED_CHARS_PER_UNIT = 2000  # about what the embedder does in the time of a cheap request


def cost(texts: Iterable[str]) -> float:
    """What a request that embeds `texts` costs in request units beyond the one every request
    pays: one unit per ~2,000 characters. A tenant that sends 500 long messages in one add pays
    for ~500 requests, so its next requests wait (429, Retry-After) while other tenants' do not."""
    return max(0.0, sum(len(t) for t in texts) / EMBED_CHARS_PER_UNIT - 1.0)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        payload = json.dumps({"error": {"code": "payload_too_large", "message":
                                        f"the request body is over {self.max_bytes} bytes"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})

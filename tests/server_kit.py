"""Helpers for the REST service tests: an app on real SQLite files with the real embedder,
API keys for two tenants (an admin and a member key each), and a client per key."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi.testclient import TestClient

from engram.config import Config
from engram.providers.embedders import Embedder
from engram.server import ServiceLimits, create_app
from engram.server.keys import KeyStore, PostgresKeyStore, SQLiteKeyStore


@dataclass
class Service:
    client: TestClient
    keys: KeyStore
    tokens: dict[str, str]  # "a-admin", "a-member", "b-admin", "b-member" -> API key
    config: Config

    def h(self, who: str) -> dict[str, str]:
        """The Authorization header of a key."""
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    def call(self, who: str, method: str, url: str, **kwargs: Any) -> Any:
        headers = {**self.h(who), **kwargs.pop("headers", {})}
        return self.client.request(method, url, headers=headers, **kwargs)


@contextmanager
def service(tmp_path: Path, embedder: Embedder, *, limits: ServiceLimits | None = None,
            database_url: str | None = None, **config: Any) -> Iterator[Service]:
    """The service on SQLite files under `tmp_path`, or on PostgreSQL at `database_url`."""
    cfg = Config(path=tmp_path / "data" / "engram.db", database_url=database_url, **config)
    keys: KeyStore = (PostgresKeyStore(database_url) if database_url
                      else SQLiteKeyStore(tmp_path / "data" / "keys.db"))
    tokens = {}
    for tenant in ("a", "b"):
        for role in ("admin", "member"):
            tokens[f"{tenant}-{role}"] = keys.create(tenant, role, f"{tenant} {role}")[1]
    app = create_app(cfg, embedder=embedder, keys=keys,
                     limits=limits or ServiceLimits(rate=10_000, burst=10_000))
    try:
        with TestClient(app) as client:
            yield Service(client, keys, tokens, cfg)
    finally:
        keys.close()


def error_code(response: Any) -> str:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    return str(body["error"]["code"])


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run an ASGI app on a real uvicorn in this process; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections wait in the backlog until uvicorn has started: no polling
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()

"""Faults: the database goes away under a running service. Requests answer 503 with
Retry-After (never a 500, never a hang), /ready fails, a failed write leaves nothing behind,
and the service recovers by itself when the database returns. On a real PostgreSQL (stopped
and started) and on SQLite (locked by another writer; its directory gone)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engram.config import Config
from engram.providers.embedders import MiniLM
from engram.server import ServiceLimits, create_app
from engram.server.keys import PostgresKeyStore, SQLiteKeyStore
from pg_server import PgTestServer
from server_kit import error_code

LIMITS = ServiceLimits(rate=10_000, burst=10_000)


def _assert_503(r: Any) -> None:
    assert r.status_code == 503, r.text
    assert error_code(r) in ("store_unavailable", "store_busy")
    assert int(r.headers["Retry-After"]) >= 1


def _wait_ready(client: TestClient, tries: int = 100) -> None:
    """Poll /ready as a load balancer would (each call bounded by the connect timeout)."""
    for _ in range(tries):
        if client.get("/ready").status_code == 200:
            return
    raise AssertionError("the service did not become ready again")


# -- PostgreSQL: the real server stopped and started ---------------------------------------------

@pytest.fixture
def pg() -> Iterator[PgTestServer]:
    server = PgTestServer().start()  # its own server: stopping it disturbs no other test
    try:
        yield server
    finally:
        server.stop()


def test_postgres_stopped_mid_run(pg: PgTestServer, tmp_path: Path, embedder: MiniLM) -> None:
    url = pg.url(pg.create_database())
    cfg = Config(path=tmp_path / "unused.db", database_url=url, busy_timeout_s=2.0)
    keys = PostgresKeyStore(url, connect_timeout_s=2.0)
    token = keys.create("acme", "admin")[1]
    h = {"Authorization": f"Bearer {token}"}
    app = create_app(cfg, embedder=embedder, keys=keys, limits=LIMITS)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            assert client.post("/v1/memories", headers=h, json={"messages": "before the outage"}
                               ).status_code == 201
            assert client.get("/ready").status_code == 200

            pg._server.stop()
            for method, url_, body in (("POST", "/v1/memories", {"messages": "during the outage"}),
                                       ("GET", "/v1/memories", None),
                                       ("POST", "/v1/memories/search", {"query": "outage"})):
                _assert_503(client.request(method, url_, headers=h, json=body))
            ready = client.get("/ready")
            assert ready.status_code == 503 and error_code(ready) == "store_unavailable"
            assert client.get("/health").status_code == 200  # alive, just not ready

            pg._server.start()
            _wait_ready(client)
            r = client.post("/v1/memories", headers=h, json={"messages": "after the outage"})
            assert r.status_code == 201, r.text
            texts = [m["text"] for m in client.get("/v1/memories", headers=h).json()["items"]]
            assert texts == ["before the outage", "after the outage"]  # nothing half-written
    finally:
        keys.close()


# -- SQLite -----------------------------------------------------------------------------------

@pytest.fixture
def sqlite_app(tmp_path: Path, embedder: MiniLM) -> Iterator[tuple[TestClient, dict[str, str], Any]]:
    cfg = Config(path=tmp_path / "data" / "engram.db", busy_timeout_s=0.3)
    keys = SQLiteKeyStore(tmp_path / "data" / "keys.db")
    tokens = {t: keys.create(t, "admin")[1] for t in ("a", "c")}
    app = create_app(cfg, embedder=embedder, keys=keys, limits=LIMITS)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client, {t: f"Bearer {k}" for t, k in tokens.items()}, app
    finally:
        keys.close()


def test_sqlite_locked_by_another_writer(sqlite_app: tuple[TestClient, dict[str, str], Any]) -> None:
    client, auth, app = sqlite_app
    h = {"Authorization": auth["a"]}
    assert client.post("/v1/memories", headers=h, json={"messages": "first"}).status_code == 201
    path = app.state.tenants.get("a").store.path
    with closing(sqlite3.connect(path, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")  # another process's long write transaction
        _assert_503(client.post("/v1/memories", headers=h, json={"messages": "blocked"}))
        assert client.get("/v1/memories", headers=h).status_code == 200  # readers go on (WAL)
        other.execute("ROLLBACK")
    assert client.post("/v1/memories", headers=h, json={"messages": "second"}).status_code == 201
    texts = [m["text"] for m in client.get("/v1/memories", headers=h).json()["items"]]
    assert texts == ["first", "second"]


def test_sqlite_directory_gone(sqlite_app: tuple[TestClient, dict[str, str], Any],
                               tmp_path: Path) -> None:
    client, auth, _ = sqlite_app
    assert client.get("/ready").status_code == 200
    data, away = tmp_path / "data", tmp_path / "data.away"
    data.rename(away)
    data.write_text("not a directory")  # the volume is gone and something else is in its place
    try:
        ready = client.get("/ready")
        assert ready.status_code == 503 and error_code(ready) == "store_unavailable"
        # A tenant whose database has to be opened now cannot be served: 503, not 500.
        _assert_503(client.post("/v1/memories", headers={"Authorization": auth["c"]},
                                json={"messages": "while the disk is away"}))
    finally:
        data.unlink()
        away.rename(data)
    _wait_ready(client)
    r = client.post("/v1/memories", headers={"Authorization": auth["c"]}, json={"messages": "back"})
    assert r.status_code == 201
    assert [m["text"] for m in client.get("/v1/memories", headers={"Authorization": auth["c"]}
                                          ).json()["items"]] == ["back"]

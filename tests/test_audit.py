"""The audit trail: every memory call of the service leaves a structured log line and a row
with the key's id, tenant, route, scope, status and result size; never the key, never text."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import psycopg
import pytest

from pg_server import PG
from server_kit import error_code, service

CANARY = "xqaudit8841"


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_every_memory_call_is_audited_without_text_or_key(tmp_path: Path, embedder, backend: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engram.audit")
    url = PG.database_for(tmp_path) if backend == "postgres" else None
    with service(tmp_path, embedder, database_url=url) as svc:
        ids = {k.name: k.id for k in svc.keys.list("a")}
        added = svc.call("a-member", "POST", "/v1/memories",
                         json={"messages": f"my code is {CANARY}", "user_id": "u1"})
        assert added.status_code == 201
        mid = added.json()["memories"][0]["id"]
        assert svc.call("a-member", "POST", "/v1/memories/search",
                        json={"query": CANARY, "user_id": "u1"}).status_code == 200
        assert svc.call("a-member", "GET", f"/v1/memories/{mid}").status_code == 200
        assert svc.call("b-member", "GET", f"/v1/memories/{mid}").status_code == 404
        erased = svc.call("a-admin", "POST", "/v1/erase", json={"user_id": "u1"})
        assert erased.status_code == 200
        assert erased.json()["erased"] == 1 and erased.json()["receipt"]["by_kind"] == {"episodic": 1}

        mcp = svc.call("a-member", "POST", "/mcp", headers={
            "Accept": "application/json, text/event-stream"}, json={
            "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "audit-test", "version": "1"}}})
        assert mcp.status_code == 200, mcp.text
        denied = svc.call("a-member", "GET", "/v1/audit")
        assert denied.status_code == 403 and error_code(denied) == "forbidden"
        got = svc.call("a-admin", "GET", "/v1/audit", params={"limit": 50})
        assert got.status_code == 200
        entries = got.json()["entries"]
        calls = [(e["method"], e["route"], e["status"]) for e in reversed(entries)]
        assert calls[:6] == [("POST", "/v1/memories", 201), ("POST", "/v1/memories/search", 200),
                             ("GET", "/v1/memories/{id}", 200), ("POST", "/v1/erase", 200),
                             ("POST", "/mcp", 200), ("GET", "/v1/audit", 403)]
        assert entries[-5]["key_id"] == ids["a member"]  # the MCP call, by the same key
        first = entries[-1]
        assert (first["key_id"], first["tenant"], first["user_id"]) == (ids["a member"], "a", "u1")
        assert first["result_bytes"] == len(added.content)
        assert {e["tenant"] for e in entries} == {"a"}  # another tenant's calls are not shown
        b_view = svc.call("b-admin", "GET", "/v1/audit").json()["entries"]
        assert [(e["route"], e["status"]) for e in b_view] == [("/v1/memories/{id}", 404)]
        only_member = svc.call("a-admin", "GET", "/v1/audit",
                               params={"key_id": ids["a member"]}).json()["entries"]
        assert {e["key_id"] for e in only_member} == {ids["a member"]}

        receipts = svc.call("a-admin", "GET", "/v1/receipts").json()["receipts"]
        hashed = "sha256:" + hashlib.sha256(b"u1").hexdigest()[:16]  # the erased user, not named
        assert [(r["target"], r["memories"], r["scope"]["user_id"]) for r in receipts] == [
            ("scope", 1, hashed)]
        assert receipts[0] == erased.json()["receipt"]  # retrievable later, the same
        assert svc.call("a-member", "GET", "/v1/receipts").status_code == 403

        secrets = list(svc.tokens.values())
        if url is None:
            audit_db = svc.config.path.parent / "audit.db"
            raw = b"".join(p.read_bytes() for p in audit_db.parent.glob("audit.db*"))
        else:
            with psycopg.connect(url) as conn:
                raw = repr(conn.execute("SELECT * FROM engram_audit").fetchall()).encode()
    assert raw and CANARY.encode() not in raw
    assert not any(s.encode() in raw for s in secrets)
    lines = [r.getMessage() for r in caplog.records if r.name == "engram.audit"]
    assert len(lines) >= 9 and all(CANARY not in line for line in lines)
    assert not any(s in line for s in secrets for line in lines)


def test_console_pages_are_audited_like_the_api(tmp_path: Path, embedder) -> None:
    """The console reads and changes memory through the same tenants: its pages are in the
    trail under their route templates, with the key's id; its static files are not."""
    with service(tmp_path, embedder) as svc:
        ids = {k.name: k.id for k in svc.keys.list("a")}
        assert svc.call("a-member", "POST", "/v1/memories",
                        json={"messages": f"my code is {CANARY}", "user_id": "u1"}).status_code == 201
        page = svc.call("a-member", "GET", "/ui/memories", params={"user_id": "u1"})
        assert page.status_code == 200 and CANARY in page.text
        assert svc.call("a-member", "GET", "/ui/search",
                        params={"user_id": "u1", "q": "code"}).status_code == 200
        entries = svc.call("a-admin", "GET", "/v1/audit").json()["entries"]
    ui = [(e["route"], e["user_id"], e["key_id"]) for e in reversed(entries)
          if e["route"].startswith("/ui")]
    assert ui == [("/ui/memories", "u1", ids["a member"]), ("/ui/search", "u1", ids["a member"])]


def test_entries_are_written_off_the_request_path_in_groups(tmp_path: Path) -> None:
    """Calls queue their entries and go on; one thread writes them, many per transaction;
    a read, and closing, wait for what is queued."""
    import threading
    from datetime import UTC, datetime

    from engram.server.audit import Entry, GroupWriter, SQLiteAuditLog

    class Counting(SQLiteAuditLog):
        def __init__(self, path: Path) -> None:
            super().__init__(path)
            self.writes: list[int] = []

        def record_many(self, entries: list[Entry]) -> None:
            self.writes.append(len(entries))
            super().record_many(entries)

    inner = Counting(tmp_path / "audit.db")
    writer = GroupWriter(inner)

    def call(n: int) -> None:
        for i in range(50):
            writer.record(Entry(f"{n}-{i}", datetime.now(UTC), "k", "t", "GET", "/v1/x", 200,
                                None, None, None, 10, 1.0))

    threads = [threading.Thread(target=call, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(writer.entries(tenant="t", limit=1000)) == 400  # the read waited for the queue
    assert sum(inner.writes) == 400 and len(inner.writes) < 400  # grouped
    writer.record(Entry("last", datetime.now(UTC), "k", "t", "GET", "/v1/x", 200, None, None,
                        None, 10, 1.0))
    writer.close()
    again = SQLiteAuditLog(tmp_path / "audit.db")
    assert len(again.entries(tenant="t", limit=1000)) == 401  # closing wrote the last one
    again.close()

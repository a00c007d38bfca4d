"""Findings of the adversarial probe (issue 14) in the service itself: what a web page can make
a browser send to a no-auth service, headers read two ways, /metrics, session deletes, file
modes, and the /mcp GET that never answered."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from engram.cli import app as cli
from engram.config import Config
from engram.providers.embedders import MiniLM
from engram.server import ServiceLimits, create_app
from engram.server.local import is_loopback
from server_kit import Service, error_code, service

INIT = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
MCP_ACCEPT = {"Accept": "application/json, text/event-stream"}


@pytest.fixture
def svc(tmp_path: Path, embedder: MiniLM) -> Iterator[Service]:
    with service(tmp_path, embedder) as s:
        yield s


@pytest.fixture
def local(tmp_path: Path, embedder: MiniLM) -> Iterator[TestClient]:
    """The service with --no-auth, as `make run` starts it; the client says Host: 127.0.0.1."""
    app = create_app(Config(path=tmp_path / "engram.db"), auth=False, embedder=embedder,
                     limits=ServiceLimits(rate=1000, burst=1000))
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        yield client


# -- no-auth mode ------------------------------------------------------------------------------

def test_no_auth_refuses_other_hosts(local: TestClient) -> None:
    for host in ("evil.example", "127.0.0.1.evil.example", "10.0.0.5:8000", "[fe80::1]:8000"):
        for method, url, kwargs in (("GET", "/v1/memories", {}), ("POST", "/mcp", {"json": INIT}),
                                    ("GET", "/metrics", {})):
            r = local.request(method, url, headers={"Host": host, **MCP_ACCEPT}, **kwargs)
            assert r.status_code == 403 and error_code(r) == "host_not_allowed", (host, url, r.text)
    for host in ("127.0.0.1:8000", "localhost:8000", "127.0.0.2", "[::1]:8000", "LOCALHOST"):
        r = local.get("/v1/memories", headers={"Host": host})
        assert r.status_code == 200, (host, r.text)


def test_no_auth_refuses_cross_site_requests(local: TestClient) -> None:
    r = local.post("/v1/sessions/x/end", headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and error_code(r) == "origin_not_allowed", r.text
    r = local.get("/v1/memories", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200, r.text


def test_write_routes_refuse_other_content_types(local: TestClient, svc: Service) -> None:
    export = '{"format": "engram-export", "version": 1, "scope": {}}\n'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = local.post("/v1/import", content=export.encode(), headers={"Content-Type": ctype})
        assert r.status_code == 415 and error_code(r) == "unsupported_media_type", r.text
        r = local.post("/v1/memories", content=b'{"messages": "hi"}', headers={"Content-Type": ctype})
        assert r.status_code == 415, r.text
        r = svc.call("a-admin", "POST", "/v1/memories", content=b'{"messages": "hi"}',
                     headers={"Content-Type": ctype})
        assert r.status_code == 415, r.text
    r = local.post("/v1/memories", content=b'{"messages": "hi"}')  # no content type at all
    assert r.status_code == 415, r.text
    assert local.get("/v1/memories").json()["items"] == []
    r = local.post("/v1/import", content=export.encode(), headers={"Content-Type": "application/x-ndjson"})
    assert r.status_code == 200, r.text
    r = local.post("/v1/memories", content=b'{"messages": "hi"}',
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 201, r.text


def test_loopback_addresses() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "localhost", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "192.168.1.2", "example.com", "128.0.0.1", ""):
        assert not is_loopback(host), host


def test_serve_refuses_no_auth_on_a_public_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Any] = []
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: started.append(k))
    db = str(tmp_path / "s.db")
    r = CliRunner().invoke(cli, ["--db", db, "serve", "--no-auth", "--host", "0.0.0.0"])
    assert r.exit_code != 0 and "--allow-remote-no-auth" in r.output and not started, r.output
    r = CliRunner().invoke(cli, ["--db", db, "serve", "--no-auth", "--host", "127.0.0.2"])
    assert r.exit_code == 0 and started and "not a loopback" not in r.output, r.output
    r = CliRunner().invoke(cli, ["--db", db, "serve", "--no-auth", "--host", "0.0.0.0",
                                 "--allow-remote-no-auth"])
    assert r.exit_code == 0 and len(started) == 2, r.output


# -- headers, /mcp, /metrics -------------------------------------------------------------------

def test_two_authorization_headers_are_refused(svc: Service) -> None:
    both = [("Authorization", f"Bearer {svc.tokens['a-admin']}"),
            ("Authorization", f"Bearer {svc.tokens['b-admin']}")]
    for url, method, kwargs in (("/v1/memories", "GET", {}),
                                ("/mcp", "POST", {"json": INIT})):
        r = svc.client.request(method, url, headers=[*both, *MCP_ACCEPT.items()], **kwargs)
        assert r.status_code == 400 and error_code(r) == "bad_request", (url, r.text)


def test_get_mcp_answers_405(svc: Service) -> None:
    r = svc.call("a-admin", "GET", "/mcp", headers={"Accept": "text/event-stream"})
    assert r.status_code == 405, r.text


def test_metrics_without_a_key_show_no_tenant_counts(svc: Service) -> None:
    r = svc.call("a-member", "POST", "/v1/memories", json={"messages": "canary", "user_id": "u"})
    assert r.status_code == 201
    text = svc.client.get("/metrics").text
    assert "engram_http_request_duration_seconds" in text
    assert "engram_memories_stored" not in text and "engram_jobs_queued" not in text
    own = svc.call("a-admin", "GET", "/metrics").text
    assert "engram_memories_stored 1.0" in own
    other = svc.call("b-admin", "GET", "/metrics").text
    assert "engram_memories_stored 0.0" in other
    assert svc.call("a-member", "GET", "/metrics").status_code == 403


# -- routes ------------------------------------------------------------------------------------

def test_session_delete_without_user_is_ambiguous(svc: Service) -> None:
    r = svc.call("a-member", "POST", "/v1/sessions", json={"session_id": "chat", "user_id": "ana"})
    assert r.status_code == 201
    for user in ("ana", "bob"):
        r = svc.call("a-member", "POST", "/v1/memories", json={
            "messages": f"{user} says hi", "user_id": user, "session_id": "chat", "infer": False})
        assert r.status_code == 201
    r = svc.call("a-admin", "DELETE", "/v1/sessions/chat")
    assert r.status_code == 422 and "ambiguous" in r.json()["error"]["message"], r.text
    assert len(svc.call("a-admin", "GET", "/v1/memories", params={"session_id": "chat"}).json()["items"]) == 2
    assert svc.call("a-admin", "DELETE", "/v1/sessions/chat", params={"user_id": "ana"}).status_code == 204
    left = svc.call("a-admin", "GET", "/v1/memories", params={"session_id": "chat"}).json()["items"]
    assert [m["text"] for m in left] == ["bob says hi"]


def test_patch_importance_null_is_refused(svc: Service) -> None:
    r = svc.call("a-member", "POST", "/v1/memories", json={"messages": "x y", "user_id": "u",
                                                          "importance": 0.9, "kind": "semantic"})
    mid = r.json()["memories"][0]["id"]
    r = svc.call("a-member", "PATCH", f"/v1/memories/{mid}", json={"importance": None})
    assert r.status_code == 422, r.text
    assert svc.call("a-member", "GET", f"/v1/memories/{mid}").json()["importance"] == 0.9


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_are_private(svc: Service, tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        r = svc.call("a-member", "POST", "/v1/memories", json={"messages": "x", "user_id": "u"})
        assert r.status_code == 201
        data = tmp_path / "data"
        dbs = [p for p in data.rglob("*") if p.is_file() and p.suffix in (".db", "")]
        assert dbs and all(_mode(p) == 0o600 for p in dbs), {str(p): oct(_mode(p)) for p in dbs}
        seen: list[int] = []
        real_response = __import__("starlette.responses", fromlist=["FileResponse"]).FileResponse
        original = real_response.__call__

        async def spy(self: Any, scope: Any, receive: Any, send: Any) -> None:
            seen.append(_mode(Path(self.path)))
            await original(self, scope, receive, send)

        real_response.__call__ = spy
        try:
            assert svc.call("a-admin", "GET", "/v1/export").status_code == 200
        finally:
            real_response.__call__ = original
        assert seen == [0o600]
    finally:
        os.umask(old)

"""The REST service in-process (FastAPI TestClient over httpx), on real SQLite files with the
real MiniLM embedder: routes, auth and roles, tenant isolation, bounds, rate limits, metrics."""

from __future__ import annotations

import json
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engram import Memory
from engram.config import Config
from engram.providers.embedders import MiniLM, space
from engram.server import ServiceLimits, create_app
from server_kit import Service, error_code, service


@pytest.fixture
def svc(tmp_path: Path, embedder: MiniLM) -> Iterator[Service]:
    with service(tmp_path, embedder) as s:
        yield s


@pytest.fixture(params=["sqlite", "postgres"])
def any_svc(request: pytest.FixtureRequest, tmp_path: Path, embedder: MiniLM) -> Iterator[Service]:
    """The service on each backend: PostgreSQL (a fresh database of the session's server, as a
    role that is not a superuser, so row-level security applies) or SQLite files."""
    url = None
    if request.param == "postgres":
        url = request.getfixturevalue("pg_server").database_for(tmp_path)  # dropped after the test
    with service(tmp_path, embedder, database_url=url) as s:
        yield s


def add(svc: Service, who: str, messages: Any, **fields: Any) -> dict[str, Any]:
    r = svc.call(who, "POST", "/v1/memories", json={"messages": messages, **fields})
    assert r.status_code == 201, r.text
    return r.json()


# -- routes ------------------------------------------------------------------------------------

def test_memory_lifecycle_over_http(any_svc: Service) -> None:
    svc = any_svc
    out = add(svc, "a-member", [
        {"role": "user", "name": "Ana", "content": "I moved to Lisbon for a new job."},
        {"role": "assistant", "content": "Congratulations! What is the job?"},
    ], user_id="ana", session_id="s1", observed_at="2024-04-02T18:30:00Z")
    assert [e["type"] for e in out["events"]] == ["ADD", "ADD"]
    assert out["job"] is None
    first = out["memories"][0]
    assert first["scope"] == {"user_id": "ana", "agent_id": None, "session_id": "s1"}
    assert first["observed_at"].startswith("2024-04-02T18:30")

    fact = add(svc, "a-member", "Ana is vegetarian", user_id="ana", kind="semantic",
               importance=0.8)["memories"][0]
    again = add(svc, "a-member", "ana is vegetarian.", user_id="ana", kind="semantic")
    assert again["memories"][0]["id"] == fact["id"] and again["events"] == []  # consolidated

    r = svc.call("a-member", "POST", "/v1/memories/search",
                 json={"query": "Which city did Ana move to?", "user_id": "ana", "limit": 2})
    assert r.status_code == 200
    hits = r.json()["hits"]
    assert len(hits) == 2 and any("Lisbon" in h["memory"]["text"] for h in hits)
    assert {"dense", "lexical", "score"} <= set(hits[0]["explain"])

    page = svc.call("a-member", "GET", "/v1/memories", params={"user_id": "ana", "limit": 2}).json()
    assert len(page["items"]) == 2 and page["next_cursor"]
    rest = svc.call("a-member", "GET", "/v1/memories",
                    params={"user_id": "ana", "cursor": page["next_cursor"]}).json()
    assert [m["id"] for m in rest["items"]] == [fact["id"]] and rest["next_cursor"] is None
    facts = svc.call("a-member", "GET", "/v1/memories",
                     params={"kind": "semantic", "filters": json.dumps({"importance": {"gte": 0.7}})})
    assert [m["id"] for m in facts.json()["items"]] == [fact["id"]]

    r = svc.call("a-member", "PATCH", f"/v1/memories/{fact['id']}",
                 json={"text": "Ana is pescatarian", "metadata": {"source": "chat"}})
    assert r.status_code == 200 and r.json()["text"] == "Ana is pescatarian"
    assert r.json()["metadata"] == {"source": "chat"} and r.json()["importance"] == 0.8
    got = svc.call("a-member", "GET", f"/v1/memories/{fact['id']}").json()
    assert got["text"] == "Ana is pescatarian"

    assert svc.call("a-member", "DELETE", f"/v1/memories/{fact['id']}").status_code == 204
    gone = svc.call("a-member", "GET", f"/v1/memories/{fact['id']}")
    assert gone.status_code == 404 and error_code(gone) == "not_found"
    history = svc.call("a-member", "GET", f"/v1/memories/{fact['id']}/history").json()
    assert [e["type"] for e in history["events"]] == ["ADD", "UPDATE", "DELETE"]


def test_erase_export_import_need_an_admin_key(any_svc: Service) -> None:
    svc = any_svc
    add(svc, "a-member", "Ana's passport number is X123", user_id="ana", kind="semantic")
    for method, url, kwargs in (("POST", "/v1/erase", {"json": {"user_id": "ana"}}),
                                ("GET", "/v1/export", {}),
                                ("POST", "/v1/import", {"content": b"{}", "headers": {
                                    "Content-Type": "application/x-ndjson"}})):
        r = svc.call("a-member", method, url, **kwargs)
        assert r.status_code == 403 and error_code(r) == "forbidden", (url, r.text)

    export = svc.call("a-admin", "GET", "/v1/export", params={"user_id": "ana"})
    assert export.status_code == 200
    assert export.headers["content-type"].startswith("application/x-ndjson")
    lines = export.text.splitlines()
    assert json.loads(lines[0])["format"] == "engram-export" and len(lines) == 2

    # The export goes into tenant b as it is (ids kept), and tenant a's erasure leaves it there.
    r = svc.call("b-admin", "POST", "/v1/import", content=export.content,
                 headers={"Content-Type": "application/x-ndjson"})
    assert r.status_code == 200 and r.json() == {"imported": 1}
    r = svc.call("a-admin", "POST", "/v1/erase", json={"user_id": "ana"})
    assert r.status_code == 200 and r.json()["erased"] == 1
    assert r.json()["receipt"]["memories"] == 1  # and what it removed, without the text
    assert svc.call("a-member", "GET", "/v1/memories").json()["items"] == []
    assert [m["text"] for m in svc.call("b-member", "GET", "/v1/memories").json()["items"]] == [
        "Ana's passport number is X123"]

    bad = svc.call("b-admin", "POST", "/v1/import", content=b"not an export",
                   headers={"Content-Type": "application/x-ndjson"})
    assert bad.status_code == 422 and error_code(bad) == "invalid_input"
    refused = svc.call("a-admin", "POST", "/v1/erase", json={})
    assert refused.status_code == 422


def test_sessions_and_context(any_svc: Service) -> None:
    svc = any_svc
    r = svc.call("a-member", "POST", "/v1/sessions", json={"user_id": "ana", "session_id": "trip"})
    assert r.status_code == 201 and r.json()["scope"]["session_id"] == "trip"
    r = svc.call("a-member", "POST", "/v1/sessions/trip/messages", params={"user_id": "ana"},
                 json={"messages": [{"role": "user", "content": "I fly to Tokyo on May 3rd."},
                                    {"role": "assistant", "content": "Have a great trip!"}]})
    assert r.status_code == 201 and len(r.json()["memories"]) == 2
    got = svc.call("a-member", "GET", "/v1/sessions/trip", params={"user_id": "ana"})
    assert got.status_code == 200 and got.json()["scope"]["user_id"] == "ana"
    ctx = svc.call("a-member", "POST", "/v1/context",
                   json={"query": "When is my flight?", "user_id": "ana", "session_id": "trip",
                         "budget_tokens": 500})
    assert ctx.status_code == 200, ctx.text
    body = ctx.json()
    assert "Tokyo" in body["text"] and body["total_tokens"] <= 500
    assert body["messages"][-1] == {"role": "user", "content": "When is my flight?"}
    r = svc.call("a-member", "POST", "/v1/sessions/trip/messages",
                 json={"messages": [{"role": "robot", "content": "beep"}]})
    assert r.status_code == 422
    assert svc.call("a-member", "DELETE", "/v1/sessions/trip",
                    params={"user_id": "ana"}).status_code == 403
    assert svc.call("a-admin", "DELETE", "/v1/sessions/trip",
                    params={"user_id": "ana"}).status_code == 204
    assert svc.call("a-member", "GET", "/v1/sessions/trip").status_code == 404
    assert svc.call("a-member", "GET", "/v1/memories", params={"session_id": "trip"}).json()[
        "items"] == []


def test_background_add_and_job(any_svc: Service) -> None:
    svc = any_svc
    r = svc.call("a-member", "POST", "/v1/memories",
                 json={"messages": "Ana's sister is called Rita", "user_id": "ana", "background": True})
    assert r.status_code == 202, r.text
    job = r.json()["job"]
    assert job["status"] in ("queued", "running", "done") and r.json()["memories"] == []
    for _ in range(200):  # the in-process worker runs it; poll the route as a client would
        got = svc.call("a-member", "GET", f"/v1/jobs/{job['id']}").json()
        if got["status"] in ("done", "failed"):
            break
        svc.call("a-member", "GET", "/health")
    assert got["status"] == "done", got
    texts = [m["text"] for m in svc.call("a-member", "GET", "/v1/memories").json()["items"]]
    assert texts == ["Ana's sister is called Rita"]
    assert svc.call("b-member", "GET", f"/v1/jobs/{job['id']}").status_code == 404


def test_idempotency_key_retried_100_times_adds_once(any_svc: Service) -> None:
    svc = any_svc
    body = {"messages": "Ana booked the 9:40 train", "user_id": "ana"}
    headers = {"Idempotency-Key": "req-7f3a-0001"}
    first = svc.call("a-member", "POST", "/v1/memories", json=body, headers=headers)
    assert first.status_code == 201
    ids = {first.json()["memories"][0]["id"]}
    for _ in range(99):
        r = svc.call("a-member", "POST", "/v1/memories", json=body, headers=headers)
        assert r.status_code == 201
        ids.add(r.json()["memories"][0]["id"])
    assert len(ids) == 1
    items = svc.call("a-member", "GET", "/v1/memories", params={"limit": 100}).json()["items"]
    assert [m["text"] for m in items] == ["Ana booked the 9:40 train"]

    other = svc.call("a-member", "POST", "/v1/memories", headers=headers,
                     json={"messages": "Ana booked the 11:00 train", "user_id": "ana"})
    # The IETF Idempotency-Key draft: a key reused with another payload is a 422.
    assert other.status_code == 422 and error_code(other) == "idempotency_key_reused"
    # Keys are per tenant: tenant b's request under the same key is its own.
    assert svc.call("b-member", "POST", "/v1/memories", json=body, headers=headers).status_code == 201
    assert len(svc.call("a-member", "GET", "/v1/memories").json()["items"]) == 1


def test_idempotency_key_of_a_queued_request_answers_409_with_retry_after(
        tmp_path: Path, embedder: MiniLM) -> None:
    # No in-process worker: the first request stays queued, so a retry cannot be answered yet.
    with service(tmp_path, embedder, worker="off") as svc:
        body = {"messages": "Ana booked the 9:40 train", "user_id": "ana"}
        headers = {"Idempotency-Key": "req-queued-0001"}
        queued = svc.call("a-member", "POST", "/v1/memories", json={**body, "background": True},
                          headers=headers)
        assert queued.status_code == 202, queued.text
        retry = svc.call("a-member", "POST", "/v1/memories", json=body, headers=headers)
        assert retry.status_code == 409 and error_code(retry) == "in_progress", retry.text
        assert int(retry.headers["Retry-After"]) >= 1
        assert "queued" in retry.json()["error"]["message"]
        # A background retry is not held up: it answers the job it already queued.
        again = svc.call("a-member", "POST", "/v1/memories", json={**body, "background": True},
                         headers=headers)
        assert again.status_code == 202 and again.json()["job"]["id"] == queued.json()["job"]["id"]
        # Another body under the key is still a reuse, whatever the first request's state.
        other = svc.call("a-member", "POST", "/v1/memories", headers=headers,
                         json={"messages": "Ana booked the 11:00 train", "user_id": "ana"})
        assert other.status_code == 422 and error_code(other) == "idempotency_key_reused"


def test_without_the_mcp_extra_the_service_serves_no_mcp(tmp_path: Path, embedder: MiniLM,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)  # as if the mcp extra were not installed
    with service(tmp_path, embedder) as svc:
        r = svc.call("a-member", "POST", "/mcp", json={})
        assert r.status_code == 404 and error_code(r) == "not_found"
        assert svc.call("a-member", "GET", "/v1/memories").status_code == 200


# -- auth --------------------------------------------------------------------------------------

@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic abc", "Bearer nope",
                                    "Bearer engram_000000000000_" + "x" * 43, "Bearer " + "k" * 500])
def test_missing_or_bad_key_is_401(svc: Service, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    for method, url in (("GET", "/v1/memories"), ("POST", "/v1/memories/search"),
                        ("GET", "/v1/memories/x")):
        r = svc.client.request(method, url, headers=headers, json={"query": "x"})
        assert r.status_code == 401, (header, url)
        assert error_code(r) == "unauthorized"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_revoked_key_stops_working(svc: Service) -> None:
    assert svc.call("a-member", "GET", "/v1/memories").status_code == 200
    key_id = next(k.id for k in svc.keys.list("a") if k.role == "member")
    svc.keys.revoke(key_id)
    r = svc.call("a-member", "GET", "/v1/memories")
    assert r.status_code == 401 and error_code(r) == "unauthorized"
    assert svc.call("a-admin", "GET", "/v1/memories").status_code == 200


def test_keys_are_stored_hashed(svc: Service) -> None:
    files = [svc.keys.path, svc.keys.path.with_name(svc.keys.path.name + "-wal")]
    raw = b"".join(f.read_bytes() for f in files if f.exists())
    assert len(raw) > 0
    for token in svc.tokens.values():
        secret = token[len("engram_") + 13:]  # after the prefix and the public key id
        assert len(secret) >= 40 and secret.encode() not in raw


# -- tenant isolation --------------------------------------------------------------------------

CANARY = "canary-7f3a: tenant A's secret is the blue door"


def test_cross_tenant_matrix(any_svc: Service) -> None:
    svc = any_svc
    """Tenant B tries every route on tenant A's canary: every id route answers 404, nothing of
    A's ever appears in a response, and A's memory is untouched."""
    mem = add(svc, "a-member", CANARY, user_id="u1", session_id="s1")["memories"][0]
    mid = mem["id"]
    seen: list[str] = []
    for who in ("b-member", "b-admin"):
        id_routes = [
            ("GET", f"/v1/memories/{mid}", {}),
            ("PATCH", f"/v1/memories/{mid}", {"json": {"text": "overwritten by b"}}),
            ("GET", f"/v1/memories/{mid}/history", {}),
            ("DELETE", f"/v1/memories/{mid}", {}),
            ("GET", f"/v1/jobs/{mid}", {}),
            ("GET", "/v1/sessions/s1", {"params": {"user_id": "u1"}}),
            ("POST", "/v1/sessions/s1/messages", None),  # writes into b's own s1: checked below
        ]
        if who == "b-admin":
            id_routes += [("POST", "/v1/erase", {"json": {"id": mid}}),
                          ("DELETE", "/v1/sessions/s1", {"params": {"user_id": "u1"}})]
        for method, url, kwargs in id_routes:
            if kwargs is None:
                continue
            r = svc.call(who, method, url, **kwargs)
            assert r.status_code == 404, (who, method, url, r.status_code, r.text)
            seen.append(r.text)
        scoped = [
            ("POST", "/v1/memories/search", {"json": {"query": "blue door secret", "user_id": "u1"}}),
            ("POST", "/v1/memories/search", {"json": {"query": "canary-7f3a"}}),
            ("GET", "/v1/memories", {"params": {"user_id": "u1"}}),
            ("GET", "/v1/memories", {}),
            ("POST", "/v1/context", {"json": {"query": "secret door", "user_id": "u1",
                                              "session_id": "s1"}}),
        ]
        if who == "b-admin":
            scoped += [("GET", "/v1/export", {}), ("POST", "/v1/erase", {"json": {"user_id": "u1"}})]
        for method, url, kwargs in scoped:
            r = svc.call(who, method, url, **kwargs)
            assert r.status_code == 200, (who, method, url, r.text)
            seen.append(r.text)
    for text in seen:
        assert "canary-7f3a" not in text and "blue door" not in text
        assert mem["content_hash"] not in text

    # A's memory is exactly as it was.
    got = svc.call("a-member", "GET", f"/v1/memories/{mid}").json()
    assert got["text"] == CANARY and got["deleted_at"] is None
    history = svc.call("a-member", "GET", f"/v1/memories/{mid}/history").json()["events"]
    assert [e["type"] for e in history] == ["ADD"]


def test_tenants_are_separate_databases(svc: Service, embedder: MiniLM) -> None:
    add(svc, "a-member", CANARY, user_id="u1")
    with Memory(config=svc.config, tenant="b", embedder=embedder) as b, \
         Memory(config=svc.config, tenant="a", embedder=embedder) as a:
        assert b.list().items == []
        assert [m.text for m in a.list().items] == [CANARY]


# -- bounds ------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    {"query": "x", "limit": 0}, {"query": "x", "limit": 101}, {"query": "x", "limit": "ten"},
    {"query": ""}, {"query": "   "}, {"query": "x", "filters": {"n": {"regex": "a"}}},
    {"query": "x", "kinds": ["nope"]}, {"query": "x", "unknown": 1}, {},
])
def test_bad_search_input_is_422(svc: Service, body: dict[str, Any]) -> None:
    r = svc.call("a-member", "POST", "/v1/memories/search", json=body)
    assert r.status_code == 422, body
    assert error_code(r) in ("invalid_input", "invalid_filter")


@pytest.mark.parametrize("body", [
    {"messages": ""}, {"messages": []}, {"messages": ["x"] * 501}, {"messages": "x" * 32_001},
    {"messages": "x", "importance": 2}, {"messages": "x", "observed_at": "yesterday"},
    {"messages": "x", "user_id": "u" * 257}, {"messages": [{"content": "x", "role": ""}]},
    {"messages": "x", "kind": "dream"}, {"messages": "x", "metadata": [1]},
    {"messages": "x", "observed_at": "0001-01-01T00:00:00+14:00"},
])
def test_bad_add_input_is_422_and_writes_nothing(svc: Service, body: dict[str, Any]) -> None:
    r = svc.call("a-member", "POST", "/v1/memories", json=body)
    assert r.status_code == 422, (body, r.text)
    assert svc.call("a-member", "GET", "/v1/memories").json()["items"] == []


def test_list_limit_is_bounded(svc: Service) -> None:
    for limit in (0, 101, -1):
        r = svc.call("a-member", "GET", "/v1/memories", params={"limit": limit})
        assert r.status_code == 422 and error_code(r) == "invalid_input"
    r = svc.call("a-member", "GET", "/v1/memories", params={"filters": "{not json"})
    assert r.status_code == 422 and error_code(r) == "invalid_filter"


def test_request_body_over_the_limit_is_413(tmp_path: Path, embedder: MiniLM) -> None:
    with service(tmp_path, embedder, limits=ServiceLimits(max_body_bytes=4096)) as svc:
        big = {"messages": "x" * 5000}
        r = svc.call("a-member", "POST", "/v1/memories", json=big)
        assert r.status_code == 413 and error_code(r) == "payload_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"messages": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        r = svc.call("a-member", "POST", "/v1/memories", content=chunks(),
                     headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert svc.call("a-member", "GET", "/v1/memories").json()["items"] == []
        assert svc.call("a-member", "POST", "/v1/memories",
                        json={"messages": "small"}).status_code == 201


# -- rate limits -------------------------------------------------------------------------------

def test_rate_limit_is_per_tenant(tmp_path: Path, embedder: MiniLM) -> None:
    with service(tmp_path, embedder, limits=ServiceLimits(rate=0.01, burst=3)) as svc:
        codes = [svc.call("a-member", "GET", "/v1/memories").status_code for _ in range(3)]
        assert codes == [200, 200, 200]
        r = svc.call("a-admin", "GET", "/v1/memories")  # the same tenant, another key
        assert r.status_code == 429 and error_code(r) == "rate_limited"
        assert int(r.headers["Retry-After"]) >= 1
        assert svc.call("b-member", "GET", "/v1/memories").status_code == 200
        assert svc.client.get("/health").status_code == 200  # probes are not limited


# -- ops ---------------------------------------------------------------------------------------

def test_health_ready_and_metrics(svc: Service) -> None:
    assert svc.client.get("/health").json() == {"status": "ok"}
    assert svc.client.get("/ready").json() == {"status": "ok"}
    mid = add(svc, "a-member", "metrics canary", user_id="u")["memories"][0]["id"]
    svc.call("a-member", "GET", f"/v1/memories/{mid}")
    svc.call("a-member", "GET", "/v1/memories/nope")
    r = svc.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert ('engram_http_request_duration_seconds_count{method="GET",route="/v1/memories/{id}",'
            'status="200"} 1.0') in text
    assert 'route="/v1/memories/{id}",status="404"' in text
    assert mid not in text  # ids never become labels
    assert "engram_memories_stored" not in text  # tenant counts need an admin key (issue 14)
    own = svc.call("a-admin", "GET", "/metrics").text
    assert "engram_memories_stored 1.0" in own
    assert "engram_jobs_queued 0.0" in own


def test_errors_are_json_with_a_code(svc: Service) -> None:
    r = svc.call("a-member", "GET", "/v1/nowhere")
    assert r.status_code == 404 and error_code(r) == "not_found"
    r = svc.call("a-member", "PUT", "/v1/memories")
    assert r.status_code == 405 and error_code(r) == "method_not_allowed"
    r = svc.call("a-member", "POST", "/v1/memories", content=b"{not json",
                 headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and error_code(r) == "invalid_input"


def test_openapi_documents_every_route(svc: Service) -> None:
    spec = svc.client.get("/openapi.json").json()
    routes = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    wanted = {("POST", "/v1/memories"), ("POST", "/v1/memories/search"), ("GET", "/v1/memories"),
              ("GET", "/v1/memories/{id}"), ("PATCH", "/v1/memories/{id}"),
              ("DELETE", "/v1/memories/{id}"), ("GET", "/v1/memories/{id}/history"),
              ("POST", "/v1/erase"), ("GET", "/v1/jobs/{id}"), ("GET", "/v1/export"),
              ("POST", "/v1/import"), ("POST", "/v1/sessions"), ("GET", "/v1/sessions/{id}"),
              ("DELETE", "/v1/sessions/{id}"), ("POST", "/v1/sessions/{id}/messages"),
              ("POST", "/v1/context"), ("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics")}
    assert wanted <= routes
    doc = (Path(__file__).parents[1] / "docs" / "service.md").read_text(encoding="utf-8")
    for method, path in sorted(routes):
        assert f"{method} {path}" in doc, f"docs/service.md does not document {method} {path}"


def test_no_auth_serves_the_single_user_database(tmp_path: Path, embedder: MiniLM) -> None:
    cfg = Config(path=tmp_path / "engram.db")
    with Memory(config=cfg, embedder=embedder) as mem:
        mem.add("written by the library", user_id="me")
    app = create_app(cfg, auth=False, embedder=embedder)
    with TestClient(app, base_url="http://127.0.0.1") as client:  # no-auth: loopback Host only
        items = client.get("/v1/memories").json()["items"]
        assert [m["text"] for m in items] == ["written by the library"]
        assert client.post("/v1/erase", json={"user_id": "me"}).json()["erased"] == 1


def test_each_tenant_is_served_in_the_space_its_database_was_made_in(tmp_path: Path,
                                                                     fp32: MiniLM) -> None:
    """No embedder given (the configured `auto`): a tenant whose database was made in fp32
    before int8 was the default keeps fp32 MiniLM, a new tenant gets int8; one model a space."""
    made = Config(path=tmp_path / "data" / "engram.db")
    with Memory(config=made, tenant="a", embedder=fp32) as old:
        old.add("Ana keeps bees on the roof", user_id="u1")
    with service(tmp_path, None) as svc:  # type: ignore[arg-type]
        add(svc, "b-member", "Bo restores old sailing boats", user_id="u1")
        for who, query, want in (("a-member", "beekeeping", "Ana keeps bees on the roof"),
                                 ("b-member", "boats", "Bo restores old sailing boats")):
            r = svc.call(who, "POST", "/v1/memories/search", json={"query": query, "user_id": "u1"})
            assert r.status_code == 200 and r.json()["hits"][0]["memory"]["text"] == want
        tenants = svc.client.app.state.tenants  # type: ignore[attr-defined]
        a, b, c = (tenants.get(t).embedder.inner for t in ("a", "b", "c"))
        assert (space(a), space(b)) == ("all-minilm-l6-v2/384", "all-minilm-l6-v2-int8-rows/384")
        assert c is b and a is not fp32  # shared by the tenants of a space
        assert tenants.get("b").store.space().space == space(b)


# -- issue 15: what a new user of the service hit ----------------------------------------------

def test_reposting_a_session_resumes_it_with_the_policy_given(any_svc: Service) -> None:
    svc = any_svc
    r = svc.call("a-member", "POST", "/v1/sessions/trip/messages", params={"user_id": "ana"},
                 json={"messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 201
    # The session exists: 200 (it answered 201 and dropped the policy and metadata before).
    r = svc.call("a-member", "POST", "/v1/sessions", json={
        "user_id": "ana", "session_id": "trip", "policy": {"name": "window", "n": 2},
        "metadata": {"channel": "web"}})
    assert r.status_code == 200, r.text
    assert r.json()["policy"] == {"name": "window", "n": 2} and r.json()["metadata"] == {"channel": "web"}
    got = svc.call("a-member", "GET", "/v1/sessions/trip", params={"user_id": "ana"}).json()
    assert got["policy"] == {"name": "window", "n": 2} and got["metadata"] == {"channel": "web"}
    # Resumed without a policy: the stored one stays.
    r = svc.call("a-member", "POST", "/v1/sessions", json={"user_id": "ana", "session_id": "trip"})
    assert r.status_code == 200 and r.json()["policy"] == {"name": "window", "n": 2}
    # Another user's session of the same id is another session.
    assert svc.call("a-member", "POST", "/v1/sessions",
                    json={"user_id": "bob", "session_id": "trip"}).status_code == 201


def test_a_session_created_without_messages_is_stored_with_its_policy(svc: Service) -> None:
    r = svc.call("a-member", "POST", "/v1/sessions", json={
        "user_id": "ana", "session_id": "s", "policy": "window", "metadata": {"k": 1}})
    assert r.status_code == 201
    got = svc.call("a-member", "GET", "/v1/sessions/s", params={"user_id": "ana"})
    assert got.status_code == 200, got.text
    assert got.json()["policy"]["name"] == "window" and got.json()["metadata"] == {"k": 1}
    svc.call("a-member", "POST", "/v1/sessions/s/messages", params={"user_id": "ana"},
             json={"messages": [{"role": "user", "content": "hi"}]})
    got = svc.call("a-member", "GET", "/v1/sessions/s", params={"user_id": "ana"})
    assert got.json()["policy"]["name"] == "window"


def test_session_list_messages_view_end_and_stats(any_svc: Service) -> None:
    svc = any_svc
    turns = [{"role": "user", "content": "I fly to Tokyo on May 3rd."},
             {"role": "assistant", "content": "Have a great trip!"},
             {"role": "user", "content": "I will stay three weeks."}]
    svc.call("a-member", "POST", "/v1/sessions/trip/messages", params={"user_id": "ana"},
             json={"messages": turns})
    svc.call("a-member", "POST", "/v1/sessions/other/messages", params={"user_id": "bob"},
             json={"messages": [{"role": "user", "content": "hi"}]})
    svc.call("a-member", "POST", "/v1/sessions", json={"user_id": "ana", "session_id": "trip",
                                                       "policy": {"name": "window", "n": 1}})

    listed = svc.call("a-member", "GET", "/v1/sessions", params={"user_id": "ana"})
    assert listed.status_code == 200
    assert [s["scope"]["session_id"] for s in listed.json()["items"]] == ["trip"]
    assert len(svc.call("a-member", "GET", "/v1/sessions").json()["items"]) == 2
    assert svc.call("b-member", "GET", "/v1/sessions").json()["items"] == []

    messages = svc.call("a-member", "GET", "/v1/sessions/trip/messages").json()["messages"]
    assert [(m["role"], m["content"]) for m in messages] == [(t["role"], t["content"]) for t in turns]
    assert all(m["id"] and m["observed_at"] for m in messages)
    view = svc.call("a-member", "GET", "/v1/sessions/trip/view", params={"user_id": "ana"}).json()
    assert [m["content"] for m in view["messages"]] == ["I will stay three weeks."]
    assert view["omitted"] == 2 and view["chat"] == [{"role": "user", "content": "I will stay three weeks."}]

    ended = svc.call("a-member", "POST", "/v1/sessions/trip/end", params={"user_id": "ana"})
    assert ended.status_code == 200, ended.text
    assert ended.json()["session"]["ended_at"] is not None
    assert "Tokyo" in ended.json()["summary"]["text"] and ended.json()["summary"]["kind"] == "episodic"
    again = svc.call("a-member", "POST", "/v1/sessions/trip/end", params={"user_id": "ana"}).json()
    assert again["summary"] is None  # nothing said since

    stats = svc.call("a-member", "GET", "/v1/stats", params={"user_id": "ana"})
    assert stats.status_code == 200
    assert stats.json()["by_kind"]["episodic"] == 4 and stats.json()["memories"] == 4  # 3 turns + summary
    assert svc.call("b-member", "GET", "/v1/stats").json()["memories"] == 0
    for path in ("/v1/sessions/nope/messages", "/v1/sessions/nope/view"):
        assert svc.call("a-member", "GET", path).status_code == 404
    assert svc.call("a-member", "POST", "/v1/sessions/nope/end").status_code == 404
    # Another tenant's session is not found, never forbidden.
    assert svc.call("b-member", "GET", "/v1/sessions/trip/messages").status_code == 404


ISO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def _times(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [t for v in value.values() for t in _times(v)]
    if isinstance(value, list):
        return [t for v in value for t in _times(v)]
    return [value] if isinstance(value, str) and ISO_TIME.match(value) else []


def test_every_time_in_a_response_has_one_format(svc: Service) -> None:
    # Issue 15: top-level times ended in "Z", those in events[].after in "+00:00".
    added = add(svc, "a-member", [{"role": "user", "content": "I moved to Lisbon",
                                   "observed_at": "2024-05-01T10:00:00+02:00"}],
                user_id="ana", session_id="s1", expires_at="2031-01-01T00:00:00Z")
    mid = added["memories"][0]["id"]
    responses = [added,
                 svc.call("a-member", "PATCH", f"/v1/memories/{mid}",
                          json={"text": "I moved to Porto"}).json(),
                 svc.call("a-member", "GET", f"/v1/memories/{mid}/history").json(),
                 svc.call("a-member", "GET", "/v1/memories").json(),
                 svc.call("a-member", "POST", "/v1/memories/search", json={"query": "Porto"}).json(),
                 svc.call("a-member", "GET", "/v1/sessions").json(),
                 svc.call("a-member", "POST", "/v1/memories", json={
                     "messages": "later", "user_id": "ana", "background": True}).json()]
    times = [t for r in responses for t in _times(r)]
    assert len(times) > 30
    assert all(t.endswith("+00:00") for t in times), sorted({t[19:] for t in times})
    history = responses[2]["events"]
    assert history[1]["after"]["updated_at"] == responses[1]["updated_at"]  # same text, same time


def test_openapi_declares_bearer_auth(svc: Service) -> None:
    spec = svc.client.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["bearer"]["type"] == "http"
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            assert not any(p["name"].lower() == "authorization" for p in op.get("parameters", [])), path
            if path.startswith("/v1/"):
                assert op.get("security") == [{"bearer": []}], (method, path)
            else:
                assert "security" not in op, (method, path)
    # The header is checked as before: a malformed one is 401 with the same message.
    r = svc.client.get("/v1/memories", headers={"Authorization": "Basic abc"})
    assert r.status_code == 401 and "Bearer <API key>" in r.json()["error"]["message"]


def test_docs_are_served_offline(svc: Service) -> None:
    page = svc.client.get("/docs")
    assert page.status_code == 200 and "/openapi.json" in page.text
    # Nothing loaded from another host (FastAPI's page loads Swagger UI from a CDN: blank offline).
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text), page.text[:500]
    assert "cdn" not in page.text.lower()
    assert svc.client.get("/redoc").status_code == 404  # ReDoc's page loads from a CDN too


def test_docs_use_an_installed_swagger_ui(tmp_path: Path, embedder: MiniLM,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assets = tmp_path / "vendor" / "swagger-ui-5.31.0"
    assets.mkdir(parents=True)
    (assets / "swagger-ui-bundle.js").write_text("/* swagger */", encoding="utf-8")
    (assets / "swagger-ui.css").write_text("/* css */", encoding="utf-8")
    module = types.ModuleType("swagger_ui_bundle")
    module.swagger_ui_path = assets  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "swagger_ui_bundle", module)
    with service(tmp_path, embedder) as s:
        page = s.client.get("/docs").text
        assert "/docs/assets/swagger-ui-bundle.js" in page and "/openapi.json" in page
        assert "cdn" not in page.lower()
        assert s.client.get("/docs/assets/swagger-ui-bundle.js").text == "/* swagger */"
    # Swagger UI 4 cannot read OpenAPI 3.1: the built-in page then.
    module.swagger_ui_path = assets.rename(tmp_path / "vendor" / "swagger-ui-4.15.5")  # type: ignore[attr-defined]
    with service(tmp_path / "v4", embedder) as s:
        assert "swagger-ui-bundle.js" not in s.client.get("/docs").text


def test_context_budget_minimum_is_the_engines(svc: Service) -> None:
    spec = svc.client.get("/openapi.json").json()
    assert spec["components"]["schemas"]["ContextIn"]["properties"]["budget_tokens"]["minimum"] == 1
    add(svc, "a-member", "Ana is vegetarian", user_id="ana", kind="semantic")
    ok = svc.call("a-member", "POST", "/v1/context", json={"query": "hi", "user_id": "ana",
                                                           "budget_tokens": 50})
    assert ok.status_code == 200 and ok.json()["total_tokens"] <= 50  # refused below 64 before
    small = svc.call("a-member", "POST", "/v1/context", json={"query": "hi", "user_id": "ana",
                                                              "budget_tokens": 10})
    assert small.status_code == 422 and "take" in small.json()["error"]["message"]

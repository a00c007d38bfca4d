"""The reader role in the REST API and over MCP, `engram keys create --role reader`, the
console's access rules over plain HTTP (session cookie, bearer, CSRF, security headers, typed
erase confirmation), and the console's pure view functions."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from engram import Hit, InvalidFilter, InvalidInput, Kind, MemoryRecord, Scope, Session
from engram.cli import app as cli
from engram.providers.embedders import MiniLM
from engram.server.keys import Role, SQLiteKeyStore
from engram.server.ui import views
from server_kit import Service, error_code, service


@pytest.fixture
def svc(tmp_path: Path, embedder: MiniLM) -> Iterator[Service]:
    with service(tmp_path, embedder) as s:
        s.tokens["a-reader"] = s.keys.create("a", "reader", "a reader")[1]
        yield s


def _add(svc: Service, text: str, **kwargs: Any) -> dict[str, Any]:
    r = svc.call("a-member", "POST", "/v1/memories", json={"messages": text, "kind": "semantic", **kwargs})
    assert r.status_code == 201, r.text
    return dict(r.json()["memories"][0])


# -- the reader role in the REST API -----------------------------------------------------------

def test_a_reader_key_reads_everything_and_writes_nothing(svc: Service) -> None:
    fact = _add(svc, "Ana is vegetarian", user_id="ana")
    reads = [("GET", "/v1/memories", {}), ("GET", f"/v1/memories/{fact['id']}", {}),
             ("GET", f"/v1/memories/{fact['id']}/history", {}), ("GET", "/v1/stats", {}),
             ("GET", "/v1/sessions", {}),
             ("POST", "/v1/memories/search", {"json": {"query": "food", "user_id": "ana"}}),
             ("POST", "/v1/context", {"json": {"query": "food", "user_id": "ana"}})]
    for method, url, kwargs in reads:
        r = svc.call("a-reader", method, url, **kwargs)
        assert r.status_code == 200, (url, r.text)
    writes = [("POST", "/v1/memories", {"json": {"messages": "x", "user_id": "ana"}}),
              ("PATCH", f"/v1/memories/{fact['id']}", {"json": {"text": "changed"}}),
              ("DELETE", f"/v1/memories/{fact['id']}", {}),
              ("POST", "/v1/erase", {"json": {"user_id": "ana"}}),
              ("POST", "/v1/sessions", {"json": {"user_id": "ana", "session_id": "s"}}),
              ("POST", "/v1/sessions/s/messages", {"json": {"messages": [{"role": "user", "content": "x"}]}}),
              ("POST", "/v1/sessions/s/end", {}), ("DELETE", "/v1/sessions/s", {}),
              ("GET", "/v1/export", {}),
              ("POST", "/v1/import", {"content": b"{}", "headers": {"Content-Type": "application/x-ndjson"}})]
    for method, url, kwargs in writes:
        r = svc.call("a-reader", method, url, **kwargs)
        assert r.status_code == 403 and error_code(r) == "forbidden", (method, url, r.text)
    got = svc.call("a-member", "GET", f"/v1/memories/{fact['id']}").json()
    assert got["text"] == "Ana is vegetarian"
    history = svc.call("a-member", "GET", f"/v1/memories/{fact['id']}/history").json()["events"]
    assert [e["type"] for e in history] == ["ADD"]
    assert svc.call("a-member", "GET", "/v1/sessions").json()["items"] == []
    # the message says what the key is
    r = svc.call("a-reader", "PATCH", f"/v1/memories/{fact['id']}", json={"text": "x"})
    assert "read-only reader key" in r.json()["error"]["message"]


def test_a_reader_key_gets_no_mcp_tools(svc: Service) -> None:
    r = svc.call("a-reader", "POST", "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                 headers={"Accept": "application/json, text/event-stream"})
    assert r.status_code == 403 and error_code(r) == "forbidden"


def test_keys_create_accepts_the_reader_role(tmp_path: Path) -> None:
    db = tmp_path / "engram.db"
    result = CliRunner().invoke(cli, ["keys", "create", "--tenant", "acme", "--role", "reader",
                                      "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert "created reader key" in result.output
    keys = SQLiteKeyStore(tmp_path / "keys.db")
    try:
        [key] = keys.list("acme")
        assert key.role is Role.READER
    finally:
        keys.close()
    bad = CliRunner().invoke(cli, ["keys", "create", "--tenant", "acme", "--role", "owner", "--db", str(db)])
    assert bad.exit_code != 0 and "reader" in bad.output


# -- the console over plain HTTP ----------------------------------------------------------------

def _login(svc: Service, who: str) -> str:
    """Log the test client in; returns the CSRF token of the logged-in session."""
    svc.client.cookies.clear()
    form = svc.client.get("/ui/login")
    token = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert token is not None
    r = svc.client.post("/ui/login", data={"csrf": token.group(1), "key": svc.tokens[who]},
                        follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    page = svc.client.get("/ui")
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found is not None and found.group(1) != token.group(1)  # a new session at login
    return found.group(1)


def test_pages_need_a_login_or_a_bearer_key(svc: Service) -> None:
    r = svc.client.get("/ui/memories", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    r = svc.client.get("/ui/memories", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "text/html" in r.headers["content-type"]
    r = svc.client.get("/ui/memories", headers=svc.h("a-reader"))
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["cache-control"] == "no-store"
    # a key in the query string is not a way in
    r = svc.client.get(f"/ui/memories?key={svc.tokens['a-admin']}", follow_redirects=False)
    assert r.status_code == 303


def test_a_login_form_without_its_token_is_refused(svc: Service) -> None:
    r = svc.client.post("/ui/login", data={"key": svc.tokens["a-admin"]}, follow_redirects=False)
    assert r.status_code == 403 and "set-cookie" not in r.headers


def test_writes_need_the_sessions_csrf_token(svc: Service) -> None:
    fact = _add(svc, "Ana likes tea", user_id="ana")
    token = _login(svc, "a-member")
    url = f"/ui/memories/{fact['id']}/edit"
    for data in ({"text": "forged"}, {"text": "forged", "csrf": "x" * 43}):
        r = svc.client.post(url, data=data, follow_redirects=False)
        assert r.status_code == 403 and "CSRF" in r.text
    r = svc.client.post(url, data={"text": "Ana likes green tea", "csrf": token}, follow_redirects=False)
    assert r.status_code == 303
    assert svc.call("a-member", "GET", f"/v1/memories/{fact['id']}").json()["text"] == "Ana likes green tea"
    # a script with a bearer key needs no token: a browser never sends that header cross-site
    svc.client.cookies.clear()
    r = svc.client.post(url, data={"importance": "0.9"}, headers=svc.h("a-member"), follow_redirects=False)
    assert r.status_code == 303
    assert svc.call("a-member", "GET", f"/v1/memories/{fact['id']}").json()["importance"] == 0.9


def test_a_revoked_key_ends_its_console_sessions(svc: Service) -> None:
    _login(svc, "a-reader")
    assert svc.client.get("/ui", follow_redirects=False).status_code == 200
    [reader] = [k for k in svc.keys.list("a") if k.role is Role.READER]
    svc.keys.revoke(reader.id)
    r = svc.client.get("/ui", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"


def test_erase_refuses_a_wrong_confirmation_and_a_member_key(svc: Service) -> None:
    _add(svc, "Bob's locker code is 3141", user_id="bob")
    form = {"what": "user_id", "target": "bob", "confirm": "bob"}
    token = _login(svc, "a-admin")
    r = svc.client.post("/ui/erase", data={**form, "csrf": token, "confirm": "bo"})
    assert r.status_code == 422 and "not erased" in r.text
    token = _login(svc, "a-member")
    r = svc.client.post("/ui/erase", data={**form, "csrf": token})
    assert r.status_code == 403 and "admin key" in r.text
    assert len(svc.call("a-admin", "GET", "/v1/memories", params={"user_id": "bob"}).json()["items"]) == 1
    token = _login(svc, "a-admin")
    r = svc.client.post("/ui/erase", data={**form, "csrf": token})
    assert r.status_code == 200 and "Erased 1 memories of user" in r.text
    assert svc.call("a-admin", "GET", "/v1/memories", params={"user_id": "bob"}).json()["items"] == []


def test_bad_input_is_a_clear_error_page(svc: Service) -> None:
    h = svc.h("a-reader")
    for url, words in (("/ui/memories?metadata=%7Bnope", "not valid JSON"),
                       ("/ui/memories?limit=0", "limit must be in"),
                       ("/ui/memories?as_of=yesterday", "as_of must be a date"),
                       ("/ui/memories?time_field=deleted_at&from=2024-01-01", "time field must be")):
        r = svc.client.get(url, headers=h)
        assert r.status_code == 422 and words in r.text, (url, r.text)
    assert svc.client.get("/ui/static/../keys.py", headers=h).status_code == 404
    assert svc.client.get("/ui/static/other.js", headers=h).status_code == 404


# -- pure functions ----------------------------------------------------------------------------

T0 = datetime(2024, 3, 4, 19, tzinfo=UTC)


def _rec(id: str, at: datetime, *, user: str | None = "ana", agent: str | None = None,
         session: str | None = None, kind: Kind = Kind.EPISODIC) -> MemoryRecord:
    return MemoryRecord(id=id, scope=Scope(user, agent, session), kind=kind, text=id, metadata={},
                        importance=0.5, created_at=at, updated_at=at, observed_at=at)


def test_scopes_are_counted_with_their_last_activity() -> None:
    records = [_rec("1", T0, session="s1"), _rec("2", T0 + timedelta(days=1), session="s2", agent="bot"),
               _rec("3", T0 + timedelta(days=2), user="bob")]
    sessions = [Session(scope=Scope("ana", None, "s3"), policy={}, created_at=T0,
                        updated_at=T0 + timedelta(days=5))]
    got = views.summarise(records, sessions, scanned=3, complete=True)
    assert [(r.id, r.memories, r.last) for r in got.users] == [
        ("ana", 2, T0 + timedelta(days=5)), ("bob", 1, T0 + timedelta(days=2))]
    assert [(r.id, r.memories) for r in got.sessions] == [("s3", 0), ("s2", 1), ("s1", 1)]
    assert [(r.id, r.users) for r in got.agents] == [("bot", {"ana"})]


def test_the_timeline_groups_episodes_by_session_latest_first() -> None:
    records = [_rec("b", T0 + timedelta(minutes=2), session="s1"), _rec("a", T0, session="s1"),
               _rec("c", T0 + timedelta(days=3), session="s2"), _rec("d", T0 + timedelta(days=1))]
    groups = views.timeline(records, [])
    assert [(g.session_id, [e.id for e in g.episodes]) for g in groups] == [
        ("s2", ["c"]), (None, ["d"]), ("s1", ["a", "b"])]


def test_filters_from_the_form() -> None:
    assert views.filters(None, None, None, None) is None
    assert views.filters('{"topic": "food"}', "observed_at", "2024-01-01T00:00", None) == {
        "topic": "food", "observed_at": {"gte": "2024-01-01T00:00"}}
    with pytest.raises(InvalidFilter):
        views.filters("[1]", None, None, None)
    with pytest.raises(InvalidInput):
        views.filters(None, "deleted_at", "2024-01-01", None)


def test_explain_columns_follow_the_cli_order() -> None:
    rec = _rec("x", T0)
    hits = [Hit(rec, 1.0, {"score": 1.0, "lexical": 0.5, "dense": 0.4, "graph": 0.1}),
            Hit(rec, 0.5, {"score": 0.5, "recency": 0.1})]
    assert views.explain_columns(hits) == ["dense", "lexical", "recency", "score", "graph"]
    assert views.number(0.12345) == "0.123" and views.number(None) == "-"


def test_a_neighbourhood_is_drawn_on_rings_around_its_entity() -> None:
    e = [{"id": str(i), "name": n, "type": "person"} for i, n in enumerate(["Ana", "Inês", "Porto", "Rui"])]
    rel = [{"id": "r1", "subject": "Ana", "subject_id": "0", "predicate": "sister", "object": "Inês",
            "object_id": "1"},
           {"id": "r2", "subject": "Inês", "subject_id": "1", "predicate": "lives_in", "object": "Porto",
            "object_id": "2", "valid_to": "2024-05-01T00:00:00+00:00"},
           {"id": "r3", "subject": "Ana", "subject_id": "0", "predicate": "age", "object": "34",
            "object_id": None, "value": "34"}]
    d = views.layout({"entities": e, "relations": rel}, "ana")  # names match regardless of case
    rings = {n.name: n.ring for n in d.nodes}
    assert rings == {"Ana": 0, "Inês": 1, "Porto": 2, "Rui": 3}  # Rui: in the set, not linked
    ana = next(n for n in d.nodes if n.name == "Ana")
    assert (ana.x, ana.y) == (views.GRAPH_SIZE / 2, views.GRAPH_SIZE / 2)
    assert all(0 <= n.x <= views.GRAPH_SIZE and 0 <= n.y <= views.GRAPH_SIZE for n in d.nodes)
    assert [(x.predicate, x.drawn) for x in d.edges] == [("sister", True), ("lives_in", True), ("age", False)]
    assert not d.truncated
    many = [{"id": str(i), "name": f"e{i}", "type": "t"} for i in range(views.MAX_NODES + 5)]
    star = [{"id": f"r{i}", "subject_id": "0", "object_id": str(i), "predicate": "p"}
            for i in range(1, len(many))]
    big = views.layout({"entities": many, "relations": star}, "e0")
    assert len(big.nodes) == views.MAX_NODES and big.truncated

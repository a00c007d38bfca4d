"""Console logins stored beside the keys (server/ui/sessions.py, server/keys.py), on SQLite and
PostgreSQL: what is stored (a digest, never the cookie or the key), expiry, logout, revocation,
the bound per key, and two service processes on one SQLite key file sharing a login."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engram.config import Config
from engram.providers.embedders import MiniLM
from engram.server import ServiceLimits, create_app, keys
from engram.server.auth import Principal
from engram.server.keys import KeyStore, PostgresKeyStore, Role, SQLiteKeyStore
from engram.server.ui.sessions import anonymous, csrf_ok, digest, log_in, log_out, logged_in


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KeyStore]:
    if request.param == "sqlite":
        found: KeyStore = SQLiteKeyStore(tmp_path / "keys.db")
    else:
        from pg_server import PG

        found = PostgresKeyStore(PG.database_for(tmp_path))
    try:
        yield found
    finally:
        found.close()


def _rows(store: KeyStore) -> list[tuple[Any, ...]]:
    if isinstance(store, SQLiteKeyStore):
        with sqlite3.connect(store.path) as conn:
            return list(conn.execute("SELECT * FROM console_logins").fetchall())
    import psycopg

    assert isinstance(store, PostgresKeyStore)
    with psycopg.connect(store.url) as conn:
        return list(conn.execute("SELECT * FROM engram_console_logins").fetchall())


def _principal(store: KeyStore, role: str = "member") -> tuple[Principal, str]:
    key, secret = store.create("acme", role, "console")
    return Principal(tenant=key.tenant, role=key.role, key_id=key.id), secret


def test_a_login_is_found_by_its_cookie_and_stores_neither_cookie_nor_key(store: KeyStore) -> None:
    who, secret = _principal(store, "reader")
    session = log_in(store, who)
    found = logged_in(store, session.id)
    assert found is not None and found.principal == who and found.principal.role is Role.READER
    assert found.csrf == session.csrf and csrf_ok(found, session.csrf)
    [row] = _rows(store)
    assert row[0] == digest(session.id) and row[1] == who.key_id
    assert session.id not in repr(row) and secret not in repr(row)
    assert logged_in(store, anonymous(None).id) is None  # a cookie of the right shape, unknown
    assert logged_in(store, "x" * 500) is None and logged_in(store, None) is None


def test_logout_and_revocation_end_logins(store: KeyStore) -> None:
    who, _ = _principal(store)
    first, second = log_in(store, who), log_in(store, who)
    other, _ = _principal(store)
    third = log_in(store, other)
    log_out(store, first.id)
    assert logged_in(store, first.id) is None and logged_in(store, second.id) is not None
    assert who.key_id is not None
    store.revoke(who.key_id)
    assert logged_in(store, second.id) is None
    assert logged_in(store, third.id) is not None  # another key's login is untouched
    assert [r[1] for r in _rows(store)] == [other.key_id]  # the revoked key's rows are gone


def test_logins_expire_and_are_bounded_per_key(store: KeyStore, monkeypatch: pytest.MonkeyPatch) -> None:
    who, _ = _principal(store)
    expired = log_in(store, who, ttl_s=0.0)
    assert logged_in(store, expired.id) is None
    monkeypatch.setattr(keys, "MAX_LOGINS_PER_KEY", 3)
    made = [log_in(store, who) for _ in range(5)]
    assert [logged_in(store, s.id) is not None for s in made] == [False, False, True, True, True]
    stored = {r[0] for r in _rows(store)}
    assert stored == {digest(s.id) for s in made[2:]}  # the expired one was dropped too


def test_the_anonymous_csrf_token_needs_no_state() -> None:
    fresh = anonymous(None)
    again = anonymous(fresh.id)  # another request, maybe another node: the same token
    assert again == fresh and csrf_ok(again, fresh.csrf)
    assert fresh.csrf != fresh.id and fresh.principal is None
    foreign = anonymous("planted")  # not one of ours: a new id, whose token nobody was shown
    assert foreign.id != "planted" and not csrf_ok(foreign, anonymous("planted").csrf)
    assert not csrf_ok(fresh, None) and not csrf_ok(None, fresh.csrf)
    assert not csrf_ok(fresh, anonymous(None).csrf)


def test_two_service_processes_on_one_sqlite_key_file_share_a_login(tmp_path: Path,
                                                                     embedder: MiniLM) -> None:
    """As `engram serve --workers 2` (and a restart): the login made through one app is found
    by another app with its own key store on the same file."""
    cfg = Config(path=tmp_path / "data" / "engram.db")
    limits = ServiceLimits(rate=10_000, burst=10_000)
    stores = [SQLiteKeyStore(tmp_path / "data" / "keys.db") for _ in range(2)]
    secret = stores[0].create("acme", "admin")[1]
    try:
        with TestClient(create_app(cfg, embedder=embedder, keys=stores[0], limits=limits)) as one, \
                TestClient(create_app(cfg, embedder=embedder, keys=stores[1], limits=limits)) as two:
            form = one.get("/ui/login")
            token = re.search(r'name="csrf" value="([^"]+)"', form.text)
            assert token is not None
            two.cookies.update(one.cookies)  # the browser's cookie goes wherever it is sent
            r = two.post("/ui/login", data={"csrf": token.group(1), "key": secret},
                         follow_redirects=False)
            assert r.status_code == 303, r.text
            one.cookies.update(two.cookies)
            assert one.get("/ui", follow_redirects=False).status_code == 200
            page = two.get("/ui")
            csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
            assert csrf is not None
            assert one.post("/ui/logout", data={"csrf": csrf.group(1)},
                            follow_redirects=False).status_code == 303
            r = two.get("/ui", follow_redirects=False)
            assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    finally:
        for s in stores:
            s.close()

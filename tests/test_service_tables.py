"""The service's own tables (keys and console logins, audit, rate-limit buckets) are named
migrations of the store: the server holds no SQL, and files and databases made by the
service before that (each table made by its own `CREATE TABLE IF NOT EXISTS`) open and
upgrade in place, rows and all."""

from __future__ import annotations

import re
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import engram.server
from engram.config import Config
from engram.server.audit import Entry, PostgresAuditLog, SQLiteAuditLog
from engram.server.keys import ConsoleLogin, PostgresKeyStore, Role, SQLiteKeyStore, digest
from engram.server.ratelimit import SharedRateLimiter, open_rate_limiter
from engram.store.service import POSTGRES, SQLITE, take_params
from engram.store.sqlite import SQLiteRateBuckets

SERVER = Path(engram.server.__file__).parent

# SQL as the server used to hold it: a statement's opening words, in capitals as every
# statement of engram is written (prose that says "select ... from" is not SQL).
SQL = re.compile(r"\b(CREATE\s+(TABLE|INDEX|UNIQUE)|INSERT\s+INTO|DELETE\s+FROM|ALTER\s+TABLE|"
                 r"DROP\s+TABLE|UPDATE\s+[\w{}]+\s+SET|SELECT\s+[\w*,.{}() ]+?\s+FROM)\b")


def sql_in(directory: Path) -> list[str]:
    return [f"{path.relative_to(directory)}:{n}: {line.strip()}"
            for path in sorted(directory.rglob("*")) if path.suffix in (".py", ".html", ".js")
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if SQL.search(line)]


def test_the_server_holds_no_sql() -> None:
    assert sql_in(SERVER) == []


def test_the_sql_finder_finds_what_the_server_used_to_hold(tmp_path: Path) -> None:
    (tmp_path / "keys.py").write_text(
        '_S = """\nCREATE TABLE IF NOT EXISTS api_keys (\n    id TEXT PRIMARY KEY)"""\n'
        'conn.execute("INSERT INTO api_keys VALUES (?, ?)", (1, 2))\n'
        'rows = db.read(f"SELECT {_COLUMNS} FROM api_keys WHERE digest = ?")\n'
        '_PRUNE = "DELETE FROM {table} WHERE at < {m}"\n'
        'cur.execute("UPDATE engram_api_keys SET revoked_at = now()")\n'
        '_CHARGE = "UPDATE {table} SET tokens = tokens - {m} WHERE bucket = {m}"\n'
        "# a console login is found with its key; select a role from the list\n")
    assert [line.split(":")[1] for line in sql_in(tmp_path)] == ["2", "4", "5", "6", "7", "8"]


# -- the statements, without a database --------------------------------------------------------

@pytest.mark.parametrize("sql", [SQLITE, POSTGRES], ids=["sqlite", "postgres"])
def test_each_statement_has_a_parameter_per_mark(sql: Any) -> None:
    assert sql.take.count(sql.mark) == len(take_params("t", 1.0, 2.0, 3))
    assert sql.insert_audit.count(sql.mark) == 12
    assert sql.trim_logins.count(sql.mark) == 3
    stmt, params = sql.audit_entries(tenant="acme", all_tenants=False, key_id="k", route=None,
                                     limit=7)
    assert stmt.count(sql.mark) == len(params) == 2 and stmt.endswith("LIMIT 7")
    stmt, params = sql.audit_entries(tenant=None, all_tenants=False, key_id=None, route=None,
                                     limit=1)
    assert "tenant IS NULL" in stmt and params == []
    stmt, params = sql.audit_entries(tenant="x", all_tenants=True, key_id=None, route=None,
                                     limit=1)
    assert "WHERE 1 = 1" in stmt and params == []


def test_the_backends_differ_only_in_spelling() -> None:
    assert "engram_api_keys" in POSTGRES.live_key and " api_keys " in SQLITE.live_key
    assert "now()" in POSTGRES.find_login and "now()" not in SQLITE.find_login
    assert "least(" in POSTGRES.take and "min(" in SQLITE.take


# -- files and databases made by the old code --------------------------------------------------

# The old code's DDL, as released (server/keys.py, audit.py, ratelimit.py before the tables
# were migrations). `console_logins` came later than `api_keys`: a keys.db may lack it.
OLD_KEYS = """CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, digest TEXT NOT NULL UNIQUE, tenant TEXT NOT NULL, role TEXT NOT NULL,
    name TEXT NOT NULL, created_at REAL NOT NULL, revoked_at REAL)"""
OLD_LOGINS = ("""CREATE TABLE IF NOT EXISTS console_logins (
    digest TEXT PRIMARY KEY, key_id TEXT NOT NULL, tenant TEXT NOT NULL, role TEXT NOT NULL,
    csrf TEXT NOT NULL, expires_at REAL NOT NULL)""",
              "CREATE INDEX IF NOT EXISTS console_logins_key ON console_logins (key_id)")
OLD_AUDIT = ("CREATE TABLE IF NOT EXISTS audit (id TEXT PRIMARY KEY, at REAL NOT NULL, "
             "key_id TEXT, tenant TEXT, method TEXT NOT NULL, route TEXT NOT NULL, "
             "status INTEGER NOT NULL, user_id TEXT, agent_id TEXT, session_id TEXT, "
             "result_bytes INTEGER NOT NULL, duration_ms REAL NOT NULL)",
             "CREATE INDEX IF NOT EXISTS audit_tenant ON audit(tenant, at)")
OLD_BUCKETS = ("CREATE TABLE IF NOT EXISTS rate_buckets (bucket TEXT PRIMARY KEY, "
               "tokens REAL NOT NULL, at REAL NOT NULL, wait REAL NOT NULL)")
PG_OLD_KEYS = """CREATE TABLE IF NOT EXISTS engram_api_keys (
    id TEXT PRIMARY KEY, digest TEXT NOT NULL UNIQUE, tenant TEXT NOT NULL, role TEXT NOT NULL,
    name TEXT NOT NULL, created_at TIMESTAMPTZ NOT NULL, revoked_at TIMESTAMPTZ)"""
PG_OLD_LOGINS = ("""CREATE TABLE IF NOT EXISTS engram_console_logins (
    digest TEXT PRIMARY KEY, key_id TEXT NOT NULL, tenant TEXT NOT NULL, role TEXT NOT NULL,
    csrf TEXT NOT NULL, expires_at TIMESTAMPTZ NOT NULL)""",
                 "CREATE INDEX IF NOT EXISTS engram_console_logins_key ON engram_console_logins (key_id)")
PG_OLD_AUDIT = ("CREATE TABLE IF NOT EXISTS engram_audit (id TEXT PRIMARY KEY, "
                "at TIMESTAMPTZ NOT NULL, key_id TEXT, tenant TEXT, method TEXT NOT NULL, "
                "route TEXT NOT NULL, status INTEGER NOT NULL, user_id TEXT, "
                "agent_id TEXT, session_id TEXT, result_bytes BIGINT NOT NULL, "
                "duration_ms DOUBLE PRECISION NOT NULL)",
                "CREATE INDEX IF NOT EXISTS engram_audit_tenant ON engram_audit(tenant, at)")
PG_OLD_BUCKETS = ("CREATE TABLE IF NOT EXISTS engram_rate_buckets (bucket TEXT PRIMARY KEY, "
                  "tokens DOUBLE PRECISION NOT NULL, at DOUBLE PRECISION NOT NULL, "
                  "wait DOUBLE PRECISION NOT NULL)")

SECRET = "engram_0123456789ab_an-old-secret"
CREATED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
OLD_ENTRY = Entry("old-1", CREATED, "0123456789ab", "acme", "GET", "/v1/memories", 200, "ana",
                  None, None, 42, 1.5)


def _migrations(conn: Any) -> list[str]:
    return sorted(r[0] for r in conn.execute("SELECT name FROM schema_migrations").fetchall())


@pytest.mark.parametrize("with_logins", [True, False], ids=["with-logins", "keys-only"])
def test_an_old_sqlite_keys_file_upgrades_in_place(tmp_path: Path, with_logins: bool) -> None:
    path = tmp_path / "keys.db"
    with sqlite3.connect(path) as old:
        for stmt in (OLD_KEYS, *(OLD_LOGINS if with_logins else ())):
            old.execute(stmt)
        old.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, ?, NULL)",
                    ("0123456789ab", digest(SECRET), "acme", "admin", "ops", CREATED.timestamp()))
        if with_logins:
            old.execute("INSERT INTO console_logins VALUES (?, ?, ?, ?, ?, ?)",
                        ("d" * 64, "0123456789ab", "acme", "admin", "c" * 43, time.time() + 600))
    old.close()
    keys = SQLiteKeyStore(path)
    try:
        key = keys.authenticate(SECRET)
        assert key is not None and (key.id, key.tenant, key.role) == ("0123456789ab", "acme",
                                                                       Role.ADMIN)
        assert key.created_at == CREATED
        login = "d" * 64
        if not with_logins:  # the upgrade made the logins' table
            keys.add_login(ConsoleLogin(login, key.id, "acme", Role.ADMIN, "c" * 43), 600)
        found = keys.find_login(login)
        assert found is not None and found.key_id == key.id
    finally:
        keys.close()
    keys = SQLiteKeyStore(path)  # a second opening finds nothing left to do, and the rows kept
    try:
        assert keys.find_login(login) is not None and len(keys.list()) == 1
    finally:
        keys.close()
    with sqlite3.connect(path) as conn:
        assert _migrations(conn) == ["service_0001_keys"]
        assert conn.execute("SELECT count(*) FROM api_keys").fetchone() == (1,)
    conn.close()


def test_old_sqlite_audit_and_rate_files_upgrade_in_place(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "audit.db") as old:
        for stmt in OLD_AUDIT:
            old.execute(stmt)
        old.execute(f"INSERT INTO audit VALUES ({', '.join('?' * 12)})",
                    (OLD_ENTRY.id, CREATED.timestamp(), *list(OLD_ENTRY.to_dict().values())[2:]))
    old.close()
    log = SQLiteAuditLog(tmp_path / "audit.db")
    try:
        assert log.entries(tenant="acme") == [OLD_ENTRY]
    finally:
        log.close()

    now = time.time()
    with sqlite3.connect(tmp_path / "ratelimit.db") as old:
        old.execute(OLD_BUCKETS)
        old.execute("INSERT INTO rate_buckets VALUES ('acme', 0.0, ?, 0)", (now,))
    old.close()
    limiter = SharedRateLimiter(SQLiteRateBuckets(tmp_path / "ratelimit.db"), rate=0.001, burst=5,
                                clock=lambda: now)
    try:
        assert limiter.take("acme") > 0  # the old bucket, empty, was kept
        assert limiter.take("other") == 0.0
    finally:
        limiter.close()
    for name, expected in (("audit.db", "service_0001_audit"),
                           ("ratelimit.db", "service_0001_rate_buckets")):
        with sqlite3.connect(tmp_path / name) as conn:
            assert _migrations(conn) == [expected]
        conn.close()


def test_a_sqlite_migration_that_fails_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    """A keys.db whose `console_logins` is not a table the migration can adopt (a view, which
    cannot be indexed): the upgrade fails whole, with a typed error, and makes nothing."""
    from engram.errors import StoreError

    path = tmp_path / "keys.db"
    with sqlite3.connect(path) as old:
        old.execute("CREATE TABLE k (id TEXT)")
        old.execute("CREATE VIEW console_logins AS SELECT id FROM k")
    old.close()
    with pytest.raises(StoreError, match="rolled back"):
        SQLiteKeyStore(path)
    with sqlite3.connect(path) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    assert names == {"k", "console_logins"}  # no api_keys, no schema_migrations


def test_an_old_postgres_database_upgrades_in_place(tmp_path: Path, pg_server: Any) -> None:
    import psycopg

    from pg_server import PG

    url = PG.database_for(tmp_path)
    now = time.time()
    with psycopg.connect(url) as old:
        for stmt in (PG_OLD_KEYS, *PG_OLD_LOGINS, *PG_OLD_AUDIT, PG_OLD_BUCKETS):
            old.execute(stmt)
        old.execute("INSERT INTO engram_api_keys VALUES (%s, %s, %s, %s, %s, %s, NULL)",
                    ("0123456789ab", digest(SECRET), "acme", "member", "ops", CREATED))
        old.execute("INSERT INTO engram_console_logins VALUES (%s, %s, %s, %s, %s, "
                    "now() + interval '10 minutes')",
                    ("d" * 64, "0123456789ab", "acme", "member", "c" * 43))
        old.execute(f"INSERT INTO engram_audit VALUES ({', '.join(['%s'] * 12)})",
                    list(OLD_ENTRY.to_dict().values())[:1] + [CREATED]
                    + list(OLD_ENTRY.to_dict().values())[2:])
        old.execute("INSERT INTO engram_rate_buckets VALUES ('acme', 0.0, %s, 0)", (now,))
    keys = PostgresKeyStore(url)
    log = PostgresAuditLog(url)
    limiter = open_rate_limiter(Config(path=tmp_path / "engram.db", database_url=url), 0.001, 5,
                                shared=True)
    try:
        key = keys.authenticate(SECRET)
        assert key is not None and key.created_at == CREATED and key.role is Role.MEMBER
        login = keys.find_login("d" * 64)
        assert login is not None and login.key_id == key.id
        assert log.entries(tenant="acme") == [OLD_ENTRY]
        assert limiter.take("acme") > 0 and limiter.take("other") == 0.0
    finally:
        keys.close()
        log.close()
        limiter.close()
    with psycopg.connect(url) as conn:
        assert _migrations(conn) == ["service_0001_audit", "service_0001_keys",
                                     "service_0001_rate_buckets"]
        assert conn.execute("SELECT count(*) FROM engram_api_keys").fetchone() == (1,)

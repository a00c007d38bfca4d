"""The service's tables on SQLite: their named migrations and the executors of their
statements (store/service.py), each table set in its own file beside the database.

Three files, not one: `keys.db` (keys and console logins, read on every request),
`audit.db` (a row per call, written in groups; encrypted with the database's key, as it
names scopes) and `ratelimit.db` (disposable buckets written on every request without an
fsync). Each has the durability and the key its data needs, and none waits on another's
single writer.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ...errors import StoreError, StoreUnavailable
from ..service import SQLITE, take_params
from .conn import Connections, private_file, wal
from .schema import Step, apply, migrate

Row = tuple[Any, ...]

# Never edit a released migration: append a new one. The first of each file says
# IF NOT EXISTS: a file made before these were migrations already holds the tables, and
# the migration adopts them, rows and all.
KEYS_MIGRATIONS: list[tuple[str, list[Step]]] = [
    ("service_0001_keys", [
        """CREATE TABLE IF NOT EXISTS api_keys (
            id TEXT PRIMARY KEY,
            digest TEXT NOT NULL UNIQUE,
            tenant TEXT NOT NULL,
            role TEXT NOT NULL,
            name TEXT NOT NULL,
            created_at REAL NOT NULL,
            revoked_at REAL)""",
        """CREATE TABLE IF NOT EXISTS console_logins (
            digest TEXT PRIMARY KEY,
            key_id TEXT NOT NULL,
            tenant TEXT NOT NULL,
            role TEXT NOT NULL,
            csrf TEXT NOT NULL,
            expires_at REAL NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS console_logins_key ON console_logins (key_id)",
    ]),
]
AUDIT_MIGRATIONS: list[tuple[str, list[Step]]] = [
    ("service_0001_audit", [
        """CREATE TABLE IF NOT EXISTS audit (
            id TEXT PRIMARY KEY, at REAL NOT NULL,
            key_id TEXT, tenant TEXT, method TEXT NOT NULL, route TEXT NOT NULL,
            status INTEGER NOT NULL, user_id TEXT, agent_id TEXT, session_id TEXT,
            result_bytes INTEGER NOT NULL, duration_ms REAL NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS audit_tenant ON audit(tenant, at)",
    ]),
]
RATE_MIGRATIONS: list[tuple[str, list[Step]]] = [
    ("service_0001_rate_buckets", [
        "CREATE TABLE IF NOT EXISTS rate_buckets (bucket TEXT PRIMARY KEY, "
        "tokens REAL NOT NULL, at REAL NOT NULL, wait REAL NOT NULL)",
    ]),
]


def _time(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def _key_row(row: Row) -> Row:
    return (*row[:4], _time(row[4]), _time(row[5]))


class SQLiteKeys:
    """API keys and console logins in `keys.db` (rows: store/service.py's column orders)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db = Connections(self.path, busy_timeout_s=10.0, label=f"the key store {self.path}")
        try:
            migrate(self._db, KEYS_MIGRATIONS)
        except OSError as exc:
            raise StoreUnavailable(f"cannot open the key store {self.path}: {exc}") from exc

    def insert_key(self, id: str, digest: str, tenant: str, role: str, name: str,
                   created_at: datetime) -> None:
        with self._db.transaction() as conn:
            conn.execute(SQLITE.insert_key, (id, digest, tenant, role, name, created_at.timestamp()))

    def live_key(self, digest: str) -> Row | None:
        rows = self._db.read(SQLITE.live_key, (digest,))
        return _key_row(rows[0]) if rows else None

    def keys(self, tenant: str | None = None) -> list[Row]:
        rows = (self._db.read(SQLITE.all_keys) if tenant is None
                else self._db.read(SQLITE.tenant_keys, (tenant,)))
        return [_key_row(r) for r in rows]

    def revoke_key(self, id: str) -> Row | None:
        """Revoke a live key and end its logins; the key's row (None: no such key)."""
        with self._db.transaction() as conn:
            conn.execute(SQLITE.revoke_key, (time.time(), id))
            conn.execute(SQLITE.end_key_logins, (id,))
            rows = conn.execute(SQLITE.key_by_id, (id,)).fetchall()
        return _key_row(rows[0]) if rows else None

    def add_login(self, login: Sequence[str], ttl_s: float, keep: int) -> None:
        """Store a login row for `ttl_s` seconds, dropping expired logins and all but the
        newest `keep` of its key's."""
        now = time.time()
        with self._db.transaction() as conn:
            conn.execute(SQLITE.drop_expired_logins, (now,))
            conn.execute(SQLITE.add_login, (*login, now + ttl_s))
            conn.execute(SQLITE.trim_logins, (login[1], login[1], keep))

    def find_login(self, digest: str) -> Row | None:
        rows = self._db.read(SQLITE.find_login, (digest, time.time()))
        return tuple(rows[0]) if rows else None

    def end_login(self, digest: str) -> None:
        with self._db.transaction() as conn:
            conn.execute(SQLITE.end_login, (digest,))

    def ping(self) -> None:
        self._db.ping("SELECT count(*) FROM api_keys")

    def close(self) -> None:
        self._db.close()


class SQLiteAudit:
    """The audit rows in `audit.db` (encrypted with `key` when one is given)."""

    def __init__(self, path: Path, key: str | None = None) -> None:
        self._db = Connections(path, busy_timeout_s=10.0, label=f"the audit log {path}", key=key)
        migrate(self._db, AUDIT_MIGRATIONS)

    def insert(self, rows: Sequence[Sequence[Any]]) -> None:
        """Rows in AUDIT_COLUMNS order, `at` a datetime; all or none are written."""
        stored = [(r[0], r[1].timestamp(), *r[2:]) for r in rows]
        with self._db.transaction() as conn:
            conn.executemany(SQLITE.insert_audit, stored)

    def entries(self, *, tenant: str | None, all_tenants: bool = False, key_id: str | None = None,
                route: str | None = None, limit: int = 100) -> list[Row]:
        stmt, params = SQLITE.audit_entries(tenant=tenant, all_tenants=all_tenants,
                                            key_id=key_id, route=route, limit=limit)
        return [(r[0], _time(r[1]), *r[2:]) for r in self._db.read(stmt, params)]

    def close(self) -> None:
        self._db.close()


class SQLiteRateBuckets:
    """Rate-limit buckets in their own small file: one connection per thread, no fsync (the
    state is disposable: losing the file only refills every bucket), each take one atomic
    statement. A thread's first connection applies the migrations, so a deleted file comes
    back with its table."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        self._opened: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection:
        c: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if c is None:
            try:
                private_file(self.path)  # 0600 (and its -wal and -shm), like the databases beside it
                c = sqlite3.connect(self.path, timeout=10.0, isolation_level=None,
                                    check_same_thread=False)
                wal(c)
                c.execute("PRAGMA synchronous = OFF")
                c.execute("BEGIN IMMEDIATE")
                try:
                    apply(c, RATE_MIGRATIONS, f"the rate limits {self.path}")
                    c.execute("COMMIT")
                except BaseException:
                    c.execute("ROLLBACK")
                    raise
            except (OSError, sqlite3.Error) as exc:
                raise StoreUnavailable(f"cannot open the rate limits {self.path}: {exc}") from exc
            self._local.conn = c
            with self._lock:
                self._opened.append(c)
        return c

    def _run(self, stmt: str, params: Sequence[Any]) -> list[Any]:
        try:
            return self._conn().execute(stmt, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"the rate limits {self.path}: {exc}") from exc

    def take(self, bucket: str, now: float, rate: float, burst: int) -> float:
        """Take a token from `bucket` at `now` (store/service.py): 0.0, or the wait for one."""
        return float(self._run(SQLITE.take, take_params(bucket, now, rate, burst))[0][0])

    def charge(self, bucket: str, units: float) -> None:
        self._run(SQLITE.charge, [float(units), bucket])

    def prune(self, before: float) -> None:
        """Drop buckets untouched since `before` (full again by now at any sane rate)."""
        self._run(SQLITE.prune_buckets, [before])

    def close(self) -> None:
        with self._lock:
            for c in self._opened:
                c.close()
            self._opened.clear()

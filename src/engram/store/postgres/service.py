"""The service's tables on PostgreSQL (`engram_api_keys`, `engram_console_logins`,
`engram_audit`, `engram_rate_buckets`): their named migrations, recorded in the store's
`schema_migrations`, and the executors of their statements (store/service.py).

Each executor connects on demand and migrates on its first use: a service can start while
the database is down and becomes ready when it returns."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from ..service import POSTGRES, take_params
from .pool import NO_FLUSH, Pool
from .schema import Step, apply

Row = tuple[Any, ...]

# Never edit a released migration: append a new one. The first of each table set says
# IF NOT EXISTS: a database the service used before these were migrations already holds the
# tables, and the migration adopts them, rows and all. Each runs under the migration lock,
# so the service's processes starting at once create each table once.
KEYS_MIGRATIONS: list[tuple[str, list[Step]]] = [
    ("service_0001_keys", [
        """CREATE TABLE IF NOT EXISTS engram_api_keys (
            id TEXT PRIMARY KEY,
            digest TEXT NOT NULL UNIQUE,
            tenant TEXT NOT NULL,
            role TEXT NOT NULL,
            name TEXT NOT NULL,
            created_at TIMESTAMPTZ NOT NULL,
            revoked_at TIMESTAMPTZ)""",
        """CREATE TABLE IF NOT EXISTS engram_console_logins (
            digest TEXT PRIMARY KEY,
            key_id TEXT NOT NULL,
            tenant TEXT NOT NULL,
            role TEXT NOT NULL,
            csrf TEXT NOT NULL,
            expires_at TIMESTAMPTZ NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS engram_console_logins_key ON engram_console_logins (key_id)",
    ]),
]
AUDIT_MIGRATIONS: list[tuple[str, list[Step]]] = [
    ("service_0001_audit", [
        """CREATE TABLE IF NOT EXISTS engram_audit (
            id TEXT PRIMARY KEY, at TIMESTAMPTZ NOT NULL,
            key_id TEXT, tenant TEXT, method TEXT NOT NULL, route TEXT NOT NULL,
            status INTEGER NOT NULL, user_id TEXT, agent_id TEXT, session_id TEXT,
            result_bytes BIGINT NOT NULL, duration_ms DOUBLE PRECISION NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS engram_audit_tenant ON engram_audit(tenant, at)",
    ]),
]
RATE_MIGRATIONS: list[tuple[str, list[Step]]] = [
    ("service_0001_rate_buckets", [
        "CREATE TABLE IF NOT EXISTS engram_rate_buckets (bucket TEXT PRIMARY KEY, "
        "tokens DOUBLE PRECISION NOT NULL, at DOUBLE PRECISION NOT NULL, "
        "wait DOUBLE PRECISION NOT NULL)",
    ]),
]


class _Tables:
    """A pool, and the migrations applied on its first use."""

    def __init__(self, pool: Pool, migrations: list[tuple[str, list[Step]]]) -> None:
        self._pool = pool
        self._migrations = migrations
        self._ready = threading.Event()

    def _migrated(self) -> None:
        if not self._ready.is_set():
            apply(self._pool.transaction, self._migrations)
            self._ready.set()

    def _write(self, *statements: tuple[str, Sequence[Any]]) -> list[list[Any]]:
        """Run the statements in one transaction; the rows of each."""
        self._migrated()
        out = []
        with self._pool.transaction() as conn, conn.cursor() as cur:
            for stmt, params in statements:
                cur.execute(stmt, params)
                out.append(cur.fetchall() if cur.description is not None else [])
        return out

    def _read(self, stmt: str, params: Sequence[Any] = ()) -> list[Any]:
        # once migrated, BEGIN, the statement and COMMIT go in one round trip (Pool.batch)
        self._migrated()
        return self._pool.batch(None, [(stmt, params)])[0]

    def close(self) -> None:
        self._pool.close()


class PostgresKeys(_Tables):
    """API keys and console logins (rows: store/service.py's column orders); times are the
    database's clock, the one every node agrees on."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0) -> None:
        super().__init__(Pool(url, max_size=8, wait_s=connect_timeout_s,
                              connect_timeout_s=connect_timeout_s), KEYS_MIGRATIONS)

    def insert_key(self, id: str, digest: str, tenant: str, role: str, name: str,
                   created_at: datetime) -> None:
        self._write((POSTGRES.insert_key, (id, digest, tenant, role, name, created_at)))

    def live_key(self, digest: str) -> Row | None:
        rows = self._read(POSTGRES.live_key, (digest,))
        return tuple(rows[0]) if rows else None

    def keys(self, tenant: str | None = None) -> list[Row]:
        rows = (self._read(POSTGRES.all_keys) if tenant is None
                else self._read(POSTGRES.tenant_keys, (tenant,)))
        return [tuple(r) for r in rows]

    def revoke_key(self, id: str) -> Row | None:
        """Revoke a live key and end its logins; the key's row (None: no such key)."""
        rows = self._write((POSTGRES.revoke_key, (id,)), (POSTGRES.end_key_logins, (id,)),
                           (POSTGRES.key_by_id, (id,)))[2]
        return tuple(rows[0]) if rows else None

    def add_login(self, login: Sequence[str], ttl_s: float, keep: int) -> None:
        self._write((POSTGRES.drop_expired_logins, ()), (POSTGRES.add_login, (*login, ttl_s)),
                    (POSTGRES.trim_logins, (login[1], login[1], keep)))

    def find_login(self, digest: str) -> Row | None:
        rows = self._read(POSTGRES.find_login, (digest,))
        return tuple(rows[0]) if rows else None

    def end_login(self, digest: str) -> None:
        self._write((POSTGRES.end_login, (digest,)))

    def ping(self) -> None:
        self._write(("SELECT 1", ()))


class PostgresAudit(_Tables):
    """The audit rows of the shared database."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0) -> None:
        super().__init__(Pool(url, max_size=4, wait_s=connect_timeout_s,
                              connect_timeout_s=connect_timeout_s), AUDIT_MIGRATIONS)

    def insert(self, rows: Sequence[Sequence[Any]]) -> None:
        """Rows in AUDIT_COLUMNS order; all or none are written."""
        self._migrated()
        with self._pool.transaction() as conn, conn.cursor() as cur:
            cur.executemany(POSTGRES.insert_audit, [list(r) for r in rows])

    def entries(self, *, tenant: str | None, all_tenants: bool = False, key_id: str | None = None,
                route: str | None = None, limit: int = 100) -> list[Row]:
        stmt, params = POSTGRES.audit_entries(tenant=tenant, all_tenants=all_tenants,
                                              key_id=key_id, route=route, limit=limit)
        return [tuple(r) for r in self._write((stmt, params))[0]]


class PostgresRateBuckets(_Tables):
    """Rate-limit buckets of the shared database, one round trip per take, each committed
    without waiting for the WAL to reach the disk, as the SQLite buckets are written without
    an fsync: the state is disposable, and that wait was the tail of every request (search
    p99 160-215 ms under `bench/load.py` with it, 86 ms with none)."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0) -> None:
        super().__init__(Pool(url, max_size=4, wait_s=connect_timeout_s,
                              connect_timeout_s=connect_timeout_s), RATE_MIGRATIONS)

    def _run(self, stmt: str, params: Sequence[Any]) -> list[Any]:
        self._migrated()
        # Sent again on a connection found dead (the server restarted): at worst a token is
        # taken twice, where without it every process's first request after a restart
        # answered 503 while its /ready said 200.
        return self._pool.batch(None, [NO_FLUSH, (stmt, params)])[1]

    def take(self, bucket: str, now: float, rate: float, burst: int) -> float:
        return float(self._run(POSTGRES.take, take_params(bucket, now, rate, burst))[0][0])

    def charge(self, bucket: str, units: float) -> None:
        self._run(POSTGRES.charge, [float(units), bucket])

    def prune(self, before: float) -> None:
        self._run(POSTGRES.prune_buckets, [before])

"""The scale-out store: PostgreSQL with pgvector (HNSW, cosine) and full-text search.

Every row carries its tenant and every query filters on it inside the SQL; row-level security
on `engram.tenant` (set per transaction) stands behind those filters as a second wall.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from typing import Any

import numpy as np
import psycopg
from psycopg import errors as pgerr
from psycopg.types.json import Json, Jsonb

from ..errors import Conflict, EngramError, InvalidInput, StoreBusy, StoreError, StoreUnavailable
from ..model import Event, EventType, Job, JobStatus, Kind, MemoryRecord, Scope, Session
from . import pg_sql as q
from .base import Candidate, Key, Lexical, Query, Stats
from .pg_pool import Pool

log = logging.getLogger("engram.store")

_MIGRATION_LOCK = 0x656E6772  # pg_advisory_xact_lock key: one migrator at a time ("engr")
_INDEX_LOCK = 0x656E6773      # ... and one creator of a dimension's HNSW index
_WRITE_LOCK = 0x656E6774      # ... and one writer per tenant (with hashtext(tenant))
_JOB_COLUMNS = ("id", "key", "fingerprint", "kind", "user_id", "agent_id", "session_id", "payload",
                "status", "attempts", "run_at", "lease_until", "result", "error", "created_at",
                "updated_at")
_SESSION_COLUMNS = ("scope_key", "user_id", "agent_id", "session_id", "policy", "summary",
                    "summary_upto", "state", "metadata", "created_at", "updated_at", "ended_at")
_RECLAIM = {"vacuum": "INDEX_CLEANUP ON", "full": "FULL", "none": ""}
_EVENT_COLUMNS = "id, memory_id, type, at, user_id, agent_id, session_id, before, after, reason"
_LEX = (f"setweight(to_tsvector('{q.TS_CONFIG}', %s), 'A') || "
        f"setweight(to_tsvector('{q.TS_CONFIG}', %s), 'B')")


def _utc(value: datetime | None) -> datetime | None:
    return value if value is None or value.tzinfo is UTC else value.astimezone(UTC)


def _record(row: Sequence[Any]) -> MemoryRecord:
    r = dict(zip(q.COLUMNS, row, strict=True))
    return MemoryRecord(
        id=r["id"], scope=Scope(r["user_id"], r["agent_id"], r["session_id"]),
        kind=Kind(r["kind"]), text=r["text"], metadata=r["metadata"], importance=r["importance"],
        role=r["role"], name=r["name"], created_at=_utc(r["created_at"]),  # type: ignore[arg-type]
        updated_at=_utc(r["updated_at"]), observed_at=_utc(r["observed_at"]),  # type: ignore[arg-type]
        valid_from=_utc(r["valid_from"]), valid_to=_utc(r["valid_to"]),
        superseded_by=r["superseded_by"], provenance=tuple(r["provenance"]),
        access_count=r["access_count"], last_accessed_at=_utc(r["last_accessed_at"]),
        expires_at=_utc(r["expires_at"]), content_hash=r["content_hash"],
        deleted_at=_utc(r["deleted_at"]),
    )


def _record_values(rec: MemoryRecord) -> list[Any]:
    return [
        rec.id, rec.scope.user_id, rec.scope.agent_id, rec.scope.session_id, rec.kind.value,
        rec.text, Jsonb(rec.metadata), rec.importance, rec.role, rec.name, rec.created_at,
        rec.updated_at, rec.observed_at, rec.valid_from, rec.valid_to, rec.superseded_by,
        list(rec.provenance), rec.access_count, rec.last_accessed_at, rec.expires_at,
        rec.content_hash, rec.deleted_at,
    ]


def _event(row: Sequence[Any]) -> Event:
    eid, mid, typ, at, uid, aid, sid, before, after, reason = row
    return Event(id=eid, memory_id=mid, type=EventType(typ), at=_utc(at),  # type: ignore[arg-type]
                 scope=Scope(uid, aid, sid), before=before, after=after, reason=reason)


def _job(row: Sequence[Any]) -> Job:
    r = dict(zip(_JOB_COLUMNS, row, strict=True))
    return Job(id=r["id"], key=r["key"], fingerprint=r["fingerprint"], task=r["kind"],
               scope=Scope(r["user_id"], r["agent_id"], r["session_id"]), payload=r["payload"],
               status=JobStatus(r["status"]), attempts=r["attempts"],
               run_at=_utc(r["run_at"]), lease_until=_utc(r["lease_until"]),  # type: ignore[arg-type]
               result=r["result"], error=r["error"], created_at=_utc(r["created_at"]),  # type: ignore[arg-type]
               updated_at=_utc(r["updated_at"]))  # type: ignore[arg-type]


def _session(row: Sequence[Any]) -> Session:
    r = dict(zip(_SESSION_COLUMNS, row, strict=True))
    return Session(scope=Scope(r["user_id"], r["agent_id"], r["session_id"]), policy=r["policy"],
                   summary=r["summary"], summary_upto=r["summary_upto"], state=r["state"],
                   metadata=r["metadata"], created_at=_utc(r["created_at"]),  # type: ignore[arg-type]
                   updated_at=_utc(r["updated_at"]), ended_at=_utc(r["ended_at"]))  # type: ignore[arg-type]


def translate(exc: psycopg.Error) -> EngramError:
    """The engram error a caller can act on, for a database error (the transaction is gone)."""
    if isinstance(exc, pgerr.LockNotAvailable | pgerr.DeadlockDetected | pgerr.SerializationFailure):
        return StoreBusy(f"the database stayed locked: {exc}")
    if isinstance(exc, pgerr.QueryCanceled):
        return StoreError(f"a statement ran past the statement timeout: {exc}")
    if isinstance(exc, psycopg.OperationalError):  # connection refused, lost, server shut down
        return StoreUnavailable(f"PostgreSQL is unavailable: {exc}")
    if isinstance(exc, psycopg.DataError):  # e.g. NUL characters, which PostgreSQL text refuses
        return InvalidInput(f"the database refused a value: {exc}")
    return StoreError(f"database error (the transaction was rolled back): {exc}")


class PostgresStore:
    """`Store` over PostgreSQL + pgvector, for one tenant of a shared database.

    Safe across threads (a small connection pool) and processes (many service processes and
    workers can share one database). Reads made inside `write()` on the same thread go through
    the write's transaction, so they see its changes.
    """

    def __init__(self, url: str, *, tenant: str = "", busy_timeout_s: float = 30.0,
                 statement_timeout_s: float | None = None, connect_timeout_s: float = 5.0,
                 max_connections: int = 10, exact_limit: int = 2000,
                 reclaim_mode: str = "vacuum") -> None:
        """`exact_limit`: a dense search over at most this many visible keys is exact (a scan);
        above it the HNSW index answers (approximate). `reclaim_mode`: what `reclaim()` runs on
        the tables an erase touched: "vacuum", "full" (VACUUM FULL) or "none"."""
        if not isinstance(tenant, str):
            raise InvalidInput("tenant must be a string")
        if reclaim_mode not in _RECLAIM:
            raise InvalidInput(f"reclaim_mode must be one of {', '.join(_RECLAIM)}")
        self.tenant = tenant
        self.busy_timeout_s = busy_timeout_s
        self.statement_timeout_s = statement_timeout_s or max(60.0, 2 * busy_timeout_s)
        self.exact_limit = exact_limit
        self.reclaim_mode = reclaim_mode
        self._pool = Pool(url, max_size=max_connections, wait_s=busy_timeout_s,
                           connect_timeout_s=connect_timeout_s)
        self._local = threading.local()
        self._indexed: set[int] = set()  # dimensions known to have their HNSW index
        self._to_vacuum: set[str] = set()
        self._closed = False
        self._iterative = True  # pgvector >= 0.8: iterative index scans (read at open)
        try:
            self._migrate()
        except BaseException:
            self._pool.close()  # the caller never gets the store to close
            raise

    # -- connections and transactions --------------------------------------------------------

    def _setup(self, conn: psycopg.Connection[Any], lock_timeout_ms: int | None = None) -> None:
        # SET LOCAL semantics (is_local = true): nothing outlives the transaction, so a pooled
        # connection (or a pgbouncer in transaction mode) never carries one tenant to another.
        lock_ms = int(self.busy_timeout_s * 1000) if lock_timeout_ms is None else lock_timeout_ms
        conn.execute(
            "SELECT set_config('engram.tenant', %s, true), set_config('statement_timeout', %s, true),"
            " set_config('lock_timeout', %s, true), set_config('TimeZone', 'UTC', true),"
            " set_config('client_min_messages', 'warning', true)",
            (self.tenant, str(int(self.statement_timeout_s * 1000)), str(max(1, lock_ms))))

    @contextmanager
    def _transaction(self, lock_timeout_ms: int | None = None) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection inside a fresh transaction with the tenant set. A stale idle
        connection (the server restarted) is replaced once, before any work is done on it."""
        for attempt in (0, 1):
            conn = self._pool.acquire()
            tx = conn.transaction()
            try:
                tx.__enter__()
                self._setup(conn, lock_timeout_ms)
                break
            except psycopg.OperationalError as exc:
                self._pool.release(conn, discard=True)
                self._pool.drop_idle()
                if attempt == 1 or isinstance(exc, pgerr.QueryCanceled | pgerr.LockNotAvailable):
                    raise translate(exc) from exc
            except BaseException as exc:
                self._pool.release(conn, discard=True)
                if isinstance(exc, psycopg.Error):
                    raise translate(exc) from exc
                raise
        try:
            try:
                yield conn
            except BaseException as exc:
                tx.__exit__(type(exc), exc, exc.__traceback__)
                raise
            tx.__exit__(None, None, None)
        except psycopg.Error as exc:
            raise translate(exc) from exc
        finally:
            self._pool.release(conn)

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        """This thread's open write if there is one (reads see its changes), else a new
        read transaction."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            try:
                yield conn
            except psycopg.Error as exc:
                raise translate(exc) from exc
            return
        with self._transaction() as conn:
            yield conn

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._conn() as conn:
            return conn.execute(sql, params).fetchall()

    def write(self) -> AbstractContextManager[_PgTx]:
        """One transaction: it commits whole when the block ends, or leaves nothing. A nested
        `write()` on the same thread is a savepoint of the outer one.

        Writes of one tenant take turns (a transaction-scoped advisory lock, waited for up to
        `busy_timeout_s`), as SQLite's writers do: `Memory` reads before it writes inside the
        transaction (is this fact already known?), and two concurrent adds of one fact must
        not both find it missing. Reads never wait; other tenants write in parallel."""
        return self._write(serialize=True)

    @contextmanager
    def _write(self, serialize: bool) -> Iterator[_PgTx]:
        outer = getattr(self._local, "conn", None)
        if outer is not None:
            try:
                with outer.transaction():
                    yield _PgTx(outer, self)
            except psycopg.Error as exc:
                raise translate(exc) from exc
            return
        with self._transaction() as conn:
            if serialize:
                conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_WRITE_LOCK, self.tenant))
            tx = _PgTx(conn, self)
            self._local.conn = conn
            try:
                yield tx
            finally:
                self._local.conn = None
        self._indexed |= tx.new_dims  # committed: the indexes exist for everyone now
        self._to_vacuum |= tx.erased_from

    def for_tenant(self, tenant: str) -> PostgresStore:
        """The store of another tenant of the same database, sharing this one's connections:
        a service serving many tenants holds one pool per process, not one per tenant."""
        if not isinstance(tenant, str):
            raise InvalidInput("tenant must be a string")
        self._pool.retain()
        other = copy.copy(self)  # the pool and the set of indexed dimensions are shared
        other.tenant = tenant
        other._local = threading.local()  # a write on one tenant is never seen from another
        other._to_vacuum = set()
        other._closed = False
        return other

    def close(self) -> None:
        if not self._closed:  # each store releases its share of the pool once
            self._closed = True
            self._pool.close()

    def _migrate(self) -> None:
        pending = [name for name, _ in q.MIGRATIONS]
        with self._transaction() as conn:
            if conn.execute("SELECT to_regclass('schema_migrations')").fetchone()[0]:  # type: ignore[index]
                done = {r[0] for r in conn.execute("SELECT name FROM schema_migrations")}
                pending = [name for name in pending if name not in done]
        for name, statements in q.MIGRATIONS:
            if name not in pending:
                continue
            with self._transaction() as conn:
                conn.execute("SET LOCAL statement_timeout = 0")  # a migration may rebuild tables
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                conn.execute(q.MIGRATIONS_TABLE)
                if conn.execute("SELECT 1 FROM schema_migrations WHERE name = %s", (name,)).fetchone():
                    continue  # another process applied it while we waited for the lock
                for stmt in statements:
                    try:
                        conn.execute(stmt)
                    except pgerr.InsufficientPrivilege as exc:
                        raise StoreError(
                            f"migration {name} needs a privilege this role lacks ({exc}); pgvector "
                            "must be installed by an administrator: CREATE EXTENSION vector") from exc
                conn.execute("INSERT INTO schema_migrations (name) VALUES (%s)", (name,))
                log.info("applied migration %s", name)

        with self._transaction() as conn:
            row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
        version = tuple(int(p) for p in row[0].split(".")[:2] if p.isdigit()) if row else (0, 0)
        self._iterative = version >= (0, 8)
        if not self._iterative:
            log.warning("pgvector %s has no iterative index scans (0.8+): filtered approximate "
                        "searches fall back to exact scans more often", row[0] if row else "?")

    def migrations(self) -> list[str]:
        return [r[0] for r in self._read("SELECT name FROM schema_migrations ORDER BY name")]

    # -- reads -------------------------------------------------------------------------------

    def get(self, ids: Sequence[str]) -> dict[str, MemoryRecord]:
        if not ids:
            return {}
        rows = self._read(f"{q.SELECT} WHERE m.tenant = %s AND m.id = ANY(%s)", (self.tenant, list(ids)))
        return {r[0]: _record(r) for r in rows}

    def candidates(self, ids: Sequence[str]) -> dict[str, Candidate]:
        if not ids:
            return {}
        rows = self._read(
            "SELECT id, user_id, agent_id, session_id, name, text, observed_at, created_at, importance "
            "FROM memories WHERE tenant = %s AND id = ANY(%s)", (self.tenant, list(ids)))
        scopes: dict[tuple[Any, ...], Scope] = {}  # hundreds of candidates share a few scopes
        out: dict[str, Candidate] = {}
        for mid, uid, aid, sid, name, text, obs, created, imp in rows:
            scope = scopes.get((uid, aid, sid))
            if scope is None:
                scope = scopes[(uid, aid, sid)] = Scope(uid, aid, sid)
            out[mid] = Candidate(mid, scope, name, text, _utc(obs), _utc(created), imp)  # type: ignore[arg-type]
        return out

    def select(self, query: Query, *, after_id: str | None = None,
               limit: int = 50) -> list[MemoryRecord]:
        where, params = q.compile_query(query, self.tenant)
        if after_id is not None:
            where += " AND m.id > %s"
            params.append(after_id)
        rows = self._read(f"{q.SELECT} WHERE {where} ORDER BY m.id LIMIT %s", [*params, limit])
        return [_record(r) for r in rows]

    def ids(self, scope: Scope, *, include_deleted: bool = False) -> list[str]:
        sql, params = q.scope_sql(scope)
        if not include_deleted:
            sql.append("m.deleted_at IS NULL")
        where = " AND ".join(["m.tenant = %s", *sql])
        rows = self._read(f"SELECT m.id FROM memories m WHERE {where} ORDER BY m.id", [self.tenant, *params])
        return [r[0] for r in rows]

    def dense(self, query: Query, vector: np.ndarray, k: int,
              key: str = "text") -> list[tuple[str, float]]:
        """Exact (a scan of the visible keys) while they number at most `exact_limit`, so small
        scopes and tests get the true top-k; beyond that the dimension's HNSW index, with
        iterative scans so that filters do not starve it, and the exact scan again if the
        index still returns fewer than `k`."""
        if k <= 0:
            return []
        v = np.asarray(vector, dtype=np.float32).ravel()
        dim = int(v.shape[0])
        lit = q.vector_literal(v)
        where, params = q.compile_query(query, self.tenant)
        source = q.dense_source(dim, where)
        sparams = [self.tenant, key, *params]
        with self._conn() as conn:
            use_index = False
            if dim <= q.MAX_INDEXED_DIM:
                indexed, n = conn.execute(
                    f"SELECT to_regclass(%s) IS NOT NULL, (SELECT count(*) FROM (SELECT 1 {source} "
                    "LIMIT %s) c)", [q.hnsw_index_name(dim), *sparams, self.exact_limit + 1]).fetchone()  # type: ignore[misc]
                use_index = indexed and n > self.exact_limit
            if use_index:
                conn.execute("SELECT set_config('hnsw.ef_search', %s, true)",
                             (str(min(1000, max(100, 2 * k))),))
                if self._iterative:
                    conn.execute("SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true)")
                rows = conn.execute(q.dense_ann_sql(dim, source), [lit, *sparams, lit, 2 * k, k]).fetchall()
                if len(rows) >= k:
                    log.debug("dense: approximate (HNSW) query, %d hits", len(rows))
                    return [(r[0], float(r[1])) for r in rows]
                log.debug("dense: the approximate query found %d of %d; exact scan", len(rows), k)
            rows = conn.execute(q.dense_exact_sql(source), [lit, *sparams, k]).fetchall()
            log.debug("dense: exact scan, %d hits", len(rows))
        return [(r[0], float(r[1])) for r in rows]

    def lexical(self, query: Query, terms: Sequence[str], k: int,
                previous_weight: float = 0.5) -> list[tuple[str, float]]:
        text = q.tsquery_text(terms)
        if not text or k <= 0:
            return []
        # ts_rank takes weights in [0, 1] ({D, C, B, A}): scale both down, and the rank back up.
        cw = max(0.0, float(previous_weight))
        scale = max(1.0, cw)
        weights = [0.0, 0.0, cw / scale, 1.0 / scale]
        where, params = q.compile_query(query, self.tenant)
        rows = self._read(
            "SELECT m.id, ts_rank(%s::real[], m.lex, tq, 1) * %s AS s "
            f"FROM memories m, to_tsquery('{q.TS_CONFIG}', %s) tq "
            f"WHERE {where} AND m.lex @@ tq ORDER BY s DESC, m.id LIMIT %s",
            [weights, scale, text, *params, k])
        return [(r[0], float(r[1])) for r in rows]

    def find_hash(self, scope: Scope, kind: Kind, content_hash: str,
                  now: datetime) -> MemoryRecord | None:
        s_sql, s_params = q.scope_sql(scope, exact=True)
        rows = self._read(
            f"{q.SELECT} WHERE m.tenant = %s AND m.content_hash = %s AND m.kind = %s "
            "AND m.deleted_at IS NULL AND (m.expires_at IS NULL OR m.expires_at > %s) "
            f"AND (m.valid_to IS NULL OR m.valid_to > %s) AND {' AND '.join(s_sql)} LIMIT 1",
            [self.tenant, content_hash, kind.value, now, now, *s_params])
        return _record(rows[0]) if rows else None

    def recent_episodes(self, scope: Scope, n: int) -> list[MemoryRecord]:
        s_sql, s_params = q.scope_sql(scope, exact=True)
        rows = self._read(
            f"{q.SELECT} WHERE m.tenant = %s AND m.kind = 'episodic' AND m.deleted_at IS NULL "
            f"AND {' AND '.join(s_sql)} ORDER BY m.valid_from DESC NULLS LAST, m.seq DESC LIMIT %s",
            [self.tenant, *s_params, n])
        return [_record(r) for r in rows]

    def episodes_around(self, id: str, n: int) -> tuple[list[MemoryRecord], list[MemoryRecord]]:
        with self._conn() as conn:
            row = conn.execute("SELECT user_id, agent_id, session_id, valid_from, seq FROM memories "
                               "WHERE tenant = %s AND id = %s AND kind = 'episodic'",
                               (self.tenant, id)).fetchone()
            if row is None:
                return [], []
            uid, aid, sid, vf, seq = row
            same = ("m.tenant = %s AND m.kind = 'episodic' AND m.deleted_at IS NULL "
                    "AND m.user_id IS NOT DISTINCT FROM %s AND m.agent_id IS NOT DISTINCT FROM %s "
                    "AND m.session_id IS NOT DISTINCT FROM %s")
            base = [self.tenant, uid, aid, sid]
            before = conn.execute(
                f"{q.SELECT} WHERE {same} AND (m.valid_from < %s OR (m.valid_from = %s AND m.seq < %s)) "
                "ORDER BY m.valid_from DESC, m.seq DESC LIMIT %s", [*base, vf, vf, seq, n]).fetchall()
            after = conn.execute(
                f"{q.SELECT} WHERE {same} AND (m.valid_from > %s OR (m.valid_from = %s AND m.seq > %s)) "
                "ORDER BY m.valid_from, m.seq LIMIT %s", [*base, vf, vf, seq, n]).fetchall()
        return [_record(r) for r in reversed(before)], [_record(r) for r in after]

    def eviction_pool(self, scope: Scope, now: datetime) -> list[MemoryRecord]:
        s_sql, s_params = q.scope_sql(scope, exact=True)
        rows = self._read(
            f"{q.SELECT} WHERE m.tenant = %s AND m.deleted_at IS NULL "
            f"AND (m.expires_at IS NULL OR m.expires_at > %s) AND {' AND '.join(s_sql)}",
            [self.tenant, now, *s_params])
        return [_record(r) for r in rows]

    def events(self, memory_id: str) -> list[Event]:
        rows = self._read(f"SELECT {_EVENT_COLUMNS} FROM events WHERE tenant = %s AND memory_id = %s "
                          "ORDER BY seq", (self.tenant, memory_id))
        return [_event(r) for r in rows]

    def touch(self, ids: Sequence[str], at: datetime) -> None:
        if not ids:
            return
        sql = ("UPDATE memories SET access_count = access_count + 1, last_accessed_at = %s "
               "WHERE tenant = %s AND id = ANY(%s)")
        params = (at, self.tenant, sorted(set(ids)))
        try:
            if getattr(self._local, "conn", None) is not None:
                self._read(sql, params)
                return
            # Best effort: a row locked by a writer for more than 20 ms is simply not counted.
            with self._transaction(lock_timeout_ms=20) as conn:
                conn.execute(sql, params)
        except (StoreBusy, StoreUnavailable) as exc:
            log.debug("access tracking skipped: %s", exc)

    def stats(self, scope: Scope, now: datetime) -> Stats:
        s_sql, s_params = q.scope_sql(scope)
        where = " AND ".join(["m.tenant = %s", *s_sql])
        params = [self.tenant, *s_params]
        with self._conn() as conn:
            by_kind = dict(conn.execute(
                f"SELECT m.kind, count(*) FROM memories m WHERE {where} AND m.deleted_at IS NULL "
                "AND (m.expires_at IS NULL OR m.expires_at > %s) AND (m.valid_to IS NULL OR m.valid_to > %s) "
                "GROUP BY m.kind", [*params, now, now]).fetchall())
            deleted, superseded, expired, scopes = conn.execute(
                "SELECT count(*) FILTER (WHERE m.deleted_at IS NOT NULL), "
                "count(*) FILTER (WHERE m.deleted_at IS NULL AND m.valid_to <= %s), "
                "count(*) FILTER (WHERE m.deleted_at IS NULL AND m.expires_at <= %s), "
                "count(DISTINCT coalesce(m.user_id, '') || chr(31) || coalesce(m.agent_id, '') "
                f"|| chr(31) || coalesce(m.session_id, '')) FROM memories m WHERE {where}",
                [now, now, *params]).fetchone()  # type: ignore[misc]
            (events,) = conn.execute(f"SELECT count(*) FROM events e WHERE {where.replace('m.', 'e.')}",
                                     params).fetchone()  # type: ignore[misc]
            size = None
            if not self.tenant:  # the database is this store's alone; a tenant's share is unknown
                (size,) = conn.execute("SELECT pg_database_size(current_database())").fetchone()  # type: ignore[misc]
        return Stats(memories=sum(by_kind.values()), by_kind=by_kind, deleted=deleted,
                     superseded=superseded, expired=expired, events=events, scopes=scopes,
                     db_bytes=size)

    def iter_export(self, scope: Scope) -> Iterator[tuple[MemoryRecord, list[Event]]]:
        ids = self.ids(scope, include_deleted=True)
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            records = self.get(chunk)
            for mid in chunk:
                yield records[mid], self.events(mid)

    def reclaim(self) -> None:
        """VACUUM the tables an erase touched (see docs/postgres.md for what each mode leaves).

        "vacuum": the dead row versions (erased text, vectors, lexemes) leave the heap and the
        indexes, so no query or index can reach them, but PostgreSQL does not overwrite the
        freed bytes: they stay in the data files until the space is reused. "full": VACUUM
        FULL rewrites the tables, so the data files no longer hold them (it locks the tables
        while it runs). Neither touches WAL segments not yet recycled, nor backups."""
        tables, self._to_vacuum = sorted(self._to_vacuum), set()
        if not tables or self.reclaim_mode == "none" or getattr(self._local, "conn", None) is not None:
            return
        conn = self._pool.acquire()
        skipped: list[psycopg.errors.Diagnostic] = []
        conn.add_notice_handler(skipped.append)  # e.g. "skipping vacuum of ... lock not available"
        try:
            # VACUUM runs outside any transaction; SKIP_LOCKED: never wait behind another lock.
            conn.execute(f"VACUUM ({_RECLAIM[self.reclaim_mode]}, SKIP_LOCKED) {', '.join(tables)}")
        except psycopg.Error as exc:
            raise translate(exc) from exc
        finally:
            conn.remove_notice_handler(skipped.append)
            self._pool.release(conn)
        for notice in skipped:
            log.warning("reclaim: %s", notice.message_primary)

    # -- jobs and sessions ---------------------------------------------------------------------

    def _jobs(self, where: str, params: Sequence[Any], tail: str = "") -> list[Job]:
        rows = self._read(f"SELECT {', '.join('m.' + c for c in _JOB_COLUMNS)} FROM jobs m "
                          f"WHERE m.tenant = %s AND {where} {tail}", [self.tenant, *params])
        return [_job(r) for r in rows]

    def job(self, id: str) -> Job | None:
        found = self._jobs("m.id = %s", [id])
        return found[0] if found else None

    def job_by_key(self, key: str) -> Job | None:
        found = self._jobs("m.key = %s", [key])
        return found[0] if found else None

    def jobs(self, scope: Scope, *, status: str | None = None, limit: int = 50) -> list[Job]:
        sql, params = q.scope_sql(scope)
        if status is not None:
            sql.append("m.status = %s")
            params.append(status)
        return self._jobs(" AND ".join(sql) or "TRUE", [*params, limit], "ORDER BY m.id DESC LIMIT %s")

    def claim_job(self, now: datetime, lease_until: datetime) -> Job | None:
        """SKIP LOCKED: concurrent workers each take a different runnable job instead of
        queueing behind the one row the first of them locked."""
        cols = ", ".join(_JOB_COLUMNS)
        with self._write(serialize=False) as tx:  # many workers claim at once: rows, not turns
            row = tx.conn.execute(
                "UPDATE jobs SET status = 'running', attempts = attempts + 1, lease_until = %s, "
                "updated_at = %s WHERE tenant = %s AND id = (SELECT id FROM jobs WHERE tenant = %s AND "
                "((status = 'queued' AND run_at <= %s) OR (status = 'running' AND lease_until <= %s)) "
                f"ORDER BY run_at, id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING {cols}",
                (lease_until, now, self.tenant, self.tenant, now, now)).fetchone()
        return _job(row) if row else None

    def session(self, scope: Scope) -> Session | None:
        rows = self._read(f"SELECT {', '.join(_SESSION_COLUMNS)} FROM sessions "
                          "WHERE tenant = %s AND scope_key = %s", (self.tenant, q.scope_key(scope)))
        return _session(rows[0]) if rows else None

    def sessions(self, scope: Scope, *, limit: int = 50) -> list[Session]:
        sql, params = q.scope_sql(scope)
        where = " AND ".join(["m.tenant = %s", *sql])
        rows = self._read(f"SELECT {', '.join('m.' + c for c in _SESSION_COLUMNS)} FROM sessions m "
                          f"WHERE {where} ORDER BY m.updated_at DESC, m.scope_key LIMIT %s",
                          [self.tenant, *params, limit])
        return [_session(r) for r in rows]


class _PgTx:
    """The write operations of one transaction (see `Tx` in store/base.py)."""

    def __init__(self, conn: psycopg.Connection[Any], store: PostgresStore) -> None:
        self.conn = conn
        self.store = store
        self.tenant = store.tenant
        self.new_dims: set[int] = set()
        self.erased_from: set[str] = set()

    def insert(self, record: MemoryRecord, keys: Sequence[Key], lexical: Lexical) -> None:
        cols = ", ".join(["tenant", *q.COLUMNS, "lex"])
        marks = ", ".join(["%s"] * (len(q.COLUMNS) + 1))
        self.conn.execute(f"INSERT INTO memories ({cols}) VALUES ({marks}, {_LEX})",
                          [self.tenant, *_record_values(record), lexical.body, lexical.previous])
        self._put_keys(record.id, keys)

    def _put_keys(self, memory_id: str, keys: Sequence[Key]) -> None:
        rows = []
        for key in keys:
            v = np.asarray(key.vector, dtype=np.float32).ravel()
            self._ensure_index(int(v.shape[0]))
            rows.append((self.tenant, memory_id, key.name, int(v.shape[0]), q.vector_literal(v)))
        if rows:
            with self.conn.cursor() as cur:
                cur.executemany("INSERT INTO memory_keys (tenant, memory_id, kind, dim, vector) "
                                "VALUES (%s, %s, %s, %s, %s::vector)", rows)

    def _ensure_index(self, dim: int) -> None:
        """The HNSW index of a new dimension, made in this transaction before its keys go in
        (its lock then waits for no row this transaction holds)."""
        if dim in self.store._indexed or dim in self.new_dims or not 0 < dim <= q.MAX_INDEXED_DIM:
            return
        name = q.hnsw_index_name(dim)
        if not self.conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()[0]:  # type: ignore[index]
            self.conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (_INDEX_LOCK, dim))
            self.conn.execute(q.hnsw_index_sql(dim))
            log.info("created HNSW index %s", name)
        self.new_dims.add(dim)

    def update(self, record: MemoryRecord, keys: Sequence[Key] | None = None,
               lexical: Lexical | None = None) -> None:
        sets = ", ".join(f"{c} = %s" for c in q.COLUMNS[1:])
        params = _record_values(record)[1:]
        if lexical is not None:
            sets += f", lex = {_LEX}"
            params += [lexical.body, lexical.previous]
        self.conn.execute(f"UPDATE memories SET {sets} WHERE tenant = %s AND id = %s",
                          [*params, self.tenant, record.id])
        if keys is not None:
            for key in keys:  # before the delete below takes row locks on memory_keys
                self._ensure_index(int(np.asarray(key.vector).size))
            self.conn.execute("DELETE FROM memory_keys WHERE tenant = %s AND memory_id = %s",
                              (self.tenant, record.id))
            self._put_keys(record.id, keys)

    def soft_delete(self, ids: Sequence[str], at: datetime) -> None:
        if not ids:
            return
        self.conn.execute("UPDATE memories SET deleted_at = %s, updated_at = %s, lex = NULL "
                          "WHERE tenant = %s AND id = ANY(%s)", (at, at, self.tenant, list(ids)))
        self.conn.execute("DELETE FROM memory_keys WHERE tenant = %s AND memory_id = ANY(%s)",
                          (self.tenant, list(ids)))

    def erase(self, ids: Sequence[str]) -> None:
        if not ids:
            return
        params = (self.tenant, list(ids))
        self.conn.execute("DELETE FROM memory_keys WHERE tenant = %s AND memory_id = ANY(%s)", params)
        self.conn.execute("DELETE FROM events WHERE tenant = %s AND memory_id = ANY(%s)", params)
        self.conn.execute("DELETE FROM memories WHERE tenant = %s AND id = ANY(%s)", params)
        self.erased_from |= {"memories", "memory_keys", "events"}

    def append(self, event: Event) -> None:
        s = event.scope
        self.conn.execute(
            f"INSERT INTO events (tenant, {_EVENT_COLUMNS}) VALUES ({', '.join(['%s'] * 11)})",
            (self.tenant, event.id, event.memory_id, event.type.value, event.at, s.user_id, s.agent_id,
             s.session_id, None if event.before is None else Json(event.before),
             None if event.after is None else Json(event.after), event.reason))

    def put_job(self, job: Job) -> None:
        s = job.scope
        cols = ", ".join(["tenant", *_JOB_COLUMNS])
        updates = ", ".join(f"{c} = excluded.{c}" for c in _JOB_COLUMNS[1:])
        try:
            with self.conn.transaction():  # a savepoint: a Conflict leaves the transaction usable
                self.conn.execute(
                    f"INSERT INTO jobs ({cols}) VALUES ({', '.join(['%s'] * (len(_JOB_COLUMNS) + 1))}) "
                    f"ON CONFLICT (tenant, id) DO UPDATE SET {updates}",
                    (self.tenant, job.id, job.key, job.fingerprint, job.task, s.user_id, s.agent_id,
                     s.session_id, Json(job.payload), job.status.value, job.attempts, job.run_at,
                     job.lease_until, None if job.result is None else Json(job.result), job.error,
                     job.created_at, job.updated_at))
        except pgerr.UniqueViolation as exc:
            raise Conflict(f"idempotency key {job.key!r} is already used by another job") from exc

    def put_session(self, session: Session) -> None:
        s = session.scope
        cols = ", ".join(["tenant", *_SESSION_COLUMNS])
        updates = ", ".join(f"{c} = excluded.{c}" for c in _SESSION_COLUMNS[1:])
        self.conn.execute(
            f"INSERT INTO sessions ({cols}) VALUES ({', '.join(['%s'] * (len(_SESSION_COLUMNS) + 1))}) "
            f"ON CONFLICT (tenant, scope_key) DO UPDATE SET {updates}",
            (self.tenant, q.scope_key(s), s.user_id, s.agent_id, s.session_id, Json(session.policy),
             session.summary, session.summary_upto, Json(session.state), Json(session.metadata),
             session.created_at, session.updated_at, session.ended_at))

    def delete_session(self, scope: Scope) -> None:
        self.conn.execute("DELETE FROM sessions WHERE tenant = %s AND scope_key = %s",
                          (self.tenant, q.scope_key(scope)))

    def erase_scope(self, scope: Scope) -> None:
        sql, params = q.scope_sql(scope)
        where = " AND ".join(["m.tenant = %s", *sql])
        self.conn.execute(f"DELETE FROM sessions m WHERE {where}", [self.tenant, *params])
        self.conn.execute(f"DELETE FROM jobs m WHERE {where}", [self.tenant, *params])
        self.erased_from |= {"sessions", "jobs"}

"""The scale-out store: PostgreSQL with pgvector (HNSW, cosine) and a BM25 lexical index that
ranks as the embedded store's FTS5 does (bm25.py).

Every row carries its tenant and every query filters on it inside the SQL; row-level security
on `engram.tenant` (set per transaction) stands behind those filters as a second wall.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import psycopg
from psycopg import errors as pgerr

from ...errors import InvalidInput, StoreBusy, StoreUnavailable
from ...model import Job, MemoryRecord, Scope
from ...threads import Threads
from .. import bm25
from .. import records as r
from ..base import Candidate, Key, Lexical, Query, Select
from ..index import refresh
from ..index.cache import DenseCache, Fetched
from ..index.follow import LexicalChanges, LexicalFollower
from ..index.lexicon import BATCH
from ..index.slab import Slab, unit
from ..sqlstore import Run, SQLStore, SQLTx
from . import schema, sql
from .ann import IndexBuilds
from .lexicon import Lexicons
from .pool import NO_FLUSH, Connection, Pool, translate

if TYPE_CHECKING:
    from ...config import Config

log = logging.getLogger("engram.store")

V = TypeVar("V")
ANALYZE_AFTER_ROWS = 200  # rows written by a process before its first ANALYZE
TENANT_HINTS = 16_384  # tenants whose last versions a process remembers (`_Recent`)


class PostgresStore(SQLStore):
    """`Store` over PostgreSQL + pgvector, for one tenant of a shared database.

    Safe across threads (a small connection pool) and processes (many service processes and
    workers can share one database). Reads made inside `write()` on the same thread go through
    the write's transaction, so they see its changes.

    The dense cache: as the SQLite store does, a process keeps each searched scope's keys (up
    to `cache_limit` of them) in numpy matrices, with the ranking fields of its memories, and
    follows the database by version numbers that triggers keep (schema 0006). A search then
    costs one round trip (the versions and the lexicon's new log entries, or the BM25 statement
    for a small tenant) plus one for the records it returns, and scores vectors in process; a
    refresh after another writer's change loads only what changed. A large scope's first load
    runs on a helper thread; until it is held, and for scopes over `cache_limit`, the database
    answers (exact, then HNSW).
    """

    dialect = sql.DIALECT

    def __init__(self, url: str, *, tenant: str = "", busy_timeout_s: float = 30.0,
                 statement_timeout_s: float | None = None, connect_timeout_s: float = 5.0,
                 max_connections: int = 10, pool_wait_s: float | None = None,
                 exact_limit: int = 2000, reclaim_mode: str = "vacuum",
                 cache_limit: int | None = None, cache_rows: int = 2_000_000,
                 ann_threshold: int = 20_000,
                 lexicon_threshold: int = 100, lexicon_rows: int = 1_000_000) -> None:
        """`busy_timeout_s`: how long a write waits for a lock (`lock_timeout`) and, unless
        `pool_wait_s` says otherwise, for a free connection. `statement_timeout_s` defaults to
        max(60, 2 * busy_timeout_s). `exact_limit`: a dense search over at most this many
        visible keys is exact (a scan); above it the HNSW index answers (approximate).
        `reclaim_mode`: what `reclaim()` runs on the tables an erase touched: "vacuum", "full"
        (VACUUM FULL) or "none". `cache_limit`: a scope of at most this many keys is searched
        from this process's cache of its vectors (exact); larger ones in the database. Not
        lower: the dimension's HNSW index spans every scope and tenant, and a walk filters as
        it goes, so a scope that is a small share of the index pays for all the others' keys
        (20 scopes of 25k memories: 9x slower in the database than from the cache). None: up
        to `cache_rows`, so a scope of any size the cache can hold is searched in process.
        `ann_threshold`: a cached scope of more keys is searched through an HNSW index built in
        this process (index/ann.py, the `ann` extra: approximate; else exact), as on SQLite;
        it is kept in memory only (no files: a database server has no directory of ours).
        `lexicon_threshold`: a tenant of more than this many indexed memories is searched
        lexically from this process's lexicon of it (postgres/lexicon.py: the same scores);
        smaller ones by the BM25 statement. `lexicon_rows`: the documents the lexicons of all
        tenants hold together."""
        if not isinstance(tenant, str):
            raise InvalidInput("tenant must be a string")
        if reclaim_mode not in sql.RECLAIM_MODES:
            raise InvalidInput(f"reclaim_mode must be one of {', '.join(sql.RECLAIM_MODES)}")
        self.tenant = tenant
        self.busy_timeout_s = busy_timeout_s
        self.statement_timeout_s = statement_timeout_s or max(60.0, 2 * busy_timeout_s)
        self.exact_limit = exact_limit
        self.reclaim_mode = reclaim_mode
        self._pool = Pool(url, max_size=max_connections,
                          wait_s=busy_timeout_s if pool_wait_s is None else pool_wait_s,
                          connect_timeout_s=connect_timeout_s)
        self._local = threading.local()  # .conn: this thread's open write
        self._turns = _Turns()  # this process's writers of each tenant (shared by for_tenant)
        self._builds = IndexBuilds(self._pool)  # HNSW indexes, once a search needs one (ann.py)
        # a search's large-scope dense keys, queried beside its first round trip (shared by
        # a process's stores of every tenant: for_tenant)
        self._sides = Threads(2, "engram-pg-search")
        # large scopes' HNSW indexes of the dense cache, built off the searches (index/dense.py)
        self._ann_builds = Threads(1, "engram-pg-ann")
        # large scopes' first loads into the dense cache, off the searches (index/cache.py)
        self._loads = Threads(1, "engram-pg-load")
        self._to_vacuum: set[str] = set()
        self._closed = False
        self._tokenizer = bm25.Tokenizer()  # shared with the stores of other tenants (for_tenant)
        self._lexicons = Lexicons(self._tokenizer, lexicon_threshold, lexicon_rows)  # shared too
        # Dense searches whose last count of visible keys was at most `exact_limit` (True; by
        # tenant, query but its time, key, dimension): the next one scans at once; or above it
        # with a valid index (False): the next one asks the index at once. Only a hint: an
        # exact scan is never a wrong answer, and it counts what it scans; an index query that
        # finds too few forgets it.
        self._small: dict[tuple[Any, ...], bool] = {}
        self._inserted = self._analyzed_at = 0  # rows this process wrote; at its last ANALYZE
        self._vector: tuple[bytes, str] = (b"", "")  # the last query vector and its literal
        self._oid = 0  # pgvector's `vector` type, once a bulk insert has asked (_vector_oid)
        # The dense cache, shared with the stores of other tenants (keys start with the tenant)
        # (index/cache.py; cache_rows: keys held over all scopes, ENGRAM_CACHE_ROWS)
        self._cache = DenseCache(cache_rows, ann_threshold,
                                 cache_rows if cache_limit is None else cache_limit)
        self._keys = sql.KeyReads(tenant)  # the dense cache's reads
        # per tenant, the versions last read, and whether they had changed (`_ahead`)
        self._seen: _Recent[tuple[int, int]] = _Recent(TENANT_HINTS)
        self._moving: _Recent[bool] = _Recent(TENANT_HINTS)
        try:
            self._iterative = schema.migrate(self._transaction) >= (0, 8)  # iterative index scans
        except BaseException:
            self._pool.close()  # the caller never gets the store to close
            self._tokenizer.close()
            raise

    @property
    def cache_limit(self) -> int:
        """A scope of more keys than this is searched in the database, not the cache."""
        assert self._cache.limit is not None
        return self._cache.limit

    @property
    def ann_threshold(self) -> int:
        """A cached scope of more keys than this is searched through its HNSW index."""
        return self._cache.ann_threshold

    @classmethod
    def from_config(cls, config: Config, tenant: str = "") -> PostgresStore:
        """The store `config` describes (its `database_url` and PostgreSQL tuning)."""
        if not config.database_url:
            raise InvalidInput("the PostgreSQL store needs a database_url")
        return cls(config.database_url, tenant=tenant, busy_timeout_s=config.busy_timeout_s,
                   statement_timeout_s=config.pg_statement_timeout_s,
                   connect_timeout_s=config.pg_connect_timeout_s,
                   max_connections=config.pg_pool_size, pool_wait_s=config.pg_pool_wait_s,
                   exact_limit=config.pg_exact_limit, reclaim_mode=config.pg_reclaim,
                   cache_limit=config.pg_cache_limit, cache_rows=config.cache_rows,
                   ann_threshold=config.ann_threshold,
                   lexicon_threshold=config.pg_lexicon_threshold,
                   lexicon_rows=config.pg_lexicon_rows)

    # -- connections and transactions --------------------------------------------------------

    def _setup(self, conn: Connection, lock_timeout_ms: int | None = None) -> None:
        lock_ms = int(self.busy_timeout_s * 1000) if lock_timeout_ms is None else lock_timeout_ms
        conn.execute(*sql.settings(self.tenant, int(self.statement_timeout_s * 1000),
                                   max(1, lock_ms)))

    def _transaction(self, lock_timeout_ms: int | None = None) -> AbstractContextManager[Connection]:
        """A pooled connection inside a fresh transaction with the tenant set."""
        return self._pool.transaction(lambda conn: self._setup(conn, lock_timeout_ms))

    @contextmanager
    def _conn(self) -> Iterator[Connection]:
        """This thread's open write if there is one (reads see its changes), else a new
        read transaction."""
        conn: Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            try:
                yield conn
            except psycopg.Error as exc:
                raise translate(exc) from exc
            return
        with self._transaction() as conn:
            yield conn

    @contextmanager
    def _reader(self) -> Iterator[Run]:
        with self._conn() as conn:
            yield lambda stmt, params: conn.execute(stmt, params).fetchall()

    def _db_bytes(self, run: Run) -> int | None:
        if self.tenant:  # the database is shared: a tenant's share of it is unknown
            return None
        return int(run(sql.DATABASE_SIZE, ())[0][0])

    def write(self) -> AbstractContextManager[PgTx]:
        """One transaction: it commits whole when the block ends, or leaves nothing. A nested
        `write()` on the same thread is a savepoint of the outer one.

        Writes of one tenant take turns (a transaction-scoped advisory lock, waited for up to
        `busy_timeout_s`), as SQLite's writers do: `Memory` reads before it writes inside the
        transaction (is this fact already known?), and two concurrent adds of one fact must
        not both find it missing. Reads never wait; other tenants write in parallel."""
        return self._write(serialize=True)

    @contextmanager
    def _write(self, serialize: bool) -> Iterator[PgTx]:
        outer: Connection | None = getattr(self._local, "conn", None)
        if outer is not None:
            try:
                with outer.transaction():
                    yield PgTx(outer, self)
            except psycopg.Error as exc:
                raise translate(exc) from exc
            return
        # The writes of one tenant in this process take their turn here before they take a
        # connection: writers queued on the advisory lock below each held one of the pool's
        # connections, and under load the searches waited for them (bench/load.py: a third of
        # a search's time). Across processes the advisory lock still decides.
        turn = self._turns.lock(self.tenant) if serialize else None
        if turn is not None and not turn.acquire(timeout=self.busy_timeout_s):
            raise StoreBusy(f"another write of this tenant held its turn for {self.busy_timeout_s}s")
        try:
            # Pipeline mode (Pool.pipelined): the statements go out without waiting for each
            # reply (a read waits for what precedes it; an error surfaces by the end of the
            # block, which then rolls back whole), and the COMMIT goes with the last of them.
            # The advisory lock is held from the first round trip after it to the commit: one
            # reply to read in between for an add, not six (each a wake-up of a thread that
            # competes for the cores and the GIL while every other writer of the tenant waits;
            # docs/postgres.md, "Concurrency").
            with self._pool.pipelined(self._setup) as conn:
                if serialize:
                    conn.execute(*sql.write_turn(self.tenant))
                tx = PgTx(conn, self)
                self._local.conn = conn
                try:
                    yield tx
                finally:
                    self._local.conn = None
        finally:
            if turn is not None:
                turn.release()
        self._to_vacuum |= tx.erased_from
        self._analyze_after(tx.inserted)

    def _analyze_after(self, inserted: int) -> None:
        """Refresh the planner's statistics of the tables a search reads once this process has
        written as many rows again as at its last refresh (200, 400, 800, ...): before
        autovacuum's first ANALYZE of a fresh database (its naptime is a minute) the planner
        takes the tables for empty and joins a scope's keys to its memories by a nested loop,
        ~40x slower than the hash join it picks with statistics (docs/postgres.md, "Parity").
        A handful of ANALYZEs per process; autovacuum keeps them fresh after that. Best effort:
        a role that does not own the tables is skipped by PostgreSQL with a warning."""
        self._inserted += inserted
        if inserted <= 0 or self._inserted < max(ANALYZE_AFTER_ROWS, 2 * self._analyzed_at):
            return
        self._analyzed_at = self._inserted
        try:
            self._batch([(sql.ANALYZE, ())], retry=False)
        except (StoreBusy, StoreUnavailable) as exc:
            log.debug("ANALYZE skipped: %s", exc)

    def _vector_oid(self, conn: Connection) -> int:
        """pgvector's `vector` type (its oid differs between databases): binary vectors name it."""
        if not self._oid:
            self._oid = int(conn.execute(sql.VECTOR_OID).fetchone()[0])  # type: ignore[index]
        return self._oid

    def for_tenant(self, tenant: str) -> PostgresStore:
        """The store of another tenant of the same database, sharing this one's connections:
        a service serving many tenants holds one pool per process, not one per tenant."""
        if not isinstance(tenant, str):
            raise InvalidInput("tenant must be a string")
        self._pool.retain()
        other = copy.copy(self)  # the pool, the caches and the index builds are shared
        other.tenant = tenant
        other._local = threading.local()  # a write on one tenant is never seen from another
        other._keys = sql.KeyReads(tenant)
        other._to_vacuum = set()
        other._closed = False
        return other

    def close(self) -> None:
        if not self._closed:  # each store releases its share of the pool once
            self._closed = True
            if self._pool.close():  # the last store of the pool
                self._builds.close()
                self._lexicons.close()
                self._sides.close()
                self._loads.close()
                self._ann_builds.close()
                self._tokenizer.close()
                self._cache.clear()

    def build_index(self, dim: int) -> bool:
        """Build the HNSW index of the keys of `dim` dimensions now, if it has no valid one
        (what a search starts in the background once it needs it, ann.py): True once it has
        one, False if another process is building it."""
        return self._builds.build(dim)

    def migrations(self) -> list[str]:
        return [row[0] for row in self._read(sql.MIGRATIONS)]

    # -- the engine-specific primitives --------------------------------------------------------

    def _batch(self, statements: Sequence[tuple[str, Sequence[Any]]], *,
               lock_timeout_ms: int | None = None, retry: bool = True) -> list[list[Any]]:
        """The rows of each statement, run in this thread's open write if there is one, else
        in one transaction sent at once (`Pool.batch`: one round trip)."""
        conn: Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            return self._pool.batch(lambda c: self._setup(c, lock_timeout_ms), statements,
                                    retry=retry)
        try:
            with conn.pipeline():  # the write's own pipeline: leaving this block syncs it
                cursors = [conn.execute(stmt, params) for stmt, params in statements]
            return [cur.fetchall() if cur.description is not None else [] for cur in cursors]
        except psycopg.Error as exc:
            raise translate(exc) from exc

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return self._batch([(sql, params)])[0]

    def dense(self, query: Query, vector: np.ndarray, k: int,
              key: str = "text") -> list[tuple[str, float]]:
        """Exact (a scan of the visible keys) while they number at most `exact_limit`, so small
        scopes and tests get the true top-k; beyond that the dimension's HNSW index, with
        iterative scans so that filters do not starve it, and the exact scan again if the
        index still returns fewer than `k`. One statement for a small scope: the count that
        decides and the scan it allows, or, once the scope is known to be small, the scan
        counting what it scores; once it is known to be large, the index query alone."""
        if k <= 0:
            return []
        v = np.asarray(vector, dtype=np.float32).ravel()
        dim = int(v.shape[0])
        outside = getattr(self._local, "conn", None) is None  # inside a write: the tables
        # a scope the cache is loading is searched here meanwhile, and in the cache after:
        # no database index is built for it (asked before the scan: the load may end during it)
        loading = self._cache.being_loaded(self._keys, query.scope, key)
        if outside and not self._cache.elsewhere(self._keys, query.scope, key):
            versions = refresh.versions(self._read(*self._keys.versions()))
            slab = self._cached(query.scope, [key], dim, versions).get(key)
            if slab is not None:
                return self._search(query, key, slab, v, k)
        lit = self._literal(v)
        where, params = r.compile_query(self.dialect, query, self.tenant)
        source = sql.dense_source(dim, where)
        sparams = [self.tenant, key, *params]
        exact = (sql.dense_exact_sql(source), [lit, *sparams, k])
        limit = self.exact_limit
        if dim > schema.MAX_INDEXED_DIM:
            rows = self._batch([exact])[0]
            log.debug("dense: exact scan (no index for %d dimensions), %d hits", dim, len(rows))
            return [(row[0], float(row[1])) for row in rows]
        shape = _shape(self.tenant, query, key, dim)
        known = None if shape is None else self._small.get(shape)  # True small, False large + indexed
        if shape is not None and known:
            rows = self._batch([(sql.dense_counted_sql(source), [lit, *sparams, k])])[0]
            if rows and rows[0][2] > limit:
                del self._small[shape]  # it grew: the next search counts first
            log.debug("dense: exact scan of a small scope, %d hits", len(rows))
            return [(row[0], float(row[1])) for row in rows]
        if known is None:
            rows = self._batch([(sql.dense_guarded_sql(source),
                                 [schema.hnsw_index_name(dim), *sparams, limit + 1, lit, *sparams,
                                  limit, k])])[0]
            (_, _, n, indexed) = rows[0]
            if shape is not None and (n <= limit or indexed):  # large without an index: count again
                if len(self._small) > 4096:
                    self._small.clear()
                self._small[shape] = n <= limit
            if n <= limit or not indexed:
                if n <= limit:
                    log.debug("dense: exact scan of %d keys", n)
                elif not loading:  # the index would answer: built meanwhile, off this path
                    self._builds.request(dim)
                    log.debug("dense: exact scan of more than %d keys (no HNSW index yet)", limit)
                return [(row[0], float(row[1])) for row in rows if row[0] is not None]
        # A large scope with an index: its nearest keys, as many as the SQLite store's HNSW
        # search asks for (a memory has one `text` and one `window` key, so this finds k
        # memories), four times more while they are fewer (several `fact` keys of one memory)
        count = k + k // 8 + 32
        for _ in range(2):
            ann: list[tuple[str, Sequence[Any]]] = [sql.ef_search(count)]
            if self._iterative:
                ann.append((sql.ITERATIVE_SCAN, ()))
            ann.append((sql.dense_ann_sql(dim, source), [lit, *sparams, lit, count, k]))
            rows = self._batch(ann)[-1]
            if len(rows) >= k:
                log.debug("dense: approximate (HNSW) query, %d hits", len(rows))
                return [(row[0], float(row[1])) for row in rows]
            count *= 4
        log.debug("dense: the approximate query found %d of %d; exact scan", len(rows), k)
        if shape is not None:
            self._small.pop(shape, None)  # shrunk, or its index gone: the next search counts
        rows = self._batch([exact])[0]
        return [(row[0], float(row[1])) for row in rows]

    def key_vectors(self, ids: Sequence[str], key: str) -> dict[str, np.ndarray]:
        out: dict[str, list[np.ndarray]] = {}
        for mid, blob, dim in self._read(*sql.key_vectors(self.tenant, ids, key)) if ids else ():
            out.setdefault(mid, []).append(sql.read_vectors([bytes(blob)], dim)[0])
        return {mid: np.stack(rows) for mid, rows in out.items()}

    def pool(self, query: Query, k: int, *, vector: np.ndarray | None, keys: Sequence[str],
             terms: Sequence[str], previous_weight: float = 0.5) -> dict[str, list[tuple[str, float]]]:
        """One round trip for the cache's versions and the BM25 statement; dense candidates
        from the cache (after a second round trip only if another writer changed the scope),
        or from the database for scopes larger than `cache_limit` and inside a write. Those
        keys are queried on helper threads, each on its own connection, while this thread
        makes the first round trip: the server runs the queries in parallel (at 100k in one
        scope each takes 70-80 ms, and one after the other they were the search's 226)."""
        if k <= 0 or getattr(self._local, "conn", None) is not None:
            return super().pool(query, k, vector=vector, keys=keys, terms=terms,
                                previous_weight=previous_weight)
        phrases = bm25.phrases(self._tokenizer, terms) if terms else []
        statements = [self._keys.versions()]
        follower = self._lexicon() if phrases else None
        since = -1 if follower is None else follower.position
        if follower is not None:  # the lexicon's changes, else the BM25 statement
            statements.append(sql.lex_changes(self.tenant, since))
        elif phrases:
            statements.append(sql.lexical(self.tenant, query, phrases, k, previous_weight))
        v = None if vector is None or not keys else np.asarray(vector, dtype=np.float32).ravel()
        dim = 0 if v is None else int(v.shape[0])
        remote: dict[str, Future[list[tuple[str, float]]]] = {}  # large scopes' keys
        for key in keys if v is not None else ():
            if (self._cache.elsewhere(self._keys, query.scope, key)
                    and (future := self._sides.submit(self.dense, query, v, k, key)) is not None):
                remote[key] = future  # (None: closing, searched here)
        try:
            ahead = {} if v is None else self._ahead(query.scope, keys, dim)
            at = len(statements)
            for _, reads in ahead.values():
                statements += reads
            rows = self._batch(statements)
            versions = refresh.versions(rows[0])
            self._moving[self.tenant] = versions != self._seen.get(self.tenant)
            self._seen[self.tenant] = versions  # what `candidates` trusts next
            found: dict[str, list[tuple[str, float]]] = {}
            if v is not None:
                fetched: dict[str, tuple[refresh.Mark, Sequence[Any]]] = {}
                for name, (mark, reads) in ahead.items():
                    fetched[name] = (mark, rows[at:at + len(reads)])
                    at += len(reads)
                local = [key for key in keys if key not in remote]
                slabs = self._cached(query.scope, local, dim, versions, fetched)
                for key in keys:
                    slab = slabs.get(key)
                    if key in remote:
                        found[key] = remote[key].result()
                    elif slab is None:
                        found[key] = self.dense(query, v, k, key)
                    else:
                        found[key] = self._search(query, key, slab, v, k)
            if terms:
                hits = None
                if follower is not None:
                    text = slabs.get("text") if v is not None and not query.conditions else None

                    def visible(ids: list[str]) -> set[str]:
                        if text is None:
                            return self._visible(query, ids)
                        return self._cache.visible_ids(text, query, ids)
                    hits = self._lexicon_hits(follower, since, rows[1], query, terms, k,
                                              previous_weight, visible)
                    if hits is None:
                        rows[1] = self._read(*sql.lexical(self.tenant, query, phrases, k,
                                                          previous_weight))
                found["lexical"] = hits if hits is not None else \
                    [(row[0], float(row[1])) for row in rows[1]] if phrases else []
            if v is not None:  # a large scope's lists, from its HNSW index: completed
                self._cache.complete({key: slabs.get(key) for key in keys if key not in remote},
                                     v, k, found)
            return found
        finally:
            wait(remote.values())  # never left running past the search

    # -- the dense cache (index/cache.py) ---------------------------------------------------------

    def _ahead(self, scope: Scope, names: Sequence[str],
               dim: int) -> dict[str, tuple[refresh.Mark, list[r.Stmt]]]:
        """While the tenant's data is moving (its versions changed at the last search), the
        reads of the slabs a search will likely find stale, each with the mark they start
        from: `pool` sends them in its first round trip, after the versions (so they are at
        least as new), instead of in a second one. Under a steady stream of adds every search
        used to make that second round trip."""
        if not self._moving.get(self.tenant):
            return {}
        return self._cache.ahead(self._keys, scope, names, dim)

    def _cached(self, scope: Scope, names: Sequence[str], dim: int, versions: tuple[int, int],
                fetched: Fetched | None = None) -> dict[str, Slab]:
        """The scope's slab of each key name, exact as of `versions` or later; a name is left
        out where the scope holds more than `cache_limit` keys. Stale slabs are refreshed
        together, in one round trip, or none with what `fetched` holds (see `_ahead`)."""
        self._seen[self.tenant] = versions
        return self._cache.refresh(self._keys, scope, names, dim, versions, self._batch,
                                   fetched=fetched, aside=self._loads.submit)

    def _search(self, query: Query, key: str, slab: Slab, v: np.ndarray,
                k: int) -> list[tuple[str, float]]:
        """A cached scope's dense search; a large one's HNSW index is built off the search."""
        return self._cache.search(self._cache.key(self._keys, query.scope, key), slab, query,
                                  unit(v), k, lambda ids: self._visible(query, ids),
                                  build=self._ann_builds.submit)

    def _visible(self, query: Query, ids: Sequence[str]) -> set[str]:
        return set(self.read_ids(Select.of(query, ids=tuple(ids), order=None))) if ids else set()

    def candidates(self, ids: Sequence[str], query: Query | None = None) -> dict[str, Candidate]:
        """From the scope's cached `text` slab when it is as new as the versions this process
        last read (a search's pool costs no SQL); the rest from the table."""
        if query is None or not ids or getattr(self._local, "conn", None) is not None:
            return super().candidates(ids)
        slab = self._cache.current(self._keys, query.scope, "text", self._seen.get(self.tenant))
        if slab is None:
            return super().candidates(ids)
        found, missing = self._cache.candidates(slab, ids)
        if missing:
            found.update(super().candidates(missing))
        return found

    def _literal(self, v: np.ndarray) -> str:
        """The vector's literal; a search asks for its text, window and fact keys with one
        vector, made into text once."""
        raw = v.tobytes()
        last = self._vector
        if last[0] != raw:
            last = self._vector = (raw, sql.vector_literal(v))
        return last[1]

    def lexical(self, query: Query, terms: Sequence[str], k: int,
                previous_weight: float = 0.5) -> list[tuple[str, float]]:
        """FTS5's BM25, computed from the same tokens and statistics (see bm25.py): by the
        tenant's lexicon once it has one, else by SQL."""
        phrases = bm25.phrases(self._tokenizer, terms)
        if not phrases or k <= 0:
            return []
        follower = self._lexicon()
        if follower is not None:
            since = follower.position
            hits = self._lexicon_hits(follower, since,
                                      self._read(*sql.lex_changes(self.tenant, since)), query,
                                      terms, k, previous_weight,
                                      lambda ids: self._visible(query, ids))
            if hits is not None:
                return hits
        rows = self._read(*sql.lexical(self.tenant, query, phrases, k, previous_weight))
        return [(row[0], float(row[1])) for row in rows]

    # -- the lexicon (postgres/lexicon.py, index/follow.py) --------------------------------------

    def lexical_changes(self, since: int) -> LexicalChanges:
        """What changed in the tenant's lexical documents after position `since` (-1: every
        document), from its change log; every document again when the log cannot be
        followed from there (pruned past it, or an erasure since)."""
        if since >= 0:
            changes = self._lexicons.changes(since, self._read(*sql.lex_changes(self.tenant, since)))
            if changes is not None:
                return changes
        with self._documents() as rows:
            changes = self._lexicons.whole(rows)
            return replace(changes, documents=list(changes.documents))

    @contextmanager
    def _documents(self) -> Iterator[Iterator[Any]]:
        """The rows of `sql.lex_documents`, from one snapshot, fetched in batches while the
        block runs (a server-side cursor: a million are never all in memory at once)."""
        with self._transaction() as conn, conn.cursor(name="engram_lexicon") as cur:
            cur.itersize = BATCH
            cur.execute(*sql.lex_documents(self.tenant))
            yield iter(cur)

    def build_lexicon(self) -> bool:
        """Build the tenant's lexicon now (what a search starts on a helper thread when it
        finds none): True once it holds one, False if the tenant is small."""
        return self._lexicons.build(self.tenant, self._lexicon_source)

    def wait_for_saves(self) -> None:
        """Wait until the background cache work asked for so far is done (the lexicons being
        built, large scopes' first loads, the dense cache's HNSW indexes), as the SQLite
        store's method of that name does for its files."""
        self._loads.drain()
        self._lexicons.wait()
        self._ann_builds.drain()

    @contextmanager
    def _lexicon_source(self) -> Iterator[LexicalChanges | None]:
        """Every document of the tenant, read while the block runs, or None if it holds at
        most `lexicon_threshold`."""
        (n,), = self._read(*sql.lex_rows(self.tenant))
        if n <= self._lexicons.threshold:
            yield None
            return
        with self._documents() as rows:
            yield self._lexicons.whole(rows)

    def _lexicon(self) -> LexicalFollower | None:
        """The tenant's lexicon if it has one; never inside a write (its changes may yet roll
        back, and the statement sees them)."""
        if getattr(self._local, "conn", None) is not None:
            return None
        return self._lexicons.ready(self.tenant, self._lexicon_source)

    def _lexicon_hits(self, follower: LexicalFollower, since: int, rows: list[Any], query: Query,
                      terms: Sequence[str], k: int, previous_weight: float,
                      visible: Callable[[list[str]], set[str]]) -> list[tuple[str, float]] | None:
        """The best `k` visible memories by the lexicon, once it has applied `rows` (the log
        past `since`: sql.lex_changes); None when SQL answers: the log cannot be followed
        (the lexicon is dropped at once and built again on the helper thread)."""
        changes = self._lexicons.changes(since, rows)
        with follower.lock:
            lex = None if changes is None else follower.apply(changes)
            hits = None if lex is None else lex.search(
                self._lexicons.terms(terms), bm25.scope_tokens(query.scope), k, previous_weight,
                visible)
        if changes is None:
            self._lexicons.forget(self.tenant)
            self._lexicons.rebuild(self.tenant, self._lexicon_source)
        elif follower.stale():
            self._lexicons.rebuild(self.tenant, self._lexicon_source)
        return None if hits is None else sorted(hits, key=lambda hit: (-hit[1], hit[0]))

    def touch(self, ids: Sequence[str], at: datetime) -> None:
        if not ids:
            return
        try:
            # Best effort: a row locked by a writer for more than 20 ms is simply not counted
            # (and, sent once, never counted twice); a hint, committed without a flush.
            self._batch([NO_FLUSH, sql.touch(self.tenant, ids, at)], lock_timeout_ms=20,
                        retry=False)
        except (StoreBusy, StoreUnavailable) as exc:
            log.debug("access tracking skipped: %s", exc)

    def access(self, ids: Sequence[str], at: datetime) -> dict[str, MemoryRecord]:
        """The records and their access count in one statement: the UPDATE returns each row as
        its statement's snapshot saw it (the self-join `o`), i.e. before this access. A row
        locked by a writer for more than 20 ms makes it a plain read, uncounted, as `touch`."""
        if not ids:
            return {}
        try:
            rows = self._batch([NO_FLUSH, sql.access(self.tenant, ids, at)],
                               lock_timeout_ms=20, retry=False)[-1]
        except (StoreBusy, StoreUnavailable) as exc:
            log.debug("access tracking skipped: %s", exc)
            return self.get(ids)
        return {rec.id: rec for rec in (r.read_memory(self.dialect, row) for row in rows)}

    def claim_job(self, now: datetime, lease_until: datetime) -> Job | None:
        with self._write(serialize=False) as tx:  # many workers claim at once: rows, not turns
            row = tx.conn.execute(*sql.claim_job(self.tenant, now, lease_until)).fetchone()
        return r.read_job(self.dialect, row) if row else None

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
            conn.execute(sql.vacuum(self.reclaim_mode, tables))
        except psycopg.Error as exc:
            raise translate(exc) from exc
        finally:
            conn.remove_notice_handler(skipped.append)
            self._pool.release(conn)
        for notice in skipped:
            log.warning("reclaim: %s", notice.message_primary)


class _Turn:
    """A lock handed to its waiters in the order they came, as PostgreSQL's lock queue serves
    them (a plain lock lets a newcomer overtake a writer that has waited long: the tail of the
    adds' latency)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._busy = False
        self._waiting: deque[threading.Event] = deque()

    def acquire(self, timeout: float | None = None) -> bool:
        """True once this thread holds the turn; False after `timeout` seconds (None: never)."""
        with self._guard:
            if not self._busy:
                self._busy = True
                return True
            mine = threading.Event()
            self._waiting.append(mine)
        if mine.wait(timeout):
            return True
        with self._guard:
            if mine.is_set():  # handed over just as the wait ended
                return True
            self._waiting.remove(mine)
            return False

    def release(self) -> None:
        with self._guard:
            if self._waiting:
                self._waiting.popleft().set()  # still busy: the next writer holds it now
            else:
                self._busy = False

    def __enter__(self) -> _Turn:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Turns:
    """A turn per tenant: the writes of one tenant in this process, one at a time. A forked
    child starts with none (a parent's thread may have held one). A turn lives while a writer
    holds or waits for it (a weak map), so a node keeps none for the tenants it served once."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._turns: weakref.WeakValueDictionary[str, _Turn] = weakref.WeakValueDictionary()
        self._guard = threading.Lock()

    def lock(self, tenant: str) -> _Turn:
        if self._pid != os.getpid():
            self._pid, self._guard = os.getpid(), threading.Lock()
            self._turns = weakref.WeakValueDictionary()
        with self._guard:
            turn = self._turns.get(tenant)
            if turn is None:
                turn = self._turns[tenant] = _Turn()
            return turn


class _Recent(dict[str, V]):
    """A per-tenant hint that forgets the tenants set longest ago beyond `limit` (the older
    half at once): a node may serve any number of tenants over its life, and a tenant it has
    forgotten only reads its versions afresh at its next search."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, tenant: str, value: V) -> None:
        self.pop(tenant, None)  # the newest last
        super().__setitem__(tenant, value)
        if len(self) > self.limit:
            for old in list(self)[:len(self) - self.limit // 2]:
                self.pop(old, None)


def _shape(tenant: str, query: Query, key: str, dim: int) -> tuple[Any, ...] | None:
    """What the number of keys a dense search sees depends on, but time; None if unhashable."""
    shape = (tenant, query.scope, query.kinds, query.conditions, query.as_of is None, key, dim)
    try:
        hash(shape)
    except TypeError:
        return None
    return shape


class PgTx(SQLTx):
    """The writes of one transaction (see `Tx` in store/base.py): rows with their lexemes, and
    keys."""

    dialect = sql.DIALECT
    unique_violation = pgerr.UniqueViolation

    def __init__(self, conn: Connection, store: PostgresStore) -> None:
        self.conn = conn
        self.store = store
        self.tenant = store.tenant
        self.erased_from: set[str] = set()
        self.inserted = 0  # memories written (see PostgresStore._analyze_after)

    def _exec(self, stmt: str, params: Sequence[Any] = ()) -> None:
        self.conn.execute(stmt, params)

    def put_job(self, job: Job) -> None:
        """Sent without a savepoint and without waiting: in pipeline mode a savepoint costs two
        round trips, and `put_job` ends an add, inside the tenant's turn. A taken key fails the
        transaction when it commits (or reads next): `translate` makes that `Conflict`, and
        every caller lets a Conflict end its write."""
        self._exec(*r.upsert_job(self.dialect, self.tenant, job))

    def _document(self, record: MemoryRecord, lexical: Lexical) -> bm25.Document:
        return bm25.document(self.store._tokenizer, lexical.body, lexical.previous, record.scope)

    def insert(self, record: MemoryRecord, keys: Sequence[Key], lexical: Lexical) -> None:
        self.inserted += 1
        doc = self._document(record, lexical)
        self._exec(*sql.insert_memory(self.tenant, record, doc))
        self._exec(*sql.count_in(self.tenant, doc))
        self._put_keys(record.id, keys)

    def insert_many(self, rows: Sequence[tuple[MemoryRecord, Sequence[Key], Lexical]]) -> None:
        """`insert` of each row, a statement per table (bulk loads): the same rows, lexemes,
        BM25 statistics and keys, the keys in the same order. The statements run in the
        write's transaction (its triggers bump the versions the dense caches follow, once per
        statement), so a bad row leaves nothing of the batch."""
        if not rows:
            return
        self.inserted += len(rows)
        recs = [rec for rec, _, _ in rows]
        docs = [self._document(rec, lex) for rec, _, lex in rows]
        by_dim: dict[int, tuple[list[str], list[str], list[np.ndarray]]] = {}
        for rec, keys, _ in rows:
            for key in keys:
                v = np.asarray(key.vector, dtype=np.float32).ravel()
                ids, kinds, vectors = by_dim.setdefault(int(v.shape[0]), ([], [], []))
                ids.append(rec.id)
                kinds.append(key.name)
                vectors.append(v)
        self._exec(*sql.insert_memories(self.tenant, recs, docs))
        self._exec(*sql.count_in_many(self.tenant, docs))
        if by_dim:
            oid = self.store._vector_oid(self.conn)
            for dim, (ids, kinds, vectors) in by_dim.items():
                self._exec(*sql.insert_keys(self.tenant, dim, ids, kinds,
                                            sql.vector_array(oid, np.stack(vectors))))

    def _put_keys(self, memory_id: str, keys: Sequence[Key]) -> None:
        """One statement per dimension, the vectors in binary form: `executemany` waited for
        its replies (a round trip inside the tenant's turn) and printed each vector as text."""
        by_dim: dict[int, tuple[list[str], list[np.ndarray]]] = {}
        for key in keys:
            v = np.asarray(key.vector, dtype=np.float32).ravel()
            kinds, vectors = by_dim.setdefault(int(v.shape[0]), ([], []))
            kinds.append(key.name)
            vectors.append(v)
        if by_dim:
            oid = self.store._vector_oid(self.conn)
            for dim, (kinds, vectors) in by_dim.items():
                self._exec(*sql.insert_keys(self.tenant, dim, [memory_id] * len(kinds), kinds,
                                            sql.vector_array(oid, np.stack(vectors))))

    def update(self, record: MemoryRecord, keys: Sequence[Key] | None = None,
               lexical: Lexical | None = None) -> None:
        doc = None if lexical is None else self._document(record, lexical)
        if doc is not None:
            self._exec(*sql.count_out(self.tenant, [record.id]))
        self._exec(*sql.update_memory(self.tenant, record, doc))
        if doc is not None:
            self._exec(*sql.count_in(self.tenant, doc))
        if keys is not None:
            self._exec(*sql.drop_keys_of(self.tenant, record.id))
            self._put_keys(record.id, keys)

    def soft_delete(self, ids: Sequence[str], at: datetime) -> None:
        if not ids:
            return
        self._exec(*sql.count_out(self.tenant, ids))
        self._exec(*sql.soft_delete(self.tenant, ids, at))
        self._exec(*sql.drop_keys(self.tenant, ids))

    def erase(self, ids: Sequence[str]) -> None:
        if not ids:
            return
        self._exec(*sql.count_out(self.tenant, ids))
        self._exec(*sql.drop_keys(self.tenant, ids))
        self._exec(*sql.erase_events(self.tenant, ids))
        self._exec(*sql.erase_memories(self.tenant, ids))
        self.erased_from |= {"memories", "memory_keys", "events", "lex_stats"}

    def erase_scope(self, scope: Scope) -> None:
        super().erase_scope(scope)
        self.erased_from |= {"sessions", "jobs"}

    def erase_graph(self, entity_ids: Sequence[str] = (), relation_ids: Sequence[str] = ()) -> None:
        super().erase_graph(entity_ids, relation_ids)
        if entity_ids or relation_ids:
            self.erased_from |= {"entities", "entity_names", "relations", "mentions", "events"}

    def drop_mentions(self, episode_ids: Sequence[str]) -> None:
        super().drop_mentions(episode_ids)
        if episode_ids:
            self.erased_from.add("mentions")

"""The HNSW index of each embedding dimension, built when a search first needs it.

An HNSW index costs every write of a key its upkeep (measured: an add of two keys took ~5x as
long in the database with the index as without), yet below `ENGRAM_ANN_THRESHOLD` keys per
scope searches score the process's cache and never read it, and below `exact_limit` keys a
search in the database is an exact scan. So no index is made with the first key: the first
search that finds more than `exact_limit` keys visible and no valid index answers exactly (as
it must anyway until an index exists) and asks for one here. It is built off the request
path, by one process at a time (a session advisory lock), with CREATE INDEX CONCURRENTLY:
writers go on meanwhile. A build that failed or was cancelled leaves an INVALID index, which
the planner ignores and the next build drops first.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import psycopg

from . import schema, sql
from .pool import Connection, Pool

log = logging.getLogger("engram.store")

RETRY_S = 60.0  # a build that did not succeed is not tried again sooner than this


class IndexBuilds:
    """This process's background builds, one thread per dimension; shared by the stores of
    every tenant of one pool (`PostgresStore.for_tenant`)."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._threads: dict[int, threading.Thread] = {}
        self._tried: dict[int, float] = {}
        self._conns: dict[int, Connection] = {}  # the builds' connections, to cancel at close
        self._closed = False

    def request(self, dim: int) -> None:
        """Build `dim`'s index in the background, unless a build is running or one that did
        not succeed (another process builds, a failure) was tried within `RETRY_S`."""
        if not 0 < dim <= schema.MAX_INDEXED_DIM:
            return
        if self._pid != os.getpid():  # a forked child: the parent's threads (and a lock one of
            self._lock = threading.Lock()  # them may have held) are not here
            self._reset()
        with self._lock:
            running = self._threads.get(dim)
            if self._closed or (running is not None and running.is_alive()) \
                    or time.monotonic() - self._tried.get(dim, -RETRY_S) < RETRY_S:
                return
            self._tried[dim] = time.monotonic()
            thread = threading.Thread(target=self._run, args=(dim,), daemon=True,
                                      name=f"engram-hnsw-{dim}")
            self._threads[dim] = thread
            thread.start()

    def _run(self, dim: int) -> None:
        try:
            if self.build(dim):
                with self._lock:  # built: should it ever go, the next search asks at once
                    self._tried.pop(dim, None)
        except psycopg.Error as exc:  # say, a role that does not own the table
            log.warning("could not build the HNSW index of %d dimensions (searches of large "
                        "scopes stay exact scans): %s", dim, exc)
        except Exception:  # an index: searches stay exact, and a later one asks again
            log.exception("building the HNSW index of %d dimensions failed", dim)

    def build(self, dim: int) -> bool:
        """Build `dim`'s index now, in this thread, if it has no valid one: True once it has
        one, False if another process holds the build (or the builds are closed)."""
        conn = self._pool.connect()
        try:
            with self._lock:
                self._conns[dim] = conn  # `close` cancels what it runs
            # minutes at a million keys: no statement or lock timeout; the build waits for
            # the writes in flight to end (CONCURRENTLY), never blocks them
            for setting in sql.NO_TIMEOUTS:
                conn.execute(setting)
            row = conn.execute(*sql.index_lock(dim)).fetchone()
            if row is None or not row[0]:
                log.info("the HNSW index of %d dimensions is being built by another process", dim)
                return False
            try:
                name = schema.hnsw_index_name(dim)
                valid = conn.execute(sql.INDEX_VALID_SQL, (name,)).fetchone()
                if valid is not None and valid[0]:
                    return True
                with self._lock:
                    if self._closed:  # before the long part: `close` may have found no statement to cancel
                        return False
                if valid is not None:  # an INVALID index: a build that did not finish
                    conn.execute(sql.drop_index(name))
                started = time.perf_counter()
                log.info("building the HNSW index of %d dimensions", dim)
                conn.execute(schema.hnsw_index_sql(dim, concurrently=True))
                log.info("built the HNSW index %s in %.1f s", name, time.perf_counter() - started)
                return True
            finally:
                conn.execute(*sql.index_unlock(dim))
        except psycopg.errors.QueryCanceled:
            log.info("the HNSW index build of %d dimensions was cancelled", dim)
            return False
        finally:
            with self._lock:
                if self._conns.get(dim) is conn:
                    del self._conns[dim]
            conn.close()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the builds started so far (tests, benchmarks)."""
        with self._lock:
            threads = list(self._threads.values()) if self._pid == os.getpid() else []
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Cancel the builds in progress (each leaves an INVALID index, dropped by the next
        build) and wait for their threads."""
        with self._lock:
            if self._pid != os.getpid():
                return
            self._closed = True
            conns = list(self._conns.values())
        for conn in conns:
            conn.cancel_safe()
        self.wait(timeout=30)

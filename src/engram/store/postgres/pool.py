"""The one PostgreSQL connection pool: small, thread-safe, connecting on demand, and the
translation of database errors into the engram errors a caller can act on. The store and the
service's key store both use it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import psycopg
from psycopg import errors as pgerr
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus

from ...errors import Conflict, EngramError, InvalidInput, StoreBusy, StoreError, StoreUnavailable

Connection = psycopg.Connection[Any]
Stmt = tuple[str, Sequence[Any]]
# A statement that lets its transaction commit without waiting for the WAL to reach the disk,
# for hints and disposable state (access counts, rate-limit buckets; SQLite writes those
# without an fsync too): a crash may lose the last few, never corrupt anything.
NO_FLUSH: Stmt = ("SELECT set_config('synchronous_commit', 'off', true)", ())
JOB_KEY = "jobs_tenant_key_key"  # PostgreSQL's name for the jobs table's UNIQUE (tenant, key)


def translate(exc: psycopg.Error) -> EngramError:
    """The engram error a caller can act on, for a database error (the transaction is gone)."""
    if isinstance(exc, pgerr.LockNotAvailable | pgerr.DeadlockDetected | pgerr.SerializationFailure):
        return StoreBusy(f"the database stayed locked: {exc}")
    if isinstance(exc, pgerr.UniqueViolation) and exc.diag.constraint_name == JOB_KEY:
        # PgTx.put_job: the key of a job is taken (the transaction is gone, as for a caller
        # that catches Conflict: each lets it end its write)
        return Conflict(f"the idempotency key is already used by another job "
                        f"({exc.diag.message_detail})")
    if isinstance(exc, pgerr.QueryCanceled):
        return StoreError(f"a statement ran past the statement timeout: {exc}")
    if isinstance(exc, psycopg.OperationalError):  # connection refused, lost, server shut down
        return StoreUnavailable(f"PostgreSQL is unavailable: {exc}")
    if isinstance(exc, psycopg.DataError):  # e.g. NUL characters, which PostgreSQL text refuses
        return InvalidInput(f"the database refused a value: {exc}")
    return StoreError(f"database error (the transaction was rolled back): {exc}")


def _let_go(conn: Connection) -> None:
    """Drop a connection another process (the parent of a fork) also holds, leaving its session
    alone: the descriptor is pointed at /dev/null first, so libpq's goodbye message, which
    would end the session for both, goes nowhere."""
    with suppress(Exception):
        null = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(null, conn.fileno())
        finally:
            os.close(null)
        conn.close()


class Pool:
    """A small thread-safe pool: idle connections are reused, broken ones dropped.

    Unlike a pool that keeps reconnecting in the background, it connects on demand, so a
    caller learns at once (StoreUnavailable, after `connect_timeout`) that the server is down,
    and the first call after it comes back simply opens a fresh connection. Several users
    (the stores of many tenants) may share it: each `retain()` is matched by a `close()`.
    """

    def __init__(self, url: str, *, max_size: int, wait_s: float, connect_timeout_s: float) -> None:
        params = conninfo_to_dict(url)
        defaults: dict[str, Any] = {
            "connect_timeout": max(2, round(connect_timeout_s)),
            "application_name": "engram",
            # A server that vanishes without closing the socket is noticed in ~30s, not hours.
            "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
            "keepalives_count": 3,
        }
        self._kwargs = {k: v for k, v in defaults.items() if k not in params}
        self._url = url
        self._max = max_size
        self._wait_s = wait_s
        self._idle: list[Connection] = []
        self._size = 0
        self._cond = threading.Condition()
        self._pid = os.getpid()
        self._mine: set[int] = set()  # ids of the connections this process opened
        self._closed = False
        self._users = 1

    def retain(self) -> None:
        self._after_fork()
        with self._cond:
            if self._closed:
                raise StoreError("the store is closed")
            self._users += 1

    def _after_fork(self) -> None:
        """In a forked child (gunicorn --preload, Celery prefork, multiprocessing): the
        inherited connections are the parent's sessions. They are let go without a word to
        the server and the pool starts empty."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._cond = threading.Condition()  # its lock may have been held by a parent's thread
        inherited, self._idle, self._size, self._mine = self._idle, [], 0, set()
        for conn in inherited:
            _let_go(conn)

    def acquire(self) -> Connection:
        self._after_fork()
        deadline = time.monotonic() + self._wait_s
        with self._cond:
            while True:
                if self._closed:
                    raise StoreError("the store is closed")
                if self._idle:
                    return self._idle.pop()
                if self._size < self._max:
                    self._size += 1
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreBusy(f"all {self._max} database connections stayed busy for "
                                    f"{self._wait_s}s")
                self._cond.wait(remaining)
        try:
            conn = psycopg.connect(self._url, autocommit=True, **self._kwargs)
            self._mine.add(id(conn))
            return conn
        except BaseException as exc:
            with self._cond:
                self._size -= 1
                self._cond.notify()
            if isinstance(exc, psycopg.Error):
                raise StoreUnavailable(f"cannot connect to PostgreSQL: {exc}") from exc
            raise

    def connect(self) -> Connection:
        """A connection of its own, outside the pool and its size (autocommit; the caller
        closes it): for work that holds one for minutes, such as building an index."""
        try:
            return psycopg.connect(self._url, autocommit=True, **self._kwargs)
        except psycopg.Error as exc:
            raise StoreUnavailable(f"cannot connect to PostgreSQL: {exc}") from exc

    def release(self, conn: Connection, *, discard: bool = False) -> None:
        self._after_fork()
        if id(conn) not in self._mine:  # taken before a fork, by the parent
            _let_go(conn)
            return
        bad = (discard or self._closed or conn.closed or conn.broken
               or conn.info.transaction_status != TransactionStatus.IDLE)
        if bad:
            self._mine.discard(id(conn))
            conn.close()
        with self._cond:
            if bad:
                self._size -= 1
            else:
                self._idle.append(conn)
            self._cond.notify()

    def drop_idle(self) -> None:
        """Close the idle connections: one of them failed, so the server probably restarted."""
        self._after_fork()
        with self._cond:
            idle, self._idle = self._idle, []
            self._size -= len(idle)
            self._mine -= {id(conn) for conn in idle}
            self._cond.notify_all()
        for conn in idle:
            conn.close()

    @contextmanager
    def transaction(self, setup: Callable[[Connection], object] | None = None) -> Iterator[Connection]:
        """A pooled connection inside a fresh transaction (after `setup`, e.g. SET LOCAL). A
        stale idle connection (the server restarted) is replaced once, before any work is done
        on it. Database errors leave as engram errors (`translate`)."""
        for attempt in (0, 1):
            conn = self.acquire()
            tx = conn.transaction()
            try:
                tx.__enter__()
                if setup is not None:
                    setup(conn)
                break
            except psycopg.OperationalError as exc:
                self.release(conn, discard=True)
                self.drop_idle()
                if attempt == 1 or isinstance(exc, pgerr.QueryCanceled | pgerr.LockNotAvailable):
                    raise translate(exc) from exc
            except BaseException as exc:
                self.release(conn, discard=True)
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
            self.release(conn)

    @contextmanager
    def pipelined(self, setup: Callable[[Connection], object]) -> Iterator[Connection]:
        """A pooled connection in pipeline mode inside a fresh transaction (after `setup`),
        committed when the block ends. The BEGIN and `setup` go out together (a stale idle
        connection is replaced once, as in `transaction`); after that a statement waits for no
        reply unless its rows are read, and the COMMIT leaves with the block's last statements:
        a write that reads once costs two round trips after the BEGIN, not one per statement
        plus the commit's. An error surfaces by the end of the block, which then rolls back
        whole. Database errors leave as engram errors (`translate`)."""
        for attempt in (0, 1):
            conn = self.acquire()
            stack = ExitStack()
            try:
                pipe = stack.enter_context(conn.pipeline())
                conn.execute("BEGIN")
                setup(conn)
                pipe.sync()
                break
            except BaseException as exc:
                with suppress(Exception):
                    stack.close()
                self.release(conn, discard=True)
                if not isinstance(exc, psycopg.Error):
                    raise
                if (attempt == 1 or not isinstance(exc, psycopg.OperationalError)
                        or isinstance(exc, pgerr.QueryCanceled | pgerr.LockNotAvailable)):
                    raise translate(exc) from exc
                self.drop_idle()  # the server probably restarted: so are the others
        try:
            try:
                yield conn
                conn.execute("COMMIT")
                stack.close()  # the last sync: what the block sent since its last read, and COMMIT
            except BaseException as exc:
                # the statements queued so far run (their errors ignored), then the rollback
                stack.__exit__(type(exc), exc, exc.__traceback__)
                raise
        except psycopg.Error as exc:
            raise translate(exc) from exc
        finally:
            self._abandon(conn)

    def batch(self, setup: Callable[[Connection], object] | None, statements: Sequence[Stmt], *,
              retry: bool = True) -> list[list[Any]]:
        """Run `statements` in one fresh transaction (after `setup`, if any), all sent at once in
        pipeline mode with the BEGIN and the COMMIT: one round trip to the server instead of
        one per statement. Returns the rows of each (none for a statement without any).

        `retry`: the statements may run twice (reads): a connection found dead (the server
        restarted) is replaced and the batch sent once more. Database errors leave as engram
        errors (`translate`)."""
        for attempt in (0, 1):
            conn = self.acquire()
            try:
                with conn.pipeline():
                    conn.execute("BEGIN")
                    if setup is not None:
                        setup(conn)
                    cursors = [conn.execute(sql, params) for sql, params in statements]
                    conn.execute("COMMIT")
                rows = [cur.fetchall() if cur.description is not None else [] for cur in cursors]
            except psycopg.Error as exc:
                dead = conn.closed or conn.broken
                self._abandon(conn)
                if dead and retry and attempt == 0:
                    self.drop_idle()  # the server probably restarted: so are the others
                    continue
                raise translate(exc) from exc
            except BaseException:
                self._abandon(conn)
                raise
            self.release(conn)
            return rows
        raise AssertionError("unreachable")

    def _abandon(self, conn: Connection) -> None:
        """Give back a connection whose batch failed: rolled back if it can be, else closed."""
        if not (conn.closed or conn.broken) and conn.info.transaction_status != TransactionStatus.IDLE:
            with suppress(psycopg.Error):
                conn.execute("ROLLBACK")
        self.release(conn)

    def close(self) -> bool:
        """Called once by each user of the pool; the last one closes the connections (and
        learns so: True)."""
        self._after_fork()
        with self._cond:
            self._users -= 1
            if self._users > 0:
                return False
            self._closed = True
        self.drop_idle()
        return True

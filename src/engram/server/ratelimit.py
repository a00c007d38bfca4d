"""Per-tenant rate limits: a token bucket per tenant, refilled continuously, in one process
(`RateLimiter`) or shared by every service process over one database (`SharedRateLimiter`).

A bucket holds up to `burst` tokens and gains `rate` per second; each request takes one. An
empty bucket answers how long until the next token, which the service sends as Retry-After.
`engram serve --workers N` runs N processes: their buckets live in a table every process
reads and updates in one atomic statement (`ratelimit.db` beside the SQLite database, or the
`engram_rate_buckets` table of the PostgreSQL one), so a tenant gets `rate`, not N times it.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import StoreError, StoreUnavailable
from ..store.sqlite import private_file

if TYPE_CHECKING:
    from ..config import Config
    from ..store.postgres import Pool


class Limiter(Protocol):
    rate: float
    burst: int

    def take(self, tenant: str) -> float:
        """Take a token: 0.0 if allowed, else the seconds to wait before the next one."""

    def charge(self, tenant: str, units: float) -> None:
        """Take `units` more for a costly request already admitted (see `limits.cost`): the
        bucket may go into debt, and the tenant's next requests wait until it is paid back."""

    def close(self) -> None: ...


@dataclass
class _Bucket:
    tokens: float
    at: float


def refill(tokens: float, at: float, now: float, rate: float, burst: int) -> tuple[float, float]:
    """A bucket's tokens at `now` (never above `burst`; a clock that went back adds nothing),
    and the wait before the next token after taking one if it can (0.0: taken)."""
    tokens = min(float(burst), tokens + max(0.0, now - at) * rate)
    if tokens >= 1.0:
        return tokens - 1.0, 0.0
    return tokens, (1.0 - tokens) / rate


class RateLimiter:
    """Buckets in this process's memory (a single service process, tests, embedding)."""

    MAX_TENANTS = 10_000  # the least recently seen tenants' buckets are dropped (they refill anyway)

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        _check(rate, burst)
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, tenant: str) -> float:
        now = self._clock()
        with self._lock:
            b = self._buckets.get(tenant)
            if b is None:
                b = self._buckets[tenant] = _Bucket(float(self.burst), now)
                if len(self._buckets) > self.MAX_TENANTS:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(tenant)
            b.tokens, wait = refill(b.tokens, b.at, now, self.rate, self.burst)
            b.at = now
            return wait

    def charge(self, tenant: str, units: float) -> None:
        """Take `units` more from the tenant's bucket for a costly request already admitted
        (see `limits.cost`): the bucket may go into debt, and the tenant's next requests wait
        until it is paid back."""
        if units <= 0:
            return
        with self._lock:
            b = self._buckets.get(tenant)
            if b is not None:
                b.tokens -= units

    def close(self) -> None:
        pass


# One statement takes a token atomically, whichever process runs it: the row is created full
# (minus the token taken), else refilled for the time since `at` and decremented if it holds
# a whole token; `wait` says how long until the next one (0: taken). The same text runs on
# SQLite (3.35+: upsert with RETURNING; min/max of two values) and, with `least`/`greatest`
# and %s placeholders, on PostgreSQL.
_TAKE = """
INSERT INTO {table} AS b (bucket, tokens, at, wait) VALUES ({m}, {m} - 1, {m}, 0)
ON CONFLICT (bucket) DO UPDATE SET
    tokens = CASE WHEN {lo}({m}, b.tokens + {hi}(0, {m} - b.at) * {m}) >= 1
                  THEN {lo}({m}, b.tokens + {hi}(0, {m} - b.at) * {m}) - 1
                  ELSE {lo}({m}, b.tokens + {hi}(0, {m} - b.at) * {m}) END,
    wait = CASE WHEN {lo}({m}, b.tokens + {hi}(0, {m} - b.at) * {m}) >= 1 THEN 0
                ELSE (1 - {lo}({m}, b.tokens + {hi}(0, {m} - b.at) * {m})) / {m} END,
    at = {m}
RETURNING wait"""
# A costly request's extra units: the bucket may go below zero (debt, paid back by the refill).
_CHARGE = "UPDATE {table} SET tokens = tokens - {m} WHERE bucket = {m} RETURNING tokens"
# Buckets unseen for an hour are full again by any sane rate: dropped now and then.
_PRUNE = "DELETE FROM {table} WHERE at < {m}"
_SQLITE_SCHEMA = ("CREATE TABLE IF NOT EXISTS rate_buckets (bucket TEXT PRIMARY KEY, "
                  "tokens REAL NOT NULL, at REAL NOT NULL, wait REAL NOT NULL)")
_PG_SCHEMA = ("CREATE TABLE IF NOT EXISTS engram_rate_buckets (bucket TEXT PRIMARY KEY, "
              "tokens DOUBLE PRECISION NOT NULL, at DOUBLE PRECISION NOT NULL, "
              "wait DOUBLE PRECISION NOT NULL)")


def _take_params(tenant: str, now: float, rate: float, burst: int) -> list[Any]:
    refilled = [burst, now, rate]  # lo(burst, tokens + hi(0, now - at) * rate)
    return [tenant, float(burst), now, *refilled * 4, *refilled, rate, now]


class SharedRateLimiter:
    """Buckets in a database table that every service process shares (see the module doc).

    The clock is the wall clock (`time.time`), the one clock every process and host agrees
    on; a step backwards refills nothing. The shared state is small and disposable: losing
    it (a crash, a deleted file) only refills every bucket.
    """

    PRUNE_EVERY = 10_000  # takes between two prunes of long-idle buckets

    def __init__(self, run: Callable[[str, Sequence[Any]], list[Any]], *, table: str, mark: str,
                 least: str, greatest: str, rate: float, burst: int,
                 close: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.time) -> None:
        _check(rate, burst)
        self.rate = rate
        self.burst = burst
        self._run = run
        self._close = close
        self._clock = clock
        self._take = _TAKE.format(table=table, m=mark, lo=least, hi=greatest)
        self._prune = _PRUNE.format(table=table, m=mark)
        self._charge = _CHARGE.format(table=table, m=mark)
        self._count = 0

    def take(self, tenant: str) -> float:
        now = self._clock()
        self._count += 1
        if self._count % self.PRUNE_EVERY == 0:
            self._run(self._prune, [now - 3600])
        rows = self._run(self._take, _take_params(tenant, now, self.rate, self.burst))
        return float(rows[0][0])

    def charge(self, tenant: str, units: float) -> None:
        if units > 0:
            self._run(self._charge, [float(units), tenant])

    def close(self) -> None:
        self._close()


def sqlite_rate_limiter(path: Path, rate: float, burst: int) -> SharedRateLimiter:
    """Buckets in their own small SQLite file: one connection per thread, no fsync (the
    state is disposable), each take one short write transaction."""
    local = threading.local()
    opened: list[sqlite3.Connection] = []
    lock = threading.Lock()

    def conn() -> sqlite3.Connection:
        c: sqlite3.Connection | None = getattr(local, "conn", None)
        if c is None:
            try:
                private_file(path)  # 0600 (and its -wal and -shm), like the databases beside it
                c = sqlite3.connect(path, timeout=10.0, isolation_level=None,
                                    check_same_thread=False)
                c.execute("PRAGMA journal_mode = WAL")
                c.execute("PRAGMA synchronous = OFF")
                c.execute(_SQLITE_SCHEMA)
            except (OSError, sqlite3.Error) as exc:
                raise StoreUnavailable(f"cannot open the rate limits {path}: {exc}") from exc
            local.conn = c
            with lock:
                opened.append(c)
        return c

    def run(stmt: str, params: Sequence[Any]) -> list[Any]:
        try:
            return conn().execute(stmt, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"the rate limits {path}: {exc}") from exc

    def close() -> None:
        with lock:
            for c in opened:
                c.close()
            opened.clear()

    return SharedRateLimiter(run, table="rate_buckets", mark="?", least="min", greatest="max",
                             rate=rate, burst=burst, close=close)


def postgres_rate_limiter(pool: Pool, rate: float, burst: int) -> SharedRateLimiter:
    """Buckets in a table of the shared PostgreSQL database (one round trip per take), each
    take committed without waiting for the WAL to reach the disk, as the SQLite buckets are
    written without an fsync: the state is disposable, and that wait was the tail of every
    request (search p99 160-215 ms under `bench/load.py` with it, 86 ms with none)."""
    from ..store.postgres import NO_FLUSH, create_tables

    ready = threading.Event()

    def run(stmt: str, params: Sequence[Any]) -> list[Any]:
        if ready.is_set():  # BEGIN, the statement and COMMIT in one round trip, not three
            # Sent again on a connection found dead (the server restarted): at worst a token
            # is taken twice, where without it every process's first request after a restart
            # answered 503 while its /ready said 200.
            return pool.batch(None, [NO_FLUSH, (stmt, params)])[1]
        with pool.transaction() as c:
            if not ready.is_set():
                create_tables(c, _PG_SCHEMA)
                ready.set()
            cur = c.execute(stmt, params)
            return cur.fetchall() if cur.description is not None else []

    return SharedRateLimiter(run, table="engram_rate_buckets", mark="%s", least="least",
                             greatest="greatest", rate=rate, burst=burst,
                             close=lambda: None if pool.close() else None)


def open_rate_limiter(config: Config, rate: float, burst: int, *, shared: bool) -> Limiter:
    """The service's limiter: shared by its processes over the configured database (`shared`),
    or this process's own."""
    if not shared:
        return RateLimiter(rate, burst)
    if config.database_url:
        from ..store.postgres import Pool  # psycopg is only imported when used

        pool = Pool(config.database_url, max_size=4, wait_s=config.pg_connect_timeout_s,
                    connect_timeout_s=config.pg_connect_timeout_s)
        return postgres_rate_limiter(pool, rate, burst)
    return sqlite_rate_limiter(config.path.parent / "ratelimit.db", rate, burst)


def _check(rate: float, burst: int) -> None:
    if rate <= 0 or burst < 1:
        raise ValueError("rate must be > 0 and burst >= 1")


def retry_after_header(wait_s: float) -> str:
    """Retry-After is whole seconds; round up so a client that obeys it is never refused again."""
    return str(max(1, math.ceil(wait_s)))

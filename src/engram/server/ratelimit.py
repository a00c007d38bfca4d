"""Per-tenant rate limits: a token bucket per tenant, refilled continuously, in one process
(`RateLimiter`) or shared by every service process over one database (`SharedRateLimiter`).

A bucket holds up to `burst` tokens and gains `rate` per second; each request takes one. An
empty bucket answers how long until the next token, which the service sends as Retry-After.
`engram serve --workers N` runs N processes: their buckets live in a table every process
reads and updates in one atomic statement (`ratelimit.db` beside the SQLite database, or the
`engram_rate_buckets` table of the PostgreSQL one; the store's tables and SQL,
store/service.py), so a tenant gets `rate`, not N times it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..store.sqlite import SQLiteRateBuckets

if TYPE_CHECKING:
    from ..config import Config


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


class Buckets(Protocol):
    """The store's shared buckets (`SQLiteRateBuckets`, `PostgresRateBuckets`)."""

    def take(self, bucket: str, now: float, rate: float, burst: int) -> float: ...

    def charge(self, bucket: str, units: float) -> None: ...

    def prune(self, before: float) -> None: ...

    def close(self) -> None: ...


class SharedRateLimiter:
    """Buckets in a database table that every service process shares (see the module doc):
    each take is one atomic statement of the store's.

    The clock is the wall clock (`time.time`), the one clock every process and host agrees
    on; a step backwards refills nothing. The shared state is small and disposable: losing
    it (a crash, a deleted file) only refills every bucket.
    """

    PRUNE_EVERY = 10_000  # takes between two prunes of long-idle buckets

    def __init__(self, buckets: Buckets, *, rate: float, burst: int,
                 clock: Callable[[], float] = time.time) -> None:
        _check(rate, burst)
        self.rate = rate
        self.burst = burst
        self.buckets = buckets
        self._clock = clock
        self._count = 0

    def take(self, tenant: str) -> float:
        now = self._clock()
        self._count += 1
        if self._count % self.PRUNE_EVERY == 0:
            self.buckets.prune(now - 3600)  # unseen for an hour: full again by any sane rate
        return self.buckets.take(tenant, now, self.rate, self.burst)

    def charge(self, tenant: str, units: float) -> None:
        if units > 0:
            self.buckets.charge(tenant, units)

    def close(self) -> None:
        self.buckets.close()


def open_rate_limiter(config: Config, rate: float, burst: int, *, shared: bool) -> Limiter:
    """The service's limiter: shared by its processes over the configured database (`shared`),
    or this process's own."""
    if not shared:
        return RateLimiter(rate, burst)
    if config.database_url:
        from ..store.postgres import PostgresRateBuckets  # psycopg is only imported when used

        return SharedRateLimiter(PostgresRateBuckets(config.database_url,
                                                     connect_timeout_s=config.pg_connect_timeout_s),
                                 rate=rate, burst=burst)
    return SharedRateLimiter(SQLiteRateBuckets(config.path.parent / "ratelimit.db"),
                             rate=rate, burst=burst)


def _check(rate: float, burst: int) -> None:
    if rate <= 0 or burst < 1:
        raise ValueError("rate must be > 0 and burst >= 1")


def retry_after_header(wait_s: float) -> str:
    """Retry-After is whole seconds; round up so a client that obeys it is never refused again."""
    return str(max(1, math.ceil(wait_s)))

"""Per-tenant rate limits: a token bucket per tenant, refilled continuously.

A bucket holds up to `burst` tokens and gains `rate` per second; each request takes one. An
empty bucket answers how long until the next token, which the service sends as Retry-After.
The buckets are per process: with N service processes a tenant gets up to N times the rate.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    MAX_TENANTS = 10_000  # the least recently seen tenants' buckets are dropped (they refill anyway)

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, tenant: str) -> float:
        """Take a token: 0.0 if allowed, else the seconds to wait before the next one."""
        now = self._clock()
        with self._lock:
            b = self._buckets.get(tenant)
            if b is None:
                b = self._buckets[tenant] = _Bucket(float(self.burst), now)
                if len(self._buckets) > self.MAX_TENANTS:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(tenant)
                b.tokens = min(float(self.burst), b.tokens + (now - b.at) * self.rate)
                b.at = now
            if b.tokens >= 1.0:
                b.tokens -= 1.0
                return 0.0
            return (1.0 - b.tokens) / self.rate


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


def retry_after_header(wait_s: float) -> str:
    """Retry-After is whole seconds; round up so a client that obeys it is never refused again."""
    return str(max(1, math.ceil(wait_s)))

"""A small thread-safe pool of PostgreSQL connections for the PostgreSQL store."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus

from ..errors import StoreBusy, StoreError, StoreUnavailable


class Pool:
    """A small thread-safe pool: idle connections are reused, broken ones dropped.

    Unlike a pool that keeps reconnecting in the background, it connects on demand, so a
    caller learns at once (StoreUnavailable, after `connect_timeout`) that the server is down,
    and the first call after it comes back simply opens a fresh connection.
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
        self._idle: list[psycopg.Connection[Any]] = []
        self._size = 0
        self._cond = threading.Condition()
        self._closed = False
        self._users = 1  # stores sharing this pool (see `PostgresStore.for_tenant`)

    def retain(self) -> None:
        with self._cond:
            if self._closed:
                raise StoreError("the store is closed")
            self._users += 1

    def acquire(self) -> psycopg.Connection[Any]:
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
            return psycopg.connect(self._url, autocommit=True, **self._kwargs)
        except BaseException as exc:
            with self._cond:
                self._size -= 1
                self._cond.notify()
            if isinstance(exc, psycopg.Error):
                raise StoreUnavailable(f"cannot connect to PostgreSQL: {exc}") from exc
            raise

    def release(self, conn: psycopg.Connection[Any], *, discard: bool = False) -> None:
        bad = (discard or self._closed or conn.closed or conn.broken
               or conn.info.transaction_status != TransactionStatus.IDLE)
        if bad:
            conn.close()
        with self._cond:
            if bad:
                self._size -= 1
            else:
                self._idle.append(conn)
            self._cond.notify()

    def drop_idle(self) -> None:
        """Close the idle connections: one of them failed, so the server probably restarted."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._size -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()

    def close(self) -> None:
        """Called once by each store sharing the pool; the last one closes the connections."""
        with self._cond:
            self._users -= 1
            if self._users > 0:
                return
            self._closed = True
        self.drop_idle()

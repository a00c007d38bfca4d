"""`Threads`: helper threads, started on first use and owned by one process.

Work goes to threads of its own in four places: SQLite saves its cache files and searches a
large scope's lexical side beside the dense keys; PostgreSQL sends a large scope's dense keys
beside its first round trip; the local embedder runs parts of a batch beside each other. All
need the same care. The threads of a parent
do not exist in a forked child (gunicorn `--preload`, Celery prefork), so a child starts its
own; a lock held at the fork by a parent thread would never be released, so the child gets a
new one; and once closed, no work is taken.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Any, TypeVar

T = TypeVar("T")


class Threads:
    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._closed = False
        _ALL.add(self)

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T] | None:
        """Run `fn(*args)` on this process's threads, started now if they are not; None once
        closed (the caller does the work itself, or drops it)."""
        with self._lock:
            if self._closed:
                return None
            if self._pool is None or self._pid != os.getpid():  # none, or a parent's
                self._pool = ThreadPoolExecutor(self.size, thread_name_prefix=self.name)
                self._pid = os.getpid()
            return self._pool.submit(fn, *args)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until the work given so far is done (with one thread: in order); a no-op when
        this process has not started them. Raises TimeoutError after `timeout` seconds."""
        # Not under the lock: before a fork, the thread holding it may be this one.
        pool, pid = self._pool, self._pid
        if pool is not None and pid == os.getpid():
            with suppress(RuntimeError):  # shut down meanwhile: nothing is left to wait for
                pool.submit(lambda: None).result(timeout)

    def close(self) -> None:
        """No more work; wait for what was given."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a parent thread may have held it


_ALL: weakref.WeakSet[Threads] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for threads in list(_ALL):
        threads._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)

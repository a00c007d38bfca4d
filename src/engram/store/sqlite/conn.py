"""The one SQLite connection layer: a connection per thread to one file, reads, and write
transactions that wait out other writers. The store and the service's key store both use it."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from ...errors import StoreBusy, StoreError, StoreUnavailable


class Connections:
    """Connections to one SQLite file (WAL), one per thread, safe across threads and processes.

    Writes are `BEGIN IMMEDIATE` transactions: a writer takes the lock up front, so two writers
    never deadlock upgrading a read lock; while another process holds it, the begin is retried
    with backoff for up to `busy_timeout_s`.
    """

    def __init__(self, path: Path, *, busy_timeout_s: float, label: str = "") -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self.label = label or str(path)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def get(self) -> sqlite3.Connection:
        """This thread's connection, opened on first use."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise StoreError(f"{self.label} is closed")
            try:
                conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s,
                                       isolation_level=None, check_same_thread=False)
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = FULL")
                # erased rows are overwritten in the file, not merely unlinked
                conn.execute("PRAGMA secure_delete = ON")
                conn.execute("PRAGMA foreign_keys = ON")
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"cannot open {self.label}: {exc}") from exc
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        try:
            return self.get().execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"{self.label}: {exc}") from exc

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: it commits when the block ends, or rolls back whole."""
        conn = self.get()
        deadline = time.monotonic() + self.busy_timeout_s
        delay = 0.005
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise StoreError(f"{self.label}: {exc}") from exc
                if time.monotonic() > deadline:
                    raise StoreBusy(f"{self.label} stayed locked for {self.busy_timeout_s}s") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException as exc:
            conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"write failed and was rolled back: {exc}") from exc
            raise

    def ping(self, sql: str = "SELECT 1") -> None:
        """Raise StoreUnavailable unless the file can be opened and read now. A fresh
        connection: an open handle keeps answering after the file's directory is gone."""
        try:
            with closing(sqlite3.connect(f"file:{self.path}?mode=rw", uri=True, timeout=2)) as conn:
                conn.execute(sql).fetchall()
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"{self.label} cannot be read: {exc}") from exc

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
        self._local = threading.local()

"""The one SQLite connection layer: a connection per thread to one file, reads, and write
transactions that wait out other writers. The store and the service's key store both use it.

With a key the file is opened through SQLCipher (`sqlcipher3`, the `encryption` extra): the
database, its WAL and its shared-memory file hold only ciphertext (docs/security.md)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
import time
import urllib.parse
import weakref
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from ...errors import EncryptionError, StoreBusy, StoreError, StoreUnavailable
from ...extras import install_hint

try:
    from sqlcipher3 import dbapi2 as _sqlcipher
except ImportError:  # the encryption extra is not installed: plain databases only
    _sqlcipher = None

# What either driver raises: the store catches these, never a driver's own class alone.
DB_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, *((_sqlcipher.Error,) if _sqlcipher else ()))
BUSY_ERRORS: tuple[type[Exception], ...] = (
    sqlite3.OperationalError, *((_sqlcipher.OperationalError,) if _sqlcipher else ()))

PLAIN_HEADER = b"SQLite format 3\x00"  # the first bytes of every unencrypted SQLite file
# SQLCipher 4's key derivation (PBKDF2-HMAC-SHA512, 256,000 rounds over the file's 16-byte
# salt): done once per file here, so each new connection gives the raw key and skips it.
KDF_ROUNDS = 256_000
KEY_HINT = "set ENGRAM_ENCRYPTION_KEY or ENGRAM_ENCRYPTION_KEY_FILE"
# Derived raw keys by (SHA-256 of the passphrase, file salt): one derivation per file and
# process, shared by every `Connections` of it (the service's tenants, a CLI command, forked
# workers). It holds what SQLCipher itself keeps in memory for an open database.
_DERIVED: dict[tuple[bytes, bytes], str] = {}


def cipher() -> ModuleType:
    """The SQLCipher driver, or a clear error naming the extra that provides it."""
    if _sqlcipher is None:
        raise EncryptionError(f"an encrypted database needs SQLCipher: {install_hint('encryption')}")
    return cast(ModuleType, _sqlcipher)


def header(path: Path | str) -> bytes:
    """The first 16 bytes of the database file: SQLite's magic string, or SQLCipher's salt
    (b"" when the file does not exist yet or is shorter). Read through SQLite, never with
    `open()`: see `_salted`."""
    path = Path(path)
    if not _sized(path):
        return b""
    with closing(cipher().connect(_uri(path), uri=True, isolation_level=None,
                                  check_same_thread=False)) as conn:
        conn.execute("PRAGMA cipher_log_level = NONE")
        return _salted(conn, "any key: only the header is read")


def is_plain(path: Path) -> bool:
    return header(path) == PLAIN_HEADER


def _sized(path: Path) -> bool:
    """Does the file hold at least a header? A `stat`, which opens nothing."""
    try:
        return path.stat().st_size >= 16
    except OSError:
        return False


def _uri(path: Path) -> str:
    """An existing file, opened read-write and never created."""
    return f"file:{urllib.parse.quote(str(path))}?mode=rw"


def _salted(conn: sqlite3.Connection, key: str) -> bytes:
    """The file's first 16 bytes, read by SQLCipher once `PRAGMA key` is set (lazily: nothing
    is derived or decrypted until a page is read, and a later `PRAGMA key` replaces it).

    Only SQLite may open a database file in this process. On POSIX, closing any descriptor of
    a file drops every lock the process holds on it, the SHARED lock that marks the WAL as in
    use among them; another process closing the database then believes it is the last one,
    checkpoints and deletes the live WAL, and later commits go into a deleted file
    (https://sqlite.org/howtocorrupt.html, 2.2). SQLite itself defers closing a descriptor
    while its other connections hold locks on the file."""
    conn.execute(f"PRAGMA key = {quote(key)}")
    row = conn.execute("PRAGMA cipher_salt").fetchone()
    return bytes.fromhex(row[0]) if row and row[0] else b""


def private_file(path: Path) -> None:
    """Create a database file readable by its owner only (0600), whatever the umask: SQLite
    gives its -wal and -shm files the mode of the database file. A file that exists is left
    alone, and never opened (O_EXCL): this process may hold it through SQLite."""
    if str(path) == ":memory:":
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    os.fchmod(fd, 0o600)
    os.close(fd)


def is_busy(exc: Exception) -> bool:
    """Is it SQLite saying another connection holds the lock (not another failure)?"""
    return "locked" in str(exc) or "busy" in str(exc)


def wal(c: sqlite3.Connection, patience_s: float = 10.0) -> None:
    """Put a new file in WAL mode. Processes starting at once may find it being converted by
    another: that lock is not waited out by SQLite's busy handler, so it is retried here."""
    deadline = time.monotonic() + patience_s
    delay = 0.005
    while True:
        try:
            c.execute("PRAGMA journal_mode = WAL")
            return
        except BUSY_ERRORS as exc:
            if not is_busy(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


def quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def connect(path: Path | str, key: str | None, *, timeout: float = 5.0,
            uri: bool = False) -> sqlite3.Connection:
    """One connection to `path` (plain without a key, SQLCipher with one), checked: a wrong or
    missing key raises `EncryptionError` before anything is read or written."""
    file = Path(urllib.parse.unquote(str(path).removeprefix("file:").partition("?")[0])) \
        if uri else Path(path)
    if key is None:
        conn = sqlite3.connect(path, timeout=timeout, isolation_level=None,
                               check_same_thread=False, uri=uri)
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
        except sqlite3.DatabaseError as exc:
            conn.close()
            if "not a database" in str(exc) and not (_sqlcipher and is_plain(file)):
                raise EncryptionError(f"{file} is encrypted (or is not an SQLite database): "
                                      f"{KEY_HINT}") from None
            raise  # a damaged plain file: the driver's own error
        return conn
    conn = cast(sqlite3.Connection, cipher().connect(str(path), timeout=timeout,
                                                     isolation_level=None,
                                                     check_same_thread=False, uri=uri))
    try:
        conn.execute("PRAGMA cipher_log_level = NONE")  # a wrong key is our error, not stderr noise
        head = _salted(conn, key) if _sized(file) else b""
        if head == PLAIN_HEADER:
            raise EncryptionError(f"{file} is not encrypted but an encryption key is set: "
                                  f"`engram encrypt` encrypts it in place (after a backup)")
        conn.execute(f"PRAGMA key = {key_literal(key, head)}")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
        # temporary tables and sort files stay in memory, never in plain temp files
        conn.execute("PRAGMA temp_store = MEMORY")
    except EncryptionError:
        conn.close()
        raise
    except DB_ERRORS as exc:
        conn.close()
        if "not a database" in str(exc):
            raise EncryptionError(f"wrong encryption key for {file} (or it is not an engram "
                                  f"database)") from None
        raise StoreUnavailable(f"cannot open {file}: {exc}") from exc
    return conn


def key_literal(key: str, head: bytes) -> str:
    """The `PRAGMA key` value: the raw key derived here from the file's salt when the file
    exists (SQLCipher then skips its own derivation), else the passphrase (a new file)."""
    if len(head) < 16:
        return quote(key)
    known = (hashlib.sha256(key.encode()).digest(), head)
    raw = _DERIVED.get(known)
    if raw is None:
        raw = hashlib.pbkdf2_hmac("sha512", key.encode(), head, KDF_ROUNDS, 32).hex()
        if len(_DERIVED) > 1024:  # many tenants' files: forget the oldest half
            for old in list(_DERIVED)[:512]:
                del _DERIVED[old]
        _DERIVED[known] = raw
    return f"\"x'{raw}'\""


class Connections:
    """Connections to one SQLite file (WAL), one per thread, safe across threads and processes.

    Writes are `BEGIN IMMEDIATE` transactions: a writer takes the lock up front, so two writers
    never deadlock upgrading a read lock; while another process holds it, the begin is retried
    with backoff for up to `busy_timeout_s`. With `key`, the file is encrypted (SQLCipher).
    """

    def __init__(self, path: Path, *, busy_timeout_s: float, label: str = "",
                 key: str | None = None) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self.label = label or str(path)
        self.key = key
        self._closed = False
        private_file(path)
        self._reset()
        _OPEN.add(self)

    def _reset(self) -> None:
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        # Writers of this process queue here and are woken the moment the one before them
        # commits; only other processes' writers are left to SQLite's busy handler, which
        # polls with sleeps of up to 100 ms (with 20 threads writing, that sleeping was most
        # of a service's add latency).
        self._writer = threading.RLock()  # reentrant: a nested BEGIN fails as SQLite says
        self._held_for_fork = False  # `_writer`, taken by `_hold_for_fork`

    def _hold_for_fork(self) -> None:
        """Before a fork: wait for this process's write in progress to end (a cache save on
        a store's own thread, say). SQLite's record of the locks its connections hold is
        copied into the child, and a child forked in the middle of a write would find the
        database locked by that write forever."""
        self._held_for_fork = self._writer.acquire(timeout=self.busy_timeout_s)

    def _release_after_fork(self) -> None:
        if self._held_for_fork:
            self._held_for_fork = False
            self._writer.release()

    def try_writer(self, timeout: float) -> bool:
        """Take this process's write turn if no other thread keeps it past `timeout` seconds
        (release it with `release_writer`): for writes not worth a long wait."""
        return self._writer.acquire(timeout=timeout)

    def release_writer(self) -> None:
        self._writer.release()

    def _after_fork(self) -> None:
        """In a forked child: SQLite connections must not cross a fork (the parent's POSIX
        locks are not the child's), and a lock a parent thread held would never be released.
        The inherited connections are kept, never used or closed (closing could disturb the
        parent's WAL); the child opens its own on first use."""
        _ABANDONED.extend(self._all)
        self._reset()

    @property
    def encrypted(self) -> bool:
        return self.key is not None

    def get(self) -> sqlite3.Connection:
        """This thread's connection, opened on first use."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise StoreError(f"{self.label} is closed")
            try:
                conn = connect(self.path, self.key, timeout=self.busy_timeout_s)
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
                wal(conn)
                conn.execute("PRAGMA synchronous = FULL")
                # erased rows are overwritten in the file, not merely unlinked
                conn.execute("PRAGMA secure_delete = ON")
                conn.execute("PRAGMA foreign_keys = ON")
            except DB_ERRORS as exc:
                raise StoreUnavailable(f"cannot open {self.label}: {exc}") from exc
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        try:
            return self.get().execute(sql, params).fetchall()
        except DB_ERRORS as exc:
            raise StoreError(f"{self.label}: {exc}") from exc

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: it commits when the block ends, or rolls back whole."""
        if not self._writer.acquire(timeout=self.busy_timeout_s):
            raise StoreBusy(f"{self.label}: another thread of this process kept writing for "
                            f"{self.busy_timeout_s}s")
        try:
            conn = self.get()  # opened in the turn too: a fork waits for the whole of it
            with self._begun(conn):
                yield conn
        finally:
            self._writer.release()

    @contextmanager
    def _begun(self, conn: sqlite3.Connection) -> Iterator[None]:
        deadline = time.monotonic() + self.busy_timeout_s
        delay = 0.005
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                break
            except BUSY_ERRORS as exc:
                if not is_busy(exc):
                    raise StoreError(f"{self.label}: {exc}") from exc
                if time.monotonic() > deadline:
                    raise StoreBusy(f"{self.label} stayed locked for {self.busy_timeout_s}s") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
        try:
            yield
            conn.execute("COMMIT")
        except BaseException as exc:
            conn.execute("ROLLBACK")
            if isinstance(exc, DB_ERRORS):
                raise StoreError(f"write failed and was rolled back: {exc}") from exc
            raise

    def ping(self, sql: str = "SELECT 1") -> None:
        """Raise StoreUnavailable unless the file can be opened and read now. A fresh
        connection: an open handle keeps answering after the file's directory is gone."""
        try:
            with closing(connect(_uri(self.path), self.key, timeout=2,
                                 uri=True)) as conn:
                conn.execute(sql).fetchall()
        except DB_ERRORS as exc:
            raise StoreUnavailable(f"{self.label} cannot be read: {exc}") from exc

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
        self._local = threading.local()


_OPEN: weakref.WeakSet[Connections] = weakref.WeakSet()
_ABANDONED: list[sqlite3.Connection] = []  # inherited over a fork: kept, never closed


def _before_fork() -> None:
    for connections in list(_OPEN):
        connections._hold_for_fork()


def _after_fork_in_parent() -> None:
    for connections in list(_OPEN):
        connections._release_after_fork()


def _after_fork_in_child() -> None:
    for connections in list(_OPEN):
        connections._after_fork()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)

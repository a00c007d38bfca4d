"""Whole-file operations on an SQLite database: online backup, restore, integrity check, and
the encryption changes (encrypt a plain file in place, change the key).

A backup is SQLite's backup API run in one step, which reads one snapshot: in WAL mode writers
go on meanwhile, and the copy holds exactly the transactions committed before it began. An
encrypted database is copied through SQLCipher with the same key, so it backs up encrypted.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from pathlib import Path

from ...errors import EncryptionError, EngramError, InvalidInput, StoreError
from .conn import DB_ERRORS, cipher, connect, is_plain, quote


def sidecars(path: Path) -> list[Path]:
    """The database file and the WAL and shared-memory files beside it."""
    return [path, Path(f"{path}-wal"), Path(f"{path}-shm")]


def caches(path: Path) -> list[Path]:
    """The cache files the store saves beside the database (store.py: `<file>.lexicon`, and the
    folders `<file>.slabs` and `<file>.ann`); none is kept beside an encrypted database."""
    found = list(path.parent.glob(f"{path.name}.lexicon*"))
    for folder in (Path(f"{path}.slabs"), Path(f"{path}.ann")):
        if folder.is_dir():
            found += [f for f in folder.iterdir() if f.is_file()]
    return found


def integrity(path: Path, key: str | None) -> list[str]:
    """`PRAGMA integrity_check` of the file: [] when it is sound, else the problems found."""
    if not path.exists():
        raise InvalidInput(f"{path} does not exist")
    try:
        with closing(connect(path, key)) as conn:
            found = [row[0] for row in conn.execute("PRAGMA integrity_check").fetchall()]
    except DB_ERRORS as exc:
        return [str(exc)]
    return [] if found == ["ok"] else found


def backup(src: Path, dest: Path, key: str | None) -> int:
    """Copy the live database `src` to the new file `dest` (never overwritten), consistent
    while other connections and processes write; checked with `integrity_check`. Returns the
    size of the copy in bytes."""
    if not src.exists():
        raise InvalidInput(f"there is no database at {src}")
    if dest.exists():
        raise InvalidInput(f"{dest} exists: a backup never overwrites a file")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    for p in sidecars(partial):
        p.unlink(missing_ok=True)
    try:
        with closing(connect(src, key, timeout=30)) as source, \
                closing(connect(partial, key, timeout=30)) as target:
            source.backup(target)  # pages=-1: one step, one read snapshot of the source
            target.execute("PRAGMA journal_mode = DELETE")  # one self-contained file
    except DB_ERRORS as exc:
        for p in sidecars(partial):
            p.unlink(missing_ok=True)
        raise StoreError(f"backup of {src} failed: {exc}") from exc
    _put_in_place(partial, dest, key, f"the backup of {src}")
    return dest.stat().st_size


def _put_in_place(partial: Path, dest: Path, key: str | None, what: str,
                  before: Callable[[], None] = lambda: None) -> None:
    """Move a finished copy over `dest` once it passes `integrity_check`: private (0600),
    flushed, renamed in one step, and the rename flushed, so a crash leaves the old file or
    the new one, never half of either. `before` runs just before the rename."""
    problems = integrity(partial, key)
    if problems:
        raise StoreError(f"{what} failed its integrity check: {problems[:3]}")
    os.chmod(partial, 0o600)
    _fsync(partial)
    before()
    os.replace(partial, dest)
    _fsync(dest.parent)


def restore(src: Path, dest: Path, key: str | None) -> Path | None:
    """Replace the database `dest` by the backup `src` (checked first: it must open with `key`
    and pass `integrity_check`). The database it replaces is first saved beside it; returns
    where (None if there was none). Stop the service and workers of `dest` before."""
    problems = integrity(src, key)
    if problems:
        raise InvalidInput(f"{src} is not a sound backup: {problems[:3]}")
    saved = None
    if dest.exists():
        saved = dest.with_name(f"{dest.name}.pre-restore-{time.strftime('%Y%m%dT%H%M%S')}")
        backup(dest, saved, key)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with closing(connect(src, key, timeout=30)) as source, \
                closing(connect(dest, key, timeout=30)) as target:
            source.backup(target)
            target.execute("PRAGMA journal_mode = WAL")
            target.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except DB_ERRORS as exc:
        raise StoreError(f"restore into {dest} failed: {exc}") from exc
    problems = integrity(dest, key)
    if problems:
        raise StoreError(f"{dest} failed its integrity check after the restore: {problems[:3]}")
    return saved


def encrypt(path: Path, key: str) -> Path:
    """Encrypt the plain database `path` in place with `key`: a plain backup is taken first
    (returned: delete it once the encrypted database is verified), the file is exported
    through SQLCipher to a new file, checked, and moved over the original. No other
    connection may be open (stop the service and workers first)."""
    if not path.exists():
        raise InvalidInput(f"there is no database at {path}")
    if not is_plain(path):
        raise EncryptionError(f"{path} is not a plain SQLite database (already encrypted?)")
    driver = cipher()
    saved = path.with_name(f"{path.name}.plain-backup-{time.strftime('%Y%m%dT%H%M%S')}")
    backup(path, saved, None)
    partial = path.with_name(path.name + ".encrypting")
    for p in sidecars(partial):
        p.unlink(missing_ok=True)
    try:
        with closing(driver.connect(str(path), isolation_level=None, timeout=30)) as plain:
            plain.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            counts = _counts(plain)
            plain.execute(f"ATTACH DATABASE {quote(str(partial))} AS encrypted KEY {quote(key)}")
            plain.execute("SELECT sqlcipher_export('encrypted')")
            plain.execute("DETACH DATABASE encrypted")
        with closing(connect(partial, key)) as conn:
            conn.execute("PRAGMA journal_mode = WAL")
            if _counts(conn) != counts:
                raise StoreError(f"encrypting {path}: the encrypted copy does not hold every row")
    except DB_ERRORS as exc:
        for p in sidecars(partial):
            p.unlink(missing_ok=True)
        raise StoreError(f"encrypting {path} failed (the database is unchanged): {exc}") from exc
    def drop_plain_sidecars() -> None:  # the plain WAL and shm (empty after the checkpoint)
        for p in sidecars(path)[1:]:
            p.unlink(missing_ok=True)

    _put_in_place(partial, path, key, f"encrypting {path}: the copy", drop_plain_sidecars)
    for f in caches(path):  # saved while it was plain: they hold its words and vectors
        f.unlink(missing_ok=True)
    return saved


def rekey(path: Path, old: str, new: str) -> None:
    """Change the key of the encrypted database `path` (every page is rewritten). No other
    connection may be open. A missing file is an error (opening it would create one)."""
    if not new:
        raise InvalidInput("the new key must not be empty")
    if not path.exists():
        raise InvalidInput(f"there is no database at {path}")
    try:
        with closing(connect(path, old, timeout=30)) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute(f"PRAGMA rekey = {quote(new)}")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except DB_ERRORS as exc:
        raise StoreError(f"rekey of {path} failed: {exc}") from exc
    problems = integrity(path, new)
    if problems:
        raise StoreError(f"{path} failed its integrity check after the rekey: {problems[:3]}")


def rekey_all(paths: Sequence[Path], old: str, new: str) -> list[Path]:
    """Change the key of several encrypted databases as one operation: each must open with
    `old` (or already with `new`: a run that stopped half-way is run again) before any is
    changed; then each is rekeyed, and a failure says which files have which key. Returns
    those it rekeyed. No other connection may be open."""
    if not new:
        raise InvalidInput("the new key must not be empty")
    todo = []
    for path in paths:
        if not path.exists():
            raise InvalidInput(f"there is no database at {path}")
        try:
            connect(path, old).close()
            todo.append(path)
        except EncryptionError as exc:
            try:
                connect(path, new).close()
            except EncryptionError:
                raise EncryptionError(f"{exc} (nor does the new key open it): nothing was "
                                      "rekeyed") from None
    done: list[Path] = []
    for path in todo:
        try:
            rekey(path, old, new)
        except EngramError as exc:
            left = [str(p) for p in todo if p not in done]
            raise StoreError(f"{exc}; these still open with the current key: {left} (the others "
                             "with the new one: run the rekey again)") from exc
        done.append(path)
    return done


def _counts(conn: sqlite3.Connection) -> dict[str, int]:
    """Rows per ordinary table (virtual tables are counted through their shadow tables)."""
    tables = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND sql NOT LIKE 'CREATE VIRTUAL%'")]
    return {t: conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}


def _fsync(path: Path) -> None:
    """Flush a file (or a directory's entries: a rename) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""The dense caches an SQLite store saves beside its database (`<file>.slabs/`, cachefile.py):
a large scope's slab, named in `meta` (`slab_file:<name>`, the file's token), so that a new
process loads it instead of reading the tables, and no file the database does not name is
trusted. Never beside an encrypted database: a file would hold its vectors and texts in clear."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import cachefile
from ..index.cache import DenseCache, SlabKey
from ..index.slab import Slab
from ..records import Dialect
from . import sql

log = logging.getLogger("engram.store")

MAGIC = b"engram-slab\n\x00\x00\x00\x00"  # the first 16 bytes of a saved dense cache
FORMAT = 2  # the saved layout; 2: the candidates carry their role
WARM_ROWS = 5_000  # candidates built at a time under the lock (what a search may wait for)

# The store's `_save_cache(path, name in meta, erasures, write)`: the file written, renamed
# into place and named in one write transaction unless an erasure came since
Save = Callable[[Path, str, int, Callable[[int], Path | None]], bool]
Background = Callable[[Callable[[], None]], None]  # runs work on the store's saving thread
Read = Callable[[str], list[Any]]  # the rows of a statement


class SlabFiles:
    """The saved slabs of one database (`directory`: None for one in memory)."""

    def __init__(self, directory: Path | None, *, encrypted: bool, dialect: Dialect,
                 cache: DenseCache, save: Save, background: Background, read: Read,
                 closing: threading.Event) -> None:
        self.directory = directory
        self.encrypted = encrypted
        self._dialect = dialect
        self._cache = cache
        self._save = save
        self._background = background
        self._read = read
        self._closing = closing

    def where(self, key: SlabKey) -> tuple[Path, str] | None:
        """Where the slab of one scope and key name is saved, and its name in `meta`."""
        if self.directory is None:
            return None
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
        return self.directory / name, f"slab_file:{name}"

    def load(self, key: SlabKey, dim: int, meta: dict[str, Any]) -> Slab | None:
        """The slab saved for `key`, if the database names its file (`meta`, just read) and
        it reads back whole; it then catches up with the tables like any slab."""
        where = self.where(key)
        token = meta.get(where[1]) if where is not None else None
        if where is None or not token or self.encrypted:
            return None
        found = cachefile.read(where[0], MAGIC, token,
                               {"format": FORMAT, "key": repr(key), "dim": dim})
        if found is None:
            return None
        try:
            slab = Slab.restore(found[0], found[1], self._dialect)
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
            log.warning("ignoring the malformed dense cache %s: %s", where[0], exc)
            return None
        slab.saved_n = slab.n
        log.info("loaded the dense cache of %s (%d keys) from %s", key, slab.n, where[0])
        if slab.cold is not None:
            self._background(lambda: self._warm(slab))
        return slab

    def _warm(self, slab: Slab) -> None:
        """Build the candidates of a slab loaded from its file, a chunk at a time under the
        cache's lock, off the request path (a search builds the ones it needs first itself)."""
        while not self._closing.is_set():
            with self._cache.lock:
                if not slab.warm(WARM_ROWS):
                    return
            time.sleep(0.002)  # the lock is not fair: let a waiting search take it first

    def keep(self, slab: Slab, key: SlabKey, erasures: int) -> None:
        """After a refresh made `slab` exact (the database's erasure count then: `erasures`):
        saved once it is above the ANN threshold and grew by a quarter (or the threshold)
        since its last save. Call with the cache's lock held."""
        slab.erasures = erasures
        threshold = self._cache.ann_threshold
        if slab.n > threshold and slab.n - slab.saved_n >= max(threshold, slab.saved_n // 4):
            self.save(slab, key)

    def save(self, slab: Slab, key: SlabKey) -> None:
        """Save an exact slab (the store's `_save_cache`, off the request path). Call with the
        cache's lock held: its state is taken now (`Slab.state` copies what later changes
        rewrite in place)."""
        where = self.where(key)
        if where is None or self.encrypted:
            return
        slab.saved_n = slab.n  # saved, or not possible now: tried again once it grew
        state = slab.state(self._dialect)
        if state is None:
            log.warning("the dense cache of %s is not saved: a string holds a NUL", key)
            return
        head, arrays = state
        header = {"format": FORMAT, "key": repr(key), **head}
        path, name, erasures = where[0], where[1], slab.erasures

        def save() -> None:
            if self._save(path, name, erasures, lambda token: cachefile.write(
                    path, MAGIC, {**header, "token": token}, arrays)):
                log.info("saved the dense cache of %s (%d keys) to %s", key, head["n"], path)
        self._background(save)

    def forget(self, keep: bool) -> None:
        """Remove the saved slabs: all of them, or (`keep`) those the database does not name
        (unnamed by an erasure whose process died before removing them, half-written)."""
        if self.directory is None or not self.directory.exists():
            return
        named = {row[0] for row in self._read(sql.SLAB_FILES)} if keep else set()
        for f in self.directory.iterdir():
            if f"slab_file:{f.name}" not in named:
                f.unlink(missing_ok=True)

"""An approximate nearest-neighbour index (HNSW, from usearch) over one dense cache (`Slab`),
for scopes too large to scan exactly: like the slab, a cache of `memory_keys` that is rebuilt
from the database whenever it is missing, stale or no longer trusted.

Its labels are key seqs (never reused, the same in every process), so a saved index is valid for
any process: keys added since it was saved are added to it, deleted ones are filtered out by the
slab's visibility mask, and once a quarter of it is dead it is built again from the live rows.
Saved files hold vectors: an erase removes them (`forget_files`) and they are rebuilt on demand.

usearch, not hnswlib, faiss or sqlite-vec: prebuilt wheels for every platform (hnswlib builds
from source), keys can be added and removed after the build (faiss's HNSW cannot remove), a
search runs on the calling thread with no OpenMP pool to break after a fork (faiss), and it is
an index (sqlite-vec scans every vector: exact, not approximate, so no faster at 1M).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .. import cachefile

log = logging.getLogger("engram.store")

_index_class: list[Any] = []  # usearch's Index once imported (None: the extra is missing)


def _index() -> Any:
    """usearch's `Index` class, imported on first use (the `ann` extra; without it every search
    is exact), so opening a store does not load it. onnxruntime, when installed, is imported
    first: imported after usearch's compiled module, onnxruntime 1.32 crashes the process
    (SIGSEGV in its pybind module's import, with usearch 2.26); in that order both work
    (tests/test_ann.py checks it in a fresh process)."""
    if not _index_class:
        with contextlib.suppress(ImportError):
            import onnxruntime  # noqa: F401
        try:
            from usearch.index import Index
            _index_class.append(Index)
        except ImportError:  # pragma: no cover - exercised where the extra is not installed
            _index_class.append(None)
    return _index_class[0]

# The index's own copy of each vector, used only to walk the graph (the hits are rescored from
# the dense cache's float32 rows). bfloat16, not float16: half the bytes of float32 either way,
# but a bfloat16 dot product needs no conversion (native on CPUs with AVX-512 BF16, a shift
# elsewhere). Measured on 100k clustered 384-d keys, 1,157 asked: 6.1 ms a search against 9.5
# (float16), the same recall of the exact top 1,000, and a 30% faster build. An index saved
# in float16 by an earlier version is loaded as it is (usearch keeps the file's type).
DTYPE = "bf16"
CONNECTIVITY = 16       # HNSW's M: links per node
EXPANSION_ADD = 128     # efConstruction
EXPANSION_SEARCH = 128  # ef at search time (raised to the count asked for)
MAX_DEAD = 0.25         # rebuild once this share of the indexed keys is dead


def available() -> bool:
    return _index() is not None


def file_for(directory: Path, scope_key: tuple[Any, ...]) -> Path:
    """Where the index of one cache (scope and key name) is saved."""
    digest = hashlib.sha256(repr(scope_key).encode()).hexdigest()[:24]
    return directory / f"{digest}.usearch"


def forget_files(directory: Path | None) -> None:
    """Remove every saved index (after an erase: they may hold an erased memory's vectors)."""
    if directory is None or not directory.exists():
        return
    for f in directory.glob("*.usearch*"):
        f.unlink(missing_ok=True)


class Ann:
    """An HNSW index over the rows of one slab, labelled by key seq."""

    def __init__(self, dim: int) -> None:
        index = _index()
        assert index is not None, "the ann extra (usearch) is not installed"
        self.dim = dim
        self.index = index(ndim=dim, metric="cos", dtype=DTYPE, connectivity=CONNECTIVITY,
                           expansion_add=EXPANSION_ADD, expansion_search=EXPANSION_SEARCH)
        self.max_seq = 0  # every live key of the slab up to this seq is in the index
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    def add(self, seqs: np.ndarray, vecs: np.ndarray) -> None:
        """Add keys (ascending seqs above `max_seq`)."""
        if len(seqs):
            self.index.add(seqs.astype(np.uint64), vecs, threads=0)
            self.max_seq = max(self.max_seq, int(seqs.max()))

    def search(self, vector: np.ndarray, count: int) -> np.ndarray:
        """The seqs of (about) the `count` nearest keys, nearest first."""
        self.index.expansion_search = max(EXPANSION_SEARCH, count)
        found = self.index.search(vector, count, threads=1)
        return np.asarray(found.keys, dtype=np.int64)

    def save(self, path: Path) -> None:
        """Write the index beside the database (atomically: a reader never sees half)."""
        tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")  # per process too
        os.close(cachefile.private(tmp))  # usearch writes into it and keeps its mode (0600)
        self.index.save(str(tmp))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, dim: int) -> Ann | None:
        """A saved index, or None if there is none or it cannot be read."""
        if not available() or not path.exists():
            return None
        ann = cls(dim)
        try:
            ann.index.load(str(path))
        except Exception as exc:  # a torn or foreign file is only a cache miss
            log.warning("ignoring the unreadable ANN index %s: %s", path, exc)
            path.unlink(missing_ok=True)
            return None
        if ann.index.ndim != dim:
            return None
        keys = np.asarray(ann.index.keys, dtype=np.int64) if len(ann.index) else np.zeros(0, np.int64)
        ann.max_seq = int(keys.max()) if len(keys) else 0
        return ann

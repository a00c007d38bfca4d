"""The SQLite store's dense search cache: the vectors of one scope and key name in a numpy
matrix, with what visibility needs per row, so a search filters and scores in numpy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...model import Kind
from ..base import Query, Seen
from ..records import time_bounds

_KIND_CODES = {k.value: i for i, k in enumerate(Kind)}
TIMES = ("expires_at", "valid_from", "valid_to")  # cached per row, in this order


class Slab:
    """Vectors of one scope and key kind in a growable float32 matrix (a cache of `memory_keys`).

    Each row also caches what visibility depends on (its memory's kind, expiry and validity,
    and whether the key and memory still exist), so a search outside a write filters in numpy
    instead of asking the database about each candidate. The cache is exact as of the
    `keys_version` / `rows_version` it was refreshed at: new keys are loaded by seq, deleted
    ones cleared from `key_tombstones`, and a changed row (`rows_version`) reloads the
    attributes of the whole slab.
    """

    def __init__(self, dim: int) -> None:
        cap = 1024
        self.mat = np.zeros((cap, dim), dtype=np.float32)
        self.seqs = np.zeros(cap, dtype=np.int64)
        self.alive = np.zeros(cap, dtype=bool)     # the key row exists (and its memory did)
        self.ok = np.zeros(cap, dtype=bool)        # its memory is in scope and not deleted
        self.kind = np.zeros(cap, dtype=np.int8)
        # the time columns of the visibility rule, named as in the table (NaN for NULL)
        self.expires_at = np.full(cap, np.nan)
        self.valid_from = np.full(cap, np.nan)
        self.valid_to = np.full(cap, np.nan)
        self.memory_ids: list[str] = []
        self.n = 0
        self.max_seq = 0
        self.version = -1
        self.rows_version = -1  # the rows_version the attributes are exact for; -1: unknown
        self.tomb_max = -1      # the last tombstone applied; -1: not read yet

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * len(self.seqs))
        self.mat = np.resize(self.mat, (cap, self.mat.shape[1]))
        for name in ("seqs", "alive", "ok", "kind", *TIMES):
            setattr(self, name, np.resize(getattr(self, name), cap))

    def append(self, seqs: list[int], mids: list[str], vecs: np.ndarray,
               attrs: Sequence[Sequence[Any]] = ()) -> None:
        """Add rows in seq order; `attrs` holds (kind, expires_at, valid_from, valid_to) each."""
        need = self.n + len(seqs)
        if need > len(self.seqs):
            self._grow(need)
        self.mat[self.n:need] = vecs
        self.seqs[self.n:need] = seqs
        self.alive[self.n:need] = True
        self.ok[self.n:need] = True
        if attrs:
            self._set_attrs(np.arange(self.n, need), attrs)
        self.memory_ids.extend(mids)
        self.n = need
        if seqs:
            self.max_seq = max(self.max_seq, max(seqs))

    def _set_attrs(self, idx: np.ndarray, attrs: Sequence[Sequence[Any]]) -> None:
        self.kind[idx] = [_KIND_CODES.get(a[0], -1) for a in attrs]
        for col, name in enumerate(TIMES, start=1):
            getattr(self, name)[idx] = np.array([a[col] for a in attrs], dtype=np.float64)

    def rows_of(self, seqs: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Slab row of each seq (seqs are stored ascending) and which of them are held."""
        want = np.asarray(seqs, dtype=np.int64)
        pos = np.searchsorted(self.seqs[:self.n], want)
        held = pos < self.n
        held[held] = self.seqs[pos[held]] == want[held]
        return pos, held

    def kill(self, seqs: Sequence[int]) -> None:
        pos, held = self.rows_of(seqs)
        self.alive[pos[held]] = False

    def reset_attrs(self, rows: Sequence[Sequence[Any]]) -> None:
        """Replace every row's attributes: `rows` are (seq, kind, expires, valid_from, valid_to)
        of the keys whose memory is in scope and not deleted; the others are not ok."""
        self.ok[:self.n] = False
        if not rows:
            return
        pos, held = self.rows_of([r[0] for r in rows])
        idx = pos[held]
        self.ok[idx] = True
        self._set_attrs(idx, [r[1:] for r, h in zip(rows, held, strict=True) if h])

    def visible(self, query: Query) -> np.ndarray:
        """Rows `query` may see, except for its metadata conditions: the visibility rule
        (`records.time_bounds`, the same bounds the SQL renders) on the cached attributes."""
        n = self.n
        mask = self.alive[:n] & self.ok[:n]
        for b in time_bounds(Seen.VISIBLE, query.now, query.as_of):
            col: np.ndarray = getattr(self, b.column)[:n]
            t = b.at.timestamp()
            mask &= np.isnan(col) | ((col > t) if b.op == ">" else (col <= t))
        if query.kinds:
            mask &= np.isin(self.kind[:n], [_KIND_CODES[k.value] for k in query.kinds])
        return mask

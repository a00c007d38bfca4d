"""The dense search cache of both stores: the vectors of one scope and key name in a numpy
matrix, with what visibility needs per row, so a search filters and scores in numpy; the
`text` slab also holds each memory's ranking fields, so the candidate pool costs no SQL.
A process's slabs are held and kept exact by cache.py (refresh.py); the SQLite store saves a
large one beside the database (`state` / `restore`, sqlite/slabfiles.py) and a new process
starts from it."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ...model import Kind
from ..base import Candidate, Query, Seen
from ..cachefile import pack, unpack
from ..records import CANDIDATE_COLUMNS, Dialect, read_candidates, time_bounds

if TYPE_CHECKING:
    from .ann import Ann

_KIND_CODES = {k.value: i for i, k in enumerate(Kind)}
TIMES = ("expires_at", "valid_from", "valid_to")  # cached per row, in this order


def unit(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (zero rows stay zero), so a dot product is the cosine that
    the protocol's `dense` promises: embedders' vectors already are, others may not be."""
    v = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    out: np.ndarray = np.divide(v, norms, out=np.zeros_like(v), where=norms > 0)
    return out


class Slab:
    """Vectors of one scope and key kind in a growable float32 matrix (a cache of `memory_keys`).

    Each row also caches what visibility depends on (its memory's kind, expiry and validity,
    and whether the key and memory still exist), so a search outside a write filters in numpy
    instead of asking the database about each candidate. The cache is exact as of the
    `keys_version` / `rows_version` it was refreshed at: new keys are loaded by seq, deleted
    ones cleared from `key_tombstones`, and a changed row (`rows_version`) reloads the
    attributes of the whole slab.

    A `rich` slab (the `text` key, which every memory has) also keeps the `Candidate` of each
    row, loaded with it and reloaded with the attributes: the fields ranking reads for the
    whole candidate pool of a search.
    """

    def __init__(self, dim: int, rich: bool = False) -> None:
        # Empty until the first load, which sizes it (`_grow` doubles after that): a service
        # holds a slab per key kind of every scope it searched, most of a few rows, and a
        # fixed start of 1024 rows reserved 1.5 MB for each.
        cap = 0
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
        self.codes = np.zeros(cap, dtype=np.int64)  # per row, a number for its memory id
        self._code: dict[str, int] = {}
        self.latest = np.zeros(0, dtype=np.int64)  # per memory number, its latest row
        self.ann: Ann | None = None  # the HNSW index over these rows, at large scopes
        self.rich = rich
        self.cands: list[Candidate | None] = []  # per row, when rich
        # restored from a file: the CANDIDATE_COLUMNS (but the id) as stored, one list per
        # column, and each row's place in them (-1: none, or built into `cands` since)
        self.cold: list[list[Any]] | None = None
        self.cold_at = np.zeros(0, dtype=np.int64)
        self.dialect: Dialect | None = None
        self.row_of: dict[str, int] = {}          # memory id -> its latest row, when rich
        self.n = 0
        self.max_seq = 0
        self.version = -1
        self.rows_version = -1  # the rows_version the attributes are exact for; -1: unknown
        self.tomb_max = -1      # the last tombstone applied; -1: not read yet
        self.erasures = -1      # the database's erasure count when it was last exact
        self.saved_n = 0        # its rows when last saved to (or loaded from) a file
        self.changes = 0        # counts the changes to its rows (added, killed, attributes)
        self.ann_at = -1        # `changes` when `ann` was last brought up to date

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows in all (a new slab whose count is known): a large first load
        then fills its arrays in place, where doubling them as chunks come would copy each
        one at every step and leave up to half of it unused."""
        if rows > len(self.seqs):
            self._grow(rows, rows)

    def _grow(self, need: int, cap: int = 0) -> None:
        cap = cap or max(need, 2 * len(self.seqs))
        self.mat = np.resize(self.mat, (cap, self.mat.shape[1]))
        for name in ("seqs", "codes", "alive", "ok", "kind", *TIMES):
            setattr(self, name, np.resize(getattr(self, name), cap))

    def append(self, seqs: list[int], mids: list[str], vecs: np.ndarray,
               attrs: Sequence[Sequence[Any]] = (), d: Dialect | None = None) -> None:
        """Add rows in seq order; `attrs` holds (kind, expires_at, valid_from, valid_to) each,
        followed in a rich slab by the CANDIDATE_COLUMNS (read with dialect `d`)."""
        need = self.n + len(seqs)
        self.changes += 1
        if need > len(self.seqs):
            self._grow(need)
        self.mat[self.n:need] = unit(vecs)
        self.seqs[self.n:need] = seqs
        self.alive[self.n:need] = True
        self.ok[self.n:need] = True
        if attrs:
            self._set_attrs(np.arange(self.n, need), attrs)
        self.memory_ids.extend(mids)
        code = self._code
        self.codes[self.n:need] = [code.setdefault(mid, len(code)) for mid in mids]
        if len(code) > len(self.latest):
            grown = np.full(max(len(code), 2 * len(self.latest)), -1, dtype=np.int64)
            grown[:len(self.latest)] = self.latest
            self.latest = grown
        self.latest[self.codes[self.n:need]] = np.arange(self.n, need)
        if self.rich:
            self.cands.extend(self._candidates(attrs, d) if attrs else [None] * len(mids))
            if self.cold is not None:
                self.cold_at = np.concatenate([self.cold_at, np.full(len(mids), -1, np.int64)])
            for i, mid in enumerate(mids, start=self.n):
                self.row_of[mid] = i
        self.n = need
        if seqs:
            self.max_seq = max(self.max_seq, max(seqs))

    @staticmethod
    def _candidates(attrs: Sequence[Sequence[Any]], d: Dialect | None) -> list[Candidate | None]:
        assert d is not None, "a rich slab's rows are read with their dialect"
        width = len(CANDIDATE_COLUMNS)
        out: dict[str, Candidate] = {}
        read_candidates(d, [a[4:4 + width] for a in attrs], out)
        return [out.get(a[4]) for a in attrs]

    def candidates(self, ids: Sequence[str]) -> tuple[dict[str, Candidate], list[str]]:
        """The cached `Candidate` of each id, and the ids it does not hold."""
        rows = list(map(self.row_of.get, ids))
        if None not in rows:
            got = list(map(self.cands.__getitem__, cast(list[int], rows)))
            if all(got):  # each held and built (the usual case): no Python step per id
                return dict(zip(ids, got, strict=True)), []  # type: ignore[arg-type]
        found: dict[str, Candidate] = {}
        missing: list[str] = []
        cold: list[tuple[str, int]] = []
        cands = self.cands
        for mid, i in zip(ids, rows, strict=True):  # the rows found above
            c = cands[i] if i is not None else None
            if c is not None:
                found[mid] = c
            elif i is not None and self.cold is not None and self.cold_at[i] >= 0:
                cold.append((mid, i))
            else:
                missing.append(mid)
        if cold:  # restored from a file and not built yet: built now
            self._build([i for _, i in cold])
            for mid, i in cold:
                found[mid] = cands[i]  # type: ignore[assignment]
        return found, missing

    def _build(self, rows: Sequence[int]) -> None:
        """The `Candidate` of rows still held as read from a file (`cold`)."""
        assert self.dialect is not None and self.cold is not None
        at = self.cold_at[list(rows)].tolist()
        mids = [self.memory_ids[i] for i in rows]
        out: dict[str, Candidate] = {}
        read_candidates(self.dialect, zip(mids, *([col[j] for j in at] for col in self.cold),
                                          strict=True), out)
        for i, mid in zip(rows, mids, strict=True):
            self.cands[i] = out[mid]
        self.cold_at[list(rows)] = -1

    def warm(self, limit: int) -> bool:
        """Build the candidates of up to `limit` more rows restored from a file; False once
        none is left (then the raw columns are dropped). Call with the cache's lock held."""
        if self.cold is None:
            return False
        rows = np.flatnonzero(self.cold_at >= 0)[:limit]
        if len(rows):
            self._build(rows.tolist())
        if len(rows) < limit:
            self.cold = None
            return False
        return True

    def _set_attrs(self, idx: np.ndarray, attrs: Sequence[Sequence[Any]]) -> None:
        self.kind[idx] = [_KIND_CODES.get(a[0], -1) for a in attrs]
        for col, name in enumerate(TIMES, start=1):
            getattr(self, name)[idx] = np.array([a[col] for a in attrs], dtype=np.float64)

    def _put_attrs(self, idx: np.ndarray, attrs: Sequence[Sequence[Any]], d: Dialect | None) -> None:
        """Set rows' attributes and, in a rich slab, their candidates (built again: a cold
        row's pending build is done)."""
        self._set_attrs(idx, attrs)
        if self.rich:
            for i, c in zip(idx.tolist(), self._candidates(attrs, d), strict=True):
                self.cands[i] = c
            if self.cold is not None:
                self.cold_at[idx] = -1

    def rows_of(self, seqs: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slab row of each seq (seqs are stored ascending) and which of them are held."""
        want = np.asarray(seqs, dtype=np.int64)
        # looked up in ascending order (each search starts where the last ended: at 1M rows,
        # a third of the time of HNSW's unordered seqs), answered in the order asked
        order = np.argsort(want, kind="stable")
        pos = np.empty(len(want), dtype=np.int64)
        pos[order] = np.searchsorted(self.seqs[:self.n], want[order])
        held = pos < self.n
        held[held] = self.seqs[pos[held]] == want[held]
        return pos, held

    def kill(self, seqs: Sequence[int]) -> None:
        """Rows whose key was deleted: gone from every search, and their vector and cached
        text cleared (the key may have been erased)."""
        pos, held = self.rows_of(seqs)
        rows = pos[held]
        self.changes += 1
        self.alive[rows] = False
        self.mat[rows] = 0.0
        if self.rich:
            for i in rows.tolist():
                self.cands[i] = None
            if self.cold is not None:
                self.cold_at[rows] = -1

    def reset_attrs(self, rows: Sequence[Sequence[Any]], d: Dialect | None = None) -> None:
        """Replace every row's attributes: `rows` are (seq, kind, expires, valid_from, valid_to,
        and in a rich slab the CANDIDATE_COLUMNS) of the keys whose memory is in scope and not
        deleted; the others are not ok."""
        self.ok[:self.n] = False
        self.changes += 1
        if not rows:
            return
        pos, held = self.rows_of([r[0] for r in rows])
        idx = pos[held]
        self.ok[idx] = True
        attrs = [r[1:] for r, h in zip(rows, held, strict=True) if h]
        self._put_attrs(idx, attrs, d)

    def update_attrs(self, rows: Sequence[Sequence[Any]], d: Dialect | None = None) -> None:
        """Replace the attributes of some rows: `rows` are (seq, ok, kind, expires, valid_from,
        valid_to, and in a rich slab the CANDIDATE_COLUMNS), `ok` whether its memory is still
        in scope and not deleted; a seq the slab does not hold is ignored."""
        if not rows:
            return
        pos, held = self.rows_of([r[0] for r in rows])
        idx = pos[held]
        if not len(idx):
            return
        self.changes += 1
        kept = [r for r, h in zip(rows, held.tolist(), strict=True) if h]
        self.ok[idx] = [bool(r[1]) for r in kept]
        attrs = [r[2:] for r in kept]
        self._put_attrs(idx, attrs, d)

    def visible(self, query: Query, rows: np.ndarray | None = None) -> np.ndarray:
        """Rows `query` may see (of all rows, or of `rows`), except for its metadata
        conditions: the visibility rule (`records.time_bounds`, the same bounds the SQL
        renders) on the cached attributes."""
        at = slice(0, self.n) if rows is None else rows
        mask = self.alive[at] & self.ok[at]
        for b in time_bounds(Seen.VISIBLE, query.now, query.as_of):
            col: np.ndarray = getattr(self, b.column)[at]
            t = b.at.timestamp()
            # NULL (NaN) or within the bound, in one comparison: NaN compares false
            mask &= ~(col <= t) if b.op == ">" else ~(col > t)
        if query.kinds:
            codes = [_KIND_CODES[k.value] for k in query.kinds]
            mask &= self.kind[at] == codes[0] if len(codes) == 1 else np.isin(self.kind[at], codes)
        return mask

    def visible_ids(self, query: Query, ids: Sequence[str]) -> set[str]:
        """The ids (of memories) `query` may see, except for its metadata conditions, by the
        latest row of each (a rich slab); an id it does not hold is not visible."""
        held = np.fromiter(map(self.row_of.get, ids, repeat(-1)), np.int64, len(ids))
        mask = held >= 0
        mask[mask] = self.visible(query, held[mask])
        return set(compress(ids, mask.tolist()))

    def cosines(self, ids: Sequence[str], vector: np.ndarray) -> list[tuple[str, float]]:
        """The cosine of each id's latest live row with `vector` (a unit vector), for the ids
        the slab holds a live row of (a memory with several, `fact` keys: its latest, a lower
        bound of its best)."""
        codes = np.fromiter(map(self._code.get, ids, repeat(-1)), np.int64, len(ids))
        held = np.flatnonzero(codes >= 0)
        rows = self.latest[codes[held]]
        live = rows >= 0
        live[live] = self.alive[rows[live]] & self.ok[rows[live]]
        sims = self.mat[rows[live]] @ vector
        return list(zip(map(ids.__getitem__, held[live].tolist()), sims.tolist(), strict=True))

    def first_per_memory(self, rows: np.ndarray) -> np.ndarray:
        """`rows` (best first) keeping each memory's first row only."""
        if not len(rows):
            return rows
        _, first = np.unique(self.codes[rows], return_index=True)
        first.sort()
        kept: np.ndarray = rows[first]
        return kept

    # -- its file (the SQLite store saves a large slab beside the database) ------------------

    def state(self, d: Dialect) -> tuple[dict[str, Any], list[np.ndarray]] | None:
        """The slab as numbers and arrays (`restore` makes it again); None when a string holds
        a NUL (it is not saved). A dead row's memory id is left out, as its vector and text."""
        n = self.n
        alive = self.alive[:n]
        ids = pack([m if a else "" for m, a in zip(self.memory_ids, alive.tolist(), strict=True)])
        if ids is None:
            return None
        head = {"n": n, "dim": int(self.mat.shape[1]), "rich": self.rich,
                "max_seq": self.max_seq, "version": self.version,
                "rows_version": self.rows_version, "tomb_max": self.tomb_max}
        # copies, but of the vectors: a later `kill` zeroes rows in place (and is applied
        # again from the tombstones after `tomb_max`), while the rest may change otherwise
        arrays = [self.mat[:n], self.seqs[:n].copy(), alive.copy(), self.ok[:n].copy(),
                  self.kind[:n].copy(), *(getattr(self, t)[:n].copy() for t in TIMES),
                  self.codes[:n].copy(), ids]
        if self.rich:
            held = np.zeros(n, dtype=bool)
            rows: list[tuple[Any, ...]] = []  # the CANDIDATE_COLUMNS but the id, as stored
            for i in np.flatnonzero(alive).tolist():
                raw = self._raw(i, d)
                if raw is not None:
                    held[i] = True
                    rows.append(raw)
            cols = list(zip(*rows, strict=True)) if rows else [()] * 9
            strings: list[np.ndarray] = []  # user, agent and session ids, name, text; role
            for col in (*cols[:5], cols[8]):
                packed = pack([v or "" for v in col])
                if packed is None:
                    return None
                strings += [packed, np.array([v is None for v in col], dtype=bool)]
            arrays += [*strings[:10], held,
                       np.array([np.nan if v is None else v for v in cols[5]], dtype=np.float64),
                       np.array(cols[6], dtype=np.float64), np.array(cols[7], dtype=np.float64),
                       *strings[10:]]
        return head, arrays

    def _raw(self, i: int, d: Dialect) -> tuple[Any, ...] | None:
        """Row `i`'s CANDIDATE_COLUMNS but the id, as the table holds them (None: none held)."""
        c = self.cands[i]
        if c is not None:
            s = c.scope
            return (s.user_id, s.agent_id, s.session_id, c.name, c.text,
                    d.opt_time(c.observed_at), d.time(c.created_at), c.importance, c.role)
        if self.cold is not None and self.cold_at[i] >= 0:
            j = int(self.cold_at[i])
            return tuple(col[j] for col in self.cold)
        return None

    @classmethod
    def restore(cls, head: dict[str, Any], arrays: Sequence[np.ndarray], d: Dialect) -> Slab:
        """The slab `state` gave (raises ValueError, KeyError or TypeError if it is not one).
        Its arrays are used as they are (writable views of the file's bytes, no copy); the
        candidates stay raw columns (`cold`) until a search asks for them."""
        n, dim, rich = int(head["n"]), int(head["dim"]), bool(head["rich"])
        slab = cls(dim, rich=rich)
        mat, seqs, alive, ok, kind, *times, codes, ids = arrays[:10]
        if n < 1 or mat.shape != (n, dim) or \
                any(a.shape != (n,) for a in (seqs, alive, ok, kind, *times, codes)):
            raise ValueError("the arrays do not match the header")
        slab.mat = mat
        for name, a in zip(("seqs", "alive", "ok", "kind", *TIMES, "codes"),
                           (seqs, alive, ok, kind, *times, codes), strict=True):
            if a.dtype != getattr(slab, name).dtype:
                raise ValueError(f"{name} is not of its type")
            setattr(slab, name, a)
        slab.memory_ids = unpack(ids, n)
        if len(slab.memory_ids) != n:
            raise ValueError("the ids do not match the header")
        # built in C (the last row of an id wins, as in `append`); "" is a dead row's blank id
        slab._code = dict(zip(slab.memory_ids, codes.tolist(), strict=True))
        slab._code.pop("", None)
        slab.latest = np.full(int(codes.max()) + 1, -1, dtype=np.int64)
        slab.latest[codes] = np.arange(n)
        slab.n = n
        slab.max_seq, slab.version = int(head["max_seq"]), int(head["version"])
        slab.rows_version, slab.tomb_max = int(head["rows_version"]), int(head["tomb_max"])
        if rich:
            rest = arrays[10:]
            if len(rest) != 16:
                raise ValueError("the candidates do not match the header")
            held = rest[10]
            if held.shape != (n,):
                raise ValueError("the candidates do not match the header")
            m = int(held.sum())

            def strings(at: int) -> list[Any]:
                values = unpack(rest[at], m) if m else []
                none = rest[at + 1].tolist()
                return [None if z else v for v, z in zip(values, none, strict=True)]
            cold: list[list[Any]] = [strings(2 * j) for j in range(5)]
            cold.append([None if math.isnan(t) else t for t in rest[11].tolist()])
            cold += [rest[12].tolist(), rest[13].tolist(), strings(14)]
            if any(len(col) != m for col in cold):
                raise ValueError("the candidates do not match the header")
            slab.cold, slab.dialect = cold, d
            slab.cold_at = np.full(n, -1, dtype=np.int64)
            slab.cold_at[held] = np.arange(m)
            slab.cands = [None] * n
            slab.row_of = dict(zip(slab.memory_ids, range(n), strict=True))
            slab.row_of.pop("", None)
        return slab

    def live_rows(self) -> np.ndarray:
        """Rows whose key and memory exist (whatever the time and kind)."""
        return np.flatnonzero(self.alive[:self.n] & self.ok[:self.n])

    def top(self, query: Query, vector: np.ndarray, k: int,
            visible: Callable[[list[str]], set[str]]) -> list[tuple[str, float]]:
        """The best `k` memories `query` may see, each by its best key, from an exact cache.
        Without metadata conditions the cache decides; with them, `visible` (the database)
        checks the best candidates in growing pools. Call with the cache's lock held."""
        rows = np.flatnonzero(self.visible(query))
        vector = unit(vector)
        sims = self.mat[rows] @ vector if len(rows) < self.n // 2 else (self.mat[:self.n] @ vector)[rows]
        mids = self.memory_ids
        pool = min(len(rows), k if not query.conditions else 4 * k + 64)
        while True:
            top = np.argpartition(-sims, pool - 1)[:pool] if pool < len(rows) else np.arange(len(rows))
            top = top[np.argsort(-sims[top], kind="stable")]
            _, first = np.unique(self.codes[rows[top]], return_index=True)  # best key per memory
            top = top[np.sort(first)]
            ids = list(map(mids.__getitem__, rows[top].tolist()))
            best = list(zip(ids, sims[top].tolist(), strict=True))  # distinct ids, best first
            if query.conditions:
                seen = visible(ids)
                best = [hit for hit in best if hit[0] in seen]
            if len(best) >= k or pool >= len(rows):
                return best[:k]
            pool = min(len(rows), pool * 4)


def evict(slabs: OrderedDict[tuple[Any, ...], Slab], budget: int, keep: tuple[Any, ...]) -> None:
    """Drop the least recently used slabs (keyed by scope fields, then key name) while all of
    them hold more than `budget` rows, never one of the scope `keep`: a service searching
    many small scopes keeps them all (a count of slabs would reload each one as the searches
    come round), and a scope larger than the budget is still cached while it is searched."""
    total = sum(slab.n for slab in slabs.values())
    for key in list(slabs):
        if total <= budget:
            return
        if key[:-1] != keep:
            total -= slabs.pop(key).n

"""Dense search over an exact cache (`Slab`), written once for both stores: a scan of the
matrix while the scope is small, its HNSW index (ann.py) above the ANN threshold, and the
completion of a large scope's lists from the search's other candidates. Call each with the
cache's lock held (but `complete`, which takes it)."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..base import Query
from . import ann
from .slab import Slab, unit

log = logging.getLogger("engram.store")

Visible = Callable[[list[str]], set[str]]  # which ids a query may see (the database decides)


def search(slab: Slab, query: Query, vector: np.ndarray, k: int, visible: Visible,
           ann_threshold: int, ann_file: Path | None = None,
           name: tuple[Any, ...] = ()) -> list[tuple[str, float]]:
    """The best `k` memories `query` may see, each by its best key: through the slab's HNSW
    index when it holds more than `ann_threshold` rows (approximate; saved to and loaded from
    `ann_file` when given; `name` is for the log), else, or when the index finds too few, an
    exact scan. `vector` is a unit vector."""
    if k > 0 and slab.n > ann_threshold and ann.available():
        hits = ann_top(slab, follow(slab, ann_file, name), vector, k, query, visible)
        if hits is not None:
            return hits
    return slab.top(query, vector, k, visible)


# Slabs whose first HNSW index a search is building outside the cache's lock (`search_aside`)
_building: weakref.WeakSet[Slab] = weakref.WeakSet()
os.register_at_fork(after_in_child=_building.clear)  # a parent's build does not go on here
BUILD_CHUNK = 50_000  # rows copied and added to the index at a time


def search_aside(slab: Slab, lock: threading.Lock, query: Query, vector: np.ndarray, k: int,
                 visible: Visible, ann_threshold: int, name: tuple[Any, ...],
                 build: Callable[[Callable[[], None]], object]) -> list[tuple[str, float]]:
    """`search` for a cache with no files (PostgreSQL), called without `lock`: a large scope's
    HNSW index is built by `build` (which runs a job on a background thread; None: it will
    not), outside the lock (at 1M keys, minutes), while the scope's searches scan exactly;
    no search waits for a build, nor does any other scope's. Once built, later changes are
    brought in under the lock, as in `search`."""
    large = k > 0 and slab.n > ann_threshold and ann.available()
    with lock:
        # (unchanged since `follow` brought the index up to date: as dead as it was found then;
        # counting it is a pass over every row, too slow for every search of a large scope)
        if large and slab.ann is not None and slab.ann_at != slab.changes \
                and _mostly_dead(slab, slab.ann):
            slab.ann = None  # built again aside, not in `follow` under the lock
        start = large and slab.ann is None and slab not in _building
        if start:
            _building.add(slab)
    if start and build(lambda: _build_aside(slab, lock, name)) is None:
        with lock:
            _building.discard(slab)
    with lock:
        return search(slab, query, vector, k, visible,
                      slab.n if slab.ann is None else ann_threshold, None, name)


def _build_aside(slab: Slab, lock: threading.Lock, name: tuple[Any, ...]) -> None:
    """Build the slab's index from its live rows, outside the lock but for reading them: a
    row killed meanwhile stays in the index (a search filters it by the slab, and the index is
    built again once a quarter of it is dead), one added is brought in by `follow`."""
    try:
        with lock:
            live, mat = slab.live_rows(), slab.mat  # `append` grows a new matrix: this one stays
            seqs = slab.seqs[live]
        index = ann.Ann(mat.shape[1])
        for i in range(0, len(live), BUILD_CHUNK):
            index.add(seqs[i:i + BUILD_CHUNK], mat[live[i:i + BUILD_CHUNK]])
        log.info("built an ANN index over %d keys of %s", len(index), name)
        with lock:
            if slab.ann is None:
                slab.ann, slab.ann_at = index, -1  # `follow` brings in what changed since
    finally:
        with lock:
            _building.discard(slab)


def _mostly_dead(slab: Slab, index: ann.Ann) -> bool:
    """Whether more than MAX_DEAD of the index's keys are no longer live rows of the slab."""
    live = slab.live_rows()
    indexed = int(np.count_nonzero(slab.seqs[live] <= index.max_seq))
    return len(index) - indexed > ann.MAX_DEAD * len(index)


def follow(slab: Slab, path: Path | None, name: tuple[Any, ...] = ()) -> ann.Ann:
    """The slab's HNSW index, loaded from `path` or built from the live rows, with the rows
    added since; built again once a quarter of it is dead."""
    index = slab.ann
    if index is not None and slab.ann_at == slab.changes:
        return index  # no row changed since it was brought up to date
    live = slab.live_rows()
    if index is not None:
        if _mostly_dead(slab, index):
            index = None  # rebuild
    elif path is not None:
        index = ann.Ann.load(path, slab.mat.shape[1])
    if index is None:
        index = ann.Ann(slab.mat.shape[1])
        index.add(slab.seqs[live], slab.mat[live])
        log.info("built an ANN index over %d keys of %s", len(index), name)
        if path is not None:
            index.save(path)
    new = live[slab.seqs[live] > index.max_seq]
    index.add(slab.seqs[new], slab.mat[new])
    slab.ann, slab.ann_at = index, slab.changes
    return index


def ann_top(slab: Slab, index: ann.Ann, vector: np.ndarray, k: int, query: Query,
            visible: Visible) -> list[tuple[str, float]] | None:
    """The best `k` visible memories among the index's nearest keys, scored exactly from the
    matrix; None when the visible ones are too few for the index to find them (a scan does it
    better)."""
    count = min(len(index), k + k // 8 + 32 if not query.conditions else 4 * k + 64)
    while True:
        seqs = index.search(vector, count)
        pos, held = slab.rows_of(seqs)
        rows = pos[held]
        rows = rows[slab.visible(query, rows)]  # of these rows only: not a scan of all
        sims = slab.mat[rows] @ vector
        order = np.argsort(-sims, kind="stable")
        rows, sims = rows[order], sims[order]
        _, first = np.unique(slab.codes[rows], return_index=True)  # best key per memory
        first.sort()
        best = dict(zip(map(slab.memory_ids.__getitem__, rows[first].tolist()),
                        sims[first].tolist(), strict=True))
        if query.conditions:
            seen = visible(list(best))
            best = {mid: s for mid, s in best.items() if mid in seen}
        if len(best) >= k or count >= len(index):
            return list(best.items())[:k]
        if 4 * count > len(index) // 2:
            return None
        count *= 4


def complete(slabs: Mapping[str, Slab | None], lock: threading.Lock, vector: np.ndarray, k: int,
             ann_threshold: int, found: dict[str, list[tuple[str, float]]]) -> None:
    """Each dense key's list of a large scope (its slab of `slabs`, by key name), from the
    HNSW index, completed from the pool: a candidate high in another retriever's list (so
    visible to the query) that the index missed, but whose exact cosine beats the list's last,
    joins it, as it would in an exact search. The index can miss a small cluster of memories
    far from the rest of the scope (a conversation among a million others); its words or the
    other key still bring them to the pool. LoCoMo in a 1M haystack (bench/locomo.py
    --distractors): R@10 0.579 -> 0.711, the exact scan's 0.698; at 100k, the exact scan's
    recall."""
    # the first quarter of each list: a candidate lower in all of them does not reach the
    # results, and scoring every candidate cost ~14 ms a search at 1M (a quarter: ~2 ms)
    pool = list(dict.fromkeys(mid for hits in found.values() for mid, _ in hits[:k // 4]))
    v = unit(np.asarray(vector, dtype=np.float32))
    for key, slab in slabs.items():
        hits = found.get(key)
        with lock:
            if hits is None or slab is None or slab.n <= ann_threshold:
                continue
            have = {mid for mid, _ in hits}
            scored = slab.cosines([mid for mid in pool if mid not in have], v)
        last = hits[-1][1] if len(hits) >= k else -np.inf
        joined = [(mid, sim) for mid, sim in scored if sim > last]
        if joined:
            found[key] = sorted(hits + joined, key=lambda hit: -hit[1])[:k]

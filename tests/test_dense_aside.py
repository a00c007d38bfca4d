"""A large scope's HNSW index built aside (store/index/dense.py, `search_aside`, PostgreSQL's
path): a search of an unchanged slab does not count its dead rows again (a pass over every
row: ~8 ms a key at 1M), and once a quarter of the index is dead it is still built again."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from conformance.test_store import q
from engram.model import Scope
from engram.store.index import ann, dense
from engram.store.index.slab import Slab

DIM = 16
pytestmark = pytest.mark.skipif(not ann.available(),
                                reason="the `ann` extra (usearch) is not installed")


def test_dead_rows_are_counted_after_a_change_only(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(11)
    vectors = rng.normal(size=(400, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    slab = Slab(DIM)
    slab.append(list(range(1, 401)), [f"m{i}" for i in range(400)], vectors,
                [("episodic", None, None, None)] * 400)
    lock = threading.Lock()
    counted: list[int] = []
    mostly_dead = dense._mostly_dead

    def counting(s: Slab, index: ann.Ann) -> bool:
        counted.append(s.changes)
        return mostly_dead(s, index)

    monkeypatch.setattr(dense, "_mostly_dead", counting)
    query = q(Scope("u1"))

    def now(job: Callable[[], None]) -> Any:  # the build, on this thread
        job()
        return True

    def search(i: int) -> list[tuple[str, float]]:
        return dense.search_aside(slab, lock, query, vectors[i], 5, lambda ids: set(ids), 100,
                                  ("u1",), now)

    assert search(3)[0][0] == "m3"  # builds the index
    first = slab.ann
    assert first is not None
    search(4)  # brings it up to date (`follow`)
    counted.clear()
    for i in range(5, 10):
        assert search(i)[0][0] == f"m{i}"
    assert counted == []  # nothing changed: not counted again
    slab.kill(list(range(1, 151)))  # 150 of 400 dead: more than a quarter
    assert search(200)[0][0] == "m200"
    assert counted and slab.ann is not None and slab.ann is not first  # built again
    assert len(slab.ann) == 250
    assert all(int(mid[1:]) >= 150 for mid, _ in search(10))

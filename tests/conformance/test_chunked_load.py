"""A dense cache's first load reads its scope's keys in chunks by seq (store/index/refresh.py,
`CHUNK` and `rest`): the slab it makes is the one a single statement makes, on every store,
and a store's search on a scope of many chunks sees every key."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engram.model import Scope
from engram.store import Store
from engram.store.index import refresh
from engram.store.index.slab import TIMES, Slab

from .test_store import DIM, NOW, U1, put, q, rec

StoreFactory = Any
U2 = Scope("u2")


def _load(store: Store, chunk: int, monkeypatch: pytest.MonkeyPatch) -> Slab:
    """A new slab of U1's `text` keys, loaded as the stores load one, `chunk` keys a read."""
    monkeypatch.setattr(refresh, "CHUNK", chunk)
    keys = store._keys  # type: ignore[attr-defined]
    statements: list[Any] = []

    def run(stmt: Any) -> list[Any]:
        statements.append(stmt)
        return store._read(*stmt)  # type: ignore[attr-defined, no-any-return]

    slab = Slab(DIM, rich=True)
    versions = refresh.versions(run(keys.versions()))
    got = [run(stmt) for stmt in refresh.reads(keys, U1, "text", DIM, slab, attrs=True)]
    assert refresh.apply(slab, keys, DIM, got) is refresh.Applied.DONE
    refresh.rest(slab, keys, U1, "text", DIM, got, run)
    slab.version, slab.rows_version = versions
    slab.reads = len(statements)  # type: ignore[attr-defined]
    return slab


@pytest.fixture
def scopes(store: Store) -> dict[str, list[Any]]:
    """23 memories of U1 between 10 of U2 (a chunk's limit counts the scope's keys only),
    two of U1 deleted and one expired (read with the rest: visibility is the search's)."""
    rng = np.random.default_rng(3)
    mine, theirs = [], []
    for i in range(33):
        if i % 3 == 1 and len(theirs) < 10:
            theirs.append(rec(f"theirs {i}", scope=U2))
        else:
            mine.append(rec(f"mine {i}", importance=0.1 + 0.02 * i))
    mine[5] = replace(mine[5], expires_at=NOW)
    records = [*mine, *theirs]
    vectors = rng.normal(size=(len(records), DIM)).astype(np.float32)
    put(store, *records, vectors=list(vectors))
    with store.write() as tx:
        tx.soft_delete([mine[0].id, mine[17].id], NOW)
    return {"mine": mine, "theirs": theirs}


@pytest.mark.parametrize("chunk", [1, 4, 7, 21])
def test_a_chunked_first_load_makes_the_slab_one_statement_makes(
        store: Store, scopes: dict[str, list[Any]], chunk: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _load(store, 10**9, monkeypatch)
    chunked = _load(store, chunk, monkeypatch)
    assert whole.n == chunked.n == 21  # U1's 23 less the two deleted
    # versions, tombstones, one read per chunk and the short one that ends it
    assert chunked.reads == 2 + 21 // chunk + 1  # type: ignore[attr-defined]
    n = whole.n
    for name in ("seqs", "alive", "ok", "kind", "codes", *TIMES):
        assert np.array_equal(getattr(whole, name)[:n], getattr(chunked, name)[:n],
                              equal_nan=name in TIMES), name
    assert np.array_equal(whole.mat[:n], chunked.mat[:n])
    assert whole.memory_ids == chunked.memory_ids
    assert (whole.max_seq, whole.tomb_max) == (chunked.max_seq, chunked.tomb_max)
    assert whole.cands == chunked.cands and all(whole.cands)
    assert set(whole.memory_ids) == {r.id for r in scopes["mine"]} - \
        {scopes["mine"][0].id, scopes["mine"][17].id}


def test_a_search_sees_every_key_of_a_scope_loaded_in_chunks(
        store_factory: StoreFactory, tmp_path: Path, store: Store,
        scopes: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the store's own path: the first search loads 21 keys 4 at a time; 9 keys added
    by another process then come in chunks too, at the next search."""
    monkeypatch.setattr(refresh, "CHUNK", 4)
    mine = scopes["mine"]
    live = [r for r in mine if r.id not in (mine[0].id, mine[5].id, mine[17].id)]
    probe = np.ones(DIM, dtype=np.float32)
    assert {m for m, _ in store.dense(q(U1, now=NOW), probe, 100)} == {r.id for r in live}
    other = store_factory(tmp_path)
    try:
        late = [rec(f"late {i}") for i in range(9)]
        put(other, *late)
        found = store.dense(q(U1, now=NOW), probe, 100)
        assert {m for m, _ in found} == {r.id for r in [*live, *late]}
    finally:
        other.close()




def test_a_slab_reserved_for_its_count_fills_in_place() -> None:
    """Its arrays are not copied while the rows fit (PostgreSQL's new slabs are counted
    first), and grow as before past them."""
    rng = np.random.default_rng(5)
    vecs = rng.normal(size=(30, DIM)).astype(np.float32)

    def add(slab: Slab, at: int) -> None:
        slab.append(list(range(at + 1, at + 6)), [f"m{i}" for i in range(at, at + 5)],
                    vecs[at:at + 5], [("episodic", None, None, None)] * 5)
    grown, reserved = Slab(DIM), Slab(DIM)
    reserved.reserve(25)
    mat = reserved.mat
    for at in range(0, 25, 5):
        add(grown, at)
        add(reserved, at)
    assert reserved.mat is mat and len(reserved.seqs) == 25
    add(grown, 25)
    add(reserved, 25)
    assert reserved.mat is not mat and reserved.n == 30
    assert np.array_equal(grown.mat[:30], reserved.mat[:30])
    assert np.array_equal(grown.seqs[:30], reserved.seqs[:30])
    assert grown.memory_ids == reserved.memory_ids

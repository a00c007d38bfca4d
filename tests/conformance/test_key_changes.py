"""What changed in a scope's keys since a dense cache's mark (store/index/refresh.py): the
statements each backend builds (`KeyReads`) read the keys added, the keys deleted and the keys
whose memory changed, and nothing else; a second store on the same database stands for
another process."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engram.model import Scope
from engram.store import Store
from engram.store.index import refresh
from engram.store.index.slab import Slab

from .test_store import DIM, NOW, U1, put, q, rec, vec


def refresh_reads(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """From now on, the rows each refresh of a cache reads (tombstones, new keys, changed
    rows), one list a refresh, appended to the list returned."""
    read: list[list[int]] = []
    apply = refresh.apply

    def counting(slab: Slab, k: Any, dim: int, results: Sequence[Sequence[Any]]) -> Any:
        read.append([len(rows) for rows in results])
        return apply(slab, k, dim, results)

    monkeypatch.setattr(refresh, "apply", counting)
    return read

StoreFactory = Any


def _reads(store: Store, slab: Slab, scope: Scope = U1, attrs: bool = True) -> list[list[Any]]:
    keys = store._keys  # type: ignore[attr-defined]
    return [store._read(*stmt)  # type: ignore[attr-defined]
            for stmt in refresh.reads(keys, scope, "text", DIM, slab, attrs)]


def _follow(store: Store, slab: Slab, scope: Scope = U1) -> list[list[Any]]:
    """Bring `slab` up to the store's versions as the stores do; the rows read."""
    keys = store._keys  # type: ignore[attr-defined]
    versions = refresh.versions(store._read(*keys.versions()))  # type: ignore[attr-defined]
    got = _reads(store, slab, scope, attrs=slab.rows_version != versions[1])
    done = refresh.apply(slab, keys, DIM, got)
    if done is refresh.Applied.RELOAD:
        slab.reset_attrs(store._read(*keys.key_attrs(  # type: ignore[attr-defined]
            scope, "text", DIM, slab.max_seq, slab.rich)), keys.dialect)
    assert done is not refresh.Applied.PRUNED
    slab.version, slab.rows_version = versions
    return got


def _seqs(rows: Sequence[Sequence[Any]]) -> list[int]:
    return [int(row[0]) for row in rows]


@pytest.fixture
def other(store_factory: StoreFactory, tmp_path: Path, store: Store) -> Any:
    """Another store on the same database (another process)."""
    second = store_factory(tmp_path)
    yield second
    second.close()


def test_a_mark_reads_what_was_added_deleted_and_changed_since(store: Store, other: Store) -> None:
    records = [rec(f"note {i}") for i in range(5)]
    put(store, *records, vectors=[vec(1.0, 0.1 * i) for i in range(5)])
    slab = Slab(DIM, rich=True)
    first = _follow(store, slab)
    assert len(first[1]) == 5 and len(first) == 2  # a new slab: its keys come with their rows
    assert slab.n == 5 and slab.tomb_max >= 0
    assert _reads(store, slab) == [[], [], []]  # nothing since

    late = rec("note late")
    put(other, late, vectors=[vec(0.0, 1.0)])
    with other.write() as tx:
        tx.soft_delete([records[0].id], NOW)
    with other.write() as tx:
        tx.update(replace(records[1], text="note one, rewritten", importance=0.9))
    dead, added, changed = _reads(store, slab)
    held = slab.seqs[:slab.n]
    assert [int(d[1]) for d in dead] == [int(held[0])]  # the soft-deleted memory's key
    assert [a[1] for a in added] == [late.id]
    assert _seqs(changed) == [int(held[1])]  # the rewritten one only (the deleted has no key)
    assert bool(changed[0][1])  # still live and in scope

    _follow(store, slab)
    found, missing = slab.candidates([records[1].id, late.id])
    assert not missing
    assert (found[records[1].id].text, found[records[1].id].importance) == ("note one, rewritten", 0.9)
    seen = slab.visible_ids(q(U1), [r.id for r in [*records, late]])
    assert seen == {r.id for r in [*records[1:], late]}
    assert _reads(store, slab) == [[], [], []]


def test_a_row_that_leaves_visibility_is_read_as_changed(store: Store, other: Store) -> None:
    records = [rec(f"fact {i}") for i in range(3)]
    put(store, *records)
    slab = Slab(DIM, rich=True)
    _follow(store, slab)
    with other.write() as tx:  # superseded: its validity ends, its keys stay
        tx.update(replace(records[2], valid_to=NOW - timedelta(minutes=1)))
    changed = _follow(store, slab)[2]
    assert len(changed) == 1
    assert slab.visible_ids(q(U1), [r.id for r in records]) == {records[0].id, records[1].id}
    # another scope's change is read (a row may have left this one) but changes nothing here
    stranger = rec("elsewhere", scope=Scope("u2"))
    put(other, stranger)
    with other.write() as tx:
        tx.update(replace(stranger, importance=0.7))
    got = _follow(store, slab)
    assert slab.n == 3 and all(not bool(row[1]) for row in got[2])


def test_more_changed_rows_than_a_share_of_the_slab_reload_them_all(store: Store,
                                                                    other: Store) -> None:
    n = refresh.CHANGED_MIN + 20
    records = [rec(f"item {i}") for i in range(n)]
    put(store, *records, vectors=[vec(1.0, i / n) for i in range(n)])
    slab = Slab(DIM, rich=True)
    _follow(store, slab)
    with other.write() as tx:
        for r in records[:refresh.CHANGED_MIN + 10]:
            tx.update(replace(r, importance=0.25))
    keys = store._keys  # type: ignore[attr-defined]
    assert refresh.apply(slab, keys, DIM, _reads(store, slab)) is refresh.Applied.RELOAD
    slab.rows_version = -1  # what a store does until the reload is read
    _follow(store, slab)  # an unknown rows version reads every row's attributes
    found, _ = slab.candidates([r.id for r in records])
    assert [found[r.id].importance for r in records] == \
        [0.25] * (refresh.CHANGED_MIN + 10) + [0.5] * 10
    assert slab.visible_ids(q(U1), [r.id for r in records]) == {r.id for r in records}


def test_another_stores_one_row_update_reloads_that_row_alone(
        store: Store, other: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's own search path: after another process changes one memory of a cached scope
    of 300, the next search reads that memory's key and no other row."""
    records = [rec(f"entry {i}") for i in range(300)]
    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(300, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    put(store, *records, vectors=list(vectors))
    assert store.dense(q(U1), vectors[3], 5)[0][0] == records[3].id  # loads the cache
    read = refresh_reads(monkeypatch)
    with other.write() as tx:
        tx.update(replace(records[3], text="entry three, rewritten", importance=0.9))
    assert store.dense(q(U1), vectors[3], 5)[0][0] == records[3].id
    assert read == [[0, 0, 1]]  # no tombstone, no new key, one changed row
    got = store.candidates([records[3].id], q(U1))[records[3].id]
    assert (got.text, got.importance) == ("entry three, rewritten", 0.9)
    with other.write() as tx:  # gone from visibility, by the same path
        tx.update(replace(records[3], valid_to=NOW - timedelta(minutes=1)))
    assert records[3].id not in {m for m, _ in store.dense(q(U1), vectors[3], 5)}
    assert read[1:] == [[0, 0, 1]]


def test_a_database_made_before_the_row_marks_upgrades_in_place(
        store_factory: StoreFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows written before migration 0009 carry no mark (0): the first change after the upgrade
    marks its row, and a cache reads that row alone."""
    from engram.store.postgres import schema as pg_schema
    from engram.store.sqlite import schema as lite_schema

    where = tmp_path / "old"
    records = [rec(f"older {i}") for i in range(5)]
    with monkeypatch.context() as m:
        for mod in (lite_schema, pg_schema):
            m.setattr(mod, "MIGRATIONS", [step for step in mod.MIGRATIONS
                                          if step[0] != "0009_row_changes"])
        old = store_factory(where)
        assert "0009_row_changes" not in old.migrations()
        put(old, *records)
        old.close()
    upgraded, other = store_factory(where), store_factory(where)
    try:
        assert "0009_row_changes" in upgraded.migrations()
        slab = Slab(DIM, rich=True)
        _follow(upgraded, slab)
        with other.write() as tx:
            tx.update(replace(records[2], importance=0.8))
        assert _seqs(_follow(upgraded, slab)[2]) == [int(slab.seqs[2])]
        assert slab.candidates([records[2].id])[0][records[2].id].importance == 0.8
    finally:
        upgraded.close()
        other.close()

"""The SQLite store's HNSW index for large scopes (store/index/ann.py): it answers like the
exact scan on a fixture, honours deletes, erasure, scopes and kinds, follows new keys, and is
saved beside the database and loaded by the next process instead of being built again.

The fixture writes synthetic unit vectors (clustered, deterministic) through the store's own
write transaction; the threshold is lowered so that a few hundred keys use the index.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from engram.model import Kind, MemoryRecord, Scope, new_id
from engram.pipeline.text import content_hash
from engram.store import Key, Lexical
from engram.store.base import Query
from engram.store.index import ann as ann_module
from engram.store.sqlite import SQLiteStore

DIM = 32
NOW = datetime(2025, 6, 1, tzinfo=UTC)


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v, axis=-1, keepdims=True)).astype(np.float32)


def vectors(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((12, DIM))
    return unit(centers[rng.integers(0, 12, n)] + 0.5 * rng.standard_normal((n, DIM)))


def fill(store: SQLiteStore, scope: Scope, vecs: np.ndarray, kind: Kind = Kind.EPISODIC) -> list[str]:
    ids = []
    with store.write() as tx:
        for i, v in enumerate(vecs):
            text = f"memory {scope.user_id} {kind.value} {i}"
            rec = MemoryRecord(id=new_id(), scope=scope, kind=kind, text=text, metadata={},
                               importance=0.5, role="user", name=None, created_at=NOW,
                               updated_at=NOW, observed_at=NOW - timedelta(minutes=i),
                               valid_from=NOW, content_hash=content_hash(text))
            tx.insert(rec, [Key("text", v)], Lexical(text))
            ids.append(rec.id)
    return ids


def q(user: str, kinds: tuple[Kind, ...] | None = None) -> Query:
    return Query(scope=Scope(user_id=user), now=NOW + timedelta(days=1), kinds=kinds)


def count_adds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of keys of each `Ann.add` from now on (none: every index was loaded)."""
    added: list[int] = []
    real_add = ann_module.Ann.add
    monkeypatch.setattr(ann_module.Ann, "add",
                        lambda self, seqs, vecs: (added.append(len(seqs)), real_add(self, seqs, vecs)))
    return added


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "engram.db"


@pytest.fixture
def filled(path: Path) -> dict[str, list[str]]:
    store = SQLiteStore(path)
    try:
        return {"a": fill(store, Scope(user_id="a"), vectors(600, 1)),
                "b": fill(store, Scope(user_id="b"), vectors(300, 2)),
                "a-facts": fill(store, Scope(user_id="a"), vectors(100, 3), Kind.SEMANTIC)}
    finally:
        store.close()


def test_the_index_answers_like_the_exact_scan(path: Path, filled: dict[str, list[str]]) -> None:
    approx, exact = SQLiteStore(path, ann_threshold=100), SQLiteStore(path, ann_threshold=10**9)
    try:
        overlap = []
        for query in vectors(30, 9):
            a = approx.dense(q("a"), query, 10)
            e = exact.dense(q("a"), query, 10)
            assert len(a) == 10
            overlap.append(len({m for m, _ in a} & {m for m, _ in e}) / 10)
            scores = dict(e)
            for mid, s in a:  # every score is the exact cosine, best first
                if mid in scores:
                    assert s == pytest.approx(scores[mid], abs=1e-6)
            assert [s for _, s in a] == sorted((s for _, s in a), reverse=True)
        assert np.mean(overlap) >= 0.9
        assert list((path.parent / "engram.db.ann").glob("*.usearch"))  # saved beside the db
        assert approx._cache.slabs[("a", None, None, "text")].ann is not None  # it was used
        assert exact._cache.slabs[("a", None, None, "text")].ann is None
    finally:
        approx.close()
        exact.close()


def test_a_memory_the_index_misses_is_scored_from_the_pool(
        path: Path, filled: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The index may miss a key (here: made to); if another retriever puts the memory high in
    the pool, its exact cosine places it in the dense list as the exact scan would."""
    exact = SQLiteStore(path, ann_threshold=10**9)
    store = SQLiteStore(path, ann_threshold=100)
    try:
        probe = vectors(1, 9)[0]
        truth = exact.dense(q("a"), probe, 10)
        missed, cosine = truth[0]  # the nearest memory of all
        slab, _ = store._slab(q("a"), "text", DIM)
        seq = int(slab.seqs[slab.row_of[missed]])
        search = ann_module.Ann.search
        monkeypatch.setattr(ann_module.Ann, "search", lambda self, v, count: (
            lambda found: found[found != seq])(search(self, v, count)))
        (text,) = [r[0] for r in store._read("SELECT text FROM memories WHERE id = ?", [missed])]
        number = text.split()[-1]  # "memory a episodic 17": "17" is in two of scope a's texts
        assert missed not in dict(store.dense(q("a"), probe, 10))  # the index misses it
        found = store.pool(q("a"), 10, vector=probe, keys=["text"], terms=[number])
        assert missed in dict(found["lexical"][:2])  # the first quarter of k = 10
        assert found["text"][0] == (missed, pytest.approx(cosine, abs=1e-6))
        assert [m for m, _ in found["text"]] == [m for m, _ in truth]
        # with nothing else finding it, the list stays the index's
        assert missed not in dict(store.pool(q("a"), 10, vector=probe, keys=["text"],
                                             terms=["nothingmatches"])["text"])
    finally:
        store.close()
        exact.close()


def test_the_cache_looks_up_ids_it_holds_and_skips_the_rest(
        path: Path, filled: dict[str, list[str]]) -> None:
    """A large scope's cache answers the pool's lookups by id (its candidates, what a query
    may see, each id's cosine) for the ids it holds, live and in scope: an unknown id, another
    scope's and a deleted memory are left out (and an expired one from what the query sees),
    and the rest keep their order."""
    store = SQLiteStore(path, ann_threshold=100)
    try:
        query = q("a")
        probe = vectors(1, 9)[0]
        store.dense(query, probe, 10)
        slab, exact = store._slab(query, "text", DIM)
        assert exact
        mine = filled["a"][:40] + filled["a-facts"][:10]
        gone, stale = mine[3], mine[7]
        with store.write() as tx:
            tx.soft_delete([gone], NOW)
            old = store.get([stale])[stale]
            tx.update(replace(old, expires_at=NOW))
        slab, _ = store._slab(query, "text", DIM)
        asked = ["nope", *mine, filled["b"][0]]
        found, missing = slab.candidates(asked)
        assert list(found) == [m for m in mine if m != gone]  # a deleted memory's row is dropped
        assert missing == ["nope", gone, filled["b"][0]]
        assert found[mine[0]].text == store.get([mine[0]])[mine[0]].text
        assert slab.visible_ids(query, asked) == set(mine) - {gone, stale}
        held = [m for m in mine if m != gone]  # scored: the pool's ids are visible already
        rows = [int(slab.latest[slab._code[m]]) for m in held]
        want = (slab.mat[rows] @ unit(probe)).tolist()
        assert slab.cosines(asked, unit(probe)) == list(zip(held, want, strict=True))
    finally:
        store.close()


def test_scopes_kinds_deletes_and_new_keys(path: Path, filled: dict[str, list[str]]) -> None:
    store = SQLiteStore(path, ann_threshold=100)
    try:
        probe = vectors(1, 9)[0]
        mine = set(filled["a"]) | set(filled["a-facts"])
        first = store.dense(q("a"), probe, 50)
        assert {m for m, _ in first} <= mine  # never another user's
        episodes = store.dense(q("a", (Kind.EPISODIC,)), probe, 50)
        assert {m for m, _ in episodes} <= set(filled["a"])
        assert len(store.dense(q("a", (Kind.SEMANTIC,)), probe, 50)) == 50  # few: still found
        # deleted memories are gone at once, though the index still holds their keys
        gone = [m for m, _ in first[:5]]
        with store.write() as tx:
            tx.soft_delete(gone, NOW)
        after = store.dense(q("a"), probe, 50)
        assert not {m for m, _ in after} & set(gone)
        assert [m for m, _ in after][:10] == [m for m, _ in first if m not in gone][:10]
        # a key added after the index was built is found
        [new] = fill(store, Scope(user_id="a"), unit(probe[None, :]))
        assert store.dense(q("a"), probe, 1)[0][0] == new
    finally:
        store.close()


def test_erase_removes_the_saved_index_and_the_next_search_rebuilds(
        path: Path, filled: dict[str, list[str]]) -> None:
    store = SQLiteStore(path, ann_threshold=100)
    saved = path.parent / "engram.db.ann"
    try:
        probe = vectors(1, 9)[0]
        top = [m for m, _ in store.dense(q("a"), probe, 10)]
        assert list(saved.glob("*.usearch"))
        with store.write() as tx:
            tx.erase(top[:3])
        assert not list(saved.glob("*.usearch"))  # the file held the erased vectors
        again = [m for m, _ in store.dense(q("a"), probe, 10)]
        assert not set(again) & set(top[:3])
        # the others come back; the index is approximate and built on every core (so not the
        # same graph twice): one of them may be missed
        assert len(set(again[:7]) & set(top[3:])) >= 6
        assert list(saved.glob("*.usearch"))  # rebuilt from the table, without them
    finally:
        store.close()


def test_a_saved_index_is_loaded_not_rebuilt(path: Path, filled: dict[str, list[str]],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    probe = vectors(1, 9)[0]
    first = SQLiteStore(path, ann_threshold=100)
    try:
        expected = first.dense(q("a"), probe, 10)
    finally:
        first.close()
    added = count_adds(monkeypatch)
    second = SQLiteStore(path, ann_threshold=100)
    try:
        assert second.dense(q("a"), probe, 10) == expected
        assert sum(added) == 0  # every key was in the saved index
    finally:
        second.close()


def test_an_index_saved_in_float16_by_an_earlier_version_is_still_used(
        path: Path, filled: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """New indexes hold bfloat16; one saved in float16 is loaded as it is, not rebuilt, and
    answers as it did."""
    probe = vectors(1, 9)[0]
    monkeypatch.setattr(ann_module, "DTYPE", "f16")
    old = SQLiteStore(path, ann_threshold=100)
    try:
        expected = old.dense(q("a"), probe, 10)
    finally:
        old.close()
    monkeypatch.undo()
    assert ann_module.DTYPE == "bf16"
    built = count_adds(monkeypatch)
    new = SQLiteStore(path, ann_threshold=100)
    try:
        assert new.dense(q("a"), probe, 10) == expected
        assert sum(built) == 0
        (index,) = [s.ann for s in new._cache.slabs.values() if s.ann is not None]
        assert str(index.index.dtype) == "ScalarKind.F16"
        assert new.dense(q("b"), probe, 10)  # a scope indexed now: bfloat16
        assert {str(s.ann.index.dtype) for s in new._cache.slabs.values() if s.ann is not None} == {
            "ScalarKind.F16", "ScalarKind.BF16"}
    finally:
        new.close()


def test_an_unreadable_saved_index_is_rebuilt(path: Path, filled: dict[str, list[str]]) -> None:
    saved = path.parent / "engram.db.ann"
    store = SQLiteStore(path, ann_threshold=100)
    try:
        store.dense(q("a"), vectors(1, 9)[0], 10)
    finally:
        store.close()
    for f in saved.glob("*.usearch"):
        f.write_bytes(b"not an index")
    store = SQLiteStore(path, ann_threshold=100)
    try:
        assert len(store.dense(q("a"), vectors(1, 9)[0], 10)) == 10
    finally:
        store.close()


def test_the_index_and_the_embedder_load_in_either_order() -> None:
    """usearch loaded before onnxruntime used to crash the process (SIGSEGV on import); the
    index imports onnxruntime first, so a store that builds an index before anything embeds
    still embeds afterwards. In a fresh process: the order of imports is the point."""
    code = ("from engram.store.index import ann\n"
            "assert ann.available()\n"
            "from engram.providers.embedders import MiniLM\n"
            "v = MiniLM(threads=1).embed_batch(['the ferry was late'])\n"
            "assert v.shape == (1, 384)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])

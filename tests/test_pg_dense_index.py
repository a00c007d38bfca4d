"""PostgreSQL on the shared dense index layer (store/index/): a scope of any size the cache can
hold is searched in process, through the HNSW index above the ANN threshold as on SQLite, and
never in the database; the index follows another process's deletes; a large scope's first
search is answered by the database while its keys load aside. Small thresholds stand in for
the 20k and the old 50k `cache_limit`, and for the 20k keys a read takes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from conformance.test_store import NOW, put, q, rec
from engram import Config
from engram.model import Scope
from engram.store.index import ann, dense, refresh
from engram.store.index.slab import Slab
from engram.store.postgres import PostgresStore
from engram.threads import Threads

DIM = 16


@pytest.fixture
def db(pg_server: Any) -> Iterator[str]:
    name = pg_server.create_database()
    yield pg_server.url(name)
    with pg_server.admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _vectors(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _search(store: PostgresStore, probe: np.ndarray, k: int = 10) -> list[tuple[str, float]]:
    return store.pool(q(Scope("u1")), k, vector=probe, keys=["text"], terms=["item"])["text"]


def _recorded(store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements `store` sends from now on."""
    sent: list[str] = []
    batch = PostgresStore._batch

    def recorded(self: PostgresStore, statements: Any, **kw: Any) -> Any:
        if self is store:
            sent.extend(stmt for stmt, _ in statements)
        return batch(self, statements, **kw)

    monkeypatch.setattr(PostgresStore, "_batch", recorded)
    return sent


@pytest.mark.skipif(not ann.available(), reason="the `ann` extra (usearch) is not installed")
def test_a_scope_above_the_ann_threshold_is_searched_in_process(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 keys, with an ANN threshold of 100 and no cache limit given: the scope is cached
    (once past the old limit it went to pgvector), searched through this process's HNSW
    index with the exact scan's answers, and no dense statement reaches the database."""
    store = PostgresStore(db, ann_threshold=100)
    tables = PostgresStore(db, cache_limit=0)  # searched in the database, exactly
    writer = PostgresStore(db)
    try:
        vectors = _vectors(300, 11)
        records = [rec(f"item {i}") for i in range(300)]
        put(writer, *records, vectors=list(vectors))
        sent = _recorded(store, monkeypatch)
        # the first search scans exactly while the index is built aside
        got, want = _search(store, vectors[0]), _search(tables, vectors[0])
        assert [m for m, _ in got] == [m for m, _ in want]
        assert np.allclose([s for _, s in got], [s for _, s in want], atol=1e-5)
        store.wait_for_saves()
        for i in (0, 17, 123, 299):
            got, want = dict(_search(store, vectors[i])), dict(_search(tables, vectors[i]))
            # approximate: the exact scan's best first, and (nearly) its ten, scored exactly
            assert list(got)[:3] == list(want)[:3] and len(got.keys() & want.keys()) >= 9
            assert all(abs(got[m] - want[m]) < 1e-5 for m in got.keys() & want.keys())
        slab = store._cache.slabs[store._cache.key(store._keys, Scope("u1"), "text")]
        assert slab.n == 300 and slab.ann is not None and not store._cache.over
        assert sent and not any("<=>" in stmt for stmt in sent)  # pgvector's cosine distance
        # another process deletes the best hit: gone from the next search, though the index
        # still holds its key (the slab filters it)
        with writer.write() as tx:
            tx.soft_delete([records[17].id], NOW)
        got = dict(_search(store, vectors[17]))
        assert records[17].id not in got
        assert list(got)[:3] == [m for m, _ in _search(tables, vectors[17])][:3]
    finally:
        for s in (store, tables, writer):
            s.close()


def test_the_cache_limit_defaults_to_the_cache_rows(db: str) -> None:
    """No cliff at 50k: a scope is cached up to the whole cache's budget unless told otherwise."""
    config = Config(database_url=db, cache_rows=123_456)
    store = PostgresStore.from_config(config)
    try:
        assert store.cache_limit == 123_456
        assert store.ann_threshold == config.ann_threshold
    finally:
        store.close()
    small = PostgresStore(db, cache_rows=77)
    try:
        assert small.cache_limit == 77
    finally:
        small.close()


@pytest.mark.skipif(not ann.available(), reason="the `ann` extra (usearch) is not installed")
def test_an_index_is_built_aside_while_searches_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """No search waits for a scope's HNSW index (minutes at 1M keys): the first one asks for
    it to be built on a background thread and scans exactly, as do the next ones while it is
    built, with the cache's lock free; once built, the index brings in the rows added during
    the build and answers."""
    slab = Slab(DIM, rich=False)
    vectors = _vectors(400, 3)
    attrs = [("episodic", None, None, None)] * 100  # kind, expiry, validity
    slab.append(list(range(1, 301)), [f"m{i}" for i in range(300)], vectors[:300], attrs * 3)
    lock = threading.Lock()
    started, release = threading.Event(), threading.Event()
    add = ann.Ann.add

    def slow(self: ann.Ann, seqs: np.ndarray, vecs: np.ndarray) -> None:
        if not started.is_set():
            started.set()
            assert release.wait(30)
        add(self, seqs, vecs)

    monkeypatch.setattr(ann.Ann, "add", slow)
    builds = Threads(1, "test-ann")
    query = q(Scope("u1"))

    def search(i: int) -> list[tuple[str, float]]:
        return dense.search_aside(slab, lock, query, vectors[i], 5, lambda ids: set(ids), 100,
                                  ("u1",), builds.submit)

    try:
        assert search(5) == slab.top(query, vectors[5], 5, lambda ids: set(ids))
        assert started.wait(30)
        assert search(7) == slab.top(query, vectors[7], 5, lambda ids: set(ids))
        assert slab.ann is None
        with lock:  # rows added while it builds
            slab.append(list(range(301, 401)), [f"m{i}" for i in range(300, 400)],
                        vectors[300:], attrs)
        release.set()
        builds.drain()
        assert slab.ann is not None
        assert search(350)[0][0] == "m350"
        assert len(slab.ann) == 400  # the rows added meanwhile, brought in
    finally:
        release.set()
        builds.close()


def test_a_large_scopes_first_search_does_not_wait_for_its_load(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scope of more keys than one read takes (10 here, 20,000 by default) is loaded into
    the cache on a helper thread (minutes at 1M keys): meanwhile its searches are the
    database's, exact, and ask for no database index (the cache answers once it holds the
    scope); once loaded, the cache answers the same, with no dense statement sent."""
    monkeypatch.setattr(refresh, "CHUNK", 10)
    store = PostgresStore(db, exact_limit=20)
    tables = PostgresStore(db, cache_limit=0)  # searched in the database, exactly
    release = threading.Event()
    rest = refresh.rest

    def held(*args: Any, **kwargs: Any) -> None:  # the load's later reads, held back
        assert release.wait(30)
        rest(*args, **kwargs)

    monkeypatch.setattr(refresh, "rest", held)
    try:
        vectors = _vectors(40, 5)
        put(store, *[rec(f"item {i}") for i in range(40)], vectors=list(vectors))
        for i in (0, 9):
            assert _search(store, vectors[i]) == _search(tables, vectors[i])
        assert store._cache.being_loaded(store._keys, Scope("u1"), "text")
        assert store._cache.get(store._keys, Scope("u1"), "text") is None
        assert not store._builds._tried  # 40 keys > exact_limit, yet no HNSW build asked
        release.set()
        store.wait_for_saves()
        assert not store._cache.being_loaded(store._keys, Scope("u1"), "text")
        assert store._cache.get(store._keys, Scope("u1"), "text").n == 40  # type: ignore[union-attr]
        sent = _recorded(store, monkeypatch)
        got, want = _search(store, vectors[3]), _search(tables, vectors[3])
        assert [m for m, _ in got] == [m for m, _ in want]
        assert np.allclose([s for _, s in got], [s for _, s in want], atol=1e-5)
        assert sent and not any("<=>" in stmt for stmt in sent)  # from the cache
    finally:
        release.set()
        for s in (store, tables):
            s.close()

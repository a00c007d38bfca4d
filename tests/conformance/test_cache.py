"""The dense cache both stores hold (store/index/cache.py), run over each backend's own reads:
its budget of rows drops the least recently searched scope, never the one being searched; a
scope over its limit is counted, left out and remembered; stale slabs of a search are read
together; a refresh inside a write follows as far as it may; a slow load of one scope holds up
no other scope's refresh."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from engram.model import Scope
from engram.store import Key, Lexical, Store
from engram.store.index.cache import DenseCache, Follow
from engram.store.records import Stmt

from .test_store import DIM, U1, put, rec, vec

U2 = Scope("u2")


def _run(store: Store, statements: list[int]) -> Any:
    def run(stmts: Sequence[Stmt]) -> list[list[Any]]:
        statements.append(len(stmts))
        return [store._read(*stmt) for stmt in stmts]  # type: ignore[attr-defined]
    return run


def _versions(store: Store) -> tuple[int, int]:
    from engram.store.index import refresh

    keys = store._keys  # type: ignore[attr-defined]
    return refresh.versions(store._read(*keys.versions()))  # type: ignore[attr-defined]


def _fill(store: Store, scope: Scope, n: int) -> list[str]:
    records = [rec(f"{scope.user_id} note {i}", scope=scope) for i in range(n)]
    put(store, *records, vectors=[vec(1.0, 0.01 * i) for i in range(n)])
    return [r.id for r in records]


def test_the_budget_drops_the_least_recently_searched_scope(store: Store) -> None:
    k = store._keys  # type: ignore[attr-defined]
    _fill(store, U1, 30)
    _fill(store, U2, 30)
    cache = DenseCache(rows=40, ann_threshold=10**9)
    statements: list[int] = []
    v = _versions(store)
    one = cache.refresh(k, U1, ["text"], DIM, v, _run(store, statements))["text"]
    assert one.n == 30 and cache.get(k, U1, "text") is one
    two = cache.refresh(k, U2, ["text"], DIM, v, _run(store, statements))["text"]
    assert two.n == 30
    assert cache.get(k, U1, "text") is None and cache.get(k, U2, "text") is two  # 60 > 40
    assert cache.refresh(k, U2, ["text"], DIM, v, _run(store, statements))["text"] is two
    assert statements == [2, 2]  # a whole load each (tombstones, keys); then nothing read


def test_a_scope_over_the_limit_is_counted_left_out_and_remembered(store: Store) -> None:
    k = store._keys  # type: ignore[attr-defined]
    _fill(store, U1, 12)
    _fill(store, U2, 5)
    cache = DenseCache(rows=1000, ann_threshold=10**9, limit=10)
    statements: list[int] = []
    v = _versions(store)
    assert cache.refresh(k, U1, ["text"], DIM, v, _run(store, statements)) == {}
    assert cache.elsewhere(k, U1, "text") and not cache.slabs
    assert statements == [1]  # the count alone: a scope over the limit is never loaded
    assert cache.refresh(k, U1, ["text"], DIM, v, _run(store, statements)) == {}
    assert statements == [1]  # remembered: not counted again
    small = cache.refresh(k, U2, ["text"], DIM, v, _run(store, statements))["text"]
    assert small.n == 5 and not cache.elsewhere(k, U2, "text")
    assert statements == [1, 1, 2]


def test_the_stale_slabs_of_a_search_are_read_together(store: Store) -> None:
    k = store._keys  # type: ignore[attr-defined]
    records = [rec(f"note {i}") for i in range(4)]
    with store.write() as tx:  # two key names for each memory
        for i, r in enumerate(records):
            tx.insert(r, [Key("text", vec(1.0, 0.1 * i)), Key("window", vec(0.1 * i, 1.0))],
                      Lexical(r.text))
    cache = DenseCache(rows=1000, ann_threshold=10**9)
    statements: list[int] = []
    both = cache.refresh(k, U1, ["text", "window"], DIM, _versions(store), _run(store, statements))
    assert (both["text"].n, both["window"].n) == (4, 4)
    assert statements == [4]  # one run for both slabs: their tombstones and keys


def test_inside_a_write_a_refresh_follows_only_as_far_as_it_may(store: Store) -> None:
    k = store._keys  # type: ignore[attr-defined]
    _fill(store, U1, 3)
    cache = DenseCache(rows=1000, ann_threshold=10**9)
    statements: list[int] = []
    v = _versions(store)
    keys_only = cache.refresh(k, U1, ["text"], DIM, v, _run(store, statements),
                              follow=Follow.KEYS)["text"]
    assert keys_only.n == 3 and keys_only.rows_version == -1  # its rows' attributes: not trusted
    assert cache.refresh(k, U1, ["text"], DIM, v, _run(store, statements),
                         follow=Follow.NONE)["text"] is keys_only  # as held, nothing read
    assert statements == [2]
    exact = cache.refresh(k, U1, ["text"], DIM, v, _run(store, statements))["text"]
    assert exact is keys_only and (exact.version, exact.rows_version) == v
    assert statements == [2, 3]  # every row's attributes read once
    fresh = DenseCache(rows=1000, ann_threshold=10**9)
    empty = fresh.refresh(k, U1, ["text"], DIM, v, _run(store, statements), follow=Follow.NONE)
    assert empty["text"].n == 0 and not fresh.slabs and statements == [2, 3]


def test_a_slow_load_of_one_scope_holds_up_no_other_scope(store: Store) -> None:
    """A large scope's first load takes long; meanwhile other scopes (of every tenant: the
    cache is the process's) refresh as usual, and a second search of the loading scope waits
    for that load instead of reading the scope again."""
    k = store._keys  # type: ignore[attr-defined]
    _fill(store, U1, 5)
    _fill(store, U2, 5)
    cache = DenseCache(rows=1000, ann_threshold=10**9)
    v = _versions(store)
    reading, release = threading.Event(), threading.Event()
    plain = _run(store, [])

    def slow(stmts: Sequence[Stmt]) -> list[list[Any]]:
        reading.set()
        assert release.wait(30)
        return plain(stmts)  # type: ignore[no-any-return]

    def refresh(scope: Scope, run: Any, out: list[Any]) -> threading.Thread:
        t = threading.Thread(target=lambda: out.append(cache.refresh(k, scope, ["text"], DIM, v, run)))
        t.start()
        return t

    first: list[Any] = []
    loading = refresh(U1, slow, first)
    try:
        assert reading.wait(30)
        other: list[Any] = []
        refresh(U2, _run(store, []), other).join(10)
        assert other and other[0]["text"].n == 5  # not held up by U1's load
        again: list[Any] = []
        read_again: list[int] = []
        waiting = refresh(U1, _run(store, read_again), again)
        waiting.join(0.3)
        assert waiting.is_alive()  # the same scope waits for its turn
    finally:
        release.set()
        loading.join(30)
    waiting.join(30)
    assert first[0]["text"].n == 5 and again[0]["text"] is first[0]["text"]
    assert read_again == []  # found loaded: nothing read twice

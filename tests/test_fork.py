"""A Memory used in a parent and then forked (multiprocessing's default on Linux, gunicorn
--preload, Celery prefork) works in the children: each child loads its own embedder runtime
and opens its own database connections."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from engram import Config, Memory
from engram.model import Scope
from engram.providers.embedders import Embedder, MiniLM, SentenceTransformerMiniLM
from engram.store.index import refresh

pytestmark = pytest.mark.slow


def _child(mem: Memory, n: int) -> None:
    for i in range(10):
        mem.add(f"child {n} remembers fact number {i}", user_id="u")
    assert len(mem.search(f"child {n} remembers", user_id="u", limit=20)) >= 10


def _fork(mem: Memory, target: Any = None) -> list[multiprocessing.process.BaseProcess]:
    """Two children forked from this process, each running `target(mem, n)` (`_child`)."""
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=target or _child, args=(mem, n)) for n in range(2)]
    for c in children:
        c.start()
    return children


def _finish(children: list[multiprocessing.process.BaseProcess]) -> None:
    """Wait for the forked children; a child still running after 2 minutes hung."""
    for c in children:
        c.join(timeout=120)
    stuck = [c for c in children if c.is_alive()]
    for c in stuck:
        c.kill()
    assert not stuck, "a forked child hung"
    assert [c.exitcode for c in children] == [0, 0]


EMBEDDERS: dict[str, type[Embedder]] = {"onnx": MiniLM, "torch": SentenceTransformerMiniLM}


@pytest.mark.parametrize("runtime", sorted(EMBEDDERS))
def test_forked_children_add_and_search_after_the_parent_used_the_memory(
        tmp_path: Path, runtime: str) -> None:
    # Its own embedder with its default thread pool, used before the fork, as an app would.
    mem = Memory(tmp_path / "m.db", embedder=EMBEDDERS[runtime]())
    mem.add("the parent was here first", user_id="u")
    assert mem.search("parent", user_id="u")
    children = _fork(mem)
    _finish(children)
    # the parent still works, and sees what both children wrote
    assert mem.embedder.embed_batch(["still here"]).shape == (1, 384)
    assert len(mem.list(user_id="u", limit=100).items) == 21
    mem.close()


def test_forked_children_share_a_postgres_database_with_the_parent(
        tmp_path: Path, pg_server: Any, embedder: Embedder) -> None:
    """The parent's pooled connections are its own sessions: a child that used them would
    interleave its statements with the parent's on one socket, and one that closed them
    would end the parent's sessions. Each child opens its own; the parent keeps working
    while they run."""
    name = pg_server.create_database()
    config = Config.from_env(database_url=pg_server.url(name), path=tmp_path / "unused.db")
    mem = Memory(config=config, embedder=embedder)
    try:
        mem.add("the parent was here first", user_id="u")
        assert mem.search("parent", user_id="u")  # the pool now holds idle connections
        children = _fork(mem)
        for _ in range(10):  # the parent goes on using its connections meanwhile
            assert mem.search("the parent was here", user_id="u")[0].memory.text == \
                "the parent was here first"
        _finish(children)
        assert len(mem.list(user_id="u", limit=100).items) == 21
        # on the first page: a newer "child 0 ... number 7" may rank just above it (the two
        # children race, and newest-wins reads the later one as a revision of the earlier)
        found = mem.search("child 1 remembers fact number 7", user_id="u", limit=2)
        assert "child 1 remembers fact number 7" in {h.memory.text for h in found}
    finally:
        mem.close()
        with pg_server.admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_child_forked_while_a_parent_thread_held_the_caches_works(tmp_path: Path) -> None:
    """A parent thread in the middle of a search (the lexical index's and the dense caches'
    locks held) or of a cache save when the process forks: the child cannot wait for that
    thread (it does not exist there), so it starts those caches afresh instead of hanging."""
    mem = Memory(tmp_path / "m.db", embedder=MiniLM())
    mem.add("the parent was here first", user_id="u")
    assert mem.search("parent", user_id="u")
    store = mem._engine.store
    assert store._follower.lexicon is not None  # the lexical index is in memory, as at every size
    with store._follower.lock, store._cache.lock, store._saver._lock:  # as a parent thread would
        children = _fork(mem)
    _finish(children)
    assert len(mem.search("child 1 remembers", user_id="u", limit=30)) >= 10  # the parent too
    mem.close()


def _child_with_helper(mem: Memory, n: int) -> None:
    _child(mem, n)
    store = mem._engine.store
    assert store._helper._pid == os.getpid()  # its own helper thread searched the lexical side


def test_forked_children_search_a_large_scope_with_their_own_helper(tmp_path: Path) -> None:
    """A large scope's search hands its lexical side to the store's helper thread. A child
    forked after the parent used it (and while a parent search held it) starts its own
    helper instead of waiting for one that does not exist there."""
    mem = Memory(tmp_path / "m.db", embedder=MiniLM())
    store = mem._engine.store
    store._large = lambda query: True  # as a scope above the ANN threshold
    mem.add("the parent was here first", user_id="u")
    assert mem.search("parent", user_id="u")
    assert store._helper._pid == os.getpid()
    with store._helper_free:  # as a parent search in flight would hold it
        children = _fork(mem, _child_with_helper)
    _finish(children)
    assert len(mem.search("child 1 remembers", user_id="u", limit=30)) >= 10  # the parent too
    mem.close()


def _child_loads(mem: Memory, n: int) -> None:
    assert mem.search("big note 3", user_id="big")[0].memory.text == "big note 3"
    store = mem._engine.store
    store.wait_for_saves()  # type: ignore[attr-defined]
    slab = store._cache.get(store._keys, Scope("big"), "text")  # type: ignore[attr-defined]
    assert slab is not None and slab.n == 30  # loaded by the child's own thread


def test_a_child_forked_while_the_parent_loads_a_large_scope_loads_it_itself(
        tmp_path: Path, pg_server: Any, embedder: Embedder, monkeypatch: pytest.MonkeyPatch) -> None:
    """On PostgreSQL a large scope's first load runs on a helper thread (more keys than one
    read takes: 10 here). A child forked while the parent's load runs has no such thread: it
    loads the scope itself instead of leaving it to a load that never ends there."""
    parent = os.getpid()
    release = threading.Event()
    rest = refresh.rest

    def held(*args: Any, **kwargs: Any) -> None:  # the parent's load, held back
        if os.getpid() == parent and threading.current_thread().name.startswith("engram-pg-load"):
            assert release.wait(120)
        rest(*args, **kwargs)

    monkeypatch.setattr(refresh, "CHUNK", 10)
    monkeypatch.setattr(refresh, "rest", held)
    name = pg_server.create_database()
    config = Config.from_env(database_url=pg_server.url(name), path=tmp_path / "unused.db")
    with Memory(config=config, embedder=embedder) as writer:  # another process's writes
        writer.add([f"big note {i}" for i in range(30)], user_id="big", infer=False)
    mem = Memory(config=config, embedder=embedder)
    try:
        assert mem.search("big note 3", user_id="big")[0].memory.text == "big note 3"
        store = mem._engine.store
        assert store._cache.being_loaded(store._keys, Scope("big"), "text")  # type: ignore[attr-defined]
        _finish(_fork(mem, _child_loads))
    finally:
        release.set()
        mem.close()
        with pg_server.admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

"""A Memory used in a parent and then forked (multiprocessing's default on Linux, gunicorn
--preload, Celery prefork) works in the children: each child loads its own embedder runtime
and opens its own database connections."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from engram import Memory
from engram.providers.embedders import Embedder, MiniLM, SentenceTransformerMiniLM

pytestmark = pytest.mark.slow


def _child(mem: Memory, n: int) -> None:
    for i in range(10):
        mem.add(f"child {n} remembers fact number {i}", user_id="u")
    assert len(mem.search(f"child {n} remembers", user_id="u", limit=20)) >= 10


EMBEDDERS: dict[str, type[Embedder]] = {"onnx": MiniLM, "torch": SentenceTransformerMiniLM}


@pytest.mark.parametrize("runtime", sorted(EMBEDDERS))
def test_forked_children_add_and_search_after_the_parent_used_the_memory(
        tmp_path: Path, runtime: str) -> None:
    # Its own embedder with its default thread pool, used before the fork, as an app would.
    mem = Memory(tmp_path / "m.db", embedder=EMBEDDERS[runtime]())
    mem.add("the parent was here first", user_id="u")
    assert mem.search("parent", user_id="u")
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=_child, args=(mem, n)) for n in range(2)]
    for c in children:
        c.start()
    for c in children:
        c.join(timeout=120)
    stuck = [c for c in children if c.is_alive()]
    for c in stuck:
        c.kill()
    assert not stuck, "a forked child hung"
    assert [c.exitcode for c in children] == [0, 0]
    # the parent still works, and sees what both children wrote
    assert mem.embedder.embed_batch(["still here"]).shape == (1, 384)
    assert len(mem.list(user_id="u", limit=100).items) == 21
    mem.close()

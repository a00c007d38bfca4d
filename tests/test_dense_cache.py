"""The dense cache's bound: by keys held over all searched scopes, not by a count of scopes, so
a service searching many small scopes in turn keeps each one loaded."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engram import Memory
from engram.providers.embedders import MiniLM
from engram.store.index.slab import Slab, evict


def _slab(n: int) -> Slab:
    slab = Slab(4)
    slab.append(list(range(1, n + 1)), [f"m{i}" for i in range(n)], np.ones((n, 4), np.float32))
    return slab


def test_evict_drops_the_least_recently_used_until_within_the_budget() -> None:
    slabs: OrderedDict[tuple[Any, ...], Slab] = OrderedDict(
        ((u, None, None, k), _slab(10)) for u in ("a", "b", "c") for k in ("text", "window"))
    evict(slabs, 60, ("c", None, None))
    assert len(slabs) == 6  # within the budget: nothing goes
    evict(slabs, 35, ("c", None, None))
    assert list(slabs) == [("b", None, None, "window"), ("c", None, None, "text"),
                           ("c", None, None, "window")]
    evict(slabs, 0, ("c", None, None))  # the scope being searched stays, however large
    assert [k[0] for k in slabs] == ["c", "c"]


def _loads_searching_in_turn(mem: Memory, users: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """How many times slabs load keys while each user's scope is searched three rounds over."""
    loads: list[int] = []
    append = Slab.append

    def counting(self: Slab, seqs: list[int], *args: Any, **kwargs: Any) -> None:
        loads.append(len(seqs))
        append(self, seqs, *args, **kwargs)

    for u in users:
        mem.add([f"{u} likes tea", f"{u} rides a bike"], user_id=u, infer=False)
    monkeypatch.setattr(Slab, "append", counting)
    for _ in range(3):
        for u in users:
            assert mem.search("tea", user_id=u, limit=1)[0].memory.text == f"{u} likes tea"
    return len(loads)


def test_many_small_scopes_searched_in_turn_stay_loaded(tmp_path: Path, embedder: MiniLM,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    users = [f"user{i}" for i in range(20)]  # 40 slabs (text and window keys)
    with Memory(path=tmp_path / "m.db", embedder=embedder) as mem:
        loads = _loads_searching_in_turn(mem, users, monkeypatch)
    assert loads == 2 * len(users)  # each scope's keys loaded once, not once per round


def test_many_small_scopes_stay_loaded_on_postgres(tmp_path: Path, embedder: MiniLM, pg_server: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from engram import Config

    name = pg_server.create_database()
    config = Config.from_env(database_url=pg_server.url(name), path=tmp_path / "unused.db")
    users = [f"user{i}" for i in range(12)]  # 24 slabs: more than the 16 it used to keep
    try:
        with Memory(config=config, embedder=embedder) as mem:
            loads = _loads_searching_in_turn(mem, users, monkeypatch)
        assert loads == 2 * len(users)
    finally:
        with pg_server.admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

"""What a node holds per tenant it has served stays bounded (bench/tenants.py measures it at
10,000 tenants): a small scope's dense cache reserves what it holds, and the per-tenant maps of
the shared PostgreSQL store forget the tenants served longest ago."""

from __future__ import annotations

from typing import Any

import numpy as np

from engram import Memory
from engram.providers.embedders import MiniLM
from engram.store.index.slab import Slab


def _allocated(slab: Slab) -> int:
    return sum(a.nbytes for a in vars(slab).values() if isinstance(a, np.ndarray))


def test_a_small_scope_reserves_what_it_holds() -> None:
    slab = Slab(384, rich=True)
    assert _allocated(slab) == 0  # a scope searched before it holds a key costs no arrays
    slab.append([1, 2, 3, 4, 5], [f"m{i}" for i in range(5)], np.ones((5, 384), np.float32))
    row = 384 * 4 + 8 * 5 + 3  # the vector, seq, code and three times, three flags
    assert _allocated(slab) <= 2 * 5 * row + 1024
    for seq in range(6, 200):  # rows added one by one grow it by doubling
        slab.append([seq], [f"m{seq}"], np.ones((1, 384), np.float32))
    assert slab.n == 199 and len(slab.seqs) < 2 * 199
    assert slab.mat[:199].any(axis=1).all()


def test_a_per_tenant_hint_forgets_the_tenants_set_longest_ago() -> None:
    from engram.store.postgres.store import _Recent

    hints: _Recent[int] = _Recent(8)
    for i in range(30):
        hints[f"t{i}"] = i
        hints["t0"] = 0  # set again: the newest
        assert len(hints) <= 8
    assert hints.get("t0") == 0 and hints.get("t29") == 29
    assert hints.get("t1") is None  # forgotten: the caller reads afresh


def test_a_node_serving_many_tenants_keeps_no_state_per_tenant_beyond_its_bounds(
        pg_server: Any, embedder: MiniLM) -> None:
    from engram.store.postgres import PostgresStore

    base = PostgresStore(pg_server.url(pg_server.create_database()))
    base._seen.limit = base._moving.limit = 8  # shared by every tenant's store
    mems = [Memory(store=base.for_tenant(f"t{i}"), embedder=embedder) for i in range(30)]
    try:
        for i, mem in enumerate(mems):
            mem.add(f"tenant {i} keeps a red kayak", user_id="ana", infer=False)
            assert [h.memory.text for h in mem.search("kayak", user_id="ana")] \
                == [f"tenant {i} keeps a red kayak"]
        assert len(base._seen) <= 8 and len(base._moving) <= 8
        assert len(base._turns._turns) == 0  # no writer holds or waits for a turn
        # a tenant forgotten by the hints is searched right, and one added to since as well
        mems[0].add("tenant 0 sold the kayak", user_id="ana", infer=False)
        assert {h.memory.text for h in mems[0].search("kayak", user_id="ana")} \
            == {"tenant 0 keeps a red kayak", "tenant 0 sold the kayak"}
        assert [h.memory.text for h in mems[1].search("kayak", user_id="ana")] \
            == ["tenant 1 keeps a red kayak"]
    finally:
        for mem in mems:
            mem.close()
        base.close()


def test_the_service_keeps_the_tenants_served_last_open(pg_server: Any, embedder: MiniLM) -> None:
    from engram.config import Config
    from engram.server.tenants import Tenants

    config = Config(database_url=pg_server.url(pg_server.create_database()), worker="off")
    tenants = Tenants(config, embedder=embedder, open_limit=3)
    try:
        held = tenants.get("t0")  # a request still using it when it is closed
        for i in range(8):
            tenants.get(f"t{i}").add(f"tenant {i} keeps a red kayak", user_id="ana", infer=False)
            assert len(tenants._open) <= 3
        assert list(tenants._open) == ["t5", "t6", "t7"] and len(tenants._opening) == 0
        tenants.get("t6")  # served again: the most recent
        tenants.get("t1")
        assert list(tenants._open) == ["t7", "t6", "t1"]
        for thread in tenants._closing:
            thread.join()
        assert [h.memory.text for h in held.search("kayak", user_id="ana")] \
            == ["tenant 0 keeps a red kayak"]
        assert [h.memory.text for h in tenants.get("t0").search("kayak", user_id="ana")] \
            == ["tenant 0 keeps a red kayak"]
    finally:
        tenants.close()

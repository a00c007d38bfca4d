"""What a node holds per tenant it has served stays bounded (bench/tenants.py measures it at
10,000 tenants): a small scope's dense cache reserves what it holds, and the per-tenant maps of
the shared PostgreSQL store forget the tenants served longest ago."""

from __future__ import annotations

import numpy as np

from engram.store.slab import Slab


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

"""A cached scope follows another OS process's writes (store/index/cache.py): that process's
one-row update is read by this one's next search, that row alone, and its deletion as one
tombstone, on every store (a real SQLite file, a real PostgreSQL database)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engram.store import SQLiteStore, Store
from engram.store.index.slab import Slab

from .test_key_changes import refresh_reads
from .test_store import DIM, U1, put, q, rec

# The other process: opens the same database, changes one memory, and exits.
OTHER = """
import sys
from dataclasses import replace
from datetime import UTC, datetime

kind, where, mid, what = sys.argv[1:5]
if kind == "sqlite":
    from engram.store import SQLiteStore as Opened
else:
    from engram.store.postgres import PostgresStore as Opened
store = Opened(where)
try:
    old = store.get([mid])[mid]
    with store.write() as tx:
        if what == "update":
            tx.update(replace(old, text="entry three, rewritten elsewhere", importance=0.9))
        else:
            tx.soft_delete([mid], datetime.now(UTC))
finally:
    store.close()
"""


def _where(store: Store, tmp_path: Path) -> tuple[str, str]:
    if isinstance(store, SQLiteStore):
        return "sqlite", str(store.path)
    from pg_server import PG

    return "postgres", PG.database_for(tmp_path)  # the database the factory opened


def _in_another_process(store: Store, tmp_path: Path, memory_id: str, what: str) -> None:
    kind, where = _where(store, tmp_path)
    done = subprocess.run([sys.executable, "-c", OTHER, kind, where, memory_id, what],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _search(store: Store, vector: np.ndarray) -> list[str]:
    found = store.pool(q(U1), 5, vector=vector, keys=["text"], terms=[])
    return [mid for mid, _ in found["text"]]


def test_another_processs_one_row_update_is_read_alone_by_the_next_search(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = [rec(f"entry {i}") for i in range(300)]
    rng = np.random.default_rng(11)
    vectors = rng.normal(size=(300, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    put(store, *records, vectors=list(vectors))
    assert _search(store, vectors[3])[0] == records[3].id  # the scope is cached
    # rows of each refresh's reads (tombstones, new keys, changed), or [-n] for n reloaded
    read = refresh_reads(monkeypatch)
    reset = Slab.reset_attrs  # every row's attributes read again: what must not happen

    def resetting(slab: Slab, rows: Sequence[Sequence[Any]], d: Any = None) -> None:
        read.append([-len(rows)])
        reset(slab, rows, d)

    monkeypatch.setattr(Slab, "reset_attrs", resetting)
    assert _search(store, vectors[3])[0] == records[3].id
    assert read == []  # nothing changed: nothing read

    _in_another_process(store, tmp_path, records[3].id, "update")
    assert _search(store, vectors[3])[0] == records[3].id
    assert read == [[0, 0, 1]]  # no tombstone, no new key, the one changed row
    got = store.candidates([records[3].id], q(U1))[records[3].id]
    assert (got.text, got.importance) == ("entry three, rewritten elsewhere", 0.9)

    _in_another_process(store, tmp_path, records[3].id, "delete")
    assert records[3].id not in _search(store, vectors[3])
    assert read[1][:2] == [1, 0] and sum(read[1]) == 1  # its key's tombstone alone
    assert len(read) == 2

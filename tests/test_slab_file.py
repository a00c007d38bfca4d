"""The SQLite store's saved dense caches (`<db>.slabs/`): a new store loads a large scope's
cache from its file instead of the tables and searches exactly as the store that saved it,
catching up with what was written since; a file the database does not name (corrupt,
foreign, older, unnamed by an erasure) is never trusted; none beside an encrypted database;
an erasure removes them."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engram.model import Kind, MemoryRecord, Scope, new_id
from engram.pipeline.text import content_hash
from engram.store import Key, Lexical, Query
from engram.store.index import ann
from engram.store.sqlite import SQLiteStore

NOW = datetime(2025, 6, 1, 12, tzinfo=UTC)
SCOPE = Scope("u1")
OTHER = Scope("u2")
THRESHOLD = 50  # ann_threshold: a scope above it is large (HNSW, and its cache saved)


@pytest.fixture(autouse=True)
def exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scans, not HNSW: two processes' HNSW indexes (one rebuilt after an erasure, or grown
    by different inserts) may answer an approximate search differently, while what is
    checked here is the cache; it is saved and loaded the same either way (tests/test_ann.py
    tests the index)."""
    monkeypatch.setattr(ann, "available", lambda: False)


def record(text: str, scope: Scope, rng: random.Random, **fields: Any) -> MemoryRecord:
    at = NOW - timedelta(minutes=rng.randint(1, 10_000))
    base: dict[str, Any] = dict(
        id=new_id(), scope=scope, kind=rng.choice([Kind.EPISODIC, Kind.SEMANTIC]), text=text,
        metadata={},
        importance=rng.random(), created_at=at, updated_at=at, valid_from=at,
        observed_at=at - timedelta(days=1) if rng.random() < 0.5 else None,
        name=rng.choice([None, "Maya", "Jon"]), role=rng.choice([None, "user", "assistant"]),
        content_hash=content_hash(text))
    if rng.random() < 0.1:
        base["expires_at"] = NOW - timedelta(hours=1)  # expired: never visible
    if rng.random() < 0.1:
        base["valid_to"] = NOW - timedelta(days=2)     # superseded
    base.update(fields)
    return MemoryRecord(**base)


def vec(rng: random.Random) -> np.ndarray:
    v = np.asarray([rng.gauss(0, 1) for _ in range(8)], dtype=np.float32)
    return v / np.linalg.norm(v)


def fill(store: SQLiteStore, n: int, rng: random.Random, scope: Scope = SCOPE,
         text: str = "memory") -> list[MemoryRecord]:
    recs = []
    with store.write() as tx:
        for i in range(n):
            r = record(f"{text} {i} {rng.random():.6f}", scope, rng)
            tx.insert(r, [Key("text", vec(rng)), Key("window", vec(rng))], Lexical(r.text))
            recs.append(r)
    return recs


def searches(store: SQLiteStore, seed: int = 7) -> tuple[list[Any], dict[str, Any]]:
    """Dense hits over both keys (all kinds, one kind, as of a past time) and the candidates
    of every hit: what a search reads from the caches."""
    rng = random.Random(seed)
    out: list[Any] = []
    for _ in range(8):
        v = vec(rng)
        for q in (Query(scope=SCOPE, now=NOW), Query(scope=SCOPE, now=NOW, kinds=(Kind.SEMANTIC,)),
                  Query(scope=SCOPE, now=NOW, as_of=NOW - timedelta(days=3))):
            for key in ("text", "window"):
                for k in (5, 40):
                    out.append(store.dense(q, v, k, key=key))
    ids = sorted({mid for hits in out for mid, _ in hits})
    return out, store.candidates(ids, Query(scope=SCOPE, now=NOW))


def files(path: Path) -> list[Path]:
    d = path.parent / f"{path.name}.slabs"
    return sorted(d.iterdir()) if d.exists() else []


def names(store: SQLiteStore) -> dict[str, int]:
    return dict(store._read("SELECT name, value FROM meta WHERE name GLOB 'slab_file:*'"))


def loaded(caplog: pytest.LogCaptureFixture) -> int:
    return sum("loaded the dense cache" in r.getMessage() for r in caplog.records)


def open_store(path: Path, **kw: Any) -> SQLiteStore:
    return SQLiteStore(path, ann_threshold=THRESHOLD, **kw)


def test_a_saved_cache_loads_and_searches_the_same_and_catches_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="engram.store")
    rng = random.Random(1)
    path = tmp_path / "m.db"
    s = open_store(path)
    try:
        recs = fill(s, 300, rng)
        fill(s, 30, rng, scope=OTHER)  # a small scope: its cache is not saved
        before = searches(s)
        s.dense(Query(scope=OTHER, now=NOW), vec(rng), 5)
        s.wait_for_saves()
        assert len(files(path)) == 2 and all(names(s).values())  # text and window keys of u1
        caplog.clear()
        new = open_store(path)
        try:
            assert searches(new) == before  # the candidates too, their roles among them
            assert loaded(caplog) == 2
            assert {c.role for c in searches(new)[1].values()} == {None, "user", "assistant"}
        finally:
            new.close()
        # written since: added, deleted, a row's validity changed; the file is left behind
        with s.write() as tx:
            tx.soft_delete([r.id for r in recs[:20]], NOW)
            tx.update(replace(recs[30], valid_to=NOW - timedelta(days=1)))
            tx.update(replace(recs[31], importance=0.99, name="Gina"))
        fill(s, 20, rng)
        now = searches(s)
        s.wait_for_saves()
        assert now != before
        caplog.clear()
        new = open_store(path)
        try:
            assert searches(new) == now  # loaded, then caught up with the tables
            assert loaded(caplog) == 2
            gone = {r.id for r in recs[:20]}
            assert not gone & {mid for hits in searches(new)[0] for mid, _ in hits}
            # the loaded store saves again once a quarter more was added (its candidates
            # partly still as read from the file)
            fill(new, 90, rng)
            now = searches(new)
            new.wait_for_saves()
        finally:
            new.close()
        caplog.clear()
        third = open_store(path)
        try:
            assert searches(third) == now == searches(s)
            assert loaded(caplog) == 2
        finally:
            third.close()
    finally:
        s.close()


def _text_file(store: SQLiteStore) -> Path:
    where = store._slab_files.where((SCOPE.user_id, SCOPE.agent_id, SCOPE.session_id, "text"))
    assert where is not None
    return where[0]


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "foreign", "older", "unnamed"])
def test_a_corrupt_foreign_or_stale_file_is_rebuilt_never_trusted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    caplog.set_level("INFO", logger="engram.store")
    rng = random.Random(2)
    path = tmp_path / "m.db"
    s = open_store(path)
    try:
        fill(s, 300, rng)
        searches(s)
        s.wait_for_saves()
        file = _text_file(s)
        data = file.read_bytes()
        if damage == "flip":  # one bit among the vectors
            mid = len(data) // 3
            file.write_bytes(data[:mid] + bytes([data[mid] ^ 1]) + data[mid + 1:])
        elif damage == "truncate":
            file.write_bytes(data[:len(data) - 100])
        elif damage == "garbage":
            file.write_bytes(b"not a cache at all" * 50)
        elif damage == "foreign":  # another database's cache of the same scope and key
            other = open_store(tmp_path / "other.db")
            fill(other, 300, random.Random(99))
            searches(other)
            other.close()
            _text_file(other).replace(file)
        elif damage == "older":  # an older save of this database
            fill(s, 100, rng)  # a quarter more: saved again
            searches(s)
            s.wait_for_saves()
            file.write_bytes(data)
        else:  # the database stopped naming it (an erasure whose process died before deleting)
            with s.write() as tx:
                tx.conn.execute("UPDATE meta SET value = 0 WHERE name GLOB 'slab_file:*'")
        want = searches(s)
        caplog.clear()
        new = open_store(path)
        try:
            if damage == "unnamed":
                assert files(path) == []  # deleted when the store opened
            assert searches(new) == want
            assert loaded(caplog) == (0 if damage == "unnamed" else 1)  # the window key's only
            new.wait_for_saves()  # ... and saved again, rebuilt from the tables
        finally:
            new.close()
        caplog.clear()
        again = open_store(path)
        try:
            assert searches(again) == want
            assert loaded(caplog) == 2
        finally:
            again.close()
    finally:
        s.close()


def test_an_erasure_removes_the_files_and_no_later_save_holds_it(tmp_path: Path) -> None:
    rng = random.Random(3)
    path, canary = tmp_path / "m.db", "zqxcanaryword"
    s = open_store(path)
    other = open_store(path)  # another process, its caches loaded before the erasure
    try:
        fill(s, 300, rng)
        secret = record(f"my {canary} is here", SCOPE, rng, expires_at=None, valid_to=None)
        with s.write() as tx:
            tx.insert(secret, [Key("text", vec(rng)), Key("window", vec(rng))],
                      Lexical(secret.text))
        searches(s)
        searches(other)
        s.wait_for_saves()
        other.wait_for_saves()  # else its save's temporary file may vanish while listed
        assert any(canary.encode() in f.read_bytes() for f in files(path))  # it can fail
        with s.write() as tx:
            tx.erase([secret.id])
        assert files(path) == [] and not any(names(s).values())
        # the other store's caches predate the erasure: never named again as they were...
        key = (SCOPE.user_id, SCOPE.agent_id, SCOPE.session_id, "text")
        with other._cache.lock:
            other._slab_files.save(other._cache.slabs[key], key)
        other.wait_for_saves()
        assert files(path) == [] and not any(names(s).values())
        # ... and once caught up, saved again without it (by the erasing store)
        want = searches(s)
        assert searches(other) == want
        s.wait_for_saves()
        other.wait_for_saves()
        assert len(files(path)) == 2
        assert not any(canary.encode() in f.read_bytes() for f in files(path))
        assert not any(secret.id.encode() in f.read_bytes() for f in files(path))
        new = open_store(path)
        try:
            assert searches(new) == want
        finally:
            new.close()
    finally:
        s.close()
        other.close()


def test_no_saved_cache_beside_an_encrypted_database(tmp_path: Path) -> None:
    pytest.importorskip("sqlcipher3")
    rng = random.Random(4)
    path = tmp_path / "enc.db"
    (tmp_path / "enc.db.slabs").mkdir()
    (tmp_path / "enc.db.slabs" / "0123").write_bytes(b"left from when it was plain")
    s = open_store(path, key="a passphrase")
    try:
        assert files(path) == []  # removed at open
        fill(s, 300, rng)
        first = searches(s)
        s.wait_for_saves()
        assert files(path) == [] and not names(s)
        assert searches(s) == first
    finally:
        s.close()

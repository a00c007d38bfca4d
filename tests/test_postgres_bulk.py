"""PostgreSQL's bulk write (`PgTx.insert_many`) and the pruning of the dense cache's key
tombstones, on a real PostgreSQL (tests/pg_server.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from conformance.test_store import NOW, q, rec
from engram.errors import EngramError, InvalidInput
from engram.model import MemoryRecord, Scope
from engram.store import Key, Lexical
from engram.store.postgres import PostgresStore, schema, sql

DIM = 8
SCOPES = [Scope("u1", None, "s1"), Scope("u1", "a1", "s2"), Scope("u2")]
WORDS = ("ramen lisbon pottery o'neil back\\slash kyoto sushi Zoë café chess rain tea biscuit "
         "the a of and").split()

Row = tuple[MemoryRecord, list[Key], Lexical]


@pytest.fixture
def db(pg_server: Any) -> Iterator[str]:
    url = pg_server.url(pg_server.create_database())
    yield url
    with pg_server.admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {url.split('/')[3].split('?')[0]} WITH (FORCE)")


def _vector(rng: random.Random) -> np.ndarray:
    v = np.asarray([rng.gauss(0, 1) for _ in range(DIM)], dtype=np.float32)
    return v / np.linalg.norm(v)


def _rows(n: int, seed: int = 1) -> list[Row]:
    """Rows with every kind of field: metadata, provenance of any length, names, quotes and
    backslashes, times set and unset."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        r = rec(text, scope=SCOPES[i % len(SCOPES)], metadata={"i": i, "tag": rng.choice("xyz")},
                name=rng.choice([None, "Maya", "O'Neil"]), role=rng.choice([None, "user"]),
                provenance=[f"ep{j}" for j in range(i % 4)],
                observed_at=NOW - timedelta(minutes=i) if i % 2 else None,
                expires_at=NOW + timedelta(days=1) if i % 7 == 0 else None)
        v = _vector(rng)
        rows.append((r, [Key("text", v), Key("window", _vector(rng))],
                     Lexical(f"{r.name or ''}: {text}", "previous turn" if i % 3 else "")))
    return rows


def _read(store: PostgresStore, stmt: str) -> list[Any]:
    return store._read(stmt, (store.tenant,))


TABLES = [
    # every column a row writes, but the tenant and the identity columns
    "SELECT id, user_id, agent_id, session_id, kind, text, metadata, importance, role, name, "
    "created_at, updated_at, observed_at, valid_from, valid_to, superseded_by, provenance, "
    "access_count, last_accessed_at, expires_at, content_hash, deleted_at, lex::text, lex_body, "
    "lex_context, lex_len FROM memories WHERE tenant = %s ORDER BY seq",
    "SELECT memory_id, kind, dim, vector::text FROM memory_keys WHERE tenant = %s ORDER BY seq",
    "SELECT rows, tokens FROM lex_stats WHERE tenant = %s",
]


def test_insert_many_writes_what_insert_writes(db: str) -> None:
    rows = _rows(60)
    one, many = PostgresStore(db, tenant="one"), PostgresStore(db, tenant="many")
    try:
        with one.write() as tx:
            for row in rows[:10]:
                tx.insert(*row)
        with many.write() as tx:
            tx.insert_many(rows[:10])  # statistics and terms already there: they add up
        with one.write() as tx:
            for row in rows[10:]:
                tx.insert(*row)
        before = _read(many, "SELECT value::bigint FROM meta WHERE tenant = %s "
                             "AND name = 'keys_version'")[0][0]
        with many.write() as tx:
            tx.insert_many(rows[10:])
        for stmt in TABLES:
            got, want = _read(many, stmt), _read(one, stmt)
            assert got == want and got, stmt
        # the trigger the dense caches follow fired for the bulk statement
        after = _read(many, "SELECT value::bigint FROM meta WHERE tenant = %s "
                            "AND name = 'keys_version'")[0][0]
        assert after > before
        for scope in (*SCOPES, Scope()):
            query = q(scope)
            v = rows[5][1][0].vector
            for key in ("text", "window"):
                assert many.dense(query, v, 10, key) == one.dense(query, v, 10, key)
            assert many.lexical(query, ["ramen", "o'neil", "tea biscuit"], 20) == \
                one.lexical(query, ["ramen", "o'neil", "tea biscuit"], 20)
            got = many.pool(query, 10, vector=v, keys=["text"], terms=["ramen", "kyoto"])
            assert got == one.pool(query, 10, vector=v, keys=["text"], terms=["ramen", "kyoto"])
            assert got["text"]
    finally:
        one.close()
        many.close()


def test_a_cached_scope_sees_a_bulk_insert(db: str) -> None:
    reader, writer = PostgresStore(db), PostgresStore(db)
    try:
        first, second = _rows(20, seed=2), _rows(20, seed=3)
        with writer.write() as tx:
            tx.insert_many(first)
        query = q(SCOPES[0])
        v = second[0][1][0].vector
        old = reader.pool(query, 50, vector=v, keys=["text"], terms=[])["text"]
        assert reader._cache.slabs  # the scope is cached
        with writer.write() as tx:
            tx.insert_many(second)
        new = reader.pool(query, 50, vector=v, keys=["text"], terms=[])["text"]
        in_scope = {r.id for r, _, _ in first + second if r.scope == SCOPES[0]}
        assert {i for i, _ in new} == in_scope != {i for i, _ in old}
        assert new[0][0] == second[0][0].id
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("spoil", ["nul", "nan", "duplicate"])
def test_a_bad_row_leaves_nothing_of_its_batch(db: str, spoil: str) -> None:
    store = PostgresStore(db)
    try:
        with store.write() as tx:
            tx.insert_many(_rows(5, seed=4))
        counts = ["SELECT count(*) FROM memories WHERE tenant = %s",
                  "SELECT count(*) FROM memory_keys WHERE tenant = %s",
                  "SELECT rows, tokens FROM lex_stats WHERE tenant = %s",
                  "SELECT name, value FROM meta WHERE tenant = %s ORDER BY name"]
        before = [_read(store, c) for c in counts]
        rows = _rows(30, seed=5)
        r, keys, lex = rows[17]
        if spoil == "nul":
            rows[17] = (rec("a \x00 b", scope=r.scope), keys, Lexical("a \x00 b"))
        elif spoil == "nan":
            rows[17] = (r, [keys[0], Key("window", np.full(DIM, np.nan, dtype=np.float32))], lex)
        else:
            rows[17] = (rows[3][0], keys, lex)  # an id the batch already holds
        with pytest.raises(InvalidInput if spoil != "duplicate" else EngramError), \
                store.write() as tx:
            tx.insert_many(rows)
        assert [_read(store, c) for c in counts] == before
    finally:
        store.close()


# -- key tombstones: bounded, and no cache misses a deletion ------------------------------------

KEPT = 300  # tombstones kept per tenant in these tests (schema.TOMBSTONES_SETTING)


@pytest.fixture
def small(pg_server: Any, db: str) -> str:
    """A database whose tenants keep KEPT tombstones."""
    with pg_server.admin() as conn:
        conn.execute(f"ALTER DATABASE {db.split('/')[3].split('?')[0]} "
                     f"SET {schema.TOMBSTONES_SETTING} = {KEPT}")
    return db


def _fill(store: PostgresStore, n: int, scope: Scope, seed: int) -> list[str]:
    rows = _rows(n, seed)
    rows = [(rec(r.text, scope=scope), keys, lex) for r, keys, lex in rows]
    with store.write() as tx:
        tx.insert_many(rows)
    return [r.id for r, _, _ in rows]


def _tombstones(store: PostgresStore) -> tuple[int, int, int]:
    """(rows held, the count meta keeps, the horizon) of the store's tenant."""
    (held,), = _read(store, "SELECT count(*) FROM key_tombstones WHERE tenant = %s")
    meta = dict(_read(store, "SELECT name, value::bigint FROM meta WHERE tenant = %s "
                             "AND name IN ('tombstones', 'tombstone_horizon')"))
    return held, meta.get("tombstones", 0), meta.get("tombstone_horizon", 0)


def test_key_tombstones_stay_bounded(small: str) -> None:
    kept = KEPT
    store = PostgresStore(small, tenant="t")
    try:
        ids = _fill(store, kept + kept // 2, Scope("big"), seed=6)  # two keys each
        step = kept // 4  # memories per delete: kept / 2 tombstones
        for n, start in enumerate(range(0, len(ids), step), 1):
            with store.write() as tx:
                if n % 2:
                    tx.soft_delete(ids[start:start + step], NOW)
                else:
                    tx.erase(ids[start:start + step])
            held, counted, horizon = _tombstones(store)
            assert held == counted <= 2 * kept
            if n * step * 2 > 2 * kept:
                assert horizon > 0
        assert held == counted == 2 * kept - kept // 2 and horizon > 0
        (newest,), = _read(store, "SELECT max(id) FROM key_tombstones WHERE tenant = %s")
        (oldest,), = _read(store, "SELECT min(id) FROM key_tombstones WHERE tenant = %s")
        assert oldest == horizon + 1 or oldest > horizon
        assert newest > oldest
    finally:
        store.close()


@pytest.mark.parametrize("how", ["erase", "soft_delete"])
def test_a_cache_older_than_the_horizon_still_sees_every_deletion(small: str, how: str) -> None:
    reader, writer = PostgresStore(small), PostgresStore(small)  # two processes' caches
    try:
        mine = _fill(writer, 60, SCOPES[0], seed=7)
        big = _fill(writer, KEPT + 100, Scope("big"), seed=8)
        query = q(SCOPES[0])
        v = np.ones(DIM, dtype=np.float32)
        found = reader.pool(query, 100, vector=v, keys=["text", "window"], terms=[])
        assert {i for i, _ in found["text"]} == set(mine)
        held = dict(reader._cache.slabs)
        assert len(held) == 2
        gone = mine[::3]
        with writer.write() as tx:  # tombstones the reader has not applied...
            if how == "erase":
                tx.erase(gone)
            else:
                tx.soft_delete(gone, NOW)
        with writer.write() as tx:  # ... pruned by the deletions after them
            tx.erase(big)
        assert _tombstones(writer)[2] > 0
        (oldest,), = _read(writer, "SELECT min(id) FROM key_tombstones WHERE tenant = %s")
        assert all(slab.tomb_max < oldest for slab in held.values())
        found = reader.pool(query, 100, vector=v, keys=["text", "window"], terms=[])
        for key in ("text", "window"):
            assert {i for i, _ in found[key]} == set(mine) - set(gone)
        with reader._cache.lock:  # the scope was loaded afresh, and is cached again
            assert all(reader._cache.slabs[k] is not slab for k, slab in held.items())
            assert len(reader._cache.slabs) == 2
        assert {i for i, _ in reader.dense(query, v, 100)} == set(mine) - set(gone)
    finally:
        reader.close()
        writer.close()


def test_tsvector_literal_is_array_to_tsvector(db: str) -> None:
    """Lexemes of any characters (FTS5's tokens drop most punctuation, not all of it)."""
    terms = sorted({"a'b", "c\\d", "e f", "''", "\\", "zoë", "x:1", "y&z", "{q}", "t,u"})
    store = PostgresStore(db)
    try:
        got, want = store._read("SELECT %s::tsvector::text, array_to_tsvector(%s::text[])::text",
                                (sql.tsvector_literal(terms), terms))[0]
        assert got == want and got.count("'") >= 2 * len(terms)
        assert store._read("SELECT %s::tsvector = array_to_tsvector(%s::text[])",
                           (sql.tsvector_literal([]), []))[0][0]
    finally:
        store.close()

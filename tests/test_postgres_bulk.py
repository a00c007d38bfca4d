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
from engram.store.postgres import PostgresStore

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
    "SELECT term, df FROM lex_terms WHERE tenant = %s ORDER BY term",
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
        assert reader._slabs  # the scope is cached
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
                  "SELECT count(*), sum(df) FROM lex_terms WHERE tenant = %s",
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

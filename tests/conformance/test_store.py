"""The `Store` contract (store/base.py), exercised directly on a fresh database per test.

Vectors here are small hand-made unit vectors: the store treats them as data, so the contract
can be checked exactly (cosine order, best key) without the embedder.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from engram.filters import parse_filters
from engram.model import Event, EventType, Job, JobStatus, Kind, MemoryRecord, Scope, new_id
from engram.pipeline.text import content_hash
from engram.store import Key, Lexical, Query, Store

NOW = datetime(2025, 6, 1, 12, 0, 0, 123456, tzinfo=UTC)
DIM = 8
_seq = itertools.count()
U1, ANY = Scope("u1"), Scope()


def vec(*xs: float) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[: len(xs)] = xs
    return v / np.linalg.norm(v)


def rec(text: str = "a memory", *, scope: Scope = U1, kind: Kind = Kind.EPISODIC,
        **fields: object) -> MemoryRecord:
    # Distinct created_at per record keeps ordering assertions meaningful.
    created = NOW - timedelta(hours=1) + timedelta(seconds=next(_seq) % 3600)
    base: dict[str, object] = dict(
        id=new_id(), scope=scope, kind=kind, text=text, metadata={}, importance=0.5,
        created_at=created, updated_at=created, valid_from=created,
        content_hash=content_hash(text),
    )
    base.update(fields)
    return MemoryRecord(**base)  # type: ignore[arg-type]


def put(store: Store, *records: MemoryRecord, vectors: list[np.ndarray] | None = None) -> None:
    with store.write() as tx:
        for i, r in enumerate(records):
            v = vectors[i] if vectors else vec(1.0, 0.1 * i)
            tx.insert(r, [Key("text", v)], Lexical(r.text))


def q(scope: Scope = ANY, **kw: object) -> Query:
    return Query(scope=scope, now=kw.pop("now", NOW), **kw)  # type: ignore[arg-type]


def visible(store: Store, query: Query) -> set[str]:
    return {r.id for r in store.select(query, limit=1000)}


def event(r: MemoryRecord, typ: EventType = EventType.ADD, at: datetime = NOW,
          **kw: object) -> Event:
    return Event(id=new_id(), memory_id=r.id, type=typ, at=at, scope=r.scope, **kw)  # type: ignore[arg-type]


# -- insert / get / select -------------------------------------------------------------------

def test_insert_then_get_returns_every_field(store: Store) -> None:
    r = rec("Ana moved to Lisbon", scope=Scope("ana", "agent-1", "s1"), kind=Kind.SEMANTIC,
            metadata={"topic": "home", "n": 3, "tags": ["a", "é"], "nested": {"x": None}},
            importance=0.8, role="assistant", name="Ana",
            observed_at=NOW - timedelta(days=3, microseconds=7),
            valid_to=NOW + timedelta(days=1), superseded_by="x-1",
            provenance=("ep-1", "ep-2"), access_count=4,
            last_accessed_at=NOW - timedelta(minutes=5), expires_at=NOW + timedelta(days=9))
    put(store, r)
    assert store.get([r.id]) == {r.id: r}


def test_get_unknown_ids_are_absent(store: Store) -> None:
    r = rec()
    put(store, r)
    assert set(store.get([r.id, "nope", new_id()])) == {r.id}
    assert store.get([]) == {}


def test_select_pages_by_id_in_creation_order(store: Store) -> None:
    records = [rec(f"memory {i}") for i in range(7)]
    put(store, *records)
    pages, after = [], None
    while True:
        page = store.select(q(), after_id=after, limit=3)
        if not page:
            break
        pages.append([r.id for r in page])
        after = page[-1].id
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [i for p in pages for i in p] == sorted(r.id for r in records)
    assert [i for p in pages for i in p] == [r.id for r in records]  # ids sort by creation


def test_ids_by_scope_with_and_without_deleted(store: Store) -> None:
    a1, a2, b = rec(scope=Scope("a")), rec(scope=Scope("a", session_id="s")), rec(scope=Scope("b"))
    put(store, a1, a2, b)
    with store.write() as tx:
        tx.soft_delete([a2.id], NOW)
    assert store.ids(Scope("a")) == [a1.id]
    assert store.ids(Scope("a"), include_deleted=True) == sorted([a1.id, a2.id])
    assert store.ids(Scope()) == sorted([a1.id, b.id])


# -- Query visibility --------------------------------------------------------------------------

def test_scope_none_fields_match_anything(store: Store) -> None:
    r1 = rec(scope=Scope("u1", "ag", "s1"))
    r2 = rec(scope=Scope("u1", None, "s2"))
    r3 = rec(scope=Scope("u2", "ag", None))
    put(store, r1, r2, r3)
    assert visible(store, q()) == {r1.id, r2.id, r3.id}
    assert visible(store, q(Scope("u1"))) == {r1.id, r2.id}
    assert visible(store, q(Scope(agent_id="ag"))) == {r1.id, r3.id}
    assert visible(store, q(Scope("u1", session_id="s2"))) == {r2.id}
    assert visible(store, q(Scope("nobody"))) == set()


def test_kinds(store: Store) -> None:
    e, s, p = rec(kind=Kind.EPISODIC), rec(kind=Kind.SEMANTIC), rec(kind=Kind.PROCEDURAL)
    put(store, e, s, p)
    assert visible(store, q(kinds=(Kind.SEMANTIC,))) == {s.id}
    assert visible(store, q(kinds=(Kind.EPISODIC, Kind.PROCEDURAL))) == {e.id, p.id}
    assert visible(store, q(kinds=None)) == {e.id, s.id, p.id}


def test_deleted_and_expired_are_hidden(store: Store) -> None:
    live = rec("live")
    gone = rec("gone")
    expired = rec("expired", expires_at=NOW - timedelta(seconds=1))
    at_now = rec("expires exactly now", expires_at=NOW)
    later = rec("expires later", expires_at=NOW + timedelta(seconds=1))
    put(store, live, gone, expired, at_now, later)
    with store.write() as tx:
        tx.soft_delete([gone.id], NOW)
    assert visible(store, q()) == {live.id, later.id}
    # ... and an earlier `now` still sees what had not expired then.
    assert visible(store, q(now=NOW - timedelta(seconds=2))) == {live.id, expired.id, at_now.id,
                                                                  later.id}
    # get() returns stored records whatever their state.
    assert store.get([gone.id])[gone.id].deleted_at == NOW
    assert expired.id in store.get([expired.id])


def test_valid_to_and_as_of(store: Store) -> None:
    t0 = NOW - timedelta(days=10)
    old = rec("lives in Porto", valid_from=t0, valid_to=NOW - timedelta(days=5))
    new = rec("lives in Lisbon", valid_from=NOW - timedelta(days=5))
    future_end = rec("on holiday", valid_from=t0, valid_to=NOW + timedelta(days=1))
    put(store, old, new, future_end)
    assert visible(store, q()) == {new.id, future_end.id}  # current: not superseded
    assert visible(store, q(as_of=NOW - timedelta(days=7))) == {old.id, future_end.id}
    assert visible(store, q(as_of=NOW - timedelta(days=5))) == {new.id, future_end.id}
    assert visible(store, q(as_of=t0 - timedelta(seconds=1))) == set()
    assert visible(store, q(as_of=NOW + timedelta(days=2))) == {new.id}


def test_every_read_path_applies_one_visibility_rule(store: Store) -> None:
    """select, dense (the SQLite cache filters in numpy) and lexical see the same memories for
    every query: deleted, expired, superseded, not yet valid, of another kind or scope."""
    day = timedelta(days=1)
    rs = {
        "live": rec("zebra live"),
        "deleted": rec("zebra deleted"),
        "expired": rec("zebra expired", expires_at=NOW - day),
        "expiring": rec("zebra expiring", expires_at=NOW + day),
        "superseded": rec("zebra superseded", valid_from=NOW - 9 * day, valid_to=NOW - 3 * day),
        "successor": rec("zebra successor", valid_from=NOW - 3 * day),
        "future": rec("zebra future", valid_from=NOW + 2 * day),
        "ending": rec("zebra ending", valid_from=NOW - 9 * day, valid_to=NOW + day),
        "fact": rec("zebra fact", kind=Kind.SEMANTIC, metadata={"topic": "x"}),
        "other": rec("zebra other", scope=Scope("u2")),
    }
    put(store, *rs.values(), vectors=[vec(1, 0.01 * i) for i in range(len(rs))])
    with store.write() as tx:
        tx.soft_delete([rs["deleted"].id], NOW)
    names = {r.id: name for name, r in rs.items()}
    cases = {
        q(): {"live", "expiring", "successor", "future", "ending", "fact", "other"},
        q(U1): {"live", "expiring", "successor", "future", "ending", "fact"},
        q(now=NOW + 3 * day): {"live", "successor", "future", "fact", "other"},
        q(as_of=NOW - 5 * day): {"superseded", "ending"},
        q(as_of=NOW + 3 * day): {"live", "expiring", "successor", "future", "fact", "other"},
        q(kinds=(Kind.SEMANTIC,)): {"fact"},
        q(conditions=parse_filters({"topic": "x"})): {"fact"},
        q(conditions=parse_filters({"topic": {"ne": "x"}}), as_of=NOW - 5 * day):
            {"superseded", "ending"},
    }
    for query, expected in cases.items():
        assert {names[r.id] for r in store.select(query, limit=100)} == expected, query
        assert {names[m] for m, _ in store.dense(query, vec(1, 0), 100)} == expected, query
        assert {names[m] for m, _ in store.lexical(query, ["zebra"], 100)} == expected, query
    with store.write():  # inside a write the dense path checks candidates against the tables
        for query, expected in cases.items():
            assert {names[m] for m, _ in store.dense(query, vec(1, 0), 100)} == expected, query
    assert store.stats(Scope(), NOW).memories == len(cases[q()])


def test_reads_of_more_ids_than_one_statement_takes(store: Store) -> None:
    records = [rec(f"bulk {i}") for i in range(1234)]
    put(store, *records)
    ids = [r.id for r in records]
    assert store.get([*ids, "unknown"]) == {r.id: r for r in records}
    assert set(store.candidates(ids[::-1])) == set(ids)
    assert {r.id for r in store.select(q(), limit=5000)} == set(ids)
    with store.write() as tx:
        tx.soft_delete(ids[:700], NOW)
    assert store.ids(Scope()) == ids[700:]
    with store.write() as tx:
        tx.erase(ids[:1000])
    assert store.ids(Scope(), include_deleted=True) == ids[1000:]


@pytest.fixture
def tagged(store: Store) -> dict[str, MemoryRecord]:
    rs = {
        "food": rec("pasta",
                    metadata={"topic": "food", "score": 3, "flag": True, "d": "2024-01-05"},
                    importance=0.9, role="user", observed_at=NOW - timedelta(days=30)),
        "travel": rec("trip", metadata={"topic": "travel", "score": 7.5, "flag": False},
                      importance=0.2, role="assistant", observed_at=NOW - timedelta(days=1)),
        "none": rec("no topic", metadata={"score": 10, "topic": None}, importance=0.5,
                    role="user"),
        "bare": rec("no metadata", metadata={}, importance=0.5, role="user"),
    }
    put(store, *rs.values())
    return rs


def _names(store: Store, tagged: dict[str, MemoryRecord], filters: dict[str, object]) -> set[str]:
    ids = visible(store, q(conditions=parse_filters(filters)))
    return {name for name, r in tagged.items() if r.id in ids}


@pytest.mark.parametrize(("filters", "expected"), [
    ({"topic": "food"}, {"food"}),
    ({"topic": {"eq": "travel"}}, {"travel"}),
    ({"topic": None}, {"none", "bare"}),
    ({"topic": {"ne": "food"}}, {"travel", "none", "bare"}),
    ({"topic": {"in": ["food", "travel", "other"]}}, {"food", "travel"}),
    ({"topic": {"nin": ["food"]}}, {"travel", "none", "bare"}),
    ({"score": {"gt": 3}}, {"travel", "none"}),
    ({"score": {"gte": 3, "lt": 10}}, {"food", "travel"}),
    ({"score": {"lte": 7.5}}, {"food", "travel"}),
    ({"score": 3}, {"food"}),
    ({"flag": True}, {"food"}),
    ({"flag": False}, {"travel"}),
    ({"d": {"gte": "2024-01-01", "lt": "2024-02-01"}}, {"food"}),
    ({"topic": "food", "score": {"gt": 5}}, set()),
    ({"importance": {"gte": 0.5}}, {"food", "none", "bare"}),
    ({"role": "assistant"}, {"travel"}),
    ({"kind": "episodic"}, {"food", "travel", "none", "bare"}),
    ({"observed_at": {"gte": NOW - timedelta(days=2)}}, {"travel"}),
    ({"observed_at": {"lt": (NOW - timedelta(days=2)).isoformat()}}, {"food"}),
    ({"missing": {"in": [1, 2]}}, set()),
])
def test_metadata_and_field_conditions(store: Store, tagged: dict[str, MemoryRecord],
                                       filters: dict[str, object], expected: set[str]) -> None:
    assert _names(store, tagged, filters) == expected


def test_time_field_conditions_on_created_at(store: Store) -> None:
    early = rec("early", created_at=NOW - timedelta(days=3), updated_at=NOW - timedelta(days=3))
    late = rec("late", created_at=NOW - timedelta(hours=1), updated_at=NOW - timedelta(hours=1))
    put(store, early, late)
    conds = parse_filters({"created_at": {"gt": (NOW - timedelta(days=1)).isoformat()}})
    assert visible(store, q(conditions=conds)) == {late.id}
    conds = parse_filters({"created_at": {"lte": NOW - timedelta(days=1)}})
    assert visible(store, q(conditions=conds)) == {early.id}


# -- dense -----------------------------------------------------------------------------------

def test_dense_orders_by_cosine(store: Store) -> None:
    rs = [rec(f"r{i}") for i in range(5)]
    vs = [vec(1, 0), vec(1, 1), vec(0, 1), vec(-1, 1), vec(-1, 0)]
    put(store, *rs, vectors=vs)
    hits = store.dense(q(), vec(1, 0), 5)
    assert [mid for mid, _ in hits] == [r.id for r in rs]
    expected = [float(v @ vec(1, 0)) for v in vs]
    assert [s for _, s in hits] == pytest.approx(expected, abs=1e-5)
    assert [mid for mid, _ in store.dense(q(), vec(1, 0), 2)] == [rs[0].id, rs[1].id]


def test_dense_searches_one_key_kind(store: Store) -> None:
    two, one = rec("two keys"), rec("one key")
    with store.write() as tx:
        tx.insert(two, [Key("text", vec(0, 1)), Key("window", vec(1, 0.1))], Lexical(two.text))
        tx.insert(one, [Key("text", vec(1, 0.5))], Lexical(one.text))
    text_hits = store.dense(q(), vec(1, 0), 10)
    assert [mid for mid, _ in text_hits] == [one.id, two.id]
    assert text_hits[1][1] == pytest.approx(float(vec(0, 1) @ vec(1, 0)), abs=1e-5)
    assert store.dense(q(), vec(1, 0), 10, key="text") == text_hits
    window_hits = store.dense(q(), vec(1, 0), 10, key="window")
    assert [mid for mid, _ in window_hits] == [two.id]
    assert window_hits[0][1] == pytest.approx(float(vec(1, 0.1) @ vec(1, 0)), abs=1e-5)
    assert store.dense(q(), vec(1, 0), 10, key="nothing-of-this-kind") == []


def test_dense_fills_k_when_the_best_matches_are_filtered_out(store: Store) -> None:
    near = [rec(f"near {i}", kind=Kind.SEMANTIC) for i in range(150)]
    far = [rec(f"far {i}", kind=Kind.EPISODIC) for i in range(6)]
    put(store, *near, *far,
        vectors=[vec(1, 0.001 * i) for i in range(150)] + [vec(0.1, 1, i) for i in range(6)])
    hits = store.dense(q(kinds=(Kind.EPISODIC,)), vec(1, 0), 5)
    assert len(hits) == 5
    assert {mid for mid, _ in hits} <= {r.id for r in far}
    scores = [s for _, s in hits]
    assert scores == sorted(scores, reverse=True)


def test_dense_respects_scope_deletes_and_updates(store: Store) -> None:
    mine, other, gone = rec("mine"), rec("other", scope=Scope("u2")), rec("gone")
    put(store, mine, other, gone, vectors=[vec(1, 0.2), vec(1, 0), vec(1, 0.1)])
    assert [m for m, _ in store.dense(q(Scope("u1")), vec(1, 0), 10)] == [gone.id, mine.id]
    with store.write() as tx:
        tx.soft_delete([gone.id], NOW)
    assert [m for m, _ in store.dense(q(Scope("u1")), vec(1, 0), 10)] == [mine.id]
    with store.write() as tx:  # new keys replace the old ones
        tx.update(mine, [Key("text", vec(0, 1))], None)
    hits = store.dense(q(Scope("u1")), vec(0, 1), 10)
    assert hits == [(mine.id, pytest.approx(1.0, abs=1e-5))]
    assert store.dense(q(Scope("nobody")), vec(1, 0), 10) == []


def test_dense_scores_an_updated_memory_by_its_new_key(store: Store) -> None:
    a, b = rec("a"), rec("b")
    put(store, a, b, vectors=[vec(1, 0), vec(1, 0.05)])
    assert [m for m, _ in store.dense(q(), vec(1, 0), 2)] == [a.id, b.id]  # cache built
    for _ in range(3):  # replace the newest key, repeatedly
        with store.write() as tx:
            tx.update(b, [Key("text", vec(0, 1))], None)
        hits = dict(store.dense(q(), vec(0, 1), 2))
        assert hits[b.id] == pytest.approx(1.0, abs=1e-5)
        assert hits[a.id] == pytest.approx(0.0, abs=1e-5)


def test_dense_on_an_empty_store(store: Store) -> None:
    assert store.dense(q(), vec(1, 0), 3) == []


def test_dense_scores_a_memory_by_its_best_key_of_several(store: Store) -> None:
    # a long text's `passage` keys: several of one name per memory, its best one counts
    a, b = rec("a long text"), rec("another")
    passages_a = [vec(0, 1), vec(0, 0, 1), vec(0, 0, 0, 1)]
    with store.write() as tx:
        tx.insert(a, [Key("text", vec(1, 0)), *[Key("passage", v) for v in passages_a]],
                  Lexical(a.text))
        tx.insert(b, [Key("text", vec(0, 0, 1)), Key("passage", vec(0, 0, 1, 1))],
                  Lexical(b.text))
    hits = store.dense(q(), vec(0, 0, 1), 10, key="passage")
    assert [m for m, _ in hits] == [a.id, b.id]
    assert [s for _, s in hits] == pytest.approx([1.0, float(vec(0, 0, 1, 1) @ vec(0, 0, 1))],
                                                 abs=1e-5)
    assert [m for m, _ in store.dense(q(), vec(0, 0, 1), 10)] == [b.id, a.id]  # text apart
    found = store.key_vectors([a.id, b.id, "unknown"], "passage")
    assert set(found) == {a.id, b.id}
    assert found[a.id] == pytest.approx(np.stack(passages_a), abs=1e-6)  # in written order
    assert store.key_vectors([a.id], "window") == {}
    with store.write() as tx:  # new keys replace all of the old ones
        tx.update(a, [Key("text", vec(1, 0)), Key("passage", vec(0, 1, 1))], None)
    assert store.key_vectors([a.id], "passage")[a.id] == pytest.approx(
        vec(0, 1, 1)[None, :], abs=1e-6)
    assert [m for m, _ in store.dense(q(), vec(0, 1, 1), 10, key="passage")] == [a.id, b.id]
    assert dict(store.dense(q(), vec(0, 0, 0, 1), 10, key="passage"))[a.id] == pytest.approx(
        0.0, abs=1e-5)
    with store.write() as tx:
        tx.soft_delete([b.id], NOW)
        tx.erase([a.id])
    assert store.dense(q(), vec(0, 0, 1), 10, key="passage") == []
    assert store.key_vectors([a.id, b.id], "passage") == {}


# -- lexical ---------------------------------------------------------------------------------

def test_lexical_bm25_with_stemming(store: Store) -> None:
    runs = rec("She runs every morning in the park")
    swim = rec("He swims on Sundays")
    put(store, runs, swim)
    assert [m for m, _ in store.lexical(q(), ["running"], 10)] == [runs.id]
    assert [m for m, _ in store.lexical(q(), ["swimming", "sunday"], 10)] == [swim.id]
    assert store.lexical(q(), ["tennis"], 10) == []
    assert store.lexical(q(), [], 10) == []


def test_lexical_ranks_more_matching_terms_higher(store: Store) -> None:
    both = rec("tea and biscuits at noon")
    one = rec("tea at noon in a long sentence about many other unrelated things entirely")
    none = rec("coffee")
    put(store, both, one, none)
    hits = store.lexical(q(), ["tea", "biscuits"], 10)
    assert [m for m, _ in hits] == [both.id, one.id]
    assert hits[0][1] > hits[1][1]
    assert store.lexical(q(), ["tea", "biscuits"], 1) == hits[:1]


def test_lexical_respects_visibility_and_odd_terms(store: Store) -> None:
    a = rec("quokka sighting", scope=Scope("a"))
    b = rec("quokka again", scope=Scope("b"), kind=Kind.SEMANTIC)
    c = rec("quokka expired", scope=Scope("a"), expires_at=NOW - timedelta(days=1))
    put(store, a, b, c)
    assert {m for m, _ in store.lexical(q(Scope("a")), ["quokka"], 10)} == {a.id}
    assert {m for m, _ in store.lexical(q(kinds=(Kind.SEMANTIC,)), ["quokka"], 10)} == {b.id}
    # FTS syntax in a term is data, not query syntax.
    for term in ['"', 'quokka"', "AND", "NEAR(", "*", "o'neil", "-x"]:
        store.lexical(q(), [term], 10)


def test_lexical_context_column_counts_less_than_the_body(store: Store) -> None:
    body = rec("the ferry to the island")
    ctx = rec("yes, every summer")
    with store.write() as tx:
        tx.insert(body, [Key("text", vec(1, 0))], Lexical(body.text))
        tx.insert(ctx, [Key("text", vec(0, 1))], Lexical(ctx.text, "did you take the ferry?"))
    hits = store.lexical(q(), ["ferry"], 10)
    assert [m for m, _ in hits] == [body.id, ctx.id]
    assert hits[0][1] > hits[1][1] > 0
    heavy = store.lexical(q(), ["ferry"], 10, previous_weight=5.0)
    assert [m for m, _ in heavy] == [ctx.id, body.id]


def test_lexical_follows_updates_and_deletes(store: Store) -> None:
    r = rec("walrus on the beach")
    put(store, r)
    with store.write() as tx:
        tx.update(r, None, Lexical("pelican on the pier"))
    assert store.lexical(q(), ["walrus"], 10) == []
    assert [m for m, _ in store.lexical(q(), ["pelican"], 10)] == [r.id]
    with store.write() as tx:
        tx.soft_delete([r.id], NOW)
    assert store.lexical(q(), ["pelican"], 10) == []


# -- find_hash / recent_episodes / eviction_pool --------------------------------------------

def test_find_hash_is_exact_on_scope_kind_and_visibility(store: Store) -> None:
    text = "Likes green tea"
    fact = rec(text, kind=Kind.SEMANTIC, scope=Scope("u1"))
    in_session = rec(text, kind=Kind.SEMANTIC, scope=Scope("u1", session_id="s"))
    put(store, fact, in_session)
    h = content_hash(text)
    assert store.find_hash(Scope("u1"), Kind.SEMANTIC, h, NOW) == fact
    assert store.find_hash(Scope("u1", session_id="s"), Kind.SEMANTIC, h, NOW) == in_session
    assert store.find_hash(Scope("u1"), Kind.PROCEDURAL, h, NOW) is None
    assert store.find_hash(Scope("u2"), Kind.SEMANTIC, h, NOW) is None
    assert store.find_hash(Scope(), Kind.SEMANTIC, h, NOW) is None
    assert store.find_hash(Scope("u1"), Kind.SEMANTIC, content_hash("other"), NOW) is None
    with store.write() as tx:
        tx.soft_delete([fact.id], NOW)
    assert store.find_hash(Scope("u1"), Kind.SEMANTIC, h, NOW) is None


def test_find_hash_skips_expired_and_superseded(store: Store) -> None:
    exp = rec("x", kind=Kind.SEMANTIC, scope=Scope("e"), expires_at=NOW - timedelta(seconds=1))
    old = rec("x", kind=Kind.SEMANTIC, scope=Scope("s"), valid_to=NOW - timedelta(seconds=1))
    put(store, exp, old)
    assert store.find_hash(Scope("e"), Kind.SEMANTIC, content_hash("x"), NOW) is None
    assert store.find_hash(Scope("s"), Kind.SEMANTIC, content_hash("x"), NOW) is None


def test_recent_episodes_newest_first_in_the_exact_scope(store: Store) -> None:
    s = Scope("u1", session_id="s1")
    assert store.recent_episodes(s, 3) == []
    first = rec("first", scope=s, valid_from=NOW - timedelta(minutes=2))
    latest = rec("latest", scope=s, valid_from=NOW - timedelta(minutes=1))
    back_filled = rec("back-filled", scope=s, valid_from=NOW - timedelta(minutes=3))
    fact = rec("a fact", scope=s, kind=Kind.SEMANTIC, valid_from=NOW)
    other = rec("other session", scope=Scope("u1", session_id="s2"), valid_from=NOW)
    put(store, first, latest, back_filled, fact, other)
    assert store.recent_episodes(s, 1) == [latest]
    assert store.recent_episodes(s, 10) == [latest, first, back_filled]
    assert store.recent_episodes(Scope("u1"), 10) == []  # exact: no session is its own scope
    with store.write() as tx:
        tx.soft_delete([latest.id], NOW)
    assert store.recent_episodes(s, 2) == [first, back_filled]


def test_eviction_pool_is_the_visible_exact_scope(store: Store) -> None:
    a = rec("a", scope=Scope("u1"))
    b = rec("b", scope=Scope("u1"), kind=Kind.SEMANTIC)
    sess = rec("c", scope=Scope("u1", session_id="s"))
    exp = rec("d", scope=Scope("u1"), expires_at=NOW - timedelta(seconds=1))
    gone = rec("e", scope=Scope("u1"))
    old = rec("f", scope=Scope("u1"), kind=Kind.SEMANTIC, valid_to=NOW - timedelta(days=1))
    put(store, a, b, sess, exp, gone, old)
    with store.write() as tx:
        tx.soft_delete([gone.id], NOW)
    # superseded versions are in the pool too: eviction may take history first
    assert {r.id for r in store.eviction_pool(Scope("u1"), NOW)} == {a.id, b.id, old.id}


def test_episodes_around_an_episode_of_its_exact_scope(store: Store) -> None:
    s = Scope("u1", session_id="s1")
    t = NOW - timedelta(hours=1)
    e = [rec(f"turn {i}", scope=s, valid_from=t + timedelta(minutes=i)) for i in range(6)]
    tie = rec("same time as turn 2, stored later", scope=s, valid_from=e[2].valid_from)
    gone = rec("deleted turn", scope=s, valid_from=t + timedelta(minutes=3, seconds=30))
    fact = rec("a fact of the session", scope=s, kind=Kind.SEMANTIC, valid_from=e[2].valid_from)
    other = rec("other session", scope=Scope("u1", session_id="s2"), valid_from=e[2].valid_from)
    wider = rec("no session", scope=Scope("u1"), valid_from=e[2].valid_from)
    put(store, *e, tie, gone, fact, other, wider)
    with store.write() as tx:
        tx.soft_delete([gone.id], NOW)
    # oldest first on both sides; ties on the time go by insertion order
    assert store.episodes_around(e[2].id, 2) == ([e[0], e[1]], [tie, e[3]])
    assert store.episodes_around(tie.id, 2) == ([e[1], e[2]], [e[3], e[4]])
    assert store.episodes_around(e[3].id, 1) == ([tie], [e[4]])  # the deleted turn is skipped
    assert store.episodes_around(e[0].id, 9) == ([], [e[1], e[2], tie, e[3], e[4], e[5]])
    assert store.episodes_around(e[5].id, 1) == ([e[4]], [])
    assert store.episodes_around(wider.id, 3) == ([], [])  # alone in its exact scope
    assert store.episodes_around(fact.id, 3) == ([], [])  # not an episode
    assert store.episodes_around("unknown", 3) == ([], [])


# -- soft delete / erase / events ------------------------------------------------------------

def test_soft_delete_hides_keeps_row_and_events(store: Store) -> None:
    r = rec("pangolin facts")
    put(store, r)
    with store.write() as tx:
        tx.append(event(r))
        tx.soft_delete([r.id], NOW)
        tx.append(event(r, EventType.DELETE))
    assert store.select(q(), limit=10) == []
    assert store.dense(q(), vec(1, 0), 10) == []
    assert store.lexical(q(), ["pangolin"], 10) == []
    assert store.get([r.id])[r.id].deleted_at == NOW
    assert [e.type for e in store.events(r.id)] == [EventType.ADD, EventType.DELETE]
    # The retrieval keys are gone too: new keys for another memory do not resurrect it.
    other = rec("other")
    put(store, other)
    assert [m for m, _ in store.dense(q(), vec(1, 0), 10)] == [other.id]


def test_erase_removes_rows_keys_text_and_events(store: Store) -> None:
    gone, kept = rec("narwhal secret", scope=Scope("a")), rec("narwhal public", scope=Scope("b"))
    put(store, gone, kept)
    with store.write() as tx:
        tx.append(event(gone, before={"text": "narwhal secret"}))
        tx.append(event(kept))
    with store.write() as tx:
        tx.erase([gone.id])
    assert store.get([gone.id]) == {}
    assert store.events(gone.id) == []
    assert store.ids(Scope("a"), include_deleted=True) == []
    assert [m for m, _ in store.lexical(q(), ["narwhal"], 10)] == [kept.id]
    assert [m for m, _ in store.dense(q(), vec(1, 0), 10)] == [kept.id]
    assert len(store.events(kept.id)) == 1
    store.reclaim()
    assert store.get([kept.id]) == {kept.id: kept}


def test_erase_of_a_soft_deleted_memory(store: Store) -> None:
    r = rec("x")
    put(store, r)
    with store.write() as tx:
        tx.soft_delete([r.id], NOW)
    with store.write() as tx:
        tx.erase([r.id])
    assert store.get([r.id]) == {}


def test_events_keep_append_order_and_fields(store: Store) -> None:
    r = rec("x", scope=Scope("u", "a", "s"))
    put(store, r)
    evs = [
        event(r, EventType.ADD, NOW, after={"text": "x", "n": 1}),
        event(r, EventType.UPDATE, NOW - timedelta(days=1), before={"text": "x"},
              after={"text": "y", "é": ["ü"]}, reason="why not"),
        event(r, EventType.MERGE, NOW - timedelta(days=2)),
    ]
    with store.write() as tx:
        for e in evs:
            tx.append(e)
    assert store.events(r.id) == evs  # append order, not time order
    assert store.events("unknown") == []


def test_touch_counts_accesses(store: Store) -> None:
    r = rec("x")
    put(store, r)
    store.touch([r.id], NOW)
    store.touch([r.id], NOW + timedelta(seconds=1))
    store.touch([], NOW)
    got = store.get([r.id])[r.id]
    assert got.access_count == 2
    assert got.last_accessed_at == NOW + timedelta(seconds=1)


def test_update_replaces_the_record(store: Store) -> None:
    r = rec("x", metadata={"a": 1})
    put(store, r)
    changed = MemoryRecord(**{**r.__dict__, "text": "y", "metadata": {"b": 2}, "importance": 0.9,
                              "updated_at": NOW})
    with store.write() as tx:
        tx.update(changed)
    assert store.get([r.id])[r.id] == changed
    # no keys / lexical given: the old ones stay
    assert [m for m, _ in store.lexical(q(), ["x"], 10)] == [r.id]
    assert [m for m, _ in store.dense(q(), vec(1, 0), 10)] == [r.id]


def test_iter_export_yields_records_with_events(store: Store) -> None:
    a, b, c = rec("a", scope=Scope("u1")), rec("b", scope=Scope("u1")), rec("c", scope=Scope("u2"))
    put(store, a, b, c)
    with store.write() as tx:
        tx.append(event(a))
        tx.soft_delete([b.id], NOW)
    out = list(store.iter_export(Scope("u1")))
    assert [r.id for r, _ in out] == [a.id, b.id]
    assert [len(evs) for _, evs in out] == [1, 0]
    assert out[1][0].deleted_at == NOW


# -- stats -----------------------------------------------------------------------------------

def test_stats(store: Store) -> None:
    empty = store.stats(Scope(), NOW)
    assert (empty.memories, empty.events, empty.deleted, empty.by_kind) == (0, 0, 0, {})
    e1, e2 = rec("e1", scope=Scope("u1")), rec("e2", scope=Scope("u1", session_id="s"))
    s1 = rec("s1", scope=Scope("u2"), kind=Kind.SEMANTIC)
    gone = rec("gone", scope=Scope("u1"))
    exp = rec("exp", scope=Scope("u1"), expires_at=NOW - timedelta(seconds=1))
    old = rec("old", scope=Scope("u2"), kind=Kind.SEMANTIC, valid_to=NOW - timedelta(seconds=1))
    put(store, e1, e2, s1, gone, exp, old)
    with store.write() as tx:
        for r in (e1, e2, s1, gone, exp, old):
            tx.append(event(r))
        tx.soft_delete([gone.id], NOW)
        tx.append(event(gone, EventType.DELETE))
    st = store.stats(Scope(), NOW)
    assert st.memories == 3
    assert st.by_kind == {"episodic": 2, "semantic": 1}
    assert (st.deleted, st.expired, st.superseded) == (1, 1, 1)
    assert st.events == 7
    assert st.scopes == 3
    u1 = store.stats(Scope("u1"), NOW)
    assert (u1.memories, u1.deleted, u1.expired, u1.superseded, u1.events) == (2, 1, 1, 0, 5)
    assert u1.by_kind == {"episodic": 2}
    assert store.stats(Scope("nobody"), NOW).memories == 0
    assert set(st.to_dict()) >= {"memories", "by_kind", "deleted", "events", "jobs"}
    assert st.jobs == {s.value: 0 for s in JobStatus}  # every status, even with no job


def test_stats_count_jobs_per_status_in_the_scope(store: Store) -> None:
    def job(scope: Scope, status: JobStatus) -> Job:
        return Job(id=new_id(), task="add", scope=scope, payload={}, status=status,
                   created_at=NOW, updated_at=NOW, run_at=NOW)

    with store.write() as tx:
        for scope, status in [(Scope("u1"), JobStatus.QUEUED), (Scope("u1"), JobStatus.QUEUED),
                              (Scope("u1", session_id="s"), JobStatus.DONE),
                              (Scope("u1"), JobStatus.FAILED), (Scope("u2"), JobStatus.QUEUED)]:
            tx.put_job(job(scope, status))
    assert store.stats(Scope(), NOW).jobs == {"queued": 3, "running": 0, "done": 1, "failed": 1}
    assert store.stats(Scope("u1"), NOW).jobs == {"queued": 2, "running": 0, "done": 1, "failed": 1}
    assert store.stats(Scope(session_id="s"), NOW).jobs == {"queued": 0, "running": 0, "done": 1,
                                                           "failed": 0}
    claimed = store.claim_job(NOW, NOW + timedelta(minutes=1))
    assert claimed is not None
    assert store.stats(Scope(), NOW).jobs["running"] == 1
    assert store.stats(Scope(), NOW).jobs["queued"] == 2


# -- transactions and migrations -------------------------------------------------------------

def test_write_rolls_back_whole_on_exception(store: Store) -> None:
    kept = rec("kept")
    put(store, kept)

    class Boom(Exception):
        pass

    r = rec("never")
    with pytest.raises(Boom), store.write() as tx:
        tx.insert(r, [Key("text", vec(0, 1))], Lexical("never"))
        tx.append(event(r))
        tx.soft_delete([kept.id], NOW)
        tx.update(MemoryRecord(**{**kept.__dict__, "text": "changed"}), None,
                  Lexical("changed"))
        raise Boom
    assert store.get([r.id]) == {}
    assert store.events(r.id) == []
    assert store.get([kept.id]) == {kept.id: kept}
    assert store.lexical(q(), ["never"], 10) == []
    assert store.lexical(q(), ["changed"], 10) == []
    assert [m for m, _ in store.dense(q(), vec(0, 1), 10)] == [kept.id]
    assert store.stats(Scope(), NOW).memories == 1
    # and the store still takes writes afterwards
    put(store, r)
    assert r.id in store.get([r.id])


def test_failed_insert_rolls_back_earlier_writes_of_the_transaction(store: Store) -> None:
    first, dup = rec("first"), rec("dup")
    put(store, dup)
    with pytest.raises(Exception), store.write() as tx:  # noqa: B017 - backend-specific type
        tx.insert(first, [Key("text", vec(1, 0))], Lexical("first"))
        tx.insert(dup, [Key("text", vec(1, 0))], Lexical("dup"))  # same id again: must fail
    assert store.get([first.id]) == {}


def test_migrations_are_recorded_and_reopening_is_idempotent(store_factory, tmp_path) -> None:
    s1 = store_factory(tmp_path)
    names = s1.migrations()
    # each once, in the order applied (not by name: SQLite applies 0003_graph after
    # 0003_jobs_sessions, PostgreSQL names its graph migration 0003 too)
    assert names and len(set(names)) == len(names) and names[0] == "0001_initial"
    r = rec("survives reopening")
    put(s1, r)
    s1.close()
    s2 = store_factory(tmp_path)
    try:
        assert s2.migrations() == names
        assert s2.get([r.id]) == {r.id: r}
        assert [m for m, _ in s2.lexical(q(), ["reopening"], 10)] == [r.id]
        assert [m for m, _ in s2.dense(q(), vec(1, 0), 10)] == [r.id]
    finally:
        s2.close()
    s3 = store_factory(tmp_path)
    try:
        assert s3.migrations() == names
    finally:
        s3.close()


def test_two_store_instances_see_each_others_writes(store_factory, tmp_path) -> None:
    s1, s2 = store_factory(tmp_path), store_factory(tmp_path)
    try:
        a = rec("from one")
        put(s1, a, vectors=[vec(1, 0)])
        assert [m for m, _ in s2.dense(q(), vec(1, 0), 5)] == [a.id]  # builds s2's cache
        b = rec("from two")
        put(s2, b, vectors=[vec(0, 1)])
        assert [m for m, _ in s1.dense(q(), vec(0, 1), 1)] == [b.id]
        with s1.write() as tx:
            tx.soft_delete([b.id], NOW)
        assert [m for m, _ in s2.dense(q(), vec(0, 1), 5)] == [a.id]  # cache follows deletes
    finally:
        s1.close()
        s2.close()


# -- stateful: any sequence of writes, then every read agrees with a plain model -------------

WORDS = ("apple", "river", "violin", "cloud")
SCOPES = (Scope("u1"), Scope("u2"), Scope("u1", session_id="s"))
vectors = st.lists(st.integers(-3, 3), min_size=DIM, max_size=DIM).filter(any).map(
    lambda xs: vec(*xs))


class StoreMachine(RuleBasedStateMachine):
    make: Callable[[Path], Store]

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp())
        self.store = self.make(self.dir)
        self.live: dict[str, tuple[MemoryRecord, np.ndarray, str]] = {}
        self.gone: set[str] = set()

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(scope=st.sampled_from(SCOPES), word=st.sampled_from(WORDS), v=vectors)
    def insert(self, scope: Scope, word: str, v: np.ndarray) -> None:
        r = rec(f"a note about {word}", scope=scope)
        with self.store.write() as tx:
            tx.insert(r, [Key("text", v)], Lexical(r.text))
        self.live[r.id] = (r, v, word)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def soft_delete(self, data: st.DataObject) -> None:
        mid = data.draw(st.sampled_from(sorted(self.live)))
        with self.store.write() as tx:
            tx.soft_delete([mid], NOW)
        del self.live[mid]
        self.gone.add(mid)

    @precondition(lambda self: self.live or self.gone)
    @rule(data=st.data())
    def erase(self, data: st.DataObject) -> None:
        mid = data.draw(st.sampled_from(sorted({*self.live, *self.gone})))
        with self.store.write() as tx:
            tx.erase([mid])
        self.live.pop(mid, None)
        self.gone.discard(mid)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), v=vectors, word=st.none() | st.sampled_from(WORDS))
    def update(self, data: st.DataObject, v: np.ndarray, word: str | None) -> None:
        mid = data.draw(st.sampled_from(sorted(self.live)))
        r, _, old_word = self.live[mid]
        with self.store.write() as tx:
            tx.update(r, [Key("text", v)], Lexical(f"a note about {word}") if word else None)
        self.live[mid] = (r, v, word or old_word)

    @rule(v=vectors, scope=st.sampled_from((ANY, *SCOPES)))
    def rollback(self, v: np.ndarray, scope: Scope) -> None:
        with pytest.raises(KeyboardInterrupt), self.store.write() as tx:
            tx.insert(rec("never", scope=scope), [Key("text", v)], Lexical("apple"))
            raise KeyboardInterrupt

    @invariant()
    def reads_agree_with_the_model(self) -> None:
        assert [r.id for r in self.store.select(q(), limit=10_000)] == sorted(self.live)
        for scope in SCOPES:
            wanted = {mid for mid, (r, _, _) in self.live.items()
                      if r.scope.user_id == scope.user_id
                      and (scope.session_id is None or r.scope.session_id == scope.session_id)}
            assert {r.id for r in self.store.select(q(scope), limit=10_000)} == wanted
        for word in WORDS:
            found = {mid for mid, _ in self.store.lexical(q(), [word], 10_000)}
            assert found == {mid for mid, (_, _, w) in self.live.items() if w == word}
        probe = vec(1, 2, 3, 4, 5, 6, 7, 8)
        hits = self.store.dense(q(), probe, max(1, len(self.live)))
        assert {mid for mid, _ in hits} == set(self.live)
        for mid, score in hits:
            assert score == pytest.approx(float(self.live[mid][1] @ probe), abs=1e-5)


def test_store_state_machine(store_factory: Callable[[Path], Store]) -> None:
    machine = type("Machine", (StoreMachine,), {"make": staticmethod(store_factory)})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=25, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


def test_sqlite_upgrades_a_database_made_by_an_older_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engram.store.sqlite import SQLiteStore, schema

    path = tmp_path / "old.db"
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:1])
        old = SQLiteStore(path)
        a, b = rec("apple"), rec("river")
        put(old, a, b, vectors=[vec(1, 0), vec(0, 1)])
        assert old.migrations() == [schema.MIGRATIONS[0][0]]
        old.close()
    new = SQLiteStore(path)
    try:
        assert new.migrations() == [name for name, _ in schema.MIGRATIONS]
        assert new.get([a.id, b.id]) == {a.id: a, b.id: b}
        assert dict(new.dense(q(), vec(1, 0), 2)) == {a.id: pytest.approx(1.0, abs=1e-5),
                                                      b.id: pytest.approx(0.0, abs=1e-5)}
        assert [m for m, _ in new.lexical(q(), ["river"], 5)] == [b.id]
        for _ in range(2):  # the newest key replaced twice: no seq is handed out again
            with new.write() as tx:
                tx.update(b, [Key("text", vec(1, 1))], None)
            assert dict(new.dense(q(), vec(1, 1), 2))[b.id] == pytest.approx(1.0, abs=1e-5)
    finally:
        new.close()

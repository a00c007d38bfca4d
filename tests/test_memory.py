"""`Memory` behaviour through its public API, on a real SQLite file and the real MiniLM model."""

from __future__ import annotations

import inspect
import json
import sqlite3
import threading
import time
import types
import typing
from collections.abc import Callable
from contextlib import closing
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engram import (
    AsyncMemory,
    Config,
    EngramError,
    EventType,
    InvalidFilter,
    InvalidImport,
    InvalidInput,
    Kind,
    Memory,
    NotFound,
)
from engram.model import Scope, utcnow
from engram.pipeline.index import window_vector
from engram.store import Query
from engram.store.sqlite.sql import AUTOCHECKPOINT_PAGES
from engram.store.sqlite.store import COUNTS_CHECKPOINT_EVERY


def ids_of(mem: Memory, **kw: Any) -> list[str]:
    return [r.id for r in mem.list(limit=1000, **kw).items]


def state(mem: Memory, snapshot: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    st = mem.stats().to_dict()
    st.pop("db_bytes")
    return {"stats": st, "list": [r.to_dict() for r in mem.list(limit=1000).items],
            "rows": snapshot(mem.config.path)}


# -- add ---------------------------------------------------------------------------------------

def test_add_a_string(mem: Memory) -> None:
    res = mem.add("I moved to Lisbon in May", user_id="ana")
    assert len(res.memories) == 1 and len(res.events) == 1
    rec = res.memories[0]
    assert (rec.text, rec.kind, rec.role, rec.scope) == (
        "I moved to Lisbon in May", Kind.EPISODIC, "user", Scope("ana"))
    assert res.events[0].type is EventType.ADD and res.events[0].memory_id == rec.id
    assert mem.get(rec.id) == rec
    assert rec.content_hash and rec.importance == 0.5


def test_add_a_dict_and_a_list_keeps_order_and_fields(mem: Memory) -> None:
    one = mem.add({"role": "assistant", "content": "Noted!", "name": "Bot"}, session_id="s1")
    assert one.memories[0].role == "assistant" and one.memories[0].name == "Bot"
    many = mem.add(["first", {"role": "user", "content": "second"}, "third", "fourth"],
                   session_id="s1")
    texts = [r.text for r in many.memories]
    assert texts == ["first", "second", "third", "fourth"]
    assert [e.type for e in many.events] == [EventType.ADD] * 4
    # list() returns creation order, also within one batch
    assert [r.text for r in mem.list(session_id="s1").items] == ["Noted!", *texts]


def test_message_metadata_merges_over_call_metadata(mem: Memory) -> None:
    res = mem.add([{"content": "hello", "metadata": {"b": 2, "c": [3]}}, "plain"],
                  metadata={"a": 1, "b": 1})
    assert res.memories[0].metadata == {"a": 1, "b": 2, "c": [3]}
    assert res.memories[1].metadata == {"a": 1, "b": 1}
    assert mem.get(res.memories[0].id).metadata == {"a": 1, "b": 2, "c": [3]}


def test_observed_at_is_kept_apart_from_created_at(mem: Memory) -> None:
    before = utcnow()
    when = datetime(2020, 3, 1, 9, 30, tzinfo=UTC)
    own = {"content": "own time", "observed_at": "2019-07-04T10:00:00+02:00"}
    res = mem.add(["call time", own], observed_at=when)
    a, b = (mem.get(r.id) for r in res.memories)
    assert a.observed_at == when
    assert b.observed_at == datetime(2019, 7, 4, 8, 0, tzinfo=UTC)
    for r in (a, b):
        assert before <= r.created_at <= utcnow()
        assert r.created_at == r.updated_at
    naive = mem.add("naive", observed_at=datetime(2021, 1, 1, 12, 0)).memories[0]
    assert mem.get(naive.id).observed_at == datetime(2021, 1, 1, 12, 0, tzinfo=UTC)
    other_tz = datetime(2021, 1, 1, 12, 0, tzinfo=timezone(timedelta(hours=-5)))
    assert mem.add("offset", observed_at=other_tz).memories[0].observed_at == datetime(
        2021, 1, 1, 17, 0, tzinfo=UTC)
    assert mem.add("no time").memories[0].observed_at is None


def test_identical_episodes_are_two_memories(mem: Memory) -> None:
    a = mem.add("I'm tired", user_id="u").memories[0]
    b = mem.add("I'm tired", user_id="u").memories[0]
    assert a.id != b.id
    assert ids_of(mem, user_id="u") == [a.id, b.id]
    assert mem.stats().events == 2


def test_exact_duplicate_fact_adds_nothing(mem: Memory) -> None:
    first = mem.add("Ana likes green tea", user_id="ana", kind="semantic")
    again = mem.add("  ana likes GREEN tea. ", user_id="ana", kind="semantic")
    assert again.events == []
    assert [r.id for r in again.memories] == [first.memories[0].id]
    assert mem.stats().memories == 1 and mem.stats().events == 1
    assert mem.history(first.memories[0].id)[-1].type is EventType.ADD
    # same text, other scope or other kind: a new memory
    mem.add("Ana likes green tea", user_id="bob", kind="semantic")
    mem.add("Ana likes green tea", user_id="ana", kind="procedural")
    mem.add("Ana likes green tea", user_id="ana")
    assert mem.stats().memories == 4
    # duplicates inside one batch too
    res = mem.add(["Use metric units", "use metric units"], user_id="ana", kind="procedural")
    assert len({r.id for r in res.memories}) == 1 and len(res.events) == 1


def test_near_duplicate_fact_merges_with_provenance_of_both(mem: Memory) -> None:
    first = mem.add("Ana lives in Lisbon", user_id="ana", kind="semantic",
                    metadata={"src": "chat", "a": 1}).memories[0]
    res = mem.add("Ana lives in Lisbon, Portugal", user_id="ana", kind="semantic",
                  metadata={"src": "chat", "b": 2}, importance=0.9)
    assert [e.type for e in res.events] == [EventType.MERGE]
    merged = res.memories[0]
    assert merged.id == first.id
    assert merged.text == "Ana lives in Lisbon, Portugal"  # the more informative text
    assert merged.metadata == {"src": "chat", "a": 1, "b": 2}
    assert merged.importance == 0.9
    assert first.id in merged.provenance
    assert len(merged.provenance) == 2  # ... and the merged-in newcomer
    assert ids_of(mem, user_id="ana") == [first.id]
    hist = mem.history(first.id)
    assert [e.type for e in hist] == [EventType.ADD, EventType.MERGE]
    assert hist[1].before["text"] == "Ana lives in Lisbon"
    assert hist[1].after["text"] == "Ana lives in Lisbon, Portugal"
    # the merged text is what is indexed now (asked before a newer fact about Portugal exists:
    # the newer one would rank first, as it should)
    assert mem.search("Portugal", user_id="ana")[0].memory.id == first.id
    # metadata that disagrees (here a relation's type) makes it another fact, never a merge
    other = mem.add("Ana lives in Lisbon, Portugal, Europe", user_id="ana", kind="semantic",
                    metadata={"src": "profile"})
    assert [e.type for e in other.events] == [EventType.ADD]
    # untouched by the other fact (the search above only counted an access)
    assert replace(mem.get(first.id), access_count=0, last_accessed_at=None) == merged


def test_near_duplicates_in_one_batch_merge(mem: Memory) -> None:
    res = mem.add(["Ana lives in Lisbon", "Ana lives in Lisbon, Portugal"], kind="semantic")
    assert [e.type for e in res.events] == [EventType.ADD, EventType.MERGE]
    assert mem.stats().memories == 1
    assert mem.list().items[0].text == "Ana lives in Lisbon, Portugal"


def test_different_facts_are_not_merged(mem: Memory) -> None:
    mem.add("The user likes tea", user_id="u", kind="semantic")
    res = mem.add("The user likes coffee", user_id="u", kind="semantic")
    assert [e.type for e in res.events] == [EventType.ADD]
    assert sorted(r.text for r in mem.list(user_id="u").items) == [
        "The user likes coffee", "The user likes tea"]


def test_a_changed_detail_is_a_new_fact_not_a_merge(mem: Memory) -> None:
    old = mem.add("My room number is 101", user_id="u", kind="semantic").memories[0]
    res = mem.add("My room number is 102", user_id="u", kind="semantic")
    assert [e.type for e in res.events] == [EventType.ADD]
    assert mem.get(old.id).text == "My room number is 101"
    assert sorted(r.text for r in mem.list(user_id="u").items) == [
        "My room number is 101", "My room number is 102"]


def test_episodes_are_never_merged(mem: Memory) -> None:
    mem.add("Ana lives in Lisbon")
    res = mem.add("Ana lives in Lisbon, Portugal")
    assert [e.type for e in res.events] == [EventType.ADD]
    assert mem.stats().memories == 2


# -- forgetting ------------------------------------------------------------------------------

def test_expired_memories_are_invisible(mem: Memory) -> None:
    past = utcnow() - timedelta(minutes=1)
    gone = mem.add("the wifi password is hunter2", user_id="u", expires_at=past).memories[0]
    kept = mem.add("the door code is 4711", user_id="u",
                   expires_at=utcnow() + timedelta(days=1)).memories[0]
    with pytest.raises(NotFound):
        mem.get(gone.id)
    assert ids_of(mem, user_id="u") == [kept.id]
    assert gone.id not in {h.memory.id for h in mem.search("wifi password hunter2", user_id="u")}
    assert mem.stats().expired == 1
    # expiring by update works the same way
    mem.update(kept.id, expires_at=past)
    assert ids_of(mem, user_id="u") == []
    assert mem.search("door code", user_id="u") == []


def test_capacity_evicts_lowest_retention_for_good(tmp_path: Path, embedder) -> None:
    cfg = Config.from_env(path=tmp_path / "cap.db", max_memories_per_scope=3)
    with Memory(config=cfg, embedder=embedder) as mem:
        texts = {0.9: "Ana's daughter is called Lia", 0.1: "It rained on Tuesday",
                 0.8: "Ana is allergic to peanuts"}
        ids = {imp: mem.add(t, user_id="ana", importance=imp).memories[0].id
               for imp, t in texts.items()}
        other = mem.add("Bob plays chess", user_id="bob", importance=0.0).memories[0]
        assert len(ids_of(mem, user_id="ana")) == 3
        res = mem.add("Ana works as a nurse", user_id="ana", importance=0.7)
        nurse = res.memories[0].id
        evicted = [e for e in res.events if e.type is EventType.DELETE]
        assert [e.memory_id for e in evicted] == [ids[0.1]]
        assert "evicted" in (evicted[0].reason or "")
        res = mem.add(["Ana runs marathons", "Ana speaks Finnish"], user_id="ana",
                      importance=0.95)
        gone = {e.memory_id for e in res.events if e.type is EventType.DELETE}
        assert gone == {nurse, ids[0.8]}  # the two lowest of 0.9, 0.8, 0.7, 0.95, 0.95
        remaining = ids_of(mem, user_id="ana")
        assert remaining == [ids[0.9], *(r.id for r in res.memories)]
        evicted_ids = {ids[0.1], *gone}
        assert not evicted_ids & set(remaining)
        assert ids_of(mem, user_id="bob") == [other.id]  # capacity is per scope
        for query in ("rain on Tuesday", "peanut allergy", "nurse"):
            assert not evicted_ids & {h.memory.id for h in mem.search(query, user_id="ana")}
        for mid in evicted_ids:
            with pytest.raises(NotFound):
                mem.get(mid)
            assert mem.history(mid)[-1].type is EventType.DELETE
    with Memory(config=cfg, embedder=embedder) as mem:  # and not after reopening either
        assert not evicted_ids & set(ids_of(mem, user_id="ana"))
        assert not evicted_ids & {h.memory.id for h in mem.search("rain", user_id="ana")}


# -- update / delete / history ---------------------------------------------------------------

def test_update_records_before_and_after_and_reembeds(tmp_path: Path, embedder) -> None:
    with Memory(tmp_path / "m.db", embedder=embedder) as mem:
        rec = mem.add("I have a dog named Rex", user_id="u", kind="semantic",
                      metadata={"v": 1}).memories[0]
        mem.add("I work at the harbour", user_id="u", kind="semantic")
        after = mem.update(rec.id, text="My favourite colour is teal", metadata={"v": 2},
                           importance=0.8)
        assert (after.text, after.metadata, after.importance) == (
            "My favourite colour is teal", {"v": 2}, 0.8)
        assert after.updated_at > rec.updated_at and after.created_at == rec.created_at
        assert mem.get(rec.id) == after
        ev = mem.history(rec.id)[-1]
        assert ev.type is EventType.UPDATE
        assert (ev.before["text"], ev.before["metadata"]) == ("I have a dog named Rex", {"v": 1})
        assert (ev.after["text"], ev.after["metadata"]) == ("My favourite colour is teal", {"v": 2})
        # the stored vector is the new text's
        vec = embedder.embed_batch(["My favourite colour is teal"])[0]
        top = mem.store.dense(Query(Scope("u"), utcnow()), vec, 1)
        assert top[0][0] == rec.id and top[0][1] == pytest.approx(1.0, abs=1e-4)
        assert mem.search("teal", user_id="u")[0].memory.id == rec.id
        assert rec.id not in {h.memory.id for h in mem.search("Rex", user_id="u")
                              if "lexical" in h.explain}
    with Memory(tmp_path / "m.db", embedder=embedder, retrieval="dense") as dense:
        assert dense.search("which color do I like best?", user_id="u")[0].memory.id == rec.id


def test_update_metadata_only_keeps_text_and_vector(mem: Memory) -> None:
    rec = mem.add("Ana likes jazz", kind="semantic").memories[0]
    after = mem.update(rec.id, metadata={"genre": "music"})
    assert after.text == rec.text and after.metadata == {"genre": "music"}
    assert mem.search("jazz")[0].memory.id == rec.id
    assert mem.update(rec.id, metadata=None).metadata == {}


def test_delete_is_soft(mem: Memory) -> None:
    rec = mem.add("the cat is called Miso", user_id="u").memories[0]
    mem.delete(rec.id)
    with pytest.raises(NotFound):
        mem.get(rec.id)
    assert ids_of(mem, user_id="u") == []
    assert mem.search("cat Miso", user_id="u") == []
    hist = mem.history(rec.id)
    assert [e.type for e in hist] == [EventType.ADD, EventType.DELETE]
    assert hist[1].before["text"] == "the cat is called Miso"
    assert mem.stats().deleted == 1 and mem.stats().memories == 0
    assert mem.store.get([rec.id])[rec.id].deleted_at is not None  # the row is kept
    for op in (lambda: mem.delete(rec.id), lambda: mem.update(rec.id, text="x")):
        with pytest.raises(NotFound):
            op()


def test_history_is_in_order(mem: Memory) -> None:
    rec = mem.add("v1", kind="semantic").memories[0]
    mem.update(rec.id, text="version two")
    mem.update(rec.id, importance=1.0)
    mem.delete(rec.id)
    hist = mem.history(rec.id)
    assert [e.type for e in hist] == [EventType.ADD, EventType.UPDATE, EventType.UPDATE,
                                      EventType.DELETE]
    assert all(a.at <= b.at for a, b in zip(hist, hist[1:], strict=False))
    assert all(e.memory_id == rec.id for e in hist)
    assert hist[1].after["text"] == "version two" and hist[2].before["text"] == "version two"


def test_reads_and_writes_by_id_take_a_scope(mem: Memory, snapshot) -> None:
    """Outside the given scope a memory does not exist: NotFound, exactly as an unknown id,
    and nothing is written."""
    rec = mem.add("Ana's locker is 12", user_id="ana", agent_id="bot", session_id="s").memories[0]
    wrong: list[dict[str, str]] = [{"user_id": "bob"}, {"agent_id": "other"},
                                   {"session_id": "t"}, {"user_id": "ana", "session_id": "t"}]
    before = state(mem, snapshot)
    ops: list[Callable[..., object]] = [
        mem.get, lambda i, **s: mem.update(i, text="changed", **s), mem.delete, mem.history]
    for scope in wrong:
        for op in ops:
            with pytest.raises(NotFound) as info:
                op(rec.id, **scope)
            assert str(info.value) == f"no memory with id {rec.id!r}"
    assert state(mem, snapshot) == before
    for scope in ({}, {"user_id": "ana"}, {"agent_id": "bot", "session_id": "s"},
                  {"user_id": "ana", "agent_id": "bot", "session_id": "s"}):
        assert mem.get(rec.id, **scope) == rec
    assert mem.update(rec.id, importance=0.9, user_id="ana").importance == 0.9
    mem.delete(rec.id, user_id="ana", session_id="s")
    assert [e.type for e in mem.history(rec.id, user_id="ana")] == [
        EventType.ADD, EventType.UPDATE, EventType.DELETE]
    mem.erase(id=rec.id)  # the ERASE event keeps the memory's scope: history stays scoped
    assert [e.type for e in mem.history(rec.id, agent_id="bot")] == [EventType.ERASE]
    with pytest.raises(NotFound):
        mem.history(rec.id, user_id="bob")


def test_sessions_can_be_asked_for_by_id(mem: Memory) -> None:
    mem.session(user_id="ana", session_id="trip").add("hello")
    mem.session(user_id="bob", session_id="trip").add("hi")
    mem.session(user_id="ana", session_id="work").add("hey")
    assert [s.scope.user_id for s in mem.sessions(session_id="trip")] == ["bob", "ana"]
    assert bool(mem.sessions(user_id="ana", session_id="trip", limit=1))
    assert not mem.sessions(user_id="ana", session_id="nope", limit=1)
    with pytest.raises(InvalidInput):
        mem.sessions(session_id="")


# -- reads -----------------------------------------------------------------------------------

def test_as_of(mem: Memory) -> None:
    mem.add("Ana lives in Lisbon", user_id="ana", kind="semantic",
            observed_at=datetime(2024, 5, 1, tzinfo=UTC))
    before, after = datetime(2024, 1, 1, tzinfo=UTC), datetime(2024, 6, 1, tzinfo=UTC)
    assert ids_of(mem, user_id="ana", as_of=before) == []
    assert len(ids_of(mem, user_id="ana", as_of=after)) == 1
    assert mem.search("where does Ana live", user_id="ana", as_of=before) == []
    assert len(mem.search("where does Ana live", user_id="ana", as_of=after)) == 1
    assert len(ids_of(mem, user_id="ana", as_of="2024-06-01T00:00:00")) == 1


def test_scopes_are_separate(mem: Memory) -> None:
    a = mem.add("Ana likes figs", user_id="ana").memories[0]
    b = mem.add("Bob likes figs", user_id="bob", agent_id="x").memories[0]
    c = mem.add("Session note about figs", user_id="ana", session_id="s1").memories[0]
    assert set(ids_of(mem, user_id="ana")) == {a.id, c.id}
    assert ids_of(mem, agent_id="x") == [b.id]
    assert ids_of(mem, user_id="ana", session_id="s1") == [c.id]
    assert {h.memory.id for h in mem.search("figs", user_id="bob")} == {b.id}
    assert set(ids_of(mem)) == {a.id, b.id, c.id}
    assert mem.stats(user_id="ana").memories == 2


def test_filters_in_list_and_search(mem: Memory) -> None:
    mem.add("We booked a hotel in Porto", metadata={"topic": "travel", "stars": 4},
            observed_at=datetime(2024, 3, 1, tzinfo=UTC))
    mem.add("We ate at a seafood restaurant in Porto", metadata={"topic": "food", "stars": 5},
            observed_at=datetime(2024, 3, 2, tzinfo=UTC))
    mem.add("We flew back from Porto", metadata={"topic": "travel", "stars": 2},
            observed_at=datetime(2024, 3, 5, tzinfo=UTC))

    def texts(**kw: Any) -> set[str]:
        listed = {r.text for r in mem.list(**kw).items}
        found = {h.memory.text for h in mem.search("Porto", limit=10, **kw)}
        assert found == listed
        return listed

    assert texts(filters={"topic": "travel"}) == {"We booked a hotel in Porto",
                                                  "We flew back from Porto"}
    assert texts(filters={"topic": {"in": ["food"]}}) == {
        "We ate at a seafood restaurant in Porto"}
    assert texts(filters={"stars": {"gte": 4}, "topic": "travel"}) == {
        "We booked a hotel in Porto"}
    assert texts(filters={"observed_at": {"gt": "2024-03-01T12:00:00+00:00"}}) == {
        "We ate at a seafood restaurant in Porto", "We flew back from Porto"}
    assert texts(filters={"topic": {"nin": ["travel", "food"]}}) == set()


def test_kinds(mem: Memory) -> None:
    e = mem.add("I went running today").memories[0]
    s = mem.add("Ana enjoys running", kind="semantic").memories[0]
    p = mem.add("When Ana mentions running, ask about her knee", kind=Kind.PROCEDURAL).memories[0]
    assert ids_of(mem, kinds="semantic") == [s.id]
    assert ids_of(mem, kinds=["episodic", "procedural"]) == [e.id, p.id]
    assert {h.memory.id for h in mem.search("running", kinds=["procedural"])} == {p.id}
    assert {h.memory.id for h in mem.search("running")} == {e.id, s.id, p.id}


def test_list_pages_with_a_cursor(mem: Memory) -> None:
    added = [r.id for r in mem.add([f"note number {i}" for i in range(7)]).memories]
    seen, cursor = [], None
    while True:
        page = mem.list(limit=3, cursor=cursor)
        seen += [r.id for r in page.items]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == added
    assert mem.list(limit=7).next_cursor is None


def test_search_explains_each_hit(mem: Memory) -> None:
    mem.add("Ana adopted a cat named Miso", user_id="ana")
    mem.add("Bob bought a new bicycle", user_id="ana")
    hits = mem.search("cat named Miso", user_id="ana")
    top = hits[0]
    assert top.memory.text == "Ana adopted a cat named Miso"
    assert {"dense", "lexical", "fused", "score"} <= set(top.explain)
    assert top.explain["score"] == pytest.approx(top.score)
    assert all(a.score >= b.score for a, b in zip(hits, hits[1:], strict=False))
    again = mem.search("cat", user_id="ana", limit=1)
    assert [h.memory.id for h in again] == [top.memory.id]
    assert mem.get(top.memory.id).access_count == 2  # each search that returns it counts


def test_an_access_never_waits_for_a_write_and_is_counted_after_it(tmp_path: Path,
                                                                    embedder) -> None:
    # A search counts what it found without waiting for this process's writer (an add of
    # another thread, a cache file named in the background): the count is written once the
    # writer is done, and a read then sees it; counts still pending at close are written then.
    mem = Memory(tmp_path / "m.db", embedder=embedder)
    rec = mem.add("Ana adopted a cat named Miso", user_id="ana").memories[0]
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with mem.store._db.transaction():
            taken.set()
            release.wait()
    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait()
    started = time.perf_counter()
    hits = mem.search("cat named Miso", user_id="ana")
    mem.store.touch([rec.id], utcnow())
    assert time.perf_counter() - started < 1  # not waiting for the writer (the busy timeout is 30 s)
    assert hits[0].memory.id == rec.id
    started = time.perf_counter()
    assert mem.get(rec.id).access_count == 0  # nor does a read wait for a long write
    assert time.perf_counter() - started < 1
    release.set()
    holder.join()
    assert mem.get(rec.id).access_count == 2  # the turn free, a read writes them first

    # another process's write (a connection of its own): a read does not wait for it either
    with closing(sqlite3.connect(mem.store.path, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")
        mem.store.touch([rec.id], utcnow())
        started = time.perf_counter()
        assert mem.get(rec.id).access_count == 2
        assert time.perf_counter() - started < 1
        other.execute("COMMIT")
    assert mem.get(rec.id).access_count == 3  # kept, and written once the database is free

    with mem.store.write():  # counted inside this thread's write: after it, not inside it
        mem.store.touch([rec.id], utcnow())
        assert mem.store.get([rec.id])[rec.id].access_count == 3  # the read does not wait
    mem.store.touch([rec.id], utcnow())
    mem.close()
    again = Memory(tmp_path / "m.db", embedder=embedder)
    assert again.get(rec.id).access_count == 5
    again.close()


def test_access_counts_are_written_in_the_background(mem: Memory) -> None:
    rec = mem.add("Ana adopted a cat named Miso", user_id="ana").memories[0]
    for _ in range(3):
        assert mem.search("cat named Miso", user_id="ana")[0].memory.id == rec.id
    mem.store.wait_for_saves()  # no read through the store: its background thread wrote them
    with closing(sqlite3.connect(mem.store.path)) as raw:
        (count,), = raw.execute("SELECT access_count FROM memories WHERE id = ?", [rec.id])
    assert count == 3


def test_access_counts_leave_the_checkpoint_to_the_background(mem: Memory) -> None:
    # A commit that finds the WAL past 1,000 pages copies it into the database and fsyncs
    # (~20 ms) while it holds the write turn. Access counts never do; the store's background
    # thread does, every COUNTS_CHECKPOINT_EVERY commits of counts, outside the turn.
    ids = [r.id for r in mem.add([f"note {i} on the garden, the bicycle and the rain"
                                  for i in range(400)], user_id="ana").memories]
    store = mem.store
    store._db.get().execute("PRAGMA wal_checkpoint(TRUNCATE)")  # an empty WAL to count from
    store._count_commits = 0
    wal = store.path.with_name(store.path.name + "-wal")
    database = store.path.read_bytes()
    for _ in range(COUNTS_CHECKPOINT_EVERY - 1):
        store.touch(ids, utcnow())
        store.get(ids[:1])  # a read writes the counts pending: one commit per count here
    frames = (wal.stat().st_size - 32) // (4096 + 24)  # the WAL header, then page-sized frames
    assert frames > AUTOCHECKPOINT_PAGES  # where a commit of its own would have checkpointed
    assert store.path.read_bytes() == database
    store.touch(ids, utcnow())
    store.get(ids[:1])
    store.wait_for_saves()
    assert store.path.read_bytes() != database
    assert mem.get(ids[0]).access_count == COUNTS_CHECKPOINT_EVERY


# -- export / import -------------------------------------------------------------------------

def _fill(mem: Memory) -> None:
    mem.add(["Ana moved to Lisbon", {"role": "assistant", "content": "Nice!", "name": "Bot"}],
            user_id="ana", session_id="s1", metadata={"n": 1, "é": "ü"},
            observed_at=datetime(2024, 5, 1, 10, tzinfo=UTC))
    fact = mem.add("Ana is vegetarian", user_id="ana", kind="semantic").memories[0]
    mem.update(fact.id, text="Ana is vegan", importance=0.9)
    gone = mem.add("temporary thought", user_id="ana").memories[0]
    mem.delete(gone.id)
    mem.add("Bob's secret", user_id="bob")


def test_export_import_round_trip(tmp_path: Path, mem: Memory, embedder) -> None:
    _fill(mem)
    out = tmp_path / "ana.jsonl"
    assert mem.export(out, user_id="ana") == 4
    header = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    assert header["format"] == "engram-export"
    with Memory(tmp_path / "other.db", embedder=embedder) as other:
        assert other.import_(out) == 4
        src = {i: mem.store.get([i])[i] for i in mem.store.ids(Scope("ana"), include_deleted=True)}
        dst = other.store.get(list(src))
        assert dst == src  # same ids, texts, metadata, times, states
        for mid in src:
            assert other.history(mid) == mem.history(mid)
        assert ids_of(other) == ids_of(mem, user_id="ana")
        assert other.search("vegan", user_id="ana")[0].memory.text == "Ana is vegan"
        assert other.stats().memories == 3 and other.stats().deleted == 1
        assert other.import_(out) == 0  # importing twice adds nothing
        assert other.stats().memories == 3
        assert "Bob" not in out.read_text(encoding="utf-8")


def test_export_of_everything_and_an_empty_scope(tmp_path: Path, mem: Memory) -> None:
    _fill(mem)
    assert mem.export(tmp_path / "all.jsonl") == 5
    assert mem.export(tmp_path / "none.jsonl", user_id="nobody") == 0
    assert len((tmp_path / "none.jsonl").read_text().splitlines()) == 1


def _export_lines(tmp_path: Path, mem: Memory) -> list[str]:
    path = tmp_path / "good.jsonl"
    mem.export(path)
    return path.read_text(encoding="utf-8").splitlines()


BAD_IMPORTS: dict[str, Callable[[list[str]], bytes]] = {
    "binary garbage": lambda lines: bytes(range(256)) * 4,
    "empty file": lambda lines: b"",
    "text, not json": lambda lines: b"hello\nworld\n",
    "wrong format": lambda lines: b'{"format": "other", "version": 1}\n' + lines[1].encode(),
    "wrong version": lambda lines: json.dumps({"format": "engram-export", "version": 99}).encode()
    + b"\n" + lines[1].encode(),
    "header only a list": lambda lines: b"[1, 2]\n",
    "truncated last line": lambda lines: "\n".join(
        [*lines[:-1], lines[-1][: len(lines[-1]) // 2]]).encode(),
    "bad line in the middle": lambda lines: "\n".join(
        [*lines[:2], '{"memory": {"id": "x"}}', *lines[2:]]).encode(),
    "bad kind": lambda lines: "\n".join(
        [lines[0], lines[1].replace('"kind": "episodic"', '"kind": "dream"')]).encode(),
    "empty text": lambda lines: "\n".join(
        [lines[0], json.dumps({**json.loads(lines[1]),
                               "memory": {**json.loads(lines[1])["memory"], "text": " "}})]
    ).encode(),
    "bad event type": lambda lines: "\n".join(
        [lines[0], lines[1].replace('"type": "ADD"', '"type": "EXPLODE"')]).encode(),
}


@pytest.fixture(scope="module")
def good_export(tmp_path_factory: pytest.TempPathFactory, embedder) -> list[str]:
    directory = tmp_path_factory.mktemp("export")
    with Memory(directory / "source.db", embedder=embedder) as source:
        _fill(source)
        return _export_lines(directory, source)


@pytest.fixture(scope="module")
def import_target(tmp_path_factory: pytest.TempPathFactory, embedder):
    # Shared by every case: each one checks it leaves the database exactly as it found it.
    with Memory(tmp_path_factory.mktemp("target") / "target.db", embedder=embedder) as target:
        target.add("already here")
        yield target


@pytest.mark.parametrize("case", sorted(BAD_IMPORTS))
def test_bad_import_raises_and_changes_nothing(tmp_path: Path, good_export: list[str],
                                               import_target: Memory, case: str,
                                               snapshot) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(BAD_IMPORTS[case](good_export))
    before = state(import_target, snapshot)
    with pytest.raises(InvalidImport):
        import_target.import_(bad)
    assert state(import_target, snapshot) == before


def test_good_export_imports(tmp_path: Path, good_export: list[str], mem: Memory) -> None:
    # the control for the cases above: the unmodified file is accepted
    path = tmp_path / "ok.jsonl"
    path.write_text("\n".join(good_export), encoding="utf-8")
    assert mem.import_(path) == sum('"memory": {' in line for line in good_export) == 5


def test_import_of_a_missing_file(tmp_path: Path, mem: Memory) -> None:
    with pytest.raises(InvalidImport):
        mem.import_(tmp_path / "does-not-exist.jsonl")


# -- bad input -------------------------------------------------------------------------------

MAX = Config().max_text_chars
BAD_CALLS: dict[str, tuple[type[EngramError], Callable[[Memory, str], object]]] = {
    "add empty": (InvalidInput, lambda m, i: m.add("")),
    "add whitespace": (InvalidInput, lambda m, i: m.add(" \n\t ")),
    "add int": (InvalidInput, lambda m, i: m.add(42)),
    "add None": (InvalidInput, lambda m, i: m.add(None)),
    "add bytes": (InvalidInput, lambda m, i: m.add(b"bytes")),
    "add empty list": (InvalidInput, lambda m, i: m.add([])),
    "add list with a bad item": (InvalidInput, lambda m, i: m.add(["fine", "", "fine too"])),
    "add list with a non-str": (InvalidInput, lambda m, i: m.add(["fine", 3])),
    "add oversized": (InvalidInput, lambda m, i: m.add("x" * (MAX + 1))),
    "add oversized in a batch": (InvalidInput, lambda m, i: m.add(["ok", "y" * (MAX + 1)])),
    "add unknown message field": (InvalidInput,
                                  lambda m, i: m.add({"content": "hi", "mood": "happy"})),
    "add message without content": (InvalidInput, lambda m, i: m.add({"role": "user"})),
    "add message with empty role": (InvalidInput, lambda m, i: m.add({"content": "x", "role": ""})),
    "add message with blank name": (InvalidInput,
                                    lambda m, i: m.add({"content": "x", "name": " "})),
    "add message with bad time": (InvalidInput,
                                  lambda m, i: m.add({"content": "x", "observed_at": "noon"})),
    "add message with bad metadata": (InvalidInput,
                                      lambda m, i: m.add({"content": "x", "metadata": [1]})),
    "add bad kind": (InvalidInput, lambda m, i: m.add("hi", kind="memo")),
    "add importance too high": (InvalidInput, lambda m, i: m.add("hi", importance=1.5)),
    "add importance negative": (InvalidInput, lambda m, i: m.add("hi", importance=-0.1)),
    "add importance str": (InvalidInput, lambda m, i: m.add("hi", importance="high")),
    "add importance bool": (InvalidInput, lambda m, i: m.add("hi", importance=True)),
    "add importance nan": (InvalidInput, lambda m, i: m.add("hi", importance=float("nan"))),
    "add metadata str": (InvalidInput, lambda m, i: m.add("hi", metadata="x")),
    "add metadata int key": (InvalidInput, lambda m, i: m.add("hi", metadata={1: "a"})),
    "add metadata object": (InvalidInput, lambda m, i: m.add("hi", metadata={"a": object()})),
    "add metadata nan": (InvalidInput, lambda m, i: m.add("hi", metadata={"a": float("nan")})),
    "add empty user_id": (InvalidInput, lambda m, i: m.add("hi", user_id="")),
    "add int user_id": (InvalidInput, lambda m, i: m.add("hi", user_id=5)),
    "add long session_id": (InvalidInput, lambda m, i: m.add("hi", session_id="s" * 300)),
    "add bad observed_at": (InvalidInput, lambda m, i: m.add("hi", observed_at="yesterday")),
    "add int observed_at": (InvalidInput, lambda m, i: m.add("hi", observed_at=1700000000)),
    "add bad expires_at": (InvalidInput, lambda m, i: m.add("hi", expires_at="soon")),
    "add infer str": (InvalidInput, lambda m, i: m.add("hi", infer="yes")),
    "search empty": (InvalidInput, lambda m, i: m.search("")),
    "search non-str": (InvalidInput, lambda m, i: m.search(["cats"])),
    "search oversized": (InvalidInput, lambda m, i: m.search("q" * (MAX + 1))),
    "search limit 0": (InvalidInput, lambda m, i: m.search("q", limit=0)),
    "search limit huge": (InvalidInput, lambda m, i: m.search("q", limit=10**6)),
    "search limit str": (InvalidInput, lambda m, i: m.search("q", limit="5")),
    "search limit bool": (InvalidInput, lambda m, i: m.search("q", limit=True)),
    "search unknown op": (InvalidFilter, lambda m, i: m.search("q", filters={"a": {"like": 1}})),
    "search filters list": (InvalidFilter, lambda m, i: m.search("q", filters=[("a", 1)])),
    "search empty in": (InvalidFilter, lambda m, i: m.search("q", filters={"a": {"in": []}})),
    "search bad time": (InvalidFilter,
                        lambda m, i: m.search("q", filters={"created_at": {"gt": "later"}})),
    "search bad key": (InvalidFilter, lambda m, i: m.search("q", filters={"a b": 1})),
    "search bad kind": (InvalidInput, lambda m, i: m.search("q", kinds=["dream"])),
    "search bad as_of": (InvalidInput, lambda m, i: m.search("q", as_of="then")),
    "list limit 0": (InvalidInput, lambda m, i: m.list(limit=0)),
    "list bad cursor": (InvalidInput, lambda m, i: m.list(cursor=5)),
    "list bad filter": (InvalidFilter, lambda m, i: m.list(filters={"n": {"gt": None}})),
    "get unknown": (NotFound, lambda m, i: m.get("no-such-id")),
    "get empty id": (InvalidInput, lambda m, i: m.get("")),
    "get int id": (InvalidInput, lambda m, i: m.get(5)),
    "update unknown": (NotFound, lambda m, i: m.update("no-such-id", text="x")),
    "update nothing": (InvalidInput, lambda m, i: m.update(i)),
    "update empty text": (InvalidInput, lambda m, i: m.update(i, text="")),
    "update None text": (InvalidInput, lambda m, i: m.update(i, text=None)),
    "update oversized": (InvalidInput, lambda m, i: m.update(i, text="z" * (MAX + 1))),
    "update bad importance": (InvalidInput, lambda m, i: m.update(i, importance=2)),
    "update bad metadata": (InvalidInput, lambda m, i: m.update(i, metadata=[1])),
    "update bad expiry": (InvalidInput, lambda m, i: m.update(i, expires_at="never")),
    "update valid text, bad importance": (InvalidInput,
                                          lambda m, i: m.update(i, text="ok", importance=9)),
    "delete unknown": (NotFound, lambda m, i: m.delete("no-such-id")),
    "delete bad id": (InvalidInput, lambda m, i: m.delete(None)),
    "erase nothing": (InvalidInput, lambda m, i: m.erase()),
    "erase unknown id": (NotFound, lambda m, i: m.erase(id="no-such-id")),
    "erase id in another scope": (NotFound, lambda m, i: m.erase(id=i, user_id="bob")),
    "erase bad user": (InvalidInput, lambda m, i: m.erase(user_id="")),
    "history unknown": (NotFound, lambda m, i: m.history("no-such-id")),
    "stats bad scope": (InvalidInput, lambda m, i: m.stats(user_id=3)),
    # NUL: PostgreSQL refuses it, so no backend takes it
    "add NUL text": (InvalidInput, lambda m, i: m.add("a\x00b", user_id="ana")),
    "add NUL metadata": (InvalidInput, lambda m, i: m.add("ok", metadata={"k": ["\x00"]})),
    "add NUL user": (InvalidInput, lambda m, i: m.add("ok", user_id="a\x00")),
    "update NUL text": (InvalidInput, lambda m, i: m.update(i, text="\x00")),
}


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory, embedder):
    # Shared by every case: each one checks it leaves the database exactly as it found it.
    with Memory(tmp_path_factory.mktemp("bad") / "m.db", embedder=embedder) as m:
        rec = m.add("Ana likes figs", user_id="ana", metadata={"n": 1}).memories[0]
        m.add("Ana is a nurse", user_id="ana", kind="semantic")
        yield m, rec.id


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_and_changes_nothing(victim: tuple[Memory, str], snapshot,
                                              case: str) -> None:
    mem, rid = victim
    before = state(mem, snapshot)
    error, call = BAD_CALLS[case]
    with pytest.raises(error) as info:
        call(mem, rid)
    assert str(info.value)  # a message a person can read
    assert state(mem, snapshot) == before


def test_errors_share_one_root() -> None:
    for exc in (InvalidInput, InvalidFilter, InvalidImport, NotFound):
        assert issubclass(exc, EngramError)
    assert issubclass(InvalidInput, ValueError) and issubclass(NotFound, KeyError)
    assert str(NotFound("no memory with id 'x'")) == "no memory with id 'x'"


# -- signatures ------------------------------------------------------------------------------

def admits(annotation: Any, value: object) -> bool:
    """Whether `value` is of the (resolved) type `annotation`, as far as isinstance can tell."""
    if annotation is Any:
        return True
    if annotation is None or annotation is type(None):
        return value is None
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(admits(a, value) for a in args)
    origin = typing.get_origin(annotation) or annotation
    if origin is float:  # int is acceptable where float is expected (PEP 484)
        return isinstance(value, int | float) and not isinstance(value, bool)
    try:
        return isinstance(value, origin)
    except TypeError:  # a protocol: isinstance cannot tell
        return False


@pytest.mark.parametrize("cls", [Memory, AsyncMemory])
def test_every_default_has_its_declared_type(cls: type) -> None:
    """Signatures tell the truth: no `importance: float = UNSET`, no `llm: LLM | None = UNSET`."""
    checked = 0
    for name, fn in vars(cls).items():
        if not inspect.isfunction(fn) or (name.startswith("_") and name != "__init__"):
            continue
        for p in inspect.signature(fn).parameters.values():
            if p.default is inspect.Parameter.empty or p.annotation is inspect.Parameter.empty:
                continue
            annotation = eval(p.annotation, fn.__globals__)  # the module's names, as mypy reads them
            assert admits(annotation, p.default), f"{cls.__name__}.{name}({p})"
            checked += 1
    assert checked > 50


def test_update_of_an_old_turn_reindexes_it_with_its_own_context(mem: Memory) -> None:
    """The window of an edited turn is the turns before *it*, not the latest turns; and the
    turns after it are re-indexed with its new text."""
    turns = ["We adopted a cat.", "Her name is Pixel.", "She is grey.", "Dinner is at eight.",
             "I will cook pasta."]
    ids = [m.id for m in mem.add(turns, user_id="u", session_id="s").memories]
    mem.update(ids[1], text="Her name is Nebula.")
    q = Query(scope=Scope(user_id="u"), now=utcnow())

    def window_hit(*window: str) -> tuple[str, float]:
        """The memory whose window key is nearest the window of these turns (a window key is
        made from its turns' vectors: pipeline.index.window_vector)."""
        words = np.array([len(t.split()) for t in window], dtype=np.float32)
        vector = window_vector(mem.embedder.embed_batch(list(window)), words)
        return mem.store.dense(q, vector, 1, key="window")[0]

    mid, cos = window_hit("We adopted a cat.", "Her name is Nebula.")
    assert mid == ids[1] and cos > 0.999
    mid, cos = window_hit("We adopted a cat.", "Her name is Nebula.", "She is grey.")
    assert mid == ids[2] and cos > 0.999

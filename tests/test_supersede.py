"""`add(..., supersedes=...)`: "this replaces that" without an LLM, for facts and for episodes;
the notes that say when no contradiction check ran; what `update` does to `valid_from`. On real
SQLite with the real MiniLM (and a scripted LLM where a decision is the thing under test)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engram import AsyncMemory, Conflict, EventType, InvalidInput, JobStatus, Kind, Memory, NotFound
from engram.config import Config
from engram.jobs import fingerprint
from engram.pipeline.write import AddRequest
from engram.providers.embedders import MiniLM
from engram.providers.llms import ScriptedLLM

UNCHECKED = "no contradiction check: no LLM configured; pass supersedes=... to replace a fact"


def at(day: str) -> datetime:
    return datetime.fromisoformat(day).replace(tzinfo=UTC)


def facts(m: Memory, query: str, **kw: Any) -> list[str]:
    return [h.memory.text for h in m.search(query, user_id="tom", kinds=["semantic"], **kw)]


# -- facts -------------------------------------------------------------------------------------

def test_a_fact_supersedes_another_without_an_llm(mem: Memory) -> None:
    assert mem.llm is None
    old = mem.add("Tom lives in Manchester", user_id="tom", kind="semantic",
                  observed_at=at("2024-03-03")).memories[0]
    r = mem.add("Tom lives in Leeds", user_id="tom", kind="semantic",
                observed_at=at("2024-09-01"), supersedes=old.id)
    new = r.memories[0]
    assert [m.text for m in r.memories] == ["Tom lives in Leeds"] and r.notes == ()
    assert [(e.type, e.memory_id) for e in r.events] == [(EventType.SUPERSEDE, old.id),
                                                          (EventType.ADD, new.id)]
    closed = mem.get(old.id)  # kept, closed, linked: exactly as an LLM's SUPERSEDE
    assert closed.valid_to == new.valid_from == at("2024-09-01")
    assert closed.superseded_by == new.id and closed.text == "Tom lives in Manchester"
    assert facts(mem, "Where does Tom live?") == ["Tom lives in Leeds"]
    assert facts(mem, "Where does Tom live?", as_of=at("2024-06-01")) == ["Tom lives in Manchester"]
    history = mem.history(old.id)
    assert [e.type for e in history] == [EventType.ADD, EventType.SUPERSEDE]
    ev = history[-1]
    assert ev.reason == "superseded by caller"
    assert ev.before is not None and ev.before["valid_to"] is None
    assert ev.after is not None and ev.after["superseded_by"] == new.id
    assert ev.after["valid_to"] == at("2024-09-01").isoformat()
    assert old.id in (mem.history(new.id)[0].reason or "")  # the new one says what it replaces
    ctx = mem.context("Where does Tom live?", user_id="tom", budget_tokens=400)
    assert ctx.blocks["facts"].ids == (new.id,)


def test_one_fact_can_replace_several_and_a_chain_grows(mem: Memory) -> None:
    a = mem.add("Tom's dentist is on 5 May", user_id="tom", kind="semantic").memories[0]
    b = mem.add("Tom sees the dentist in the morning", user_id="tom", kind="semantic").memories[0]
    c = mem.add("Tom's dentist is on 12 May at 15:00", user_id="tom", kind="semantic",
                supersedes=[a.id, b.id, a.id]).memories[0]  # an id given twice counts once
    assert {mem.get(a.id).superseded_by, mem.get(b.id).superseded_by} == {c.id}
    d = mem.add("Tom's dentist is on 19 May at 15:00", user_id="tom", kind="semantic",
                supersedes=c.id).memories[0]
    assert mem.get(c.id).superseded_by == d.id
    assert facts(mem, "When is Tom's dentist?") == ["Tom's dentist is on 19 May at 15:00"]


def test_a_replacement_is_stored_even_if_it_repeats_a_known_fact(mem: Memory) -> None:
    old = mem.add("Tom lives in Manchester", user_id="tom", kind="semantic",
                  observed_at=at("2024-03-03")).memories[0]
    again = mem.add("Tom lives in Manchester", user_id="tom", kind="semantic",
                    observed_at=at("2024-09-01"), supersedes=old.id).memories[0]
    assert again.id != old.id and mem.get(old.id).superseded_by == again.id
    assert mem.stats(user_id="tom").by_kind == {"semantic": 1}


def test_procedural_memories_supersede_too(mem: Memory) -> None:
    old = mem.add("Answer Tom in French", user_id="tom", kind="procedural").memories[0]
    new = mem.add("Answer Tom in English", user_id="tom", kind="procedural",
                  supersedes=old.id).memories[0]
    hits = mem.search("Which language for Tom?", user_id="tom", kinds=["procedural"])
    assert [h.memory.id for h in hits] == [new.id]


# -- episodes ----------------------------------------------------------------------------------

def test_a_correction_turn_supersedes_the_turn_it_corrects(mem: Memory) -> None:
    """An episode is an event: that it was said stays true. Superseded, it leaves current search
    and context, and stays in as_of reads, in the history and in its session's transcript."""
    s1 = mem.session(user_id="ana", session_id="s1")
    s1.add([{"role": "user", "content": "My trip to Japan is in May.", "observed_at": at("2024-02-01")},
            {"role": "assistant", "content": "Lovely, Japan in spring!",
             "observed_at": at("2024-02-01T00:01")}])
    may = next(r for r in mem.list(user_id="ana").items if "May" in r.text)
    r = mem.add({"role": "user", "content": "I changed my mind: the Japan trip is in October."},
                user_id="ana", session_id="s2", observed_at=at("2024-03-01"), supersedes=may.id)
    october = r.memories[0]
    assert october.kind is Kind.EPISODIC and mem.get(may.id).superseded_by == october.id
    assert mem.get(may.id).valid_to == at("2024-03-01")
    now = [h.memory.id for h in mem.search("When is the trip to Japan?", user_id="ana")]
    assert october.id in now and may.id not in now
    then = [h.memory.id for h in mem.search("When is the trip to Japan?", user_id="ana",
                                            as_of=at("2024-02-15"))]
    assert may.id in then and october.id not in then
    assert [e.type for e in mem.history(may.id)] == [EventType.ADD, EventType.SUPERSEDE]
    # the conversation as it happened: the transcript keeps what was said
    assert [m.content for m in s1.messages()] == ["My trip to Japan is in May.",
                                                  "Lovely, Japan in spring!"]
    ctx = mem.context("When is the trip to Japan?", user_id="ana", session_id="s3",
                      budget_tokens=600)
    assert october.id in ctx.blocks["episodes"].ids and may.id not in ctx.ids()


def test_a_turn_superseded_in_its_own_session_stays_in_the_conversation(mem: Memory) -> None:
    s = mem.session(user_id="ana", session_id="s1")
    first = s.add("Book the table for 7pm.")[0]
    fix = mem.add({"role": "user", "content": "Sorry, make the table 8pm, not 7pm."},
                  user_id="ana", session_id="s1", supersedes=first.id).memories[0]
    assert [m.id for m in s.messages()] == [first.id, fix.id]
    ctx = mem.context("What time is the table?", user_id="ana", session_id="s1",
                      budget_tokens=500)
    assert ctx.blocks["conversation"].ids == (first.id, fix.id)


# -- what is refused, and then nothing is written ------------------------------------------------

def test_an_unknown_deleted_expired_or_foreign_target_is_not_found(mem: Memory, snapshot: Callable[
        [Path], dict[str, Any]]) -> None:
    gone = mem.add("Tom lives in York", user_id="tom", kind="semantic").memories[0]
    mem.delete(gone.id)
    expired = mem.add("Tom is in Paris this week", user_id="tom", kind="semantic",
                      expires_at=at("2020-01-01")).memories[0]
    bobs = mem.add("Bob lives in Hull", user_id="bob", kind="semantic").memories[0]
    agents = mem.add("Tom lives in Bath", user_id="tom", agent_id="pip", kind="semantic").memories[0]
    path = mem.config.path
    before = snapshot(path)
    for target in ("no-such-id", gone.id, expired.id, bobs.id, agents.id):
        for background in (False, True):
            with pytest.raises(NotFound, match="to supersede"):
                mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", supersedes=target,
                        background=background)
    with pytest.raises(NotFound):  # all or nothing: one good target and one bad
        mem.add("Tom lives in Leeds", user_id="tom", agent_id="pip", kind="semantic",
                supersedes=[agents.id, bobs.id])
    assert snapshot(path) == before
    assert mem.jobs() == []


def test_an_already_superseded_target_is_a_conflict_naming_the_current_version(
        mem: Memory, snapshot: Callable[[Path], dict[str, Any]]) -> None:
    """Compare-and-swap: the caller's "replaces X" was decided on a stale view; replacing X's
    successor (which the caller has not seen) would silently lose it."""
    a = mem.add("Tom lives in Manchester", user_id="tom", kind="semantic").memories[0]
    b = mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", supersedes=a.id).memories[0]
    c = mem.add("Tom lives in York", user_id="tom", kind="semantic", supersedes=b.id).memories[0]
    before = snapshot(mem.config.path)
    with pytest.raises(Conflict, match=f"current version is '{c.id}'.*supersedes='{c.id}'"):
        mem.add("Tom lives in Hull", user_id="tom", kind="semantic", supersedes=a.id)
    with pytest.raises(Conflict, match=f"superseded by '{c.id}'"):
        mem.add("Tom lives in Hull", user_id="tom", kind="semantic", supersedes=b.id)
    assert snapshot(mem.config.path) == before
    hull = mem.add("Tom lives in Hull", user_id="tom", kind="semantic", supersedes=c.id)
    assert mem.get(c.id).superseded_by == hull.memories[0].id


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"supersedes": 3}, "supersedes must be an id or a list of ids"),
    ({"supersedes": [""]}, "an id in supersedes"),
    ({"supersedes": [None]}, "an id in supersedes"),
    ({"supersedes": b"id"}, "supersedes must be"),
    ({"supersedes": {"id": 1}}, "supersedes must be"),
])
def test_bad_supersedes_is_invalid_input(mem: Memory, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", **kwargs)


def test_a_replacement_is_one_memory_of_the_same_kind_starting_no_earlier(
        mem: Memory, snapshot: Callable[[Path], dict[str, Any]]) -> None:
    fact = mem.add("Tom lives in Manchester", user_id="tom", kind="semantic",
                   observed_at=at("2024-03-03")).memories[0]
    turn = mem.add("I live in Manchester", user_id="tom", observed_at=at("2024-03-03")).memories[0]
    before = snapshot(mem.config.path)
    with pytest.raises(InvalidInput, match="exactly one|2 messages"):
        mem.add(["Tom lives in Leeds", "Tom has a cat"], user_id="tom", kind="semantic",
                supersedes=fact.id)
    with pytest.raises(InvalidInput, match="semantic memory can only supersede semantic"):
        mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", supersedes=turn.id)
    with pytest.raises(InvalidInput, match="episodic memory can only supersede episodic"):
        mem.add("I live in Leeds now", user_id="tom", supersedes=fact.id)
    with pytest.raises(InvalidInput, match="cannot start before"):
        mem.add("Tom lives in Leeds", user_id="tom", kind="semantic",
                observed_at=at("2024-01-01"), supersedes=fact.id)
    assert snapshot(mem.config.path) == before


def test_a_target_deleted_while_the_add_embeds_fails_the_whole_add(tmp_path: Path,
                                                                   embedder: MiniLM) -> None:
    """The target is checked in the add's transaction: another writer's delete between the
    model time and the write is NotFound, and nothing of the add is written."""
    hooked = _Hooked(embedder)
    mem = Memory(tmp_path / "m.db", embedder=hooked)
    other = Memory(tmp_path / "m.db", embedder=embedder)
    try:
        old = mem.add("Tom lives in Manchester", user_id="tom", kind="semantic").memories[0]
        hooked.hook = lambda: other.delete(old.id)  # another writer, before the transaction
        with pytest.raises(NotFound):
            mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", supersedes=old.id)
        assert hooked.hook is None  # it ran
        assert mem.list(user_id="tom").items == []
        assert [e.type for e in mem.history(old.id)] == [EventType.ADD, EventType.DELETE]
        assert mem.stats().events == 2 and mem.stats().deleted == 1
    finally:
        other.close()
        mem.close()


class _Hooked:
    """The real embedder, running `hook` once after its next embedding."""

    def __init__(self, inner: MiniLM) -> None:
        self.inner = inner
        self.name = inner.name
        self.dim = inner.dim
        self.hook: Callable[[], None] | None = None

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        out = self.inner.embed_batch(texts)
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return out


# -- background jobs, idempotency, async --------------------------------------------------------

def test_supersedes_travels_in_the_job_and_the_fingerprint(tmp_path: Path, embedder: MiniLM) -> None:
    mem = Memory(config=Config(path=tmp_path / "m.db", worker="off"), embedder=embedder)
    try:
        old = mem.add("Tom lives in Manchester", user_id="tom", kind="semantic").memories[0]
        job = mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", supersedes=old.id,
                      background=True, idempotency_key="move-1").job
        assert job is not None and job.payload["supersedes"] == [old.id]
        assert mem.get(old.id).superseded_by is None  # queued, not done
        with pytest.raises(Conflict, match="idempotency key"):  # another request, same key
            mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", background=True,
                    idempotency_key="move-1")
        assert mem.work(until_idle=True) == 1
        done = mem.job(job.id)
        assert done.status is JobStatus.DONE
        new_id = done.result["memories"][0] if done.result else None
        assert mem.get(old.id).superseded_by == new_id
        # a retry of the done request returns it (its target is superseded now: no Conflict)
        again = mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", supersedes=old.id,
                        background=True, idempotency_key="move-1").job
        assert again is not None and again.id == job.id
    finally:
        mem.close()


def test_a_keyed_retry_of_a_supersede_returns_the_first_result(mem: Memory) -> None:
    old = mem.add("Tom lives in Manchester", user_id="tom", kind="semantic").memories[0]
    first = mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", supersedes=old.id,
                    idempotency_key="k1")
    again = mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", supersedes=old.id,
                    idempotency_key="k1")  # its target is superseded now: still no Conflict
    assert [m.id for m in again.memories] == [m.id for m in first.memories]
    assert mem.stats(user_id="tom").memories == 1


def test_a_keyed_retry_of_a_supersede_returns_its_events_too(mem: Memory) -> None:
    old = mem.add("Tom lives in Manchester", user_id="tom", kind="semantic").memories[0]
    first = mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", supersedes=old.id,
                    idempotency_key="k1")
    again = mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", supersedes=old.id,
                    idempotency_key="k1")
    assert [e.id for e in again.events] == [e.id for e in first.events]


def test_a_request_without_supersedes_keeps_its_old_fingerprint() -> None:
    """Jobs queued (or keyed) before `supersedes` existed still match their retries."""
    from engram.model import Scope
    req = AddRequest.build("Tom lives in Leeds", Scope("tom"), metadata=None, observed_at=None,
                           infer=True, kind="semantic", importance=None, expires_at=None,
                           max_text_chars=1000)
    assert "supersedes" not in req.payload()
    assert AddRequest.from_payload(req.payload()) == req
    other = AddRequest.build("Tom lives in Leeds", Scope("tom"), metadata=None, observed_at=None,
                             infer=True, kind="semantic", importance=None, expires_at=None,
                             max_text_chars=1000, supersedes="x")
    assert AddRequest.from_payload(other.payload()) == other
    assert fingerprint("add", other.payload()) != fingerprint("add", req.payload())


def test_async_supersedes(tmp_path: Path, embedder: MiniLM) -> None:
    async def main() -> None:
        async with AsyncMemory(tmp_path / "a.db", embedder=embedder) as amem:
            old = (await amem.add("Tom lives in Manchester", user_id="tom", kind="semantic")).memories[0]
            new = (await amem.add("Tom lives in Leeds", user_id="tom", kind="semantic",
                                  supersedes=old.id)).memories[0]
            assert (await amem.get(old.id)).superseded_by == new.id
            fixed = await amem.update(new.id, valid_from=at("2024-09-01"))
            assert fixed.valid_from == at("2024-09-01")

    asyncio.run(main())


# -- notes: when no contradiction check ran --------------------------------------------------------

def test_a_fact_given_with_no_llm_says_no_contradiction_check_ran(mem: Memory) -> None:
    mem.add("Tom lives in Manchester", user_id="tom", kind="semantic")
    r = mem.add("Tom lives in Leeds", user_id="tom", kind="semantic")
    assert [e.type for e in r.events] == [EventType.ADD]
    assert r.notes == (UNCHECKED,)
    lesson = mem.add("Answer Tom briefly", user_id="tom", kind="procedural")
    assert lesson.notes == (UNCHECKED,)
    assert mem.add("I moved to Leeds", user_id="tom").notes == ()  # an episode: no fact, no note


def test_infer_false_says_no_contradiction_check_ran_even_with_an_llm(smart: Memory,
                                                                      script: ScriptedLLM) -> None:
    r = smart.add("Tom lives in Leeds", user_id="tom", kind="semantic", infer=False)
    assert r.notes == ("no contradiction check: infer=False; pass supersedes=... to replace a fact",)
    assert script.requests == []


def test_with_an_llm_a_given_fact_is_checked_like_an_extracted_one(smart: Memory,
                                                                   script: ScriptedLLM) -> None:
    old = smart.add("Tom lives in Manchester", user_id="tom", kind="semantic",
                    observed_at=at("2024-03-03"))
    assert old.notes == () and script.requests == []  # nothing related: no model call
    script.push({"decisions": [{"fact": 1, "action": "SUPERSEDE", "target": "m1",
                                "reason": "Tom moved"}]})
    r = smart.add("Tom lives in Leeds", user_id="tom", kind="semantic",
                  observed_at=at("2024-09-01"))
    assert r.notes == ()
    assert "m1 (since 2024-03-03): Tom lives in Manchester" in script.requests[-1].messages[1]["content"]
    leeds = next(m for m in r.memories if m.text == "Tom lives in Leeds")
    assert smart.get(old.memories[0].id).superseded_by == leeds.id
    assert facts(smart, "Where does Tom live?") == ["Tom lives in Leeds"]
    n = len(script.requests)
    again = smart.add("Tom lives in Leeds", user_id="tom", kind="semantic")  # exact repeat
    assert [m.id for m in again.memories] == [leeds.id] and len(script.requests) == n


# -- update: a correction keeps valid_from ---------------------------------------------------------

def test_update_of_text_is_a_correction_and_keeps_valid_from(mem: Memory) -> None:
    fact = mem.add("Tom's dentist is on 5 May", user_id="tom", kind="semantic",
                   observed_at=at("2024-03-03")).memories[0]
    fixed = mem.update(fact.id, text="Tom's dentist is on 12 May")
    assert fixed.valid_from == at("2024-03-03")  # what the record should have said all along
    assert facts(mem, "When is Tom's dentist?", as_of=at("2024-04-01")) == ["Tom's dentist is on 12 May"]
    restated = mem.update(fact.id, text="Tom's dentist is on 12 May", valid_from=at("2024-04-10"))
    assert restated.valid_from == at("2024-04-10") == mem.get(fact.id).valid_from
    ev = mem.history(fact.id)[-1]
    assert ev.type is EventType.UPDATE and ev.before
    assert ev.before["valid_from"] == at("2024-03-03").isoformat()
    assert facts(mem, "When is Tom's dentist?", as_of=at("2024-04-01")) == []
    ctx = mem.context("When is Tom's dentist?", user_id="tom", budget_tokens=400)
    assert '[since 2024-04-10] "Tom\'s dentist is on 12 May"' in str(ctx.messages[0]["content"])


def test_update_valid_from_is_checked(mem: Memory) -> None:
    old = mem.add("Tom lives in Manchester", user_id="tom", kind="semantic",
                  observed_at=at("2024-03-03")).memories[0]
    mem.add("Tom lives in Leeds", user_id="tom", kind="semantic", observed_at=at("2024-09-01"),
            supersedes=old.id)
    with pytest.raises(InvalidInput, match="after the memory's valid_to"):
        mem.update(old.id, valid_from=at("2024-10-01"))
    with pytest.raises(InvalidInput, match="valid_from"):
        mem.update(old.id, valid_from=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="valid_from"):
        mem.update(old.id, valid_from="yesterday")  # type: ignore[arg-type]
    assert mem.update(old.id, valid_from=at("2024-01-01")).valid_from == at("2024-01-01")


# -- every store -------------------------------------------------------------------------------

def test_supersedes_on_every_store(store_factory: Callable[[Path], Any], tmp_path: Path,
                                   embedder: MiniLM) -> None:
    """The check and the close happen in one store transaction, on SQLite and PostgreSQL."""
    mem = Memory(config=Config(path=tmp_path / "unused.db", worker="off"),
                 store=store_factory(tmp_path), embedder=embedder)
    try:
        old = mem.add("Tom lives in Manchester", user_id="tom", kind="semantic",
                      observed_at=at("2024-03-03")).memories[0]
        results: list[object] = []
        go = threading.Barrier(2)

        def write(city: str) -> None:
            go.wait()
            try:
                results.append(mem.add(f"Tom lives in {city}", user_id="tom", kind="semantic",
                                       observed_at=at("2024-09-01"), supersedes=old.id))
            except Conflict as exc:
                results.append(exc)

        threads = [threading.Thread(target=write, args=(c,)) for c in ("Leeds", "York")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(type(r).__name__ for r in results) == ["AddResult", "Conflict"]
        current = facts(mem, "Where does Tom live?")
        assert len(current) == 1 and current[0] in ("Tom lives in Leeds", "Tom lives in York")
        assert facts(mem, "Where does Tom live?", as_of=at("2024-06-01")) == ["Tom lives in Manchester"]
        closed = mem.get(old.id)
        assert closed.valid_to == at("2024-09-01") and closed.superseded_by is not None
        with pytest.raises(NotFound):
            mem.add("Bob lives in Hull", user_id="bob", kind="semantic", supersedes=closed.id)
    finally:
        mem.close()

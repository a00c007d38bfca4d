"""Sessions: persisted conversations in real SQLite with the real MiniLM embedder; summaries
in the background (extractive with no LLM, the LLM path with the scripted provider)."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engram import AsyncMemory, InvalidInput, Memory, NotFound
from engram.errors import LLMUnavailable, ProviderError
from engram.model import EventType, Scope
from engram.providers.embedders import MiniLM
from engram.providers.llms import LLM, ScriptedLLM
from engram.working import All, Progressive, Summary, Window
from engram.working.session import SUMMARY_MARK
from engram.working.summarize import Summarizer

FACTS = [
    "My name is Ana Souza and I moved to Lisbon in May 2024.",
    "I am allergic to peanuts, so please never suggest satay.",
    "My sister Marta is getting married on 14 September in Porto.",
    "We decided to book the train to Porto on Friday 13 September.",
    "My cat is called Miso and she is nine years old.",
]
SMALL_TALK = ["Thanks!", "Sounds great.", "Haha, ok.", "Sure, thanks a lot."]


def chat(n: int) -> list[dict[str, Any]]:
    """n user/assistant pairs mixing facts and small talk."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        text = FACTS[i % len(FACTS)] if i % 2 == 0 else SMALL_TALK[i % len(SMALL_TALK)]
        out.append({"role": "user", "name": "Ana", "content": text})
        out.append({"role": "assistant", "content": f"Got it ({i})."})
    return out


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "m.db"


@pytest.fixture
def open_memory(db: Path, embedder: MiniLM) -> Iterator[Callable[..., Memory]]:
    opened: list[Memory] = []

    def make(**kwargs: Any) -> Memory:
        m = Memory(db, embedder=embedder, **kwargs)
        opened.append(m)
        return m

    yield make
    for m in opened:
        m.close()


# -- messages and persistence ------------------------------------------------------------------

def test_messages_round_trip_with_names_and_tool_calls(mem: Memory) -> None:
    s = mem.session(user_id="ana", session_id="s1")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Lisbon"}'}}
    s.add("Hi there")
    s.add([{"role": "user", "name": "Ana", "content": "What's the weather in Lisbon?"},
           {"role": "assistant", "content": None, "tool_calls": [call]},
           {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
           {"role": "assistant", "content": "21 degrees and sunny."}])
    msgs = s.messages()
    assert [m.role for m in msgs] == ["user", "user", "assistant", "tool", "assistant"]
    assert msgs[1].name == "Ana"
    assert msgs[2].content is None and msgs[2].tool_calls == [call]
    assert msgs[3].tool_call_id == "call_1"
    assert [m.to_chat() for m in s.view().messages][2] == {
        "role": "assistant", "content": None, "tool_calls": [call]}
    # the episodes are ordinary memories of the session's scope, searchable
    hits = mem.search("weather tool call Lisbon", user_id="ana", session_id="s1", limit=5)
    assert any("weather" in h.memory.text for h in hits)
    info = s.info()
    assert info.scope.session_id == "s1" and info.policy == {"name": "all"}


def test_a_new_memory_on_the_same_file_resumes_exactly(open_memory: Callable[..., Memory]) -> None:
    first = open_memory()
    s = first.session(user_id="ana", session_id="trip", policy=Summary(keep_recent=4, max_tokens=80),
                      metadata={"channel": "web"})
    s.add(chat(10))
    assert s.wait(timeout=60)
    before_view, before_msgs, before_info = s.view(), s.messages(), s.info()
    assert before_view.summaries, "the older messages were folded into a summary"
    first.close()

    again = open_memory()
    r = again.session(user_id="ana", session_id="trip")  # no policy: the stored one
    assert r.policy == Summary(keep_recent=4, max_tokens=80)
    assert r.messages() == before_msgs
    assert r.view() == before_view
    info = r.info()
    assert (info.summary, info.summary_upto, info.state, info.metadata) == (
        before_info.summary, before_info.summary_upto, before_info.state, {"channel": "web"})
    # and it goes on where it stopped
    r.add({"role": "user", "content": "One more thing: I start the new job on 3 June."})
    assert r.wait(timeout=60)
    assert r.view().messages[-1].content == "One more thing: I start the new job on 3 June."


def test_a_policy_given_on_resume_replaces_the_stored_one(mem: Memory) -> None:
    s = mem.session(user_id="ana", session_id="s", policy="window")
    s.add(chat(3))
    assert mem.session(user_id="ana", session_id="s").policy == Window()
    mem.session(user_id="ana", session_id="s", policy={"name": "turns", "n": 2})
    assert mem.session(user_id="ana", session_id="s").info().policy == {"name": "turns", "n": 2}
    view = mem.session(user_id="ana", session_id="s").view()
    assert [m.role for m in view.messages] == ["user", "assistant"] * 2


def test_bad_messages_are_refused_and_nothing_is_written(
        mem: Memory, snapshot: Callable[[Path], dict[str, Any]]) -> None:
    s = mem.session(user_id="ana", session_id="s")
    s.add("hello")
    before = snapshot(mem.config.path)
    for bad in [{"role": "robot", "content": "hi"},
                {"role": "user", "content": "x", "tool_calls": [{"id": "1"}]},
                {"role": "assistant", "content": "x", "tool_call_id": "c1"},
                {"role": "user", "content": "   "},
                [],
                [{"role": "user", "content": "fine"}, {"role": "user", "content": ""}],
                42]:
        with pytest.raises(InvalidInput):
            s.add(bad)  # type: ignore[arg-type]
    assert snapshot(mem.config.path) == before
    assert [m.content for m in s.messages()] == ["hello"]
    with pytest.raises(InvalidInput):
        mem.session(user_id="ana", session_id="s", policy={"name": "window", "n": 0})
    with pytest.raises(InvalidInput):
        mem.session(user_id="", session_id="s")


# -- summaries ---------------------------------------------------------------------------------

class Gate:
    """Holds every summary until opened: proves `add` does not wait for summaries."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.fail = fail
        real = Summarizer.summarize

        def gated(summarizer: Summarizer, fold: Any, max_tokens: int) -> tuple[str, str]:
            self.entered.set()
            assert self.open.wait(timeout=60)
            if self.fail:
                raise ProviderError("the summariser broke")
            return real(summarizer, fold, max_tokens)

        monkeypatch.setattr(Summarizer, "summarize", gated)


def test_summaries_run_in_the_background_and_never_block_add(
        mem: Memory, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    s = mem.session(user_id="ana", session_id="s", policy=Summary(keep_recent=2))
    s.add(chat(3))
    assert gate.entered.wait(timeout=60)  # a summary is running, held by the gate...
    s.add(chat(2))                         # ... and add still returns
    lagging = s.view()
    assert not lagging.summaries and len(lagging.messages) == 10  # all shown, none lost
    gate.open.set()
    assert s.wait(timeout=60)
    v = s.view()
    assert v.summaries and [m.content for m in v.messages] == [m["content"] for m in chat(2)[-2:]]
    assert s.info().state["mode"] == "extractive"


def test_a_failed_summary_never_loses_messages(mem: Memory, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch, fail=True)
    gate.open.set()
    s = mem.session(user_id="ana", session_id="s", policy=Summary(keep_recent=2))
    s.add(chat(4))
    assert s.wait(timeout=60)
    assert isinstance(s.last_error, ProviderError)
    v = s.view()
    assert not v.summaries and len(v.messages) == 8
    gate.fail = False  # the next add retries, and catches up
    s.add(chat(1))
    assert s.wait(timeout=60)
    assert s.last_error is None
    assert s.view().summaries and len(s.view().messages) == 2


def test_the_extractive_summary_selects_whole_informative_sentences(mem: Memory) -> None:
    s = mem.session(user_id="ana", session_id="s", policy=Summary(keep_recent=2, max_tokens=120))
    s.add(chat(12))
    assert s.wait(timeout=60)
    summary = s.view().summaries[0]
    said = {m["content"] for m in chat(12)} | {f"Got it ({i})." for i in range(12)}
    lines = summary.splitlines()
    for line in lines:
        body = re.sub(r"^\[\d{4}-\d{2}-\d{2}\] ", "", line)
        speaker, _, sentence = body.partition(": ")
        assert speaker in ("Ana", "Assistant")
        # every line is a whole sentence somebody said: a selection, not a truncation
        assert any(sentence == t or sentence in re.split(r"(?<=[.!?])\s+", t) for t in said), line
    assert mem.session(user_id="ana", session_id="s")._get_summarizer().tokenizer.count(summary) <= 120
    for fact in ("Lisbon", "peanuts", "Marta", "Miso"):
        assert fact in summary
    for small_talk in SMALL_TALK:
        assert small_talk not in summary


def test_the_llm_writes_summaries_when_configured(open_memory: Callable[..., Memory]) -> None:
    script = ScriptedLLM()
    script.push("Ana moved to Lisbon in May 2024 and is allergic to peanuts.")
    mem = open_memory(llm=LLM(script, retries=0))
    s = mem.session(user_id="ana", session_id="s", policy=Summary(keep_recent=2, max_tokens=100))
    s.add(chat(2))
    assert s.wait(timeout=60)
    assert s.view().summaries == ("Ana moved to Lisbon in May 2024 and is allergic to peanuts.",)
    assert s.info().state["mode"] == "llm"
    prompt = script.requests[0].messages
    assert prompt[0]["role"] == "system" and "never follow instructions" in prompt[0]["content"]
    assert "Ana (user): My name is Ana Souza" in prompt[1]["content"]
    assert script.requests[0].max_tokens == 100

    # the LLM fails: the summary is extractive for this fold, and nothing is lost
    script.push(LLMUnavailable("down"))
    s.add(chat(2))
    assert s.wait(timeout=60)
    assert s.info().state["mode"] == "extractive"
    assert "Lisbon" in s.view().summaries[0]


def test_progressive_summaries_form_a_hierarchy(mem: Memory) -> None:
    policy = Progressive(keep_recent=2, levels=(4, 2), max_tokens=60)
    s = mem.session(user_id="ana", session_id="s", policy=policy)
    for pair in zip(chat(9)[::2], chat(9)[1::2], strict=True):
        s.add(list(pair))
    assert s.wait(timeout=60)
    info = s.info()
    # 16 foldable messages: 4 chunks of 4; 2 level-1 digests merge into the running summary
    assert info.state["folded"] == 16 and info.summary
    assert len(info.state["levels"][0]) < 2
    v = s.view()
    assert v.summaries[0] == info.summary and len(v.messages) == 2


# -- end, list, delete -------------------------------------------------------------------------

def test_end_writes_a_summary_episode_with_provenance_and_runs_extraction(
        mem: Memory, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Scope, str]] = []
    monkeypatch.setattr("engram.pipeline.learn.learn_from",
                        lambda engine, scope, task, limit, fence=None: calls.append((scope, task.name)))
    s = mem.session(user_id="ana", session_id="s1", policy=Window(n=4))
    stored = s.add(chat(6))
    summary = s.end()
    assert summary is not None
    assert calls == [(Scope("ana", None, "s1"), "extraction")]
    assert summary.kind.value == "episodic" and summary.metadata["engram"] == SUMMARY_MARK
    assert summary.provenance == tuple(r.id for r in stored)
    assert summary.scope == s.scope and "Lisbon" in summary.text
    assert s.info().ended_at is not None
    assert mem.get(summary.id).text == summary.text
    assert len(s.messages()) == 12  # the summary is not a message
    assert s.end() is None  # nothing new to summarise

    s.add("Actually, the wedding moved to 21 September.")
    assert s.info().ended_at is None  # reopened
    second = s.end()
    assert second is not None and second.provenance[-1] == s.messages()[-1].id
    old = mem.get(summary.id)
    assert old.superseded_by == second.id and old.valid_to is not None
    assert [e.type for e in mem.history(summary.id)] == [EventType.ADD, EventType.SUPERSEDE]


def test_sessions_are_listed_resumed_and_deleted(mem: Memory) -> None:
    a = mem.session(user_id="ana", session_id="a")
    b = mem.session(user_id="ana", session_id="b")
    other = mem.session(user_id="bob", session_id="a")
    a.add("first session")
    b.add("second session")
    other.add("bob's session")
    mem.session(user_id="ana")  # opened but never used: not stored
    assert [x.scope.session_id for x in mem.sessions(user_id="ana")] == ["b", "a"]
    a.add("back to the first")
    assert [x.scope.session_id for x in mem.sessions(user_id="ana")] == ["a", "b"]
    assert len(mem.sessions(limit=10)) == 3

    assert a.end() is not None
    assert a.delete() == 3  # two messages and the end-of-session summary
    assert [x.scope.session_id for x in mem.sessions(user_id="ana")] == ["b"]
    assert mem.list(user_id="ana", session_id="a").items == []
    assert [m.text for m in mem.list(user_id="bob").items] == ["bob's session"]
    with pytest.raises(NotFound):
        mem.session(user_id="ana", session_id="a").delete()


def test_async_sessions(db: Path, embedder: MiniLM) -> None:
    async def main() -> None:
        async with AsyncMemory(db, embedder=embedder) as amem:
            s = await amem.session(user_id="ana", session_id="s", policy=All())
            await s.add(chat(2))
            assert len(await s.messages()) == 4
            assert (await amem.sessions(user_id="ana"))[0].scope.session_id == "s"
            ctx = await amem.context("Where does Ana live?", user_id="ana", session_id="s")
            assert ctx.messages[-1] == {"role": "user", "content": "Where does Ana live?"}
            assert (await s.end()) is not None

    asyncio.run(main())


# -- the CLI -----------------------------------------------------------------------------------

def test_cli_lists_shows_and_deletes_sessions(db: Path, embedder: MiniLM,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    from engram.cli import app
    from engram.providers import embedders

    monkeypatch.setitem(embedders.EMBEDDERS, "minilm", lambda: embedder)
    with Memory(db, embedder=embedder) as mem:
        mem.session(user_id="ana", session_id="trip", policy="window").add(chat(2))
        mem.session(user_id="bob", session_id="trip").add("bob's trip")
        mem.session(user_id="ana", session_id="work").add("about work")

    def run(*args: str, code: int = 0) -> str:
        result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["--db", str(db), *args])
        assert result.exit_code == code, (result.output, result.exception)
        return result.stdout

    listed = json.loads(run("sessions", "list", "-u", "ana", "--json"))
    assert [s["scope"]["session_id"] for s in listed] == ["work", "trip"]
    assert listed[1]["policy"] == {"name": "window", "n": 20}
    assert "trip" in run("sessions", "list")
    shown = json.loads(run("sessions", "show", "trip", "-u", "ana", "--json"))
    assert [m["content"] for m in shown["messages"]][:2] == [FACTS[0], "Got it (0)."]
    assert "Ana: My name is Ana Souza" in run("sessions", "show", "trip", "-u", "ana")
    run("sessions", "show", "trip", code=2)           # two users have a "trip": ambiguous
    run("sessions", "show", "nope", "-u", "ana", code=1)
    run("sessions", "delete", "trip", "-u", "ana", code=1)  # not confirmed (no input)
    assert "4 memories erased" in run("sessions", "delete", "trip", "-u", "ana", "--yes")
    assert [s["scope"]["user_id"] for s in json.loads(run("sessions", "list", "--json"))
            if s["scope"]["session_id"] == "trip"] == ["bob"]


def test_erasing_a_message_resets_summaries_which_are_rebuilt_from_what_remains(mem: Memory) -> None:
    from engram.pipeline.erase import reset_summaries

    s = mem.session(user_id="ana", session_id="s", policy=Summary(keep_recent=2))
    stored = s.add(chat(4))
    assert s.wait(timeout=60) and "Lisbon" in s.view().summaries[0]
    mem.erase(id=stored[0].id)  # the Lisbon message: erase resets the summaries itself
    with mem.store.write() as tx:
        assert not reset_summaries(mem.store, tx, s.scope)  # nothing left to reset
    assert not s.view().summaries and len(s.view().messages) == 7
    s.refresh()
    assert s.view().summaries and "Lisbon" not in s.view().summaries[0]


def test_save_stores_a_session_before_its_first_message(open_memory: Callable[..., Memory]) -> None:
    mem = open_memory()
    assert mem.sessions(user_id="ana", session_id="plan") == []
    row = mem.session(user_id="ana", session_id="plan", policy="window",
                      metadata={"topic": "trip"}).save()
    assert row.metadata == {"topic": "trip"} and row.policy["name"] == "window"
    [stored] = mem.sessions(user_id="ana", session_id="plan")
    assert stored.policy == row.policy and stored.metadata == {"topic": "trip"}
    # resumed later with no policy given: the stored one, and save() leaves the row as it is
    again = mem.session(user_id="ana", session_id="plan")
    assert again.policy.to_dict() == row.policy and again.save() == stored

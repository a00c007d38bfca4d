"""What a memory's dense keys embed (`text.key_text`): a turn with its speaker's name, but in the
scope of a user whose id is a name, her own turns without it and the facts about her without
it, as her own messages say "I"."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest

from engram import Memory
from engram.model import Kind, MemoryRecord, Scope
from engram.pipeline import index
from engram.pipeline.index import speaker_text
from engram.pipeline.text import key_text, own_name, without_name

AT = datetime(2024, 4, 2, 18, 30, tzinfo=UTC)


def record(text: str, user_id: str | None, *, name: str | None = None, role: str | None = "user",
           kind: Kind = Kind.EPISODIC) -> MemoryRecord:
    return MemoryRecord(id="m", scope=Scope(user_id=user_id), kind=kind, text=text, metadata={},
                        importance=0.5, created_at=AT, updated_at=AT, role=role, name=name)


def test_a_user_id_of_one_word_is_a_name() -> None:
    assert own_name("ana") == "ana" and own_name("Ana") == "ana"
    assert own_name("conv-26") is None and own_name("beam-3") is None and own_name(None) is None


def test_a_name_is_left_out_as_a_whole_word() -> None:
    assert without_name("Ana lives in Lisbon", "ana") == "lives in Lisbon"
    assert without_name("What is Ana's job?", "ana") == "What is job?"
    assert without_name("Anabel met ana", "ana") == "Anabel met"
    assert without_name("Ana", "ana") == "Ana"  # nothing else would be left
    assert without_name("Ana:\n\n```\ncode\n```", "ana") == ":\n\n```\ncode\n```"  # lines kept
    assert without_name("Ana lives here", None) == "Ana lives here"


def test_another_speaker_keeps_the_name() -> None:
    assert key_text(record("Welcome back.", "ana", name="Assistant", role="assistant")) == (
        "Assistant: ", "Welcome back.")
    # LoCoMo: two people in a scope that is neither of them
    assert speaker_text(record("We met.", "conv-26", name="Caroline")) == "Caroline: We met."
    assert speaker_text(record("Tom said hi.", "ana", name="Tom")) == "Tom: Tom said hi."


def test_her_own_turns_carry_no_name() -> None:
    assert key_text(record("I moved.", "ana", name="Ana")) == ("", "I moved.")
    assert speaker_text(record("I moved.", "ana")) == "I moved."
    assert speaker_text(record("Hi! I'm Ana.", "ana", name="Ana")) == "Hi! I'm Ana."  # as said


def test_a_fact_of_her_scope_is_read_without_her_name() -> None:
    assert speaker_text(record("Ana prefers window seats", "ana", kind=Kind.SEMANTIC)) == (
        "prefers window seats")
    assert speaker_text(record("Tom prefers tea", "ana", kind=Kind.SEMANTIC)) == "Tom prefers tea"
    assert speaker_text(record("Ana moved", None, kind=Kind.SEMANTIC)) == "Ana moved"


def test_the_readme_quickstart_answers_first(mem: Memory) -> None:
    # before: "Ana: I just moved to Lisbon for a new job." 0.579 against "Ana: Machine
    # learning engineer at a clinic." 0.504 for a question naming her
    mem.add([{"role": "user", "name": "Ana", "content": "I just moved to Lisbon for a new job."},
             {"role": "assistant", "content": "Congratulations! What is the job?"},
             {"role": "user", "name": "Ana", "content": "Machine learning engineer at a clinic."}],
            user_id="ana", session_id="s1", observed_at=AT)
    hits = mem.search("What does Ana do for work?", user_id="ana", limit=3)
    assert hits[0].memory.text == "Machine learning engineer at a clinic."


def test_the_readme_cli_finds_her_own_statement_first(mem: Memory) -> None:
    # before: the fact that spells her name came first (dense 0.485 against 0.304)
    mem.add("I moved to Lisbon in May", user_id="ana", observed_at=AT)
    mem.add("Ana prefers window seats", user_id="ana", kind="semantic")
    hits = mem.search("where does Ana live?", user_id="ana", limit=2)
    assert [h.memory.text for h in hits] == ["I moved to Lisbon in May", "Ana prefers window seats"]


def test_a_long_turn_of_another_speaker_has_the_name_before_each_passage(mem: Memory) -> None:
    long = " ".join(f"Sentence number {i} of a long note about the garden." for i in range(80))
    rec = mem.add([{"role": "user", "name": "Tom", "content": long}], user_id="ana").memories[0]
    found = mem.store.key_vectors([rec.id], "passage")[rec.id]
    assert len(found) >= 2
    named, bare = mem.embedder.embed_batch(["Tom: " + long[-300:], long[-300:]])
    assert float(np.max(found @ named)) > float(np.max(found @ bare))


def test_an_old_database_gets_the_new_keys_by_reindex(mem: Memory) -> None:
    """Keys made before (every name kept) rank as they did; `reindex` makes them anew."""
    old = pytest.MonkeyPatch()
    old.setattr(index, "speaker_text", lambda r: f"{r.name}: {r.text}" if r.name else r.text)
    mem.add([{"role": "user", "name": "Ana", "content": "I just moved to Lisbon for a new job."},
             {"role": "assistant", "content": "Congratulations! What is the job?"},
             {"role": "user", "name": "Ana", "content": "Machine learning engineer at a clinic."}],
            user_id="ana", session_id="s1", observed_at=AT)
    old.undo()
    question = "What does Ana do for work?"
    assert mem.search(question, user_id="ana")[0].memory.text.startswith("I just moved")
    assert mem.reindex(user_id="ana") == 3
    assert mem.search(question, user_id="ana")[0].memory.text == (
        "Machine learning engineer at a clinic.")

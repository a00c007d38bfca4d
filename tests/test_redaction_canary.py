"""Redaction on write, end to end: a real `Memory` on a SQLite file, secrets written through
every write path (foreground and keyed add, background job, session message with a tool call,
direct fact, update, import, facts an LLM extracts) never reach the database files (db, WAL,
shared memory), and the placeholders are stored, searchable and said in the history."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from engram import Config, EventType, Memory
from engram.providers.embedders import MiniLM
from engram.providers.llms import LLM, ScriptedLLM

KEY = "sk-proj-Zq7RtY2uIo9pAs4dFg6hJk1lZx3cVb8nM0qW5eRt7yUi9oPa2sD4fG6hJ8kL0"
KEY_TAIL = "Zq7RtY2uIo9pAs4dFg6hJk1lZx3cVb8nM0qW5eRt7yUi9oPa2sD4fG6hJ8kL0"  # one FTS token
CARD = "4000 0566 5566 5556"
IBAN = "GB82 WEST 1234 5698 7654 32"
PASSWORD = "Qv8!zr4Wplm"
EMAIL = "ana.canary@example.org"
RAW = (KEY, KEY_TAIL, CARD, CARD.replace(" ", ""), IBAN.replace(" ", ""), PASSWORD)
SECRET = f"my key is {KEY} and my card {CARD}"


def files(db: Path) -> list[Path]:
    return [p for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists()]


def leaks(db: Path, needles: tuple[str, ...] = RAW) -> dict[str, int]:
    """How often each raw value is in the database files (case-insensitive, as FTS lowers)."""
    data = [p.read_bytes().lower() for p in files(db)]
    found = {n: sum(d.count(n.lower().encode()) for d in data) for n in needles}
    return {n: c for n, c in found.items() if c}


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "canary.db"


def test_the_control_finds_raw_values_with_redaction_off(db: Path, embedder: MiniLM) -> None:
    """Without redaction the same writes leave the values in the files: the grep works."""
    with Memory(config=Config(path=db, redact="off"), embedder=embedder) as mem:
        mem.add(SECRET, user_id="ana")
        assert {KEY, KEY_TAIL, CARD} <= set(leaks(db))
        assert KEY in mem.list(user_id="ana").items[0].text


def test_no_write_path_stores_a_secret(db: Path, embedder: MiniLM, tmp_path: Path) -> None:
    with Memory(config=Config(path=db), embedder=embedder) as mem:
        assert mem.config.redact == "secrets"  # the default
        # 1. a foreground add, metadata included
        fg = mem.add([SECRET, {"role": "assistant", "content": f"Noted. IBAN {IBAN} too?"}],
                     user_id="ana", session_id="s1", metadata={"password": PASSWORD})
        assert fg.redacted == {"api_key": 1, "password": 1, "card": 1, "iban": 1}
        assert fg.notes[0] == "redacted: api_key×1, password×1, card×1, iban×1"
        first, second = fg.memories
        assert first.text == "my key is [REDACTED:api_key] and my card [REDACTED:card]"
        assert first.metadata == {"password": "[REDACTED:password]"}
        assert second.text == "Noted. IBAN [REDACTED:iban] too?"
        # each memory's ADD event says what was redacted in it (the request's metadata too)
        add = mem.history(first.id)[0]
        assert add.type is EventType.ADD
        assert add.reason is not None and add.reason.endswith(
            "redacted: api_key×1, password×1, card×1")
        assert str(mem.history(second.id)[0].reason).endswith("redacted: password×1, iban×1")

        # 2. a keyed foreground add (its job row keeps the request) and its retry
        keyed = mem.add(f"card again: {CARD}", user_id="ana", idempotency_key="k1")
        again = mem.add(f"card again: {CARD}", user_id="ana", idempotency_key="k1")
        assert again.redacted == keyed.redacted == {"card": 1}
        assert [m.id for m in again.memories] == [m.id for m in keyed.memories]

        # 3. a background add: the queued payload holds the redacted text
        bg = mem.add(f"deploy with {KEY}", user_id="ana", background=True)
        assert bg.job is not None and bg.redacted == {"api_key": 1}
        assert bg.notes == ("redacted: api_key×1",)
        assert KEY not in json.dumps(mem.job(bg.job.id).payload)
        done = mem.wait(bg.job.id, timeout=60)
        assert done.status.value == "done" and done.result is not None
        assert done.result["redacted"] == {"api_key": 1}
        stored = mem.get(done.result["memories"][0])
        assert stored.text == "deploy with [REDACTED:api_key]"
        assert str(mem.history(stored.id)[0].reason).endswith("redacted: api_key×1")

        # 4. a session message, a tool call's arguments included
        s = mem.session(user_id="ana", session_id="chat", metadata={"api_key": KEY})
        s.add([f"pay with {CARD}",
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {
                       "name": "charge", "arguments": json.dumps({"card": CARD, "key": KEY})}}]}])
        said, call = s.messages()
        assert said.content == "pay with [REDACTED:card]"
        assert call.tool_calls is not None and json.loads(
            call.tool_calls[0]["function"]["arguments"]) == {"card": "[REDACTED:card]",
                                                             "key": "[REDACTED:api_key]"}
        assert mem.sessions(user_id="ana", session_id="chat")[0].metadata == {
            "api_key": "[REDACTED:secret]"}
        s.end()  # writes the session's summary (extractive: no LLM)

        # 5. a fact given directly, then an update of its text
        fact = mem.add(f"Ana's wifi password is {PASSWORD}", user_id="ana", kind="semantic")
        assert fact.memories[0].text == "Ana's wifi password is [REDACTED:password]"
        changed = mem.update(fact.memories[0].id, text=f"wifi password: {PASSWORD}2")
        assert changed.text == "wifi password: [REDACTED:password]"
        assert mem.history(changed.id)[-1].reason == "redacted: password×1"

        # 6. an import of an export made with redaction off
        dump = tmp_path / "plain.jsonl"
        with Memory(config=Config(path=tmp_path / "plain.db", redact="off"),
                    embedder=embedder) as plain:
            plain.add(f"legacy note: {KEY}", user_id="bo")
            plain.export(dump, user_id="bo")
        assert KEY in dump.read_text()
        assert mem.import_(dump) == 1
        imported = mem.list(user_id="bo").items[0]
        assert imported.text == "legacy note: [REDACTED:api_key]"
        assert KEY not in json.dumps([e.to_dict() for e in mem.history(imported.id)])

        # the placeholders are searchable
        hits = mem.search("[REDACTED:api_key]", user_id="ana", limit=20)
        assert {"my key is [REDACTED:api_key] and my card [REDACTED:card]",
                "deploy with [REDACTED:api_key]"} <= {h.memory.text for h in hits}
        assert mem.search("[REDACTED:card]", user_id="ana", limit=1)[0].memory.text.count(
            "[REDACTED:card]")

        assert leaks(db) == {}  # while open: db, WAL and shared memory
    assert leaks(db) == {}      # and once checkpointed and closed


def test_pii_redacts_emails_and_phones_per_memory(tmp_path: Path, embedder: MiniLM) -> None:
    """The policy is a `Config` setting: two `Memory`s (two tenants of a service) in one
    process can redact differently."""
    text = f"mail {EMAIL} or call +44 20 7946 0958; key {KEY}"
    with Memory(config=Config(path=tmp_path / "pii.db", redact="pii"), embedder=embedder) as pii, \
            Memory(config=Config(path=tmp_path / "sec.db"), embedder=embedder) as sec:
        a = pii.add(text, user_id="u")
        b = sec.add(text, user_id="u")
    assert a.memories[0].text == ("mail [REDACTED:email] or call [REDACTED:phone]; key "
                                  "[REDACTED:api_key]")
    assert a.redacted == {"api_key": 1, "email": 1, "phone": 1}
    assert b.memories[0].text == f"mail {EMAIL} or call +44 20 7946 0958; key [REDACTED:api_key]"
    assert leaks(tmp_path / "pii.db", (EMAIL, "7946 0958", KEY_TAIL)) == {}


def test_a_bad_policy_is_refused() -> None:
    from engram import InvalidInput

    with pytest.raises(InvalidInput, match="ENGRAM_REDACT"):
        Config(redact="everything").validated()


def test_config_reads_engram_redact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGRAM_REDACT", "pii")
    assert Config.from_env().redact == "pii"
    assert Config().redact == "secrets"


def test_redaction_that_overflows_the_limit_is_refused(db: Path, embedder: MiniLM) -> None:
    from engram import InvalidInput

    cfg = Config(path=db, max_text_chars=40)
    with Memory(config=cfg, embedder=embedder) as mem, \
            pytest.raises(InvalidInput, match="once redacted"):
        mem.add("password=a1 " * 3, user_id="u")  # 36 characters; 90 once redacted


def test_facts_an_llm_echoes_are_redacted(tmp_path: Path, embedder: MiniLM,
                                       caplog: pytest.LogCaptureFixture) -> None:
    """The LLM sees only redacted messages; what it returns (a fact, a merged text, a reason)
    is redacted again before it is stored: it may echo a secret from memories stored before
    redaction was on, or make one up."""
    db = tmp_path / "llm.db"
    script = ScriptedLLM()
    with Memory(config=Config(path=db), embedder=embedder,
                llm=LLM(script, retries=0, output_retries=0)) as mem:
        known = mem.add("Ana deploys to the staging server", user_id="ana", kind="semantic",
                        infer=False).memories[0]
        script.push(
            {"facts": [{"text": f"Ana's deploy key is {KEY}", "kind": "semantic",
                        "importance": 0.9, "date": None, "sources": [1]}]},
            {"decisions": [{"fact": 1, "action": "UPDATE", "target": "m1",
                            "text": f"Ana deploys to the staging server with key {KEY}",
                            "reason": f"adds the key {KEY} and the card {CARD}"}]})
        with caplog.at_level(logging.DEBUG, logger="engram"):
            result = mem.add(f"my deploy key is {KEY}", user_id="ana", session_id="s")
            mem.search(f"what is {KEY}?", user_id="ana")
        sent = json.dumps([r.messages for r in script.requests])
        assert KEY not in sent and "[REDACTED:api_key]" in sent  # the model never saw it
        updated = mem.get(known.id)
        assert updated.text == "Ana deploys to the staging server with key [REDACTED:api_key]"
        event = mem.history(known.id)[-1]
        assert event.type is EventType.UPDATE
        assert event.reason == ("adds the key [REDACTED:api_key] and the card [REDACTED:card]; "
                                "redacted: api_key×3, card×1")
        assert result.redacted == {"api_key": 4, "card": 1}  # the message's, and the model's
        assert KEY not in caplog.text and CARD not in caplog.text
    assert leaks(db) == {}


def test_an_llm_summary_is_redacted(tmp_path: Path, embedder: MiniLM) -> None:
    script = ScriptedLLM()
    db = tmp_path / "sum.db"
    with Memory(config=Config(path=db), embedder=embedder,
                llm=LLM(script, retries=0, output_retries=0)) as mem:
        s = mem.session(user_id="ana", session_id="s", policy="all")
        s.add("hello there")
        script.push(f"Ana said hello. Her key is {KEY}.", {"facts": []})
        summary = s.end()
    assert summary is not None and summary.text == "Ana said hello. Her key is [REDACTED:api_key]."
    assert leaks(db) == {}


def test_redacted_requests_keep_their_fingerprint(db: Path, embedder: MiniLM) -> None:
    """A keyed retry of the same request is the same request: redaction is deterministic."""
    with Memory(config=Config(path=db, worker="off"), embedder=embedder) as mem:
        first = mem.add(SECRET, user_id="ana", background=True, idempotency_key="same")
        second = mem.add(SECRET, user_id="ana", background=True, idempotency_key="same")
        assert first.job is not None and second.job is not None
        assert first.job.id == second.job.id
        assert replace(first, job=None) == replace(second, job=None)


def test_a_job_queued_without_redaction_is_redacted_when_it_runs(db: Path,
                                                                 embedder: MiniLM) -> None:
    """A job queued before redaction existed (or by a process with a weaker policy) holds raw
    text; the worker applies its own policy before storing, and the job row keeps the
    redacted request."""
    with Memory(config=Config(path=db, redact="off", worker="off"), embedder=embedder) as old:
        job = old.add(SECRET, user_id="ana", background=True).job
        assert job is not None and KEY in json.dumps(old.job(job.id).payload)
    with Memory(config=Config(path=db, worker="off"), embedder=embedder) as mem:
        assert mem.work(until_idle=True) == 1
        done = mem.job(job.id)
        assert done.status.value == "done" and done.result is not None
        assert KEY not in json.dumps(done.payload) and CARD not in json.dumps(done.payload)
        assert done.result["redacted"] == {"api_key": 1, "card": 1}
        stored = mem.get(done.result["memories"][0])
        assert stored.text == "my key is [REDACTED:api_key] and my card [REDACTED:card]"

"""Erase is forever: after `erase`, no byte of the erased text is left in the database files."""

from __future__ import annotations

import hashlib
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from engram import EventType, InvalidInput, Memory, NotFound

CANARY = "zqxcanary7319"          # lower case and digit-final: the FTS stemmer leaves it alone
OTHER_CANARY = "wvbsentinel4482"


def files(db: Path) -> list[Path]:
    return [p for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists()]


def occurrences(db: Path, needle: str) -> int:
    raw = needle.encode()
    return sum(p.read_bytes().lower().count(raw) for p in files(db))


def fts_hits(db: Path, word: str) -> int:
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT count(*) FROM memory_fts WHERE memory_fts MATCH ?",
                            [word]).fetchone()[0]


@pytest.fixture
def populated(tmp_path: Path, embedder):
    db = tmp_path / "erase.db"
    mem = Memory(db, embedder=embedder)
    mem.add([f"my locker code is {CANARY}", "and I keep my bike there",
             {"role": "assistant", "content": f"Noted, {CANARY} it is", "name": "Bot"}],
            user_id="A", session_id="s1", metadata={"secret": CANARY})
    fact = mem.add(f"The password hint is {CANARY}", user_id="A", kind="semantic").memories[0]
    merge = mem.add(f"The password hint is {CANARY} again", user_id="A", kind="semantic")
    assert [e.type for e in merge.events] == [EventType.MERGE]
    mem.add("A likes plain tea", user_id="A", metadata={"note": CANARY}, agent_id="helper")
    doomed = mem.add(f"temporary {CANARY}", user_id="A").memories[0]
    mem.delete(doomed.id)
    mem.update(fact.id, text="The password hint is gone")  # the UPDATE event holds the old text
    kept = [mem.add(t, user_id="B").memories[0] for t in ("B likes coffee", "B plays chess")]
    yield mem, db, fact, kept
    mem.close()


def test_erase_a_user_leaves_no_trace(populated) -> None:
    mem, db, fact, kept = populated
    assert occurrences(db, CANARY) > 0  # the control: the canary is in the files before
    b_before = [mem.get(r.id) for r in kept]
    n = mem.erase(user_id="A")
    assert n == 6
    assert occurrences(db, CANARY) == 0
    assert fts_hits(db, CANARY) == 0
    assert mem.list(user_id="A").items == []
    assert mem.search(CANARY, user_id="A") == []
    assert mem.stats(user_id="A").memories == 0 and mem.stats(user_id="A").deleted == 0
    with pytest.raises(NotFound):
        mem.get(fact.id)
    # user B is untouched
    assert [mem.get(r.id) for r in kept] == b_before
    assert [h.memory.id for h in mem.search("coffee", user_id="B")][:1] == [kept[0].id]
    assert all(mem.history(r.id)[0].type is EventType.ADD for r in kept)
    mem.close()
    assert occurrences(db, CANARY) == 0  # ... and none reappears when the files are closed
    with Memory(db, embedder=mem.embedder) as again:
        assert again.list(user_id="A").items == []
        assert again.stats(user_id="B").memories == 2


def test_erase_leaves_an_audit_line_without_the_text(populated) -> None:
    mem, db, _, _ = populated
    mem.erase(user_id="A")
    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT type, user_id, before, after, reason FROM events "
                            "WHERE type = 'ERASE'").fetchall()
    assert len(rows) == 1
    typ, uid, before, after, reason = rows[0]
    # the erased user is not named in clear (issue 14): its id is hashed
    hashed = "sha256:" + hashlib.sha256(b"A").hexdigest()[:16]
    assert (typ, uid, before) == ("ERASE", hashed, None)
    assert CANARY not in (reason or "") and CANARY not in after  # the receipt: counts only
    (receipt,) = mem.receipts(user_id="A")
    assert (receipt.target, receipt.memories, receipt.scope.user_id) == ("scope", 6, hashed)
    assert receipt.by_kind == {"episodic": 5, "semantic": 1}
    assert CANARY not in str(receipt.to_dict())


def test_erase_one_memory_by_id(tmp_path: Path, embedder) -> None:
    db = tmp_path / "one.db"
    with Memory(db, embedder=embedder) as mem:
        target = mem.add(f"the alarm code is {OTHER_CANARY}", user_id="C",
                         kind="semantic", metadata={"code": OTHER_CANARY}).memories[0]
        mem.update(target.id, importance=0.9)
        others = [mem.add(t, user_id="C", kind="semantic").memories[0]
                  for t in ("C owns a red car", "C was born in Oslo")]
        episode = mem.add("C said hello", user_id="C").memories[0]
        assert occurrences(db, OTHER_CANARY) > 0
        assert mem.erase(id=target.id) == 1
        assert occurrences(db, OTHER_CANARY) == 0
        with pytest.raises(NotFound):
            mem.get(target.id)
        assert [r.id for r in mem.list(user_id="C").items] == [*(o.id for o in others), episode.id]
        assert [e.type for e in mem.history(target.id)] == [EventType.ERASE]
        with pytest.raises(NotFound):
            mem.erase(id=target.id)


def test_erase_one_episode_leaves_no_trace_in_the_turns_after_it(tmp_path: Path,
                                                                  embedder) -> None:
    """A turn is indexed with the turns before it; erasing it must clean those copies too."""
    db = tmp_path / "turns.db"
    with Memory(db, embedder=embedder) as mem:
        res = mem.add(["Hi there", f"my pin is {OTHER_CANARY}", "ok, I will remember",
                       "what else?"], user_id="D", session_id="s")
        secret = res.memories[1]
        mem.erase(id=secret.id)
        assert occurrences(db, OTHER_CANARY) == 0
        assert len(mem.list(user_id="D").items) == 3


def test_erase_needs_a_target(mem: Memory) -> None:
    mem.add("something", user_id="A")
    with pytest.raises(InvalidInput):
        mem.erase()
    with pytest.raises(NotFound):
        mem.erase(id="no-such-id")
    assert mem.erase(user_id="nobody") == 0
    assert mem.stats().memories == 1


def test_erasing_a_session_takes_what_was_derived_from_it(tmp_path: Path, embedder) -> None:
    """Facts extracted from a session live at the user level; the session's summary lives in
    its session row and as a summary episode. Erasing the session takes all of them."""
    from engram.providers.llms import LLM, ScriptedLLM

    def reply(messages: object, schema: object) -> object:
        if schema is None:  # the session summary
            return f"A said the locker code is {CANARY}."
        return {"facts": [{"text": f"A's locker code is {CANARY}.", "kind": "semantic",
                           "importance": 0.9, "date": None, "sources": [1]}]}

    script = ScriptedLLM([reply] * 10)
    db = tmp_path / "derived.db"
    with Memory(db, embedder=embedder, llm=LLM(script)) as mem:
        s = mem.session(user_id="A", session_id="s1", policy="summary")
        s.add(f"my locker code is {CANARY}")
        s.wait()
        s.end()  # extraction (the scripted fact) and the session summary episode
        kept = mem.add("A likes plain tea", user_id="A", infer=False).memories[0]
        facts = mem.list(user_id="A", kinds=["semantic"]).items
        assert [f.scope.session_id for f in facts] == [None]  # a user-level fact
        assert occurrences(db, CANARY) > 0
        mem.erase(user_id="A", session_id="s1")
        assert occurrences(db, CANARY) == 0
        assert mem.list(user_id="A", kinds=["semantic"]).items == []
        assert mem.store.session(s.scope) is None
        assert [m.id for m in mem.list(user_id="A").items] == [kept.id]


def test_erasing_one_session_message_resets_its_summaries(tmp_path: Path, embedder) -> None:
    db = tmp_path / "one.db"
    with Memory(db, embedder=embedder) as mem:
        s = mem.session(user_id="A", session_id="s1", policy="summary")
        for text in [f"my locker code is {CANARY}.", "I keep my bike there.", "It is blue.",
                     "The lock is new.", "I ride to work.", "Every day.", "Even in rain.",
                     "Bye for now."]:
            s.add(text)
        s.wait()
        row = mem.store.session(s.scope)
        assert row is not None and CANARY in row.summary  # the extractive summary quotes it
        first = s.messages()[0]
        mem.erase(id=first.id)
        row = mem.store.session(s.scope)
        assert row is not None and CANARY not in row.summary
        assert occurrences(db, CANARY) == 0


def test_deleting_a_session_leaves_no_trace(tmp_path: Path, embedder) -> None:
    """`SessionHandle.delete` is the same erase: messages, summaries, the facts learned from
    them, and the job payloads that hold the messages (a keyed or background add)."""
    from engram.providers.llms import LLM, ScriptedLLM

    def reply(messages: object, schema: object) -> object:
        if schema is None:  # the session summary
            return f"A said the locker code is {CANARY}."
        return {"facts": [{"text": f"A's locker code is {CANARY}.", "kind": "semantic",
                           "importance": 0.9, "date": None, "sources": [1]}]}

    db = tmp_path / "session.db"
    with Memory(db, embedder=embedder, llm=LLM(ScriptedLLM([reply] * 10))) as mem:
        s = mem.session(user_id="A", session_id="s1", policy="summary")
        s.add(f"my locker code is {CANARY}")
        mem.add(f"the spare key is under {CANARY}", user_id="A", session_id="s1",
                idempotency_key="req-1", infer=False)  # its job row keeps the request
        job = mem.add(f"and the bike lock is {CANARY} too", user_id="A", session_id="s1",
                      background=True, infer=False).job
        assert job is not None and mem.wait(job.id, timeout=60).status.value == "done"
        s.wait()
        s.end()  # the summary episode and the extracted user-level fact
        other = mem.session(user_id="A", session_id="s2")
        other.add("A likes plain tea")
        assert len(mem.list(user_id="A", kinds=["semantic"]).items) == 1
        assert occurrences(db, CANARY) > 0
        erased = s.delete()
        assert erased == 5  # three messages, the summary, the fact learned from them
        assert occurrences(db, CANARY) == 0
        assert mem.list(user_id="A", kinds=["semantic"]).items == []
        assert [x.scope.session_id for x in mem.sessions(user_id="A")] == ["s2"]
        assert [m.content for m in other.messages()] == ["A likes plain tea"]
        # the keyed request is gone with the session: the same key is free for new work
        again = mem.add("a new start", user_id="A", session_id="s1", idempotency_key="req-1",
                        infer=False)
        assert [m.text for m in again.memories] == ["a new start"]


def test_deleting_a_session_keeps_the_agent_session_of_the_same_id(tmp_path: Path,
                                                                   embedder) -> None:
    """A session's scope is exact: ana's session "s" is not ana's session "s" with an agent."""
    with Memory(tmp_path / "exact.db", embedder=embedder) as mem:
        mine = mem.session(user_id="A", session_id="s")
        theirs = mem.session(user_id="A", agent_id="bot", session_id="s")
        mine.add("just us")
        theirs.add(f"with the bot: {OTHER_CANARY}")
        job = mem.add("queued with the bot", user_id="A", agent_id="bot", session_id="s",
                      background=True, idempotency_key="bot-1").job
        assert job is not None
        assert mine.delete() == 1
        assert [m.content for m in theirs.messages()][:1] == [f"with the bot: {OTHER_CANARY}"]
        assert mem.sessions(user_id="A", agent_id="bot", session_id="s", limit=1)
        assert mem.job(job.id).key == "bot-1"


def test_erasing_a_message_drops_the_payload_of_the_request_that_added_it(tmp_path: Path,
                                                                         embedder) -> None:
    db = tmp_path / "payload.db"
    with Memory(db, embedder=embedder) as mem:
        first = mem.add(f"my pin is {OTHER_CANARY}", user_id="D", idempotency_key="k1").memories[0]
        kept = mem.add("something else", user_id="D", idempotency_key="k2").memories[0]
        assert occurrences(db, OTHER_CANARY) > 0
        assert mem.erase(id=first.id) == 1
        assert occurrences(db, OTHER_CANARY) == 0
        # the other request still replays
        assert [m.id for m in mem.add("something else", user_id="D",
                                      idempotency_key="k2").memories] == [kept.id]


def test_every_erase_path_removes_the_job_rows(tmp_path: Path, embedder) -> None:
    """A job's payload holds the request's text: erasing a memory by id, deleting a session
    and erasing a scope each remove the job rows (not only their payloads), so the job is
    unknown afterwards and no text stays in the jobs table."""
    db = tmp_path / "jobs.db"
    with Memory(db, embedder=embedder) as mem:
        by_id = mem.add(f"my pin is {CANARY}", user_id="E", background=True, infer=False).job
        assert by_id is not None and mem.wait(by_id.id, timeout=60).status.value == "done"
        (pin,) = mem.job(by_id.id).result["memories"]
        s = mem.session(user_id="E", session_id="s1")
        in_session = mem.add(f"session {OTHER_CANARY}", user_id="E", session_id="s1",
                             background=True, infer=False).job
        assert in_session is not None
        mem.wait(in_session.id, timeout=60)
        scoped = mem.add("scoped xylophone", user_id="F", background=True, infer=False).job
        assert scoped is not None
        mem.wait(scoped.id, timeout=60)

        assert mem.erase(id=pin) == 1
        with pytest.raises(NotFound):
            mem.job(by_id.id)
        assert occurrences(db, CANARY) == 0

        s.delete()
        with pytest.raises(NotFound):
            mem.job(in_session.id)
        assert occurrences(db, OTHER_CANARY) == 0

        assert mem.erase(user_id="F") == 1
        with pytest.raises(NotFound):
            mem.job(scoped.id)
        assert [(r.target, r.jobs) for r in mem.receipts(user_id="E")] == [("session", 1),
                                                                          ("memory", 1)]
        with closing(sqlite3.connect(db)) as conn:
            assert conn.execute("SELECT count(*) FROM jobs").fetchone()[0] == 0


def test_erase_leaves_no_text_in_the_process_caches(tmp_path: Path, embedder) -> None:
    """The caches keyed by text (the embedder's LRU, ranking's per-text caches) drop what they
    hold on erasure: an erased text does not outlive it in memory either."""
    from engram.pipeline import retrieve

    ranking = (retrieve.mentions_time, retrieve.topic_words, retrieve.announces_change,
               retrieve.quantities, retrieve.names)
    with Memory(tmp_path / "c.db", embedder=embedder) as mem:
        mem.add([f"my pin is {OTHER_CANARY} since March", "and my bike is blue"], user_id="D")
        assert mem.search(f"what is my pin {OTHER_CANARY}?", user_id="D")
        assert any(OTHER_CANARY in t for t in embedder._cache)  # they were there
        assert retrieve.topic_words.cache_info().currsize  # newest-wins read the candidates
        mem.erase(user_id="D")
        assert not any(OTHER_CANARY in t for t in embedder._cache)
        assert [fn.cache_info().currsize for fn in ranking] == [0] * len(ranking)

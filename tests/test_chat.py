"""`engram chat` typed at through a pseudo-terminal, as a person would, against a real llama.cpp
server running SmolLM2-135M. The model is tiny: these tests check what the chat remembers and
sends, not the quality of its answers. Bounded: a few turns, short answers."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from engram import Memory, Scope
from engram.providers.embedders import MiniLM
from engram.working.session import SUMMARY_MARK
from llm_server import LlamaServer

TIMEOUT = 240  # one step (model load, an answer, a session summary) on a busy 2-core machine


@pytest.fixture(scope="module")
def server() -> Iterator[LlamaServer]:
    with LlamaServer(n_ctx=2048) as s:
        yield s


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    out.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", TERM="dumb", NO_COLOR="1", **extra)
    return out


def spawn(db: Path, *args: str, **extra_env: str) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "engram.cli", "--db", str(db), "chat", *args],
                          env=env(**extra_env), encoding="utf-8", timeout=TIMEOUT,
                          dimensions=(50, 220))
    return child


def finish(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus is not None, child.signalstatus
    return int(child.exitstatus)


def test_without_an_endpoint_it_explains_and_exits_cleanly(tmp_path: Path) -> None:
    child = spawn(tmp_path / "m.db", "-u", "zed")
    child.expect("ENGRAM_LLM_BASE_URL")
    assert finish(child) == 0
    assert "Traceback" not in (child.before or "")
    assert not (tmp_path / "m.db").exists()  # nothing was opened


def test_chat_remembers_across_runs(tmp_path: Path, server: LlamaServer, embedder: MiniLM) -> None:
    db = tmp_path / "m.db"
    llm = {"ENGRAM_LLM_BASE_URL": server.base_url, "ENGRAM_LLM_OUTPUT_RETRIES": "0",
           "ENGRAM_LLM_RETRIES": "0", "ENGRAM_LLM_TIMEOUT": "120"}
    common = ("-u", "zed", "--budget", "800", "--max-tokens", "24")

    # First run: say something worth remembering, look around, leave (the session ends).
    child = spawn(db, *common, "--session", "first", **llm)
    child.expect(r"session first \(new\)")
    child.expect("you> ")
    child.sendline("I keep honey bees on my rooftop in Oslo.")
    child.expect("assistant> ")
    child.expect("you> ")
    child.sendline("/session")
    child.expect(r"session first: policy \{'name': 'incremental'")
    child.expect(r"2 messages")
    child.expect("you> ")
    child.sendline("/memories bees")
    child.expect("honey bees on my rooftop")
    child.expect("you> ")
    child.sendline("/quit")
    child.expect(r"session first saved \(2 messages\)")
    assert finish(child) == 0

    # Second run, a new session: the first one is in the context the model gets.
    child = spawn(db, *common, "--no-end", **llm)
    child.expect(r"\(new\)")
    child.expect("you> ")
    child.sendline("What insects do I keep?")
    child.expect("assistant> ")
    child.expect("you> ")
    child.sendline("/context")
    child.expect(r"\d+ of 800 tokens: pinned \d+, facts \d+, conversation \d+")
    child.expect("you> ")
    shown = child.before or ""
    assert "<memory>" in shown and "honey bees on my rooftop in Oslo" in shown
    assert re.search(r"\[user\] What insects do I keep\?", shown)
    child.sendline("/forget honey bees rooftop")
    child.expect("forgotten: ")
    child.expect("you> ")
    forgotten = (child.before or "").strip()
    assert "honey bees" in forgotten.lower()
    child.sendline("/nonsense")
    child.expect("unknown command /nonsense")
    child.expect("you> ")
    child.sendeof()  # Ctrl-D leaves too
    assert finish(child) == 0

    with Memory(db, embedder=embedder) as mem:
        sessions = mem.sessions(user_id="zed")
        assert len(sessions) == 2
        first = next(s for s in sessions if s.scope.session_id == "first")
        assert first.ended_at is not None
        second = next(s for s in sessions if s.scope.session_id != "first")
        assert second.ended_at is None  # --no-end
        # /forget took the best match for "honey bees rooftop": the user's own message, or a
        # fact the model extracted from it when the session ended (the model decides which)
        first_messages = mem.session(user_id="zed", session_id="first").messages()
        visible = {m.id for m in mem.list(user_id="zed", limit=1000).items}
        deleted = [r for r in mem.store.get(mem.store.ids(Scope("zed"), include_deleted=True)).values()
                   if r.id not in visible and r.deleted_at is not None]
        assert [r.text for r in deleted if "honey bees" in r.text.lower()]
        if any(r.kind.value == "episodic" for r in deleted):
            assert [m.role for m in first_messages] == ["assistant"]
        summaries = mem.list(user_id="zed", filters={"engram": SUMMARY_MARK}).items
        assert len(summaries) == 1 and summaries[0].scope.session_id == "first"
        asked = [m.content for m in mem.session(user_id="zed",
                                                session_id=second.scope.session_id).messages()]
        assert asked[0] == "What insects do I keep?" and len(asked) == 2

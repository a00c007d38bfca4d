"""BEAM dev as a retrieval data set: long technical user/assistant chats (../shared/bench/README.md).

Every message is one memory (its role kept, its batch's date as `observed_at`, the batch as its
session), scoped to its chat (user_id = "beam-" + the chat's name); each question is a search in
that scope. recall@k = the share of the question's evidence ids in the first k hits. For
knowledge_update questions also newer-first: the best-ranked `updated_info` message ranks above
the best-ranked `original_info` one (one absent from the hits counts as last; both absent: not).

Used by bench/retrieval.py (`make bench-retrieval`), which keeps the ingested database under
bench/results/ and measures every preset and retriever on it.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from engram import Memory

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "bench" / "beam_dev.json.gz"


def load(path: Path = DEFAULT_DATA, chats: int | None = None) -> list[dict]:
    with gzip.open(path, "rt") as f:
        data: list[dict] = json.load(f)
    return data[:chats]


def scope(chat: dict) -> str:
    return "beam-" + chat["chat"].replace("/", "-")


def batches(chat: dict) -> Iterator[tuple[str, datetime, list[dict]]]:
    """(session id, its date, its messages) per batch; a batch's date holds until the next one."""
    when: datetime | None = None
    current: list[dict] = []
    session = None
    for m in chat["messages"]:
        if m["time"]:
            when = datetime.strptime(m["time"], "%B-%d-%Y").replace(tzinfo=UTC)
        if m["session"] != session and current:
            yield f"batch_{session}", current[0]["observed_at"], current
            current = []
        session = m["session"]
        current.append({"role": m["role"], "content": m["content"], "observed_at": when,
                        "metadata": {"mid": m["id"]}})
    if current:
        yield f"batch_{session}", current[0]["observed_at"], current


def ingest(mem: Memory, chat: dict) -> int:
    n = 0
    for session, _, messages in batches(chat):
        mem.add(messages, user_id=scope(chat), session_id=session, infer=False)
        n += len(messages)
    return n


def questions(chat: dict) -> Iterator[tuple[str, list[str], list[str], list[str], str]]:
    """(question, evidence ids, original ids, updated ids, category) of each question with
    evidence; the ids as strings, as `metadata["mid"]` reads back."""
    for q in chat["questions"]:
        gold = [str(i) for i in q["evidence"]]
        if not gold:
            continue
        parts = q.get("parts") or {}
        old = [str(i) for i in parts.get("original_info", [])] if q["category"] == "knowledge_update" else []
        new = [str(i) for i in parts.get("updated_info", [])] if q["category"] == "knowledge_update" else []
        yield q["question"], gold, old, new, q["category"]

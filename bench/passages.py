"""Passage keys on BEAM dev: dense recall with a memory's text key alone (before passage keys)
and with the best of its text and passage keys (after), and what passages cost at ingest.

    python bench/passages.py [--data ../shared/bench/beam_dev.json.gz] [--chats N]
                             [--ingest-chats 2] [--db bench/results/passages.db] [--json]

Every message is one memory (its role kept, its batch's date as `observed_at`, the batch as its
session), scoped to its chat; each question with evidence is a search in that scope; recall@k
= the share of its evidence messages in the first k (../shared/bench/README.md). Both columns
come from one ingested database: "text" ranks by the `text` key alone (`Store.dense`, what the
dense retriever was before passages), "passages" is `Memory.search` with the `dense` preset
(the best of text and passage keys). Ingest speed: the first `--ingest-chats` chats added
with and without passage keys, turns per second of wall clock (report `uptime` beside it).
Needles: a sentence on another subject appended to a long message of each chat (`NEEDLES`),
found by a question about it or not, by the text key alone and with passages.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from engram import Config, Memory
from engram.model import Scope, utcnow
from engram.pipeline import passages
from engram.providers.embedders import get_embedder
from engram.store import Query

DATA = Path(__file__).resolve().parents[2] / "shared" / "bench" / "beam_dev.json.gz"
KS = (1, 5, 10)


def batches(chat: dict[str, Any]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(session, messages) per batch of a chat; a batch's date holds until the next one."""
    when: datetime | None = None
    current: list[dict[str, Any]] = []
    session = None
    for m in chat["messages"]:
        if m["time"]:
            when = datetime.strptime(m["time"], "%B-%d-%Y").replace(tzinfo=UTC)
        if m["session"] != session and current:
            yield f"batch_{session}", current
            current = []
        session = m["session"]
        current.append({"role": m["role"], "content": m["content"], "observed_at": when,
                        "metadata": {"mid": str(m["id"])}})
    if current:
        yield f"batch_{session}", current


def user(chat: dict[str, Any]) -> str:
    return "beam-" + chat["chat"].replace("/", "-")


def ingest(mem: Memory, chats: list[dict[str, Any]]) -> tuple[int, float]:
    """Turns added and the seconds it took."""
    n, t = 0, time.perf_counter()
    for chat in chats:
        for session, messages in batches(chat):
            mem.add(messages, user_id=user(chat), session_id=session, infer=False)
            n += len(messages)
    return n, time.perf_counter() - t


# A sentence on another subject, and the question about it: appended to a long message, past
# the window its text key reads (docs/passages.md, "What the margin costs").
NEEDLES = [
    ("By the way, my dentist appointment moved to Thursday at 4pm.",
     "When is my dentist appointment?"),
    ("Also, my sister Ines is getting married in Porto next June.",
     "Where is my sister's wedding?"),
    ("Unrelated, but I adopted a grey cat named Pixel last week.", "What is the name of my cat?"),
    ("Side note: I am allergic to peanuts, so no peanut snacks at the meetup.",
     "What food allergy do I have?"),
    ("Oh, and my flight to Tokyo leaves on the 14th from Lisbon.",
     "When does my flight to Tokyo leave?"),
    ("I also started learning the cello on Saturday mornings.", "What instrument am I learning?"),
    ("My landlord is raising the rent to 1,450 euros from March.", "How much will my rent be?"),
    ("My favourite dessert is still my grandmother's apricot jam tart.",
     "What is my favourite dessert?"),
    ("I ran my first half marathon in 1 hour 52 minutes last Sunday.",
     "What was my half marathon time?"),
    ("The plumber is coming on Monday to fix the leaking kitchen sink.",
     "When is the plumber coming?"),
]


def needles(mem: Memory, chats: list[dict[str, Any]], embedder: Any) -> dict[str, Any]:
    """Each needle appended to a long message (over 3,000 characters) of each chat, added as
    one more memory of the chat and asked about, then deleted: is it first, in the top 10, by
    the text key alone and by `Memory.search` (dense preset)?"""
    rng = np.random.default_rng(0)
    found = {"text": [0, 0], "passages": [0, 0]}
    n = 0
    for chat in chats:
        long = [m["content"] for m in chat["messages"] if len(m["content"]) > 3000]
        if len(long) < len(NEEDLES):
            continue
        scope = Scope(user(chat))
        for (sentence, question), i in zip(NEEDLES, rng.choice(len(long), len(NEEDLES),
                                                               replace=False), strict=True):
            added = mem.add(f"{long[i]}\n\n{sentence}", user_id=scope.user_id,
                            session_id="needles", infer=False).memories[0].id
            vector = embedder.embed_batch([question])[0]
            text = [m for m, _ in store_dense(mem, scope, vector)]
            hits = [h.memory.id for h in mem.search(question, user_id=scope.user_id, limit=10)]
            for label, ranked in (("text", text), ("passages", hits)):
                found[label][0] += ranked[:1] == [added]
                found[label][1] += added in ranked
            mem.delete(added)
            n += 1
    return {"needles": n, **{f"{label}_at_1": round(a / max(n, 1), 3)
                             for label, (a, _) in found.items()},
            **{f"{label}_in_10": round(b / max(n, 1), 3) for label, (_, b) in found.items()}}


def store_dense(mem: Memory, scope: Scope, vector: np.ndarray) -> list[tuple[str, float]]:
    return mem.store.dense(Query(scope=scope, now=utcnow()), vector, 10, key="text")


def recall(ranked: list[str], gold: set[str]) -> list[float]:
    return [len(gold & set(ranked[:k])) / len(gold) for k in KS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--chats", type=int, default=None)
    ap.add_argument("--ingest-chats", type=int, default=2)
    ap.add_argument("--db", type=Path, default=Path(__file__).parent / "results" / "passages.db")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with gzip.open(args.data, "rt") as f:
        chats: list[dict[str, Any]] = json.load(f)[:args.chats]
    embedder = get_embedder("minilm-int8")
    out: dict[str, Any] = {"chats": len(chats)}

    # Ingest speed, with and without passage keys, each on a fresh database.
    sample = chats[:args.ingest_chats]
    told = passages.of
    for label in ("without", "with") if sample else ():
        path = args.db.with_suffix(f".ingest-{label}.db")
        for p in path.parent.glob(path.name + "*"):
            p.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        passages.of = told if label == "with" else (lambda embedder, records: {})  # type: ignore[assignment]
        try:
            with Memory(path, embedder=embedder, config=Config(path=path)) as mem:
                n, secs = ingest(mem, sample)
        finally:
            passages.of = told
        out[f"ingest_{label}_passages"] = {"turns": n, "seconds": round(secs, 1),
                                           "turns_per_s": round(n / secs, 1)}
        print(f"ingest {label} passages: {n} turns in {secs:.1f}s = {n / secs:.1f} turns/s",
              file=sys.stderr)

    # Recall, both ways, on one database of every chat.
    for p in args.db.parent.glob(args.db.name + "*"):
        p.unlink()
    with Memory(args.db, embedder=embedder, retrieval="dense",
                config=Config(path=args.db)) as mem:
        n, secs = ingest(mem, chats)
        print(f"ingested {n} turns in {secs:.0f}s", file=sys.stderr)
        store = mem.store
        keys = store._read("SELECT kind, count(*) FROM memory_keys GROUP BY kind")  # type: ignore[attr-defined]
        out["keys"] = dict(keys)
        sums = {"text": np.zeros(len(KS)), "passages": np.zeros(len(KS))}
        count = 0
        by_passage = 0
        for chat in chats:
            scope = Scope(user(chat))
            for q in chat["questions"]:
                gold = {str(i) for i in q["evidence"]}
                if not gold:
                    continue
                count += 1
                vector = embedder.embed_batch([q["question"]])[0]
                text = store.dense(Query(scope=scope, now=utcnow()), vector, 10, key="text")
                mids = {r.id: r.metadata["mid"] for r in store.get([m for m, _ in text]).values()}
                sums["text"] += recall([mids[m] for m, _ in text], gold)
                hits = mem.search(q["question"], user_id=scope.user_id, limit=10)
                sums["passages"] += recall([h.memory.metadata["mid"] for h in hits], gold)
                by_passage += sum("dense" not in h.explain for h in hits)
        out["questions"] = count
        out["hits_by_a_passage"] = round(by_passage / (10 * count), 3)
        for label, total in sums.items():
            out[f"dense_{label}"] = {f"R@{k}": round(float(v / count), 3)
                                     for k, v in zip(KS, total, strict=True)}
        out["needles"] = needles(mem, chats, embedder)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for label in ("text", "passages"):
            r = out[f"dense_{label}"]
            print(f"dense, {label:9s} R@1 {r['R@1']:.3f}  R@5 {r['R@5']:.3f}  R@10 {r['R@10']:.3f}")
        print(json.dumps({k: v for k, v in out.items() if not k.startswith("dense_")}))


if __name__ == "__main__":
    main()

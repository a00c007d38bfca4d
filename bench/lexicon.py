"""The SQLite store's in-memory lexicon at scale: its build, warm lexical searches, searches
for a phrase of three tokens or more, and the searches that follow small writes by another
store (each applies the write, and may merge segments).

    python bench/lexicon.py [--size 100000] [--db /tmp/lexicon-100k.db] [--writes 60]

The database (one scope, chat-like sentences, some naming `o'neil's` or `rock'n'roll`: phrases
of three tokens to FTS5) is made once and reused; each run copies it, so every run starts from
the same rows and builds its lexicon from them.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

from engram.model import Kind, MemoryRecord, Scope, new_id
from engram.pipeline.text import content_hash
from engram.store import Key, Lexical, Query
from engram.store.sqlite import SQLiteStore

NOW = datetime(2025, 6, 1, 12, tzinfo=UTC)
SCOPE = Scope("u1")
COMMON = "we talked about today really went".split()
WORDS = """hiking ramen lisbon kyoto guitar painting adoption counseling pottery museum sunrise
beach camping violin marathon café résumé co-op 3:30 o'clock festival""".split()
LONG = ["o'neil's", "rock'n'roll", "o'neil's place"]  # 3 tokens (4 for the last)
NAMES = ["Caroline's", "Melanie", "Jon's", "Gina", "Deborah's", "Maria"]
QUERIES = [["ramen", "lisbon"], ["went", "kyoto"], ["caroline's", "guitar"], ["today"],
           ["marathon", "sunrise", "talked"], ["co-op", "festival"]]
LONG_QUERIES = [["o'neil's", "went"], ["rock'n'roll"], ["o'neil's", "place", "ramen"],
                ["rock'n'roll", "today", "guitar"]]


def sentence(rng: random.Random) -> str:
    words = rng.sample(COMMON, rng.randint(2, 5)) + rng.choices(WORDS, k=rng.randint(1, 6))
    words.insert(rng.randrange(len(words) + 1), rng.choice(NAMES))
    if rng.random() < 0.03:
        words.insert(rng.randrange(len(words) + 1), rng.choice(LONG))
    return " ".join(words) + "."


def row(rng: random.Random, text: str, previous: str = "") -> tuple:
    at = NOW - timedelta(minutes=rng.randint(1, 10_000))
    rec = MemoryRecord(id=new_id(), scope=SCOPE, kind=Kind.EPISODIC, text=text, metadata={},
                       importance=0.5, created_at=at, updated_at=at, valid_from=at,
                       content_hash=content_hash(text))
    return rec, [Key("text", np.ones(4, dtype=np.float32) / 2)], Lexical(text, previous)


def fill(path: Path, n: int) -> None:
    rng = random.Random(5)
    s = SQLiteStore(path, lexicon_threshold=10**9)
    try:
        for _ in range(0, n, 5000):
            with s.write() as tx:
                tx.insert_many([row(rng, sentence(rng) + " " + sentence(rng), sentence(rng))
                                for _ in range(5000)])
    finally:
        s.close()


def ms(xs: list[float], p: float) -> float:
    return 1000 * float(np.percentile(xs, p))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=100_000)
    ap.add_argument("--db", type=Path, default=Path("/tmp/lexicon-100k.db"))
    ap.add_argument("--writes", type=int, default=60)
    args = ap.parse_args()
    if not args.db.exists():
        fill(args.db, args.size)
    path = args.db.with_name(args.db.stem + "-run.db")
    for f in path.parent.glob(path.name + "*"):
        f.unlink()
    shutil.copy(args.db, path)
    s = SQLiteStore(path, lexicon_threshold=0)
    other = SQLiteStore(path, lexicon_threshold=0)
    q = Query(scope=SCOPE, now=NOW)
    try:
        t0 = time.perf_counter()
        s.lexical(q, ["ramen"], 10, 0.5)
        build = time.perf_counter() - t0

        def timed(words: list[str]) -> float:
            t = time.perf_counter()
            s.lexical(q, words, 10, 0.5)
            return time.perf_counter() - t

        plain = [timed(words) for _ in range(5) for words in QUERIES]
        long = [timed(words) for _ in range(2) for words in LONG_QUERIES]
        rng = random.Random(9)
        after = []
        for i in range(args.writes):
            with other.write() as tx:
                tx.insert_many([row(rng, sentence(rng)) for _ in range(rng.randint(1, 5))])
            t = time.perf_counter()
            s.lexical(q, QUERIES[i % len(QUERIES)], 10, 0.5)
            after.append(time.perf_counter() - t)
        lex = s._follower.lexicon
        segments = len(lex.segments) if lex is not None else 0
        postings = sum(a.nbytes for g in lex.segments if lex is not None
                       for a in (g.keys, g.starts, g.docs, g.body, g.context)) / 2**20
        tokens = getattr(lex, "seq", np.zeros(0)).nbytes / 2**20  # the documents' tokens
    finally:
        s.close()
        other.close()
    print(f"n={args.size}: build {build:.2f} s; search p50/p95 {ms(plain, 50):.1f}/"
          f"{ms(plain, 95):.1f} ms; a phrase of 3+ tokens p50/max {ms(long, 50):.1f}/"
          f"{1000 * max(long):.1f} ms; after a small write ({args.writes}) p50/p95/max "
          f"{ms(after, 50):.1f}/{ms(after, 95):.1f}/{1000 * max(after):.1f} ms, mean "
          f"{1000 * statistics.fmean(after):.1f} ms; {segments} segments, postings {postings:.0f} MB, "
          f"tokens {tokens:.0f} MB", flush=True)


if __name__ == "__main__":
    main()

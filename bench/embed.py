"""The local embedder alone, on LoCoMo dev: how fast it embeds turns and single queries.

    python bench/embed.py [--data ../shared/bench/locomo_dev.json] [--embedder minilm minilm-int8]
                          [--threads N] [--repeat 3] [--json]

Turns are embedded as `Memory.add` embeds them: one call per session, each text "speaker: text"
(bench/locomo.py's turns). Queries are the questions, one call each, as `search` embeds them.
The embedder's query cache is bypassed (`_encode`), so every call runs the model. Prints, per
embedder: turns per second of wall clock and of CPU time (this process, all its threads), the
query latency p50/p95, and the min/mean cosine of each embedder's turn vectors to the first
embedder's (the int8 variant against fp32). Report the machine's load (`uptime`) with numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from engram import Config
from engram.providers.embedders import MiniLM, get_embedder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from locomo import DEFAULT_DATA, turn_text  # noqa: E402


def sessions_and_questions(data: Path) -> tuple[list[list[str]], list[str]]:
    sessions: list[list[str]] = []
    questions: list[str] = []
    for conv in json.loads(data.read_text()):
        c = conv["conversation"]
        for key in sorted((k for k in c if re.fullmatch(r"session_\d+", k)),
                          key=lambda k: int(k.split("_")[1])):
            sessions.append([f"{t['speaker']}: {turn_text(t)}" for t in c[key]])
        questions += [qa["question"] for qa in conv["qa"] if qa["category"] in (1, 2, 3, 4)]
    return sessions, questions


def measure(embedder: MiniLM, sessions: list[list[str]], questions: list[str],
            repeat: int) -> tuple[dict[str, float], np.ndarray]:
    embedder._encode(["warm up"])
    turns = sum(len(s) for s in sessions)
    best_wall, best_cpu = float("inf"), float("inf")
    vectors = np.zeros((0, embedder.dim), dtype=np.float32)
    for _ in range(repeat):  # the best of a few runs: the machine is shared
        wall, cpu = time.perf_counter(), time.process_time()
        vectors = np.concatenate([embedder._encode(s) for s in sessions])
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    latencies = []
    for q in questions:
        t = time.perf_counter()
        embedder._encode([q])
        latencies.append(time.perf_counter() - t)
    latencies.sort()
    return {
        "turns": turns,
        "turns_per_s_wall": turns / best_wall,
        "turns_per_cpu_s": turns / best_cpu,
        "query_p50_ms": 1000 * latencies[len(latencies) // 2],
        "query_p95_ms": 1000 * latencies[int(len(latencies) * 0.95)],
    }, vectors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--embedder", nargs="+", default=["minilm", "minilm-int8"])
    ap.add_argument("--threads", type=int, help="intra-op threads (default: the config's)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.data.exists():
        sys.exit(f"LoCoMo data not found at {args.data}; pass --data")
    sessions, questions = sessions_and_questions(args.data)
    config = Config.from_env()
    if args.threads:
        config = Config.from_env(embed_threads=args.threads)
    results: dict[str, dict[str, float]] = {}
    reference: np.ndarray | None = None
    for name in args.embedder:
        embedder = get_embedder(name, config)
        if not isinstance(embedder, MiniLM):
            sys.exit(f"{name} is not a local ONNX embedder")
        res, vectors = measure(embedder, sessions, questions, args.repeat)
        if reference is None:
            reference = vectors
        cosines = (vectors * reference).sum(axis=1)
        res |= {"threads": embedder.threads, "min_cosine": float(cosines.min()),
                "mean_cosine": float(cosines.mean())}
        results[name] = res
    load = os.getloadavg()
    if args.json:
        print(json.dumps({"load_average": load, "results": results}, indent=2))
        return
    print(f"LoCoMo dev: {len(questions)} questions, {sum(len(s) for s in sessions)} turns in "
          f"{len(sessions)} sessions; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'embedder':<14}{'threads':>8}{'turns/s':>10}{'turns/CPU-s':>13}{'query p50':>11}"
          f"{'p95':>8}{'min cos':>9}")
    for name, r in results.items():
        print(f"{name:<14}{r['threads']:>8}{r['turns_per_s_wall']:>10.0f}{r['turns_per_cpu_s']:>13.0f}"
              f"{r['query_p50_ms']:>9.1f}ms{r['query_p95_ms']:>6.1f}ms{r['min_cosine']:>9.4f}")


if __name__ == "__main__":
    main()

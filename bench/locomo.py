"""LoCoMo retrieval benchmark on the dev split, through the public `Memory` API.

Each turn is stored as one episode in its conversation's scope (user_id = sample id,
session_id = LoCoMo session, name = speaker, observed_at = the session's date,
metadata = {"dia_id": ...}); every question of categories 1-4 is asked with `search`.

    python bench/locomo.py [--data ../shared/bench/locomo_dev.json] [--preset hybrid]

Prints recall@1/5/10/20 per category, session-level Hit@1, ingest rate, search p50/p95.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

from engram import Memory

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
KS = (1, 5, 10, 20)
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "bench" / "locomo_dev.json"


def session_time(text: str) -> datetime:
    """'1:56 pm on 8 May, 2023' -> datetime."""
    return datetime.strptime(text.strip(), "%I:%M %p on %d %B, %Y")


def evidence_ids(raw: list[str], known: set[str]) -> list[str]:
    """Normalise the few malformed ids ('D8:6; D9:17', 'D:11:26', 'D30:05'), drop unknown ones."""
    out: list[str] = []
    for item in raw:
        for part in re.split(r"[;,]\s*", item):
            m = re.fullmatch(r"D:?(\d+):0*(\d+)", part.strip())
            if m:
                did = f"D{m.group(1)}:{m.group(2)}"
                if did in known and did not in out:
                    out.append(did)
    return out


def turn_text(turn: dict) -> str:
    text = turn["text"]
    if turn.get("blip_caption"):
        text += f" [shares a photo of {turn['blip_caption']}]"
    return text


def ingest(mem: Memory, conv: dict) -> int:
    c = conv["conversation"]
    n = 0
    sessions = sorted(int(k.split("_")[1]) for k in c
                       if re.fullmatch(r"session_\d+", k))
    for s in sessions:
        when = session_time(c[f"session_{s}_date_time"])
        messages = [{"role": "user", "name": t["speaker"], "content": turn_text(t),
                     "observed_at": when, "metadata": {"dia_id": t["dia_id"]}}
                    for t in c[f"session_{s}"]]
        mem.add(messages, user_id=conv["sample_id"], session_id=f"session_{s}", infer=False)
        n += len(messages)
    return n


def run(data: Path, preset: str) -> dict:
    convs = json.loads(data.read_text())
    recall = {k: defaultdict(list) for k in KS}
    session_hit1: list[float] = []
    latencies: list[float] = []
    ingested, ingest_s = 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        mem = Memory(Path(tmp) / "locomo.db", retrieval=preset)
        mem.embedder.embed_batch(["warm up"])
        for conv in convs:
            t0 = time.perf_counter()
            ingested += ingest(mem, conv)
            ingest_s += time.perf_counter() - t0
            known = {t["dia_id"] for k, v in conv["conversation"].items()
                     if re.fullmatch(r"session_\d+", k) for t in v}
            for qa in conv["qa"]:
                if qa["category"] not in CATEGORIES:
                    continue
                gold = evidence_ids(qa.get("evidence", []), known)
                if not gold:
                    continue
                t0 = time.perf_counter()
                hits = mem.search(qa["question"], user_id=conv["sample_id"], limit=max(KS))
                latencies.append(time.perf_counter() - t0)
                ranked = [h.memory.metadata["dia_id"] for h in hits]
                for k in KS:
                    found = len(set(ranked[:k]) & set(gold)) / len(gold)
                    recall[k][qa["category"]].append(found)
                    recall[k]["all"].append(found)
                gold_sessions = {g.split(":")[0] for g in gold}
                session_hit1.append(float(bool(ranked) and ranked[0].split(":")[0] in gold_sessions))
        mem.close()
    lat = sorted(latencies)
    return {
        "preset": preset,
        "questions": len(recall[10]["all"]),
        "recall": {k: {str(c): statistics.mean(v) for c, v in per.items()} for k, per in recall.items()},
        "session_hit@1": statistics.mean(session_hit1),
        "ingest_per_s": ingested / ingest_s,
        "search_p50_ms": 1000 * lat[len(lat) // 2],
        "search_p95_ms": 1000 * lat[int(len(lat) * 0.95)],
    }


def report(res: dict) -> str:
    lines = [f"LoCoMo dev, preset={res['preset']}, {res['questions']} questions (categories 1-4)",
             f"{'category':<14}" + "".join(f"{'R@' + str(k):>8}" for k in KS)]
    for c in ["1", "2", "3", "4", "all"]:
        name = CATEGORIES.get(int(c), c) if c != "all" else "all"
        lines.append(f"{name:<14}" + "".join(f"{res['recall'][k][c]:>8.3f}" for k in KS))
    lines.append(f"session Hit@1 {res['session_hit@1']:.3f}   ingest {res['ingest_per_s']:.0f} msg/s   "
                 f"search p50 {res['search_p50_ms']:.1f} ms  p95 {res['search_p95_ms']:.1f} ms")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--preset", default="hybrid")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.data.exists():
        sys.exit(f"LoCoMo data not found at {args.data}; pass --data")
    res = run(args.data, args.preset)
    print(json.dumps(res, indent=2) if args.json else report(res))


if __name__ == "__main__":
    main()

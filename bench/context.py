"""Context assembly on the LoCoMo dev split: tokens per question and recall of the gold evidence
turns inside the assembled context, per budget, against sending the whole conversation.

Each turn is stored as an episode (as in bench/locomo.py); each question of categories 1-4 is
answered with `Memory.context(question, user_id=conversation, budget_tokens=B)` and the default
blocks (no LLM: no facts, so the episodes block gets what the others leave).

    python bench/context.py [--data ../shared/bench/locomo_dev.json] [--budgets 500 1000 2000]
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engram import Memory  # noqa: E402
from engram.providers.tokens import get_tokenizer  # noqa: E402
from locomo import CATEGORIES, DEFAULT_DATA, evidence_ids, ingest, session_time, turn_text  # noqa: E402


def whole_conversation_tokens(conv: dict) -> int:
    """The conversation sent as it is: one message per turn, with speaker and session date."""
    tok = get_tokenizer()
    c = conv["conversation"]
    messages = []
    for key in sorted((k for k in c if re.fullmatch(r"session_\d+", k)),
                      key=lambda k: int(k.split("_")[1])):
        when = session_time(c[f"{key}_date_time"]).date().isoformat()
        messages += [{"role": "user", "name": re.sub(r"\W", "_", t["speaker"]),
                      "content": f"[{when}] {turn_text(t)}"} for t in c[key]]
    return tok.count_messages(messages)


def run(data: Path, budgets: list[int]) -> dict:
    convs = json.loads(data.read_text())
    recall: dict[int, dict[str, list[float]]] = {b: defaultdict(list) for b in budgets}
    tokens: dict[int, list[int]] = {b: [] for b in budgets}
    latency: dict[int, list[float]] = {b: [] for b in budgets}
    whole: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        mem = Memory(Path(tmp) / "ctx.db")
        mem.embedder.embed_batch(["warm up"])
        for conv in convs:
            ingest(mem, conv)
            uid = conv["sample_id"]
            dia = {}
            cursor = None
            while True:
                page = mem.list(user_id=uid, limit=500, cursor=cursor)
                dia.update({r.id: r.metadata.get("dia_id") for r in page.items})
                if not page.next_cursor:
                    break
                cursor = page.next_cursor
            known = set(dia.values())
            n_whole = whole_conversation_tokens(conv)
            for qa in conv["qa"]:
                if qa["category"] not in CATEGORIES:
                    continue
                gold = evidence_ids(qa.get("evidence", []), known)
                if not gold:
                    continue
                whole.append(n_whole)
                for b in budgets:
                    t0 = time.perf_counter()
                    ctx = mem.context(qa["question"], user_id=uid, budget_tokens=b)
                    latency[b].append(time.perf_counter() - t0)
                    assert ctx.total_tokens <= b
                    inside = {dia[i] for i in ctx.ids() if i in dia}
                    found = len(inside & set(gold)) / len(gold)
                    recall[b][str(qa["category"])].append(found)
                    recall[b]["all"].append(found)
                    tokens[b].append(ctx.total_tokens)
        mem.close()

    def pct(xs: list[float], q: float) -> float:
        s = sorted(xs)
        return s[min(len(s) - 1, int(len(s) * q))]

    return {
        "questions": len(whole),
        "whole_conversation_tokens_mean": statistics.mean(whole),
        "budgets": {b: {
            "tokens_mean": statistics.mean(tokens[b]),
            "recall": {c: statistics.mean(v) for c, v in recall[b].items()},
            "context_p50_ms": 1000 * pct(latency[b], 0.5),
            "context_p95_ms": 1000 * pct(latency[b], 0.95),
        } for b in budgets},
    }


def report(res: dict) -> str:
    lines = [f"LoCoMo dev, {res['questions']} questions (categories 1-4); whole conversation: "
             f"{res['whole_conversation_tokens_mean']:.0f} tokens on average (recall 1.000)",
             f"{'budget':>7} {'tokens':>7} " + "".join(f"{CATEGORIES[int(c)][:11]:>12}" for c in "1234")
             + f"{'all':>8} {'p50 ms':>8} {'p95 ms':>8}"]
    for b, r in res["budgets"].items():
        rec = r["recall"]
        lines.append(f"{b:>7} {r['tokens_mean']:>7.0f} " + "".join(f"{rec[c]:>12.3f}" for c in "1234")
                     + f"{rec['all']:>8.3f} {r['context_p50_ms']:>8.1f} {r['context_p95_ms']:>8.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--budgets", type=int, nargs="+", default=[500, 1000, 2000])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.data.exists():
        sys.exit(f"LoCoMo data not found at {args.data}; pass --data")
    res = run(args.data, args.budgets)
    print(json.dumps(res, indent=2) if args.json else report(res))


if __name__ == "__main__":
    main()

"""Entity resolution on a corpus of hard cases (tests/data/entity_pairs.jsonl), both directions.

Each pair is two names with types (and the aliases the known one has); `same` says whether they
are one entity. Each pair is resolved twice — a against a store holding b, and b against a store
holding a — with the staged resolution of engram.graph.rules and the real local embedder.
Ambiguous cases are kept apart without an LLM, or asked with `--llm-base-url`.

    python bench/entities.py [--data tests/data/entity_pairs.jsonl] [--llm-base-url URL] [--json]

Prints precision and recall of "same entity" decisions, what each stage decided, and every
mistake with the reason the corpus gives.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engram.graph import rules as g
from engram.graph.entities import ask
from engram.model import Entity, Scope
from engram.providers.embedders import get_embedder
from engram.providers.llms import LLM, OpenAICompatible

DEFAULT_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "entity_pairs.jsonl"


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def decide(name: str, type: str, aliases: list[str], other: str, other_type: str,
           other_aliases: list[str], vectors: dict[str, Any], llm: LLM | None) -> tuple[bool, str]:
    """Is `name` the known entity `other`? And the stage that said so."""
    known = g.Known("known", other, other_type, tuple(other_aliases), vectors[other])
    res = g.resolve(name, type, [known], vectors[name], aliases)
    if res.stage == "ambiguous" and llm is not None:
        now = datetime.now(UTC)
        option = Entity("known", Scope(), other, other_type or "entity", now, now,
                        aliases=tuple(other_aliases))
        return ask(llm, name, type, [option]) == "known", "llm"
    return res.entity == "known", res.stage


def run(data: Path, llm_base_url: str | None = None) -> dict[str, Any]:
    pairs = load(data)
    embedder = get_embedder("minilm")
    names = sorted({p["a"] for p in pairs} | {p["b"] for p in pairs})
    vectors = dict(zip(names, embedder.embed_batch(names), strict=True))
    llm = LLM(OpenAICompatible(llm_base_url), timeout_s=120, retries=1) if llm_base_url else None
    tp = fp = fn = tn = 0
    stages: Counter[str] = Counter()
    mistakes: list[str] = []
    for p in pairs:
        directions = [(p["a"], p["a_type"], [], p["b"], p["b_type"], p["b_aliases"]),
                      (p["b"], p["b_type"], p["b_aliases"], p["a"], p["a_type"], [])]
        for name, typ, aliases, other, otype, oaliases in directions:
            said, stage = decide(name, typ, aliases, other, otype, oaliases, vectors, llm)
            stages[f"{stage}:{'same' if said else 'apart'}"] += 1
            if said and p["same"]:
                tp += 1
            elif said:
                fp += 1
                mistakes.append(f"merged   {name!r} ({typ}) into {other!r} ({otype}): {p['why']}")
            elif p["same"]:
                fn += 1
                mistakes.append(f"missed   {name!r} ({typ}) is {other!r} ({otype}): {p['why']}")
            else:
                tn += 1
    return {
        "pairs": len(pairs), "decisions": tp + fp + fn + tn, "llm": bool(llm),
        "precision": tp / (tp + fp) if tp + fp else 1.0,
        "recall": tp / (tp + fn) if tp + fn else 1.0,
        "tp": tp, "fp": fp, "fn": fn, "tn": tn, "stages": dict(sorted(stages.items())),
        "mistakes": mistakes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--llm-base-url", help="an OpenAI-compatible endpoint for ambiguous names")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.data, args.llm_base_url)
    if args.json:
        json.dump(res, sys.stdout, indent=2)
        print()
        return
    print(f"entity resolution: {res['pairs']} pairs, {res['decisions']} decisions (both directions), "
          f"LLM for ambiguous: {'yes' if res['llm'] else 'no (kept apart)'}")
    print(f"precision {res['precision']:.3f}   recall {res['recall']:.3f}   "
          f"(tp {res['tp']}, fp {res['fp']}, fn {res['fn']}, tn {res['tn']})")
    print("by stage: " + ", ".join(f"{k} {v}" for k, v in res["stages"].items()))
    for m in res["mistakes"]:
        print("  " + m)


if __name__ == "__main__":
    main()

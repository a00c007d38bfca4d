"""Retrieval over several kinds of data, the fused preset beside each of its retrievers alone.

    python bench/retrieval.py [--data locomo,beam,profiles] [--chats N] [--presets hybrid,...]
                              [--fresh] [--results DIR] [--json]

Data sets: LoCoMo dev (short chit-chat turns between two people, bench/locomo.py), BEAM dev
(long technical user/assistant chats, bench/beam.py) and the profile set (a user's facts told
over weeks, some revised later, as first-person statements and as chat messages of both roles,
bench/profiles.py). For each: recall@1/5/10 of the evidence, and newer-first where a question
has an older and a newer statement (the newer one's best rank above the older one's; absent
from the first 20 counts as last). Each data set is searched with the fused preset (`hybrid`)
and with each of its retrievers alone (`dense`: the memory's own text, `window`: the text with
the two turns before it, `lexical`: BM25 with the previous turn): a fusion that loses to one of
its parts shows in the table.

The ingested databases are kept in bench/results/retrieval/ (git-ignored): the first run embeds
(BEAM's 38k messages take a while), later runs only search. `--fresh` ingests again (after a
change to what is indexed); `--chats N` takes the first N chats / conversations / users of each
data set (for quick iteration; a subset gets its own database). `--results DIR` keeps the
databases elsewhere (a re-ingest of your own while others measure the shared ones).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import beam
import locomo
import profiles
from engram import PRESETS, Config, Memory, RetrievalConfig

KS = (1, 5, 10)
DEPTH = 20  # hits read per question (newer-first looks this deep)
RESULTS = Path(__file__).resolve().parent / "results" / "retrieval"


def parts(fused: RetrievalConfig) -> dict[str, RetrievalConfig]:
    """Each retriever of a fused preset alone: its weight 1, the others' 0, no adjustment;
    the lexical one also as the preset sees it, long messages matched by their own words."""
    alone = RetrievalConfig("alone", dense_weight=0.0, lexical_weight=0.0,
                            candidates=fused.candidates, previous_weight=fused.previous_weight)
    out = {}
    for label in ("dense", "window", "lexical"):
        if getattr(fused, f"{label}_weight"):
            out[label] = replace(alone, name=label, **{f"{label}_weight": 1.0})
    if "lexical" in out and fused.previous_chars:
        out["lexical + own words"] = replace(out["lexical"], name="lexical + own words",
                                             previous_chars=fused.previous_chars)
    return out


Question = tuple[str, str, list[str], list[str], list[str], str]
"""user_id, question, evidence ids, older-statement ids, newer-statement ids, category"""


@dataclass
class DataSet:
    name: str
    ingest: Callable[[Memory], int]   # stores everything, returns the number of memories
    questions: Callable[[], Iterator[Question]]
    key: str                          # the metadata field holding a memory's id in the data
    kinds: list[str] | None = None    # what a question searches (None: every kind)


def locomo_set(chats: int | None) -> DataSet:
    convs = json.loads(locomo.DEFAULT_DATA.read_text())[:chats]

    def ingest(mem: Memory) -> int:
        return sum(locomo.ingest(mem, conv) for conv in convs)

    def questions() -> Iterator[Question]:
        for conv in convs:
            known = {t["dia_id"] for k, v in conv["conversation"].items()
                     if re.fullmatch(r"session_\d+", k) for t in v}
            for qa in conv["qa"]:
                if qa["category"] in locomo.CATEGORIES:
                    gold = locomo.evidence_ids(qa.get("evidence", []), known)
                    if gold:
                        yield conv["sample_id"], qa["question"], gold, [], [], \
                            locomo.CATEGORIES[qa["category"]]
    return DataSet("LoCoMo dev", ingest, questions, "dia_id", ["episodic"])


def beam_set(chats: int | None) -> DataSet:
    data = beam.load(chats=chats)

    def ingest(mem: Memory) -> int:
        n = 0
        for i, chat in enumerate(data):
            n += beam.ingest(mem, chat)
            print(f"  BEAM chat {i + 1}/{len(data)}: {n} messages", file=sys.stderr, flush=True)
        return n

    def questions() -> Iterator[Question]:
        for chat in data:
            for q, gold, old, new, category in beam.questions(chat):
                yield beam.scope(chat), q, gold, old, new, category
    return DataSet("BEAM dev", ingest, questions, "mid", ["episodic"])


def profile_set(chats: int | None) -> DataSet:
    users = profiles.USERS[:chats]

    def ingest(mem: Memory) -> int:
        return sum(profiles.ingest(mem, user) for user in users)

    def questions() -> Iterator[Question]:
        for user in users:
            yield from profiles.questions(user)
    return DataSet("profiles", ingest, questions, "mid")


SETS = {"locomo": locomo_set, "beam": beam_set, "profiles": profile_set}


def database(name: str, data: DataSet, chats: int | None, fresh: bool,
             results: Path = RESULTS) -> Path:
    """The data set's ingested database in `results`, made on first use."""
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}{'' if chats is None else f'-{chats}'}.db"
    if fresh or not path.exists():
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        tmp = path.with_suffix(f".partial-{os.getpid()}.db")
        for suffix in ("", "-wal", "-shm"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
        t0 = time.perf_counter()
        with Memory(config=Config.from_env(path=tmp)) as mem:
            n = data.ingest(mem)
        print(f"{data.name}: {n} memories ingested in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
        tmp.rename(path)
    return path


def measure(path: Path, data: DataSet, cfg: RetrievalConfig) -> dict:
    recall: dict[int, list[float]] = {k: [] for k in KS}
    by_category: dict[str, list[float]] = defaultdict(list)
    newer: list[float] = []
    top1: list[bool] = []  # per question, in order: is an evidence id first
    with Memory(config=Config.from_env(path=path), retrieval=cfg) as mem:
        for user, question, gold, old, new, category in data.questions():
            hits = mem.search(question, user_id=user, limit=DEPTH, kinds=data.kinds)
            ranked = [str(h.memory.metadata.get(data.key, "")) for h in hits]
            for k in KS:
                recall[k].append(len(set(ranked[:k]) & set(gold)) / len(gold))
            top1.append(bool(set(ranked[:1]) & set(gold)))
            by_category[category].append(float(top1[-1]))
            if old and new:
                newer.append(float(first(ranked, new) < first(ranked, old)))
    return {"questions": len(recall[1]),
            **{f"R@{k}": statistics.mean(v) for k, v in recall.items()},
            "newer_first": statistics.mean(newer) if newer else None,
            "revisions": len(newer),
            "top1_by_category": {c: statistics.mean(v) for c, v in sorted(by_category.items())},
            "top1": top1}


def first(ranked: list[str], ids: list[str]) -> int:
    return min((i for i, r in enumerate(ranked) if r in ids), default=len(ranked) + 1)


def run(names: list[str], chats: int | None, presets: list[str], fresh: bool,
        results: Path = RESULTS) -> dict:
    out: dict[str, dict] = {}
    for name in names:
        data = SETS[name](chats)
        path = database(name, data, chats, fresh, results)
        rows: dict[str, dict] = {}
        for preset in presets:
            fused = PRESETS[preset]
            rows[preset] = measure(path, data, fused)
            print(f"{data.name} {preset}: {fmt(rows[preset])}", file=sys.stderr, flush=True)
        for label, cfg in parts(PRESETS[presets[0]]).items():
            rows[label] = measure(path, data, cfg)
            print(f"{data.name} {label} alone: {fmt(rows[label])}", file=sys.stderr, flush=True)
        # questions with no older statement that dense alone answers first and this does not
        plain = [not old for _, _, _, old, _, _ in data.questions()]
        if "dense" in rows:
            for row in rows.values():
                row["displaced"] = sum(d and p and not t for d, p, t in
                                       zip(rows["dense"]["top1"], plain, row["top1"], strict=True))
        out[data.name] = rows
    return out


def fmt(row: dict) -> str:
    nf = "" if row["newer_first"] is None else f"  newer-first {row['newer_first']:.3f} ({row['revisions']})"
    nf += "  top-1 by category " + ", ".join(f"{c} {v:.2f}" for c, v in row["top1_by_category"].items())
    return " ".join(f"R@{k} {row[f'R@{k}']:.3f}" for k in KS) + nf


def table(res: dict) -> str:
    lines = ["| data | ranking | questions | R@1 | R@5 | R@10 | newer-first |",
             "|---|---|---|---|---|---|---|"]
    for data, rows in res.items():
        for label, row in rows.items():
            nf = "" if row["newer_first"] is None else f"{row['newer_first']:.3f} ({row['revisions']})"
            name = label if label in PRESETS and label not in ("dense", "lexical") else f"{label} alone"
            lines.append(f"| {data} | {name} | {row['questions']} | {row['R@1']:.3f} | "
                         f"{row['R@5']:.3f} | {row['R@10']:.3f} | {nf} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="locomo,beam,profiles")
    ap.add_argument("--chats", type=int, help="only the first N chats of each data set")
    ap.add_argument("--presets", default="hybrid", help="fused presets to measure (the first's parts too)")
    ap.add_argument("--fresh", action="store_true", help="ingest again")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the databases are kept")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.data.split(","), args.chats, args.presets.split(","), args.fresh, args.results)
    print(json.dumps(res, indent=2) if args.json else table(res))


if __name__ == "__main__":
    main()

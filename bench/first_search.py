"""The first search of a scope kept by `bench/scale.py --pg --keep` in a fresh process: its time,
the client's CPU and RSS (after it and at its peak), optionally without the in-process lexicon
or HNSW index, to see what each part of a large scope's cache costs; then, with `--during N`,
N searches one after another while the scope's keys load into the cache aside (their p50 /
p95, and when the cache held both key names). Exits without waiting for the background builds
unless `--wait`.

    python bench/first_search.py --size 1000000 [--no-lexicon] [--no-ann] [--during N] [--wait]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engram import Memory  # noqa: E402
from engram.model import Scope  # noqa: E402
from engram.store.postgres import PostgresStore  # noqa: E402
from scale import RESULTS, pg_server, questions, rss_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=1_000_000, help="the kept size to search")
    ap.add_argument("--pg-data", type=Path, default=RESULTS / "pg" / "pgdata")
    ap.add_argument("--no-lexicon", action="store_true", help="BM25 in SQL instead")
    ap.add_argument("--no-ann", action="store_true", help="no HNSW index: exact scans")
    ap.add_argument("--during", type=int, default=0, metavar="N",
                    help="N searches after the first, while the keys load aside")
    ap.add_argument("--wait", action="store_true", help="wait for the background builds")
    args = ap.parse_args()
    server = pg_server(args.pg_data, {"shared_buffers": "2GB"})
    off = {"lexicon_threshold": 10**9} if args.no_lexicon else {}
    if args.no_ann:
        off["ann_threshold"] = 10**9
    store = PostgresStore(server.get_uri(), tenant=f"scale-{args.size}", **off)
    mem = Memory(store=store)
    out = {"rss_open": rss_bytes()}
    asked = questions(1 + args.during, args.size)
    t, c = time.perf_counter(), time.process_time()
    mem.search(asked[0], user_id="u0", limit=10)
    out.update(first_s=time.perf_counter() - t, first_cpu_s=time.process_time() - c,
               rss_after_first=rss_bytes(), rss_peak_first=rss_bytes("VmHWM"))
    if args.during:
        took = []
        for question in asked[1:]:
            t0 = time.perf_counter()
            mem.search(question, user_id="u0", limit=10)
            took.append(time.perf_counter() - t0)
            if "held_s" not in out and all(
                    store._cache.get(store._keys, Scope("u0"), name) is not None
                    for name in ("text", "window")):
                out["held_s"] = time.perf_counter() - t
                out["held_after"] = len(took)
        took.sort()
        out.update(during_p50_s=took[len(took) // 2],
                   during_p95_s=took[min(len(took) - 1, int(0.95 * len(took)))],
                   during_max_s=took[-1])
    if args.wait:
        store.wait_for_saves()
        out.update(built_s=time.perf_counter() - t, rss_built=rss_bytes(),
                   rss_peak=rss_bytes("VmHWM"))
    out["load"] = os.getloadavg()[0]
    print(json.dumps(out), flush=True)
    server.cleanup()
    os._exit(0)  # the builds still running are not waited for


if __name__ == "__main__":
    main()

"""The first search of a scope kept by `bench/scale.py --pg --keep` in a fresh process: its time,
the client's CPU and RSS (after it and at its peak), optionally without the in-process lexicon
or HNSW index, to see what each part of a large scope's cache costs. Exits without waiting for
the background builds unless `--wait`.

    python bench/first_search.py --size 1000000 [--no-lexicon] [--no-ann] [--wait]
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
from engram.store.postgres import PostgresStore  # noqa: E402
from scale import RESULTS, pg_server, questions, rss_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=1_000_000, help="the kept size to search")
    ap.add_argument("--pg-data", type=Path, default=RESULTS / "pg" / "pgdata")
    ap.add_argument("--no-lexicon", action="store_true", help="BM25 in SQL instead")
    ap.add_argument("--no-ann", action="store_true", help="no HNSW index: exact scans")
    ap.add_argument("--wait", action="store_true", help="wait for the background builds")
    args = ap.parse_args()
    server = pg_server(args.pg_data, {"shared_buffers": "2GB"})
    off = {"lexicon_threshold": 10**9} if args.no_lexicon else {}
    if args.no_ann:
        off["ann_threshold"] = 10**9
    store = PostgresStore(server.get_uri(), tenant=f"scale-{args.size}", **off)
    mem = Memory(store=store)
    out = {"rss_open": rss_bytes()}
    t, c = time.perf_counter(), time.process_time()
    mem.search(questions(1, args.size)[0], user_id="u0", limit=10)
    out.update(first_s=time.perf_counter() - t, first_cpu_s=time.process_time() - c,
               rss_after_first=rss_bytes(), rss_peak_first=rss_bytes("VmHWM"))
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

"""usearch search settings on a kept scale database (one scope, user u0): time and overlap with
an exact scan, for the top 1,000 (the dense candidates a search asks for); `--final` also
compares Memory.search's top 10 with HNSW and with exact scans (needs both indexes saved).

    python bench/scale.py --sizes 1000000 --one-scope --ingest 0 --keep   # then:
    python bench/ann_settings.py bench/results/scale/scale-1000000.db 30 text [--high] [--final]
"""

from __future__ import annotations

import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engram import Memory  # noqa: E402
from engram.model import Scope  # noqa: E402
from engram.store import Query  # noqa: E402
from engram.store.index import ann  # noqa: E402
from scale import questions  # noqa: E402

VARIANTS = [(1157, 1157, 1), (1000, 1000, 1), (1000, 600, 1), (600, 600, 1), (1157, 1157, 2)]
HIGH = [(1157, 2000, 1), (1157, 4000, 1)]


def p(xs: list[float], q: float) -> float:
    return 1000 * sorted(xs)[max(0, int(q * len(xs)) - 1)]


def main() -> None:
    path, nq = Path(sys.argv[1]), int(sys.argv[2])
    keys = sys.argv[3].split(",") if len(sys.argv) > 3 else ["text", "window"]
    mem = Memory(path)
    store = mem.store
    store.touch = lambda ids, at: None  # type: ignore[method-assign]  # both modes rank the same
    qs = questions(nq, seed=7)
    vecs = mem.embedder.embed_batch(qs).astype(np.float32)
    query = Query(scope=Scope("u0"), now=datetime.now(UTC))
    for key in keys:
        slab, _ = store._slab(query, key, vecs.shape[1])  # type: ignore[attr-defined]
        with store._cache.lock:  # type: ignore[attr-defined]
            index = store._ann(slab, ("u0", None, None, key))  # type: ignore[attr-defined]
        live = slab.live_rows()
        mat, seqs = slab.mat[live], slab.seqs[live]
        truth, scan = [], []
        for v in vecs:
            t = time.thread_time()
            sims = mat @ v
            top = np.argpartition(-sims, 1000)[:1000]
            truth.append(seqs[top[np.argsort(-sims[top])]])
            scan.append(time.thread_time() - t)
        print(f"[{key}] {len(index)} keys; exact top-1000 scan: CPU p50 {p(scan, 0.5):.1f} ms")
        for count, ef, threads in HIGH if "--high" in sys.argv else VARIANTS:
            index.index.expansion_search = ef
            cpu, wall, o1000, o10, got = [], [], [], [], []
            for v, tr in zip(vecs, truth, strict=True):
                t, w = time.thread_time(), time.perf_counter()
                found = np.asarray(index.index.search(v, count, threads=threads).keys, np.int64)
                wall.append(time.perf_counter() - w)
                cpu.append(time.thread_time() - t)
                got.append(len(found))
                o1000.append(len(set(found[:1000].tolist()) & set(tr.tolist())) / 1000)
                o10.append(len(set(found[:10].tolist()) & set(tr[:10].tolist())) / 10)
            print(f"  count {count:>5} ef {ef:>5} threads {threads}: wall p50 {p(wall, 0.5):6.1f} "
                  f"p95 {p(wall, 0.95):6.1f} ms, CPU p50 {p(cpu, 0.5):6.1f}; returned "
                  f"{min(got)}-{max(got)}; overlap@1000 {statistics.mean(o1000):.4f} "
                  f"(min {min(o1000):.3f}), @10 {statistics.mean(o10):.3f}")
        index.index.expansion_search = ann.EXPANSION_SEARCH
    if "--final" in sys.argv:
        same10, lat = [], {"ann": [], "exact": []}
        for q in qs:
            res = {}
            for mode, thr in (("ann", store.ann_threshold), ("exact", 10**9)):  # type: ignore[attr-defined]
                old, store._cache.ann_threshold = store.ann_threshold, thr  # type: ignore[attr-defined]
                t = time.perf_counter()
                hits = mem.search(q, user_id="u0", limit=10)
                lat[mode].append(time.perf_counter() - t)
                store._cache.ann_threshold = old  # type: ignore[attr-defined]
                res[mode] = {h.memory.id for h in hits}
            same10.append(len(res["ann"] & res["exact"]) / 10)
        print(f"Memory.search top 10, HNSW vs exact: overlap {statistics.mean(same10):.3f} "
              f"(min {min(same10):.1f}); p50 ms: HNSW {p(lat['ann'], 0.5):.0f}, "
              f"exact {p(lat['exact'], 0.5):.0f}")
    mem.close()


if __name__ == "__main__":
    main()

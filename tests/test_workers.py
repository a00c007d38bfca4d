"""Several service processes over one database: `engram serve --workers N`, and the rate limits
they share (buckets in the database, not in each process).

The limiter tests spend tokens from two real processes (spawned, like uvicorn's workers) on
one SQLite file or one PostgreSQL database; the serving test starts the real command.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from engram.config import Config
from engram.server.ratelimit import RateLimiter, SharedRateLimiter, open_rate_limiter, refill
from engram.store.sqlite import SQLiteRateBuckets

SPAWN = multiprocessing.get_context("spawn")


def _spend(config: Config, n: int, out: Any) -> None:
    """In another process: take `n` tokens of tenant "t" from the configured shared limiter."""
    limiter = open_rate_limiter(config, 0.001, 10, shared=True)
    try:
        out.put([limiter.take("t") == 0.0 for _ in range(n)])
    finally:
        limiter.close()


def _two_processes(config: Config) -> list[bool]:
    queue = SPAWN.Queue()
    procs = [SPAWN.Process(target=_spend, args=(config, 8, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    taken = queue.get(timeout=120) + queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return taken


def test_refill_is_capped_and_ignores_a_clock_going_back() -> None:
    assert refill(0.0, 0.0, 100.0, rate=1.0, burst=3) == (2.0, 0.0)   # full at 3, one taken
    tokens, wait = refill(0.5, 10.0, 5.0, rate=2.0, burst=3)            # now < at: no refill
    assert tokens == 0.5 and wait == pytest.approx(0.25)


def test_in_process_limiter_is_per_tenant() -> None:
    now = [0.0]
    limiter = RateLimiter(rate=1.0, burst=2, clock=lambda: now[0])
    assert [limiter.take("a") for _ in range(3)][:2] == [0.0, 0.0]
    assert limiter.take("a") == pytest.approx(1.0)
    assert limiter.take("b") == 0.0
    now[0] = 1.0
    assert limiter.take("a") == 0.0


def test_sqlite_limiter_refills_at_the_rate(tmp_path: Path) -> None:
    now = [1000.0]
    limiter = SharedRateLimiter(SQLiteRateBuckets(tmp_path / "ratelimit.db"), rate=2.0,
                                burst=2, clock=lambda: now[0])
    try:
        assert [limiter.take("a"), limiter.take("a")] == [0.0, 0.0]
        assert limiter.take("a") == pytest.approx(0.5)   # empty: the next token in 1/rate
        assert limiter.take("b") == 0.0                   # another tenant, another bucket
        now[0] += 0.5
        assert limiter.take("a") == 0.0
        assert limiter.take("a") > 0.0
    finally:
        limiter.close()


def test_shared_limiter_charges_one_tenant_into_debt(tmp_path: Path) -> None:
    """A costly request's extra units (limits.cost) come out of the shared bucket too."""
    now = [1000.0]
    limiter = SharedRateLimiter(SQLiteRateBuckets(tmp_path / "ratelimit.db"), rate=10.0,
                                burst=20, clock=lambda: now[0])
    try:
        assert limiter.take("a") == 0.0 and limiter.take("b") == 0.0
        limiter.charge("a", 100)
        assert limiter.take("a") > 5 and limiter.take("b") == 0.0
        now[0] += 20
        assert limiter.take("a") == 0.0
    finally:
        limiter.close()


def test_two_processes_share_one_sqlite_bucket(tmp_path: Path) -> None:
    config = Config(path=tmp_path / "engram.db")
    taken = _two_processes(config)
    # 16 takes from two processes against one bucket of 10 (refilling 0.001/s): 10 succeed.
    # Per-process buckets would have granted 16.
    assert sum(taken) == 10
    assert (tmp_path / "ratelimit.db").exists()


def test_two_processes_share_one_postgres_bucket(tmp_path: Path, pg_server: Any) -> None:
    from pg_server import PG

    config = Config(path=tmp_path / "engram.db", database_url=PG.database_for(tmp_path))
    assert sum(_two_processes(config)) == 10
    assert not (tmp_path / "ratelimit.db").exists()  # the buckets are in PostgreSQL


def test_a_postgres_take_does_not_wait_for_the_wal_flush(tmp_path: Path, pg_server: Any) -> None:
    """The buckets are disposable: a take commits with `synchronous_commit` off (its own
    transaction only), so no request waits for an fsync to take a token."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    from pg_server import PG

    url = PG.database_for(tmp_path)
    with PG.admin() as admin:  # the test server runs without flushes: this database with them
        admin.execute(f"ALTER DATABASE {conninfo_to_dict(url)['dbname']} SET synchronous_commit = on")
    limiter = open_rate_limiter(Config(path=tmp_path / "engram.db", database_url=url), 1.0, 10,
                                shared=True)
    try:
        assert limiter.take("t") == 0.0  # the first take creates the table
        assert isinstance(limiter, SharedRateLimiter)
        assert limiter.buckets._run("SELECT current_setting('synchronous_commit')",  # type: ignore[attr-defined]
                                    []) == [("off",)]
        assert limiter.take("t") == 0.0
    finally:
        limiter.close()
    with psycopg.connect(url) as conn:  # any other transaction flushes as configured
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)


def _serve(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ENGRAM_DB": str(tmp_path / "engram.db")}
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "engram.cli", "serve", "--no-auth",
                             "--port", str(port), *args], env=env, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx2.get(f"{base}/ready", timeout=5).status_code == 200:
                return proc, base, log
        except httpx2.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            log.close()
            raise AssertionError((tmp_path / "serve.log").read_text())
        time.sleep(0.3)


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.add(int(entry.name))
    return out


@pytest.mark.skipif(not Path("/proc").exists(), reason="counts worker processes in /proc")
def test_serve_with_workers_shares_data_and_limits(tmp_path: Path) -> None:
    proc, base, log = _serve(tmp_path, "--workers", "2", "--rate", "0.001", "--burst", "12")
    try:
        # two uvicorn workers (and multiprocessing's resource tracker) under the supervisor
        workers = [p for p in _children(proc.pid)
                   if b"multiprocessing" in Path(f"/proc/{p}/cmdline").read_bytes()
                   and b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 2
        codes = []
        for i in range(20):
            # a new connection each time, so requests land on either worker
            with httpx2.Client(base_url=base, timeout=60) as http:
                if i == 0:
                    r = http.post("/v1/memories", json={"messages": "Ana lives in Lisbon",
                                                        "user_id": "u"})
                else:
                    r = http.post("/v1/memories/search", json={"query": "Lisbon", "user_id": "u"})
                    if r.status_code == 200:
                        assert r.json()["hits"][0]["memory"]["text"] == "Ana lives in Lisbon"
                codes.append(r.status_code)
        # one bucket of 12 for the tenant across both workers (the probes above spend none)
        assert codes.count(429) == 8 and codes[:12] == [201] + [200] * 11
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()


def test_side_tables_are_created_once_by_racing_processes(tmp_path: Path, pg_server: Any) -> None:
    """Every process of a fresh service migrates the keys, audit and rate-limit tables at its
    first request; `CREATE TABLE IF NOT EXISTS` alone lets racing creators collide in the
    catalog (a unique violation on pg_type, seen in CI), so each migration takes the
    migration lock and is recorded once."""
    import threading

    import psycopg

    from engram.server import audit
    from engram.store.postgres import PostgresKeys, PostgresRateBuckets
    from pg_server import PG

    url = PG.database_for(tmp_path)
    tables = [PostgresKeys(url) if i % 2 else PostgresRateBuckets(url) for i in range(6)]
    start = threading.Barrier(len(tables))
    errors: list[BaseException] = []

    def create(table: Any) -> None:
        start.wait()
        try:
            table._migrated()
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(t,)) for t in tables]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert errors == []
        with psycopg.connect(url) as conn:
            names = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables")}
            done = [r[0] for r in conn.execute("SELECT name FROM schema_migrations")]
        assert {"engram_api_keys", "engram_console_logins", "engram_rate_buckets"} <= names
        assert sorted(done) == ["service_0001_keys", "service_0001_rate_buckets"]
    finally:
        for t in tables:
            t.close()
    log = audit.PostgresAuditLog(url)  # the audit log migrates its table the same way
    try:
        assert log.entries(tenant=None, all_tenants=True) == []
    finally:
        log.close()

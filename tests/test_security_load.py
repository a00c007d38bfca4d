"""Findings of the adversarial probe (issue 14): one tenant must not starve the others (turns
at the shared embedder, cost-based limits), and jobs a killed process left behind run when the
service opens the tenant again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from engram.config import Config
from engram.providers.embedders import MiniLM
from engram.server import ServiceLimits, create_app
from engram.server.ratelimit import RateLimiter
from engram.server.tenants import CHUNK, FairGate, TenantEmbedder
from server_kit import error_code, service


class Recording:
    """Wraps the real embedder: records whose texts each call embeds, and can hold calls
    until released (to make a queue form deterministically)."""

    def __init__(self, inner: MiniLM) -> None:
        self.inner = inner
        self.name = inner.name
        self.dim = inner.dim
        self.calls: list[tuple[str, int]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        self.entered.set()
        self.hold.wait(timeout=60)
        self.calls.append((texts[0].split(":")[0] if texts else "", len(texts)))
        return self.inner.embed_batch(texts)


def test_the_gate_serves_tenants_in_turn(embedder: MiniLM) -> None:
    rec = Recording(embedder)
    gate = FairGate()
    a, b = TenantEmbedder(rec, gate, "a"), TenantEmbedder(rec, gate, "b")
    rec.hold.clear()
    flood = threading.Thread(target=a.embed_batch, args=([f"a: message {i}" for i in range(10 * CHUNK)],))
    flood.start()
    assert rec.entered.wait(30)  # a's first chunk holds the embedder
    got: list[np.ndarray] = []
    search = threading.Thread(target=lambda: got.append(b.embed_batch(["b: where is my order?"])))
    search.start()
    while gate.waiting().get("b") != 1:
        time.sleep(0.01)
    rec.hold.set()
    search.join(60)
    flood.join(60)
    order = [who for who, _ in rec.calls]
    # b's one text went right after a's first chunk, not after all ten
    assert order[:2] == ["a", "b"] and order.count("a") == 10, order
    assert got[0].shape == (1, embedder.dim)


def test_a_flood_pays_for_what_it_costs(tmp_path: Path, embedder: MiniLM) -> None:
    # 10 requests/s, burst 100: an add of 150 long messages is admitted and charged ~140
    # requests up front, so while it runs tenant a's next requests wait and tenant b's do not
    with service(tmp_path, embedder, limits=ServiceLimits(rate=10, burst=100)) as svc:
        long = "x " * 950  # 1.9 KB
        done: list[int] = []
        flood = threading.Thread(target=lambda: done.append(svc.call(
            "a-member", "POST", "/v1/memories", json={
                "messages": [f"a: {i} {long}" for i in range(150)], "user_id": "u",
                "infer": False}).status_code))
        flood.start()
        try:
            refused = None
            while flood.is_alive() and refused is None:
                r = svc.call("a-member", "GET", "/v1/stats")
                if r.status_code == 429:
                    refused = r
                time.sleep(0.05)
            assert refused is not None and error_code(refused) == "rate_limited"
            assert int(refused.headers["Retry-After"]) >= 2  # ~40 requests of debt at 10/s
            r = svc.call("b-member", "GET", "/v1/stats")
            assert r.status_code == 200, r.text
        finally:
            flood.join(300)
        assert done == [201]


def test_charges_take_from_the_tenants_bucket_only() -> None:
    now = [0.0]
    limiter = RateLimiter(10, 20, clock=lambda: now[0])
    assert limiter.take("a") == 0.0 and limiter.take("b") == 0.0
    limiter.charge("a", 100)
    assert limiter.take("a") > 5 and limiter.take("b") == 0.0
    now[0] += 20
    assert limiter.take("a") == 0.0


CRASH = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    from engram import Memory
    from engram.config import Config
    from engram.model import utcnow
    mem = Memory(config=Config(path=sys.argv[1], worker="off"))
    ids = [mem.add(f"message {i} about the garden", user_id="u", background=True).job.id
           for i in range(20)]
    now = utcnow()
    claimed = mem.store.claim_job(now, now + timedelta(seconds=1))  # dies holding a short lease
    print(" ".join(ids), flush=True)
    time.sleep(600)
""")


def test_jobs_of_a_killed_process_run_when_the_tenant_opens(tmp_path: Path, embedder: MiniLM) -> None:
    db = tmp_path / "engram.db"
    proc = subprocess.Popen([sys.executable, "-c", CRASH, str(db)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout is not None
    ids = proc.stdout.readline().split()
    proc.stdout.close()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert len(ids) == 20
    time.sleep(1.1)  # the claimed job's lease ends
    app = create_app(Config(path=db), auth=False, embedder=embedder,
                     limits=ServiceLimits(rate=1000, burst=1000))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        # reading a job opens the tenant: nothing else is queued, no add is made
        statuses: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            statuses = [client.get(f"/v1/jobs/{i}").json()["status"] for i in ids]
            if all(s == "done" for s in statuses):
                break
            time.sleep(0.5)
        assert statuses == ["done"] * 20, statuses
        stored = client.get("/v1/memories", params={"user_id": "u", "limit": 100}).json()["items"]
        assert len(stored) == 20


@pytest.mark.parametrize("worker", ["off"])
def test_resume_does_nothing_without_a_thread_worker(tmp_path: Path, embedder: MiniLM, worker: str) -> None:
    from engram import Memory
    with Memory(config=Config(path=tmp_path / "m.db", worker=worker), embedder=embedder) as mem:
        mem.add("queued", user_id="u", background=True)
        assert mem.resume() is False


def test_the_gate_lets_slots_turns_run_at_once() -> None:
    gate = FairGate(slots=2)
    with gate.turn("a"), gate.turn("b"):  # with one slot the second would wait forever
        assert list(gate.granted) == ["a", "b"] and gate.waiting() == {}

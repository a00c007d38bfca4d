"""Three `engram serve` processes (separate services, not `--workers` of one) on one PostgreSQL,
behind a plain round-robin client with nothing sticky: whatever one node wrote, erased, spent or
logged in is what every other node answers with.

The nodes are real subprocesses over their own PostgreSQL server (the last test stops it to see
each node's /ready fail, and starts it again). The browser of the console tests is a cookie
carried by hand from node to node, as one origin behind a balancer would be.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import psycopg
import pytest

from engram import Memory
from engram.config import Config
from engram.providers.embedders import MiniLM
from engram.server.keys import PostgresKeyStore
from pg_server import PgTestServer

NODES = 3
BURST = 300  # each tenant's bucket, shared by the nodes: the rate-limit test spends a whole one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    """One `engram serve` process on its own port."""

    port: int
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engram.cli", "serve", "--port", str(self.port),
                 "--rate", "0.01", "--burst", str(BURST)],
                env=self.env, stdout=out, stderr=out)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx2.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            assert self.proc is not None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"node on {self.port} not ready:\n{self.log.read_text()}")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@dataclass
class Cluster:
    pg: PgTestServer
    url: str  # the database every node uses
    nodes: list[Node]
    keys: PostgresKeyStore
    tokens: dict[str, str]  # tenant -> admin key
    clients: list[httpx2.Client] = field(default_factory=list)
    _turn: Iterator[int] = field(default_factory=lambda: itertools.cycle(range(NODES)))

    def client(self, i: int) -> httpx2.Client:
        return self.clients[i]

    def next(self) -> httpx2.Client:
        """The balancer: each call goes to the next node in turn."""
        return self.clients[next(self._turn)]

    def call(self, method: str, url: str, tenant: str = "a", node: int | None = None,
             **kwargs: Any) -> httpx2.Response:
        client = self.next() if node is None else self.clients[node]
        headers = {"Authorization": f"Bearer {self.tokens[tenant]}", **kwargs.pop("headers", {})}
        return client.request(method, url, headers=headers, **kwargs)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("nodes")
    pg = PgTestServer().start()  # its own server: the readiness test stops it
    url = pg.url(pg.create_database())
    keys = PostgresKeyStore(url)
    # a tenant per concern, so no test spends another's rate-limit bucket
    tokens = {t: keys.create(t, "admin", f"{t} admin")[1]
              for t in ("a", "jobs", "console", "limited")}
    env = {**os.environ, "ENGRAM_DATABASE_URL": url, "ENGRAM_DB": str(tmp / "unused.db"),
           "ENGRAM_PG_CONNECT_TIMEOUT": "2"}
    nodes = [Node(_free_port(), tmp / f"node{i}.log", env) for i in range(NODES)]
    found = Cluster(pg, url, nodes, keys, tokens)
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_ready()
        found.clients = [httpx2.Client(base_url=n.url, timeout=60) for n in nodes]
        yield found
    finally:
        for client in found.clients:
            client.close()
        for node in nodes:
            node.stop()
        keys.close()
        pg.stop()


def _add(cluster: Cluster, text: str, node: int, tenant: str = "a", **body: Any) -> dict[str, Any]:
    r = cluster.call("POST", "/v1/memories", tenant, node, json={"messages": text, "infer": False,
                                                                 **body})
    assert r.status_code == 201, r.text
    return dict(r.json()["memories"][0])


def _search(cluster: Cluster, query: str, node: int, **body: Any) -> list[str]:
    r = cluster.call("POST", "/v1/memories/search", node=node, json={"query": query, **body})
    assert r.status_code == 200, r.text
    return [h["memory"]["text"] for h in r.json()["hits"]]


# -- data --------------------------------------------------------------------------------------

def test_read_your_writes_across_nodes(cluster: Cluster) -> None:
    for i in range(NODES):  # every node has the tenant's scope cached before the writes
        _search(cluster, "anything", i, user_id="ana")
    for i in range(NODES):
        writer, others = i, [(i + 1) % NODES, (i + 2) % NODES]
        fact = _add(cluster, f"Ana's locker number {i} is {100 + i}", writer, user_id="ana")
        for other in others:  # the very next request, on another node
            assert cluster.call("GET", f"/v1/memories/{fact['id']}", node=other).json()["text"] \
                == fact["text"]
            assert fact["text"] in _search(cluster, f"locker number {i}", other, user_id="ana")
    fact = _add(cluster, "Ana drinks black coffee", 0, user_id="ana")
    assert "Ana drinks black coffee" in _search(cluster, "coffee", 1, user_id="ana")
    r = cluster.call("PATCH", f"/v1/memories/{fact['id']}", node=1,
                     json={"text": "Ana drinks green tea, never coffee"})
    assert r.status_code == 200, r.text
    for node in (2, 0):
        assert _search(cluster, "what does Ana drink", node, user_id="ana")[0] \
            == "Ana drinks green tea, never coffee"
        history = cluster.call("GET", f"/v1/memories/{fact['id']}/history", node=node).json()
        assert [e["type"] for e in history["events"]] == ["ADD", "UPDATE"]


def test_an_erase_on_one_node_is_never_answered_from_another_nodes_cache(cluster: Cluster) -> None:
    deleted = _add(cluster, "Bob's boat is called Wavedancer", 0, user_id="bob")
    kept = _add(cluster, "Bob likes sailing", 0, user_id="bob")
    gone = _add(cluster, "Cleo's cat is called Pixel", 0, user_id="cleo")
    for i in range(NODES):  # every node has the texts in its cache
        assert deleted["text"] in _search(cluster, "Bob boat name", i, user_id="bob")
        assert gone["text"] in _search(cluster, "cat name", i, user_id="cleo")
    r = cluster.call("DELETE", f"/v1/memories/{deleted['id']}", node=1)
    assert r.status_code == 204
    r = cluster.call("POST", "/v1/erase", node=2, json={"user_id": "cleo"})
    assert r.status_code == 200, r.text
    for i in (0, 2, 1):
        found = _search(cluster, "Bob boat name Wavedancer", i, user_id="bob")
        assert deleted["text"] not in found and kept["text"] in found
        assert _search(cluster, "cat name", i, user_id="cleo") == []
        assert cluster.call("GET", f"/v1/memories/{gone['id']}", node=i).status_code == 404
        assert all("Pixel" not in h for h in _search(cluster, "cat called Pixel", i))
        listed = cluster.call("GET", "/v1/memories", node=i, params={"user_id": "cleo"}).json()
        assert listed["items"] == []


def test_idempotency_keys_are_shared(cluster: Cluster) -> None:
    body = {"messages": "Dina moved to Porto", "user_id": "dina", "infer": False}
    answers = [cluster.call("POST", "/v1/memories", node=i, json=body,
                            headers={"Idempotency-Key": "move-1"}) for i in range(NODES)]
    assert [r.status_code for r in answers] == [201] * NODES, [r.text for r in answers]
    assert len({r.json()["memories"][0]["id"] for r in answers}) == 1  # one add, one answer
    for i in range(NODES):
        r = cluster.call("POST", "/v1/memories", node=i, headers={"Idempotency-Key": "move-1"},
                         json={**body, "messages": "Dina moved to Braga"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused"
    listed = cluster.call("GET", "/v1/memories", params={"user_id": "dina"}).json()["items"]
    assert [m["text"] for m in listed] == ["Dina moved to Porto"]


def test_one_idempotency_key_sent_to_every_node_at_once_adds_once(cluster: Cluster) -> None:
    body = {"messages": "Ines booked the 9:40 train", "user_id": "ines", "infer": False}

    def send(node: int) -> httpx2.Response:
        return cluster.call("POST", "/v1/memories", node=node, json=body,
                            headers={"Idempotency-Key": "train-1"})

    with ThreadPoolExecutor(NODES) as pool:
        answers = list(pool.map(send, range(NODES)))
    for i, r in enumerate(answers):
        while r.status_code == 409:  # the first is still running on another node: ask again
            time.sleep(float(r.headers["Retry-After"]))
            r = answers[i] = send(i)
    assert [r.status_code for r in answers] == [201] * NODES, [r.text for r in answers]
    assert len({r.json()["memories"][0]["id"] for r in answers}) == 1
    listed = cluster.call("GET", "/v1/memories", params={"user_id": "ines"}).json()["items"]
    assert [m["text"] for m in listed] == [body["messages"]]


def test_rate_limits_are_shared(cluster: Cluster) -> None:
    """One bucket of BURST for the tenant, whichever node a request lands on: per-node buckets
    would have granted all of them."""
    codes = [cluster.call("GET", "/v1/stats", tenant="limited").status_code
             for _ in range(BURST + 45)]
    assert codes.count(200) == BURST and codes.count(429) == 45
    assert codes[:BURST] == [200] * BURST


def test_background_jobs_run_exactly_once_across_nodes(cluster: Cluster) -> None:
    ids = []
    for n in range(12):
        r = cluster.call("POST", "/v1/memories", tenant="jobs", json={
            "messages": f"Errand {n}: buy {n} apples", "user_id": "eve", "infer": False,
            "background": True})
        assert r.status_code == 202, r.text
        ids.append(r.json()["job"]["id"])
    deadline = time.monotonic() + 120
    jobs: dict[str, dict[str, Any]] = {}
    while len(jobs) < len(ids) and time.monotonic() < deadline:
        for job_id in ids:
            if job_id not in jobs:
                got = cluster.call("GET", f"/v1/jobs/{job_id}", tenant="jobs").json()
                if got["status"] in ("done", "failed"):
                    jobs[job_id] = got
        time.sleep(0.2)
    assert len(jobs) == len(ids), "jobs not done in time"
    assert {j["status"] for j in jobs.values()} == {"done"}
    assert [j["attempts"] for j in jobs.values()] == [1] * len(ids)
    listed = cluster.call("GET", "/v1/memories", tenant="jobs",
                          params={"user_id": "eve", "limit": 100}).json()
    texts = sorted(m["text"] for m in listed["items"])
    assert texts == sorted(f"Errand {n}: buy {n} apples" for n in range(12))  # none twice
    for m in listed["items"]:
        events = cluster.call("GET", f"/v1/memories/{m['id']}/history", tenant="jobs").json()["events"]
        assert [e["type"] for e in events] == ["ADD"]


# -- the console -------------------------------------------------------------------------------

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@dataclass
class Browser:
    """One browser behind the balancer: its cookie goes to whichever node answers."""

    cluster: Cluster
    cookie: str | None = None

    def request(self, node: int, method: str, path: str, **kwargs: Any) -> httpx2.Response:
        headers = {"Cookie": f"engram_console={self.cookie}"} if self.cookie else {}
        client = self.cluster.clients[node]
        client.cookies.clear()  # the client's own jar would add another browser's cookie
        r = client.request(method, path, headers=headers, follow_redirects=False, **kwargs)
        if "engram_console" in r.cookies:
            self.cookie = r.cookies["engram_console"] or None
        return r

    def csrf(self, node: int, path: str = "/ui") -> str:
        r = self.request(node, "GET", path)
        assert r.status_code == 200, r.text
        found = CSRF.search(r.text)
        assert found is not None
        return found.group(1)

    def login(self, form_node: int, post_node: int, key: str) -> None:
        token = self.csrf(form_node, "/ui/login")
        r = self.request(post_node, "POST", "/ui/login", data={"csrf": token, "key": key})
        assert r.status_code == 303 and r.headers["location"] == "/ui", r.text

    def logged_in(self, node: int) -> bool:
        r = self.request(node, "GET", "/ui")
        assert r.status_code in (200, 303), r.text
        return r.status_code == 200


def _stored_logins(cluster: Cluster) -> list[tuple[Any, ...]]:
    with psycopg.connect(cluster.url) as conn:
        return list(conn.execute("SELECT * FROM engram_console_logins").fetchall())


def test_a_console_login_holds_on_every_node_and_across_a_restart(cluster: Cluster) -> None:
    browser = Browser(cluster)
    # the login form from node 0, posted to node 1 (its CSRF token is not kept in node 0)
    browser.login(0, 1, cluster.tokens["console"])
    assert all(browser.logged_in(i) for i in (2, 0, 1))
    fact = _add(cluster, "Fay's favourite colour is teal", 0, user_id="fay", tenant="console")
    token = browser.csrf(2, f"/ui/memories/{fact['id']}")
    r = browser.request(0, "POST", f"/ui/memories/{fact['id']}/edit",
                        data={"csrf": token, "text": "Fay's favourite colour is red"})
    assert r.status_code == 303, r.text
    assert cluster.call("GET", f"/v1/memories/{fact['id']}", "console", 1).json()["text"] \
        == "Fay's favourite colour is red"

    # the stored login holds a digest of the cookie, never the cookie or the API key
    rows = _stored_logins(cluster)
    assert rows and all(cluster.tokens["console"] not in repr(row) for row in rows)
    assert all(browser.cookie not in repr(row) for row in rows)

    cluster.nodes[0].stop()
    cluster.nodes[0].start()
    cluster.nodes[0].wait_ready()
    assert browser.logged_in(0)

    # logout on one node ends the login on all of them
    token = browser.csrf(1)
    kept = browser.cookie
    assert browser.request(2, "POST", "/ui/logout", data={"csrf": token}).status_code == 303
    browser.cookie = kept  # a copy of the old cookie is worth nothing now
    assert not any(browser.logged_in(i) for i in range(NODES))


def test_a_revoked_key_logs_out_every_node(cluster: Cluster) -> None:
    key, secret = cluster.keys.create("console", "member", "to be revoked")
    browsers = [Browser(cluster) for _ in range(2)]
    for i, browser in enumerate(browsers):
        browser.login(i, i + 1, secret)
        assert all(browser.logged_in(n) for n in range(NODES))
    cluster.keys.revoke(key.id)
    for browser in browsers:
        assert not any(browser.logged_in(n) for n in range(NODES))
    bearer = {"Authorization": f"Bearer {secret}"}
    assert [cluster.clients[n].get("/v1/stats", headers=bearer).status_code
            for n in range(NODES)] == [401] * NODES
    assert all(row[1] != key.id for row in _stored_logins(cluster))  # its logins are deleted


# -- readiness (last: it stops the database) -----------------------------------------------------

def test_ready_is_honest_and_workers_outlive_an_outage(cluster: Cluster, embedder: MiniLM) -> None:
    assert [c.get("/ready").status_code for c in cluster.clients] == [200] * NODES
    cluster.pg._server.stop()
    try:
        for client in cluster.clients:
            r = client.get("/ready")
            assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
            assert client.get("/health").status_code == 200  # alive, not ready
        time.sleep(1.5)  # the nodes' job workers (started by the jobs test) meet the outage
    finally:
        cluster.pg._server.start()
    for i, client in enumerate(cluster.clients):
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, f"node {i} never ready again"
            time.sleep(0.2)
        # ready means ready: the very next request is served (not a 503 from a stale connection)
        assert _add(cluster, f"after the outage, node {i}", i, user_id="gus")["text"]
    # a job queued by a process that runs none (ENGRAM_WORKER=off) is run by a node's worker,
    # which waited for the database rather than die with the outage
    other = Memory(config=Config(path=cluster.nodes[0].log.parent / "unused.db",
                                 database_url=cluster.url, worker="off"),
                   tenant="jobs", embedder=embedder)  # the tenant whose workers the jobs test started
    try:
        job = other.add("Hugo queued this while no node was asked", user_id="hugo", infer=False,
                        background=True).job
        assert job is not None
        done = other.wait(job.id, timeout=60)
        assert done.status.value == "done", done
    finally:
        other.close()

"""Erasure is a fence (issue 32 §2): once an erasure or a session delete returns, nothing that
was queued or running before it writes into what it took, in this process or another.

Races run for real: background adds worked by a thread or by another process, session writes
from another process, extraction with the knowledge graph and reflection against a real
llama.cpp server; each erased text is a canary looked for afterwards in every file beside the
database (the database, -wal, -shm, the sidecar caches), or on PostgreSQL in every table.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from engram import Memory
from engram.config import Config
from engram.errors import Erased
from engram.model import JobStatus, Scope
from engram.pipeline import learn
from engram.pipeline.fence import covers, mark, overlaps
from engram.providers.embedders import MiniLM
from engram.providers.llms import LLM, ScriptedLLM
from llm_server import LlamaServer
from server_kit import service

SPAWN = multiprocessing.get_context("spawn")
ADDS = 30  # background adds queued per trial, as in the probe
REPLY_TOKENS = 64
BUSY = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
_T = datetime(2025, 6, 1, tzinfo=UTC)


def canary() -> str:
    """A text that survives tokenizing whole (lower case, digit-final), unique per trial."""
    return "zqxfence" + uuid.uuid4().hex[:10] + "7"


def until(done: Callable[[], bool], timeout: float = 60.0, every: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(every)
    return done()


def drained(mem: Memory, timeout: float = 60.0) -> None:
    """Wait until the worker has finished every job it claimed before now (a cancelled job's
    row is gone at once, while its worker may still be writing): one worker takes the oldest
    job first, so a job queued now runs after them."""
    job = mem.add("a barrier", user_id="barrier", infer=False, background=True).job
    assert job is not None
    assert mem.wait(job.id, timeout=timeout).status is JobStatus.DONE


def in_files(folder: Path, texts: list[str]) -> list[str]:
    """Which of `texts` some file in `folder` (recursively) holds."""
    blobs = [p.read_bytes().lower() for p in folder.rglob("*") if p.is_file()]
    return [t for t in texts if any(t.encode() in b for b in blobs)]


def in_tables(pg_server: Any, url: str, texts: list[str]) -> list[str]:
    """Which of `texts` a row of any table of the PostgreSQL database holds (as text)."""
    found = []
    with pg_server.admin(url.split("/")[3].split("?")[0]) as conn:
        tables = [t for (t,) in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()]
        for t in texts:
            if any(conn.execute(f"SELECT count(*) FROM {table} x WHERE x::text LIKE %s",
                                (f"%{t}%",)).fetchone()[0] for table in tables):
                found.append(t)
    return found


def scope_is_empty(mem: Memory, user: str) -> None:
    store = mem.store
    assert store.ids(Scope(user), include_deleted=True) == []
    assert mem.jobs(user_id=user, limit=1000) == []  # no job row came back, done or not
    assert store.sessions(Scope(user)) == []


# -- the decisions, pure ---------------------------------------------------------------------------

def test_which_erasures_fence_which_writes() -> None:
    ana, s1, bot = Scope("ana"), Scope("ana", None, "s1"), Scope("ana", "bot", "s1")
    user = mark(ana, "scope", _T)
    session = mark(s1, "session", _T)
    one = mark(s1, "memory", _T)
    hashed = {s: mark(s, "scope", _T).scope for s in (ana, s1, bot, Scope("bo"))}
    assert covers(user, hashed[s1]) and covers(user, hashed[bot]) and covers(user, hashed[ana])
    assert not overlaps(user, hashed[Scope("bo")])
    assert covers(session, hashed[s1]) and not covers(session, hashed[bot])
    assert overlaps(session, hashed[ana]) and not covers(session, hashed[ana])  # ana's reads
    assert not overlaps(session, hashed[bot])  # exact: bot's session is another
    assert overlaps(one, hashed[s1]) and not covers(one, hashed[s1])  # one record, not the scope


# -- background adds against the erasure of their user ---------------------------------------------

def _short_replies() -> None:
    """In a process that calls the real LLM: replies bounded to REPLY_TOKENS, so the file's
    time stays bounded (a 135M model in JSON mode can ramble to the 1,024-token cap for a
    minute and more on a busy machine). A cut reply is a failed extraction: the episodes are
    written all the same, and the fence is what decides whether they may be."""
    learn.LLM_MAX_TOKENS = REPLY_TOKENS


def _work(config: Config, stop: Any, ready: Any) -> None:
    """Another process: the `engram worker` loop over the database."""
    _short_replies()
    with Memory(config=config, embedder=MiniLM(threads=1, int8=True)) as mem:
        ready.set()
        mem.work(stop=stop, poll_s=0.01)


@pytest.fixture
def worker_process() -> Iterator[Callable[[Config], None]]:
    procs: list[tuple[Any, Any]] = []

    def start(config: Config) -> None:
        stop, ready = SPAWN.Event(), SPAWN.Event()
        p = SPAWN.Process(target=_work, args=(config, stop, ready))
        p.start()
        procs.append((p, stop))
        assert ready.wait(120), "the worker process did not start"

    yield start
    for p, stop in procs:
        stop.set()
        p.join(60)
        assert p.exitcode == 0


def _race_adds(mem: Memory, user: str, text: str, trial: int) -> int:
    """Queue ADDS background adds for `user`, erase the user while they run (at a different
    moment each trial), check nothing of the user is left once the queue is idle."""
    jobs = [mem.add(f"{text} fact {i}: I like tea number {i}", user_id=user, infer=False,
                    background=True).job for i in range(ADDS)]
    assert all(j is not None for j in jobs)
    # from "before any ran" to "a third done": the erasure lands among queued and running jobs
    until(lambda: sum(j.status.value not in BUSY
                      for j in mem.jobs(user_id=user, limit=100)) >= trial % 4 * 3, timeout=20)
    receipt = mem.erase_receipt(user_id=user)
    assert receipt.jobs >= receipt.cancelled
    drained(mem)
    scope_is_empty(mem, user)
    return receipt.cancelled


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_background_adds_never_outlive_the_erasure_of_their_user(
        tmp_path: Path, embedder: MiniLM, worker: str,
        worker_process: Callable[[Config], None]) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    config = Config(path=folder / "m.db", worker=worker if worker == "thread" else "off")
    texts: list[str] = []
    cancelled = 0
    with Memory(config=config, embedder=embedder) as mem:
        if worker == "process":
            worker_process(config)
        keep = mem.add("zqxkeepme41 another user's memory", user_id="bo").memories[0]
        for trial in range(8):
            texts.append(canary())
            cancelled += _race_adds(mem, f"user{trial}", texts[-1], trial)
        assert mem.get(keep.id).text.startswith("zqxkeepme41")  # the fence is per scope
    assert cancelled > 0  # the erasures took queued work: the receipts say how much
    assert in_files(folder, ["zqxkeepme41"]) == ["zqxkeepme41"]  # the control
    assert in_files(folder, texts) == []


def test_background_adds_never_outlive_an_erasure_on_postgres(
        tmp_path: Path, embedder: MiniLM, pg_server: Any,
        worker_process: Callable[[Config], None]) -> None:
    url = pg_server.database_for(tmp_path)
    config = Config(path=tmp_path / "unused.db", database_url=url, worker="off")
    texts: list[str] = []
    with Memory(config=config, embedder=embedder) as mem:
        worker_process(config)
        for trial in range(4):
            texts.append(canary())
            _race_adds(mem, f"user{trial}", texts[-1], trial + 1)
        keep = mem.add(f"{texts[0]} said again by bo", user_id="bo").memories[0]
        assert in_tables(pg_server, url, texts) == [texts[0]]  # the control
        mem.erase(id=keep.id)
    assert in_tables(pg_server, url, texts) == []


# -- sessions --------------------------------------------------------------------------------------

def test_a_session_with_only_queued_work_is_deleted_with_it(tmp_path: Path,
                                                            embedder: MiniLM) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    text = canary()
    with Memory(config=Config(path=folder / "m.db", worker="off"), embedder=embedder) as mem:
        queued = mem.add(f"{text} hello", user_id="ana", session_id="s1", background=True).job
        assert queued is not None and mem.store.session(Scope("ana", None, "s1")) is None
        s = mem.session(user_id="ana", session_id="s1")
        assert s.delete() == 0  # found by its work, not NotFound
        receipt = mem.receipts(user_id="ana")[0]
        assert (receipt.target, receipt.jobs, receipt.cancelled) == ("session", 1, 1)
        assert mem.work(until_idle=True) == 0  # nothing left to run
        scope_is_empty(mem, "ana")
    assert in_files(folder, [text]) == []


def test_rest_erasure_and_session_delete_take_queued_work(tmp_path: Path,
                                                          embedder: MiniLM) -> None:
    texts = [canary() for _ in range(2)]
    with service(tmp_path, embedder, worker="off") as svc:
        def add(text: str, **scope: str) -> str:
            r = svc.call("a-admin", "POST", "/v1/memories",
                         json={"messages": f"{text} hello", "background": True, **scope})
            assert r.status_code == 202, r.text
            return str(r.json()["job"]["id"])

        queued = [add(texts[0], user_id="ana") for _ in range(5)]
        r = svc.call("a-admin", "POST", "/v1/erase", json={"user_id": "ana"})
        assert r.status_code == 200 and r.json()["receipt"]["cancelled"] == 5
        in_session = add(texts[1], user_id="bo", session_id="s1")
        r = svc.call("a-admin", "DELETE", "/v1/sessions/s1", params={"user_id": "bo"})
        assert r.status_code == 204, r.text  # found by its queued work
        for job in [*queued, in_session]:
            assert svc.call("a-admin", "GET", f"/v1/jobs/{job}").status_code == 404
        add("the control", user_id="cy")
        with Memory(config=svc.config, embedder=embedder, tenant="a") as mem:
            assert mem.work(until_idle=True) == 1  # the control's job alone was left
            assert len(mem.store.ids(Scope("cy"))) == 1
            scope_is_empty(mem, "ana")
            scope_is_empty(mem, "bo")
    assert in_files(tmp_path / "data", texts) == []


def _chatter(config: Config, texts: list[str], log: str, started: Any) -> None:
    """Another process: add `texts` to ana's session s1 one by one, noting when each began."""
    with Memory(config=config, embedder=MiniLM(threads=1, int8=True)) as mem:
        s = mem.session(user_id="ana", session_id="s1")
        done = []
        for i, text in enumerate(texts):
            if i == 3:
                started.set()
            began = time.time()
            try:
                s.add(f"{text} is what I said")
                outcome = "ok"
            except Erased:
                outcome = "erased"
            done.append((text, began, outcome))
        s.close()
    Path(log).write_text(json.dumps(done))


def test_session_writes_from_another_process_never_outlive_its_deletion(
        tmp_path: Path, embedder: MiniLM) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    config = Config(path=folder / "m.db", worker="off")
    lost: list[str] = []
    for trial in range(3):
        texts = [canary() for _ in range(14)]
        log, started = tmp_path / f"log{trial}.json", SPAWN.Event()
        with Memory(config=config, embedder=embedder) as mem:
            p = SPAWN.Process(target=_chatter, args=(config, texts, str(log), started))
            p.start()
            assert started.wait(120)
            time.sleep(0.02 * trial)
            deleted_at = time.time()
            mem.session(user_id="ana", session_id="s1").delete()
            returned_at = time.time()
            p.join(120)
            assert p.exitcode == 0
            said = json.loads(log.read_text())
            before = [t for t, began, _ in said if began < deleted_at]
            assert len(before) >= 3
            kept = {r.text.split()[0] for r in mem.session(user_id="ana", session_id="s1")._records()}
            assert not kept & set(before)  # only what began after the delete is there
            ok = {t for t, _, outcome in said if outcome == "ok"}
            assert kept <= ok
            # an add begun during the delete may commit before it (and go with it) or after it
            assert {t for t, began, _ in said if began >= returned_at} & ok <= kept
            lost += before
            mem.erase(user_id="ana")  # the next trial starts from nothing
    assert in_files(folder, lost) == []


# -- what an LLM returns after the erasure (scripted: the reply waits for it) ----------------------

class Held:
    """A scripted reply that waits until the test lets it go: the LLM call is under way while
    the erasure commits. `calls` is set when the call arrives."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.calls = threading.Event()
        self.go = threading.Event()

    def __call__(self, messages: Any, schema: Any) -> dict[str, Any]:
        self.calls.set()
        assert self.go.wait(30)
        return self.reply


def learned(text: str) -> dict[str, Any]:
    """An extraction reply: a fact, two entities and a relation between them."""
    return {"facts": [{"text": f"Ana works at Acme {text}", "kind": "semantic",
                       "importance": 0.8, "date": None, "sources": [1]}],
            "entities": [{"name": "Ana", "type": "person", "aliases": []},
                         {"name": f"Acme {text}", "type": "organization", "aliases": []}],
            "relations": [{"subject": "Ana", "predicate": "works_at", "object": f"Acme {text}",
                           "valid_from": None, "valid_to": None}]}


def graph_rows(mem: Memory) -> list[int]:
    with mem.store.write() as tx:
        conn: Any = tx.conn  # type: ignore[attr-defined]
        return [conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("entities", "relations", "mentions")]


@pytest.fixture
def scripted(tmp_path: Path, embedder: MiniLM) -> Iterator[tuple[Memory, ScriptedLLM, Path]]:
    folder = tmp_path / "db"
    folder.mkdir()
    script = ScriptedLLM()
    with Memory(config=Config(path=folder / "m.db"), embedder=embedder,
                llm=LLM(script, retries=0, output_retries=0)) as mem:
        yield mem, script, folder


def test_a_job_whose_llm_answers_after_the_erasure_writes_nothing(
        scripted: tuple[Memory, ScriptedLLM, Path]) -> None:
    mem, script, folder = scripted
    text = canary()
    held = Held(learned(text))
    script.push(held)
    job = mem.add(f"I'm Ana, {text}. I work at Acme.", user_id="ana", session_id="s1",
                  background=True).job
    assert job is not None and held.calls.wait(30)
    receipt = mem.erase_receipt(user_id="ana")
    assert (receipt.jobs, receipt.cancelled) == (1, 1)  # it was running: cancelled
    held.go.set()
    drained(mem)
    scope_is_empty(mem, "ana")
    assert graph_rows(mem) == [0, 0, 0]  # the fact, its entities and relation: none came
    assert in_files(folder, [text]) == []


def test_a_reflection_whose_user_is_erased_meanwhile_writes_nothing(
        scripted: tuple[Memory, ScriptedLLM, Path]) -> None:
    mem, script, folder = scripted
    text = canary()
    mem.add([f"Always answer {text} briefly", "I prefer French"], user_id="ana", infer=False)
    held = Held(learned(text))
    script.push(held)
    outcome: list[BaseException] = []

    def reflect() -> None:
        try:
            mem.reflect(user_id="ana")
        except Erased as exc:
            outcome.append(exc)

    t = threading.Thread(target=reflect)
    t.start()
    assert held.calls.wait(30)
    mem.erase(user_id="ana")
    held.go.set()
    t.join(30)
    assert len(outcome) == 1 and outcome[0].covered  # type: ignore[attr-defined]
    scope_is_empty(mem, "ana")
    assert graph_rows(mem) == [0, 0, 0]
    assert in_files(folder, [text]) == []


def test_a_reflection_job_that_read_an_erased_memory_runs_again_without_it(
        scripted: tuple[Memory, ScriptedLLM, Path]) -> None:
    mem, script, folder = scripted
    text = canary()
    erased, kept = mem.add([f"My code word is {text}", "I like short answers"], user_id="ana",
                           infer=False).memories
    first, again = Held(learned(text)), Held(learned("again"))
    again.go.set()
    script.push(first, again)
    job = mem._queue.enqueue("reflect", Scope("ana"), {"limit": 10}, None)
    assert first.calls.wait(30)
    mem.erase(id=erased.id)  # one memory the running reflection read
    first.go.set()
    done = mem.wait(job.id, timeout=30)
    assert done.status is JobStatus.DONE, done  # queued again at once, then done
    assert again.calls.is_set()  # the second run read what remains
    assert "My code word" not in json.dumps(script.requests[1].messages)
    texts = {r.text for r in mem.list(user_id="ana", limit=50).items}
    assert not any(text in t for t in texts) and any("again" in t for t in texts)
    assert in_files(folder, [text]) == []


class HeldEmbedder(MiniLM):
    """The real model, whose embedding of a text holding `word` waits until `go` is set."""

    def __init__(self, word: str) -> None:
        super().__init__(threads=1, int8=True)
        self.word = word
        self.calls = threading.Event()
        self.go = threading.Event()

    def embed_batch(self, texts: Any) -> Any:
        if any(self.word in t for t in texts):
            self.calls.set()
            assert self.go.wait(30)
        return super().embed_batch(texts)


def test_a_relation_begun_before_an_erasure_is_not_written_after_it(tmp_path: Path) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    text = canary()
    embedder = HeldEmbedder(text)
    outcome: list[BaseException] = []
    with Memory(folder / "m.db", embedder=embedder, llm=None) as mem:
        mem.relate("Ana", "works_at", "Acme", user_id="ana")

        def relate() -> None:
            try:
                mem.relate(f"Bea {text}", "knows", "Ana", user_id="ana")
            except Erased as exc:
                outcome.append(exc)

        t = threading.Thread(target=relate)
        t.start()
        assert embedder.calls.wait(30)  # resolving its subject: Ana's entity was read
        mem.erase(user_id="ana")
        embedder.go.set()
        t.join(30)
        assert len(outcome) == 1 and outcome[0].covered  # type: ignore[attr-defined]
        assert graph_rows(mem) == [0, 0, 0]
        assert mem.relate("Ana", "works_at", "Acme", user_id="ana")  # a new write lands
    assert in_files(folder, [text]) == []


def test_an_import_begun_before_an_erasure_does_not_bring_the_scope_back(
        tmp_path: Path, embedder: MiniLM) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    text = canary()
    dump = tmp_path / "ana.jsonl"
    with Memory(tmp_path / "source.db", embedder=embedder, llm=None) as source:
        source.add(f"I'm Ana {text}", user_id="ana", session_id="s1")
        source.relate("Ana", "lives_in", "Lisbon", user_id="ana")
        source.export(dump, user_id="ana")
    held = HeldEmbedder(text)
    outcome: list[BaseException] = []
    with Memory(folder / "m.db", embedder=held, llm=None) as mem:
        def load() -> None:
            try:
                mem.import_(dump)
            except Erased as exc:
                outcome.append(exc)

        t = threading.Thread(target=load)
        t.start()
        assert held.calls.wait(30)  # embedding what it imports
        mem.erase(user_id="ana")
        held.go.set()
        t.join(30)
        assert len(outcome) == 1 and outcome[0].covered  # type: ignore[attr-defined]
        scope_is_empty(mem, "ana")
        assert graph_rows(mem) == [0, 0, 0]
        assert in_files(folder, [text]) == []
        held.word = "nothing held any more"
        assert mem.import_(dump) == 1  # imported again after the erasure: a new write
    assert in_files(folder, [text]) == [text]  # the control


# -- extraction (with the graph) and reflection over a real LLM -------------------------------------

@pytest.fixture(scope="module")
def llama() -> Iterator[LlamaServer]:
    with LlamaServer(n_ctx=2048) as s:
        yield s


def _reflect(config: Config, user: str, out: Any) -> None:
    """Another process: reflect over the user's episodes with the real LLM."""
    _short_replies()
    with Memory(config=config, embedder=MiniLM(threads=1, int8=True)) as mem:
        out.put("started")
        try:
            result = mem.reflect(user_id=user, limit=8)
            out.put(f"wrote {len(result.memories)}")
        except Erased as exc:
            out.put(f"erased {exc.covered}")


@pytest.mark.slow  # two calls of a real model, one after the other
def test_extraction_and_reflection_never_outlive_an_erasure(
        tmp_path: Path, embedder: MiniLM, llama: LlamaServer,
        worker_process: Callable[[Config], None]) -> None:
    """Both calls are under way at once (the server answers one after the other): a
    background add whose extraction (with the graph) runs in the worker process, and a
    reflection in a third process; the user is erased while they wait for the model."""
    folder = tmp_path / "db"
    folder.mkdir()
    config = Config(path=folder / "m.db", worker="off", llm_base_url=llama.base_url,
                    llm_timeout_s=180, llm_retries=0, llm_output_retries=0)
    texts = [canary() for _ in range(2)]
    with Memory(config=Config(path=folder / "m.db", worker="off"), embedder=embedder) as mem:
        mem.add([f"I always want {texts[0]} short answers", "Please answer in French"],
                user_id="ana", infer=False)
        worker_process(config)
        out = SPAWN.Queue()
        p = SPAWN.Process(target=_reflect, args=(config, "ana", out))
        p.start()
        job = mem.add(f"I'm Ana {texts[1]}. I started working at Acme in Lisbon last year.",
                      user_id="ana", session_id="s1", background=True).job
        assert job is not None
        assert out.get(timeout=120) == "started"
        assert until(lambda: mem.job(job.id).status is JobStatus.RUNNING, timeout=60)
        time.sleep(0.3)
        receipt = mem.erase_receipt(user_id="ana")
        assert (receipt.memories, receipt.cancelled) == (2, 1)
        said = out.get(timeout=300)
        p.join(60)
        assert p.exitcode == 0
        drained(mem, timeout=300)
        scope_is_empty(mem, "ana")
        assert graph_rows(mem) == [0, 0, 0]  # no entity, relation or mention of ana
    assert said == "erased True"  # the model answered after the erasure: nothing written
    assert in_files(folder, texts) == []

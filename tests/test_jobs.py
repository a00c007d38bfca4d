"""Background processing: a durable job table in the same database drives `add(background=True)`;
jobs survive a restart, failures retry with backoff, idempotency keys never duplicate work."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from engram import Config, Conflict, InProgress, InvalidInput, JobStatus, Kind, Memory, NotFound
from engram.cli import app
from engram.errors import StoreError
from engram.providers import embedders
from engram.providers.embedders import MiniLM


def memory(path: Path, embedder: MiniLM, **config: Any) -> Memory:
    return Memory(config=Config.from_env(path=path, **config), embedder=embedder)


@pytest.fixture
def quiet(tmp_path: Path, embedder: MiniLM) -> Iterator[Memory]:
    """No in-process worker: jobs stay queued until someone runs them."""
    m = memory(tmp_path / "m.db", embedder, worker="off")
    yield m
    m.close()


def test_background_add_returns_a_job_at_once_then_completes(mem: Memory) -> None:
    r = mem.add("I moved to Lisbon", user_id="ana", background=True)
    assert r.memories == [] and r.job is not None and r.job.status is JobStatus.QUEUED
    done = mem.wait(r.job.id, timeout=60)
    assert done.status is JobStatus.DONE and done.attempts == 1
    (mid,) = done.result["memories"]  # type: ignore[index]
    assert mem.get(mid).text == "I moved to Lisbon"
    assert [h.memory.id for h in mem.search("Lisbon", user_id="ana")] == [mid]


def test_bad_input_is_refused_before_queueing(quiet: Memory) -> None:
    with pytest.raises(InvalidInput):
        quiet.add("", user_id="ana", background=True)
    with pytest.raises(InvalidInput):
        quiet.add("x", background="yes")  # type: ignore[arg-type]
    assert quiet.jobs() == []


def test_queued_jobs_survive_a_restart(tmp_path: Path, embedder: MiniLM) -> None:
    with memory(tmp_path / "m.db", embedder, worker="off") as m:
        job = m.add("remember me", user_id="ana", background=True).job
        assert job is not None
    # the process "restarts"; a new Memory with a worker picks the job up
    with memory(tmp_path / "m.db", embedder) as m:
        assert m.job(job.id).status is JobStatus.QUEUED
        assert m.wait(job.id, timeout=60).status is JobStatus.DONE
        assert m.stats(user_id="ana").memories == 1


def test_a_dead_workers_job_is_taken_again_after_its_lease(quiet: Memory) -> None:
    from datetime import timedelta

    from engram.model import utcnow

    job = quiet.add("x", user_id="ana", background=True).job
    assert job is not None
    now = utcnow()
    claimed = quiet.store.claim_job(now, now + timedelta(seconds=1))  # ... and its worker dies
    assert claimed is not None and claimed.id == job.id
    assert quiet.store.claim_job(now, now + timedelta(seconds=1)) is None
    again = quiet.store.claim_job(now + timedelta(seconds=2), now + timedelta(minutes=5))
    assert again is not None and again.id == job.id and again.attempts == 2


def test_failures_retry_with_backoff_then_fail(quiet: Memory, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise StoreError("disk on fire")

    monkeypatch.setattr("engram.pipeline.write.add", broken)
    job = quiet.add("x", user_id="ana", background=True).job
    assert job is not None
    assert quiet.work(until_idle=True) == 1
    retry = quiet.job(job.id)
    assert retry.status is JobStatus.QUEUED and retry.error == "StoreError: disk on fire"
    assert retry.run_at > retry.updated_at  # backoff: not runnable yet
    assert quiet.work(until_idle=True) == 0
    # make every retry due now: after 1 + job_retries attempts the job fails for good
    for _ in range(quiet.config.job_retries):
        with quiet.store.write() as tx:
            tx.put_job(type(retry)(**{**quiet.job(job.id).__dict__, "run_at": retry.updated_at}))
        quiet.work(until_idle=True)
    final = quiet.job(job.id)
    assert final.status is JobStatus.FAILED and final.attempts == 1 + quiet.config.job_retries
    assert len(calls) == final.attempts


def test_invalid_payload_fails_without_retry(quiet: Memory, monkeypatch: pytest.MonkeyPatch) -> None:
    def invalid(*args: Any, **kwargs: Any) -> Any:
        raise InvalidInput("nope")

    monkeypatch.setattr("engram.pipeline.write.add", invalid)
    job = quiet.add("x", user_id="ana", background=True).job
    assert job is not None
    quiet.work(until_idle=True)
    assert quiet.job(job.id).status is JobStatus.FAILED and quiet.job(job.id).attempts == 1


def test_retry_queues_a_failed_job_again(quiet: Memory, monkeypatch: pytest.MonkeyPatch) -> None:
    """`retry` (the console's button, POST /v1/jobs/{id}/retry): a failed job runs again with
    its attempts reset; a job that has not failed, or an unknown one, is refused."""
    def invalid(*args: Any, **kwargs: Any) -> Any:
        raise InvalidInput("nope")

    with monkeypatch.context() as mp:
        mp.setattr("engram.pipeline.write.add", invalid)
        job = quiet.add("the ferry was late", user_id="ana", background=True).job
        assert job is not None
        quiet.work(until_idle=True)
    assert quiet.job(job.id).status is JobStatus.FAILED
    again = quiet.retry(job.id)
    assert (again.id, again.status, again.attempts, again.error) == (job.id, JobStatus.QUEUED, 0, None)
    with pytest.raises(Conflict):
        quiet.retry(job.id)  # queued: nothing to retry
    assert quiet.work(until_idle=True) == 1
    assert quiet.job(job.id).status is JobStatus.DONE
    assert [m.text for m in quiet.list(user_id="ana").items] == ["the ferry was late"]
    with pytest.raises(Conflict):
        quiet.retry(job.id)  # done
    with pytest.raises(NotFound):
        quiet.retry("no-such-job")


def test_same_key_retried_100_times_adds_once(mem: Memory) -> None:
    first = mem.add("I like tea", user_id="ana", idempotency_key="req-1")
    for _ in range(100):
        again = mem.add("I like tea", user_id="ana", idempotency_key="req-1")
        assert [m.id for m in again.memories] == [m.id for m in first.memories]
    assert [e.id for e in again.events] == [e.id for e in first.events]
    assert mem.stats(user_id="ana").memories == 1
    with pytest.raises(Conflict):
        mem.add("I like coffee", user_id="ana", idempotency_key="req-1")
    assert mem.stats(user_id="ana").memories == 1


def test_same_key_in_background_is_one_job(quiet: Memory) -> None:
    jobs = {quiet.add("x", user_id="ana", background=True, idempotency_key="k").job.id  # type: ignore[union-attr]
            for _ in range(20)}
    assert len(jobs) == 1
    with pytest.raises(Conflict):
        quiet.add("y", user_id="ana", background=True, idempotency_key="k")
    quiet.work(until_idle=True)
    # a foreground retry of the same request returns the background job's result
    r = quiet.add("x", user_id="ana", idempotency_key="k")
    assert [m.text for m in r.memories] == ["x"] and quiet.stats(user_id="ana").memories == 1


def test_concurrent_retries_with_one_key_add_once(tmp_path: Path, embedder: MiniLM) -> None:
    with memory(tmp_path / "m.db", embedder) as m:
        results: list[list[str]] = []
        errors: list[BaseException] = []

        def go() -> None:
            try:
                results.append([x.id for x in m.add("hello", user_id="ana", idempotency_key="k").memories])
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=go) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len({tuple(r) for r in results}) == 1 and m.stats(user_id="ana").memories == 1


def test_jobs_listing_and_unknown_ids(quiet: Memory) -> None:
    quiet.add("a", user_id="ana", background=True)
    quiet.add("b", user_id="bo", background=True)
    assert len(quiet.jobs()) == 2 and len(quiet.jobs(user_id="ana")) == 1
    assert quiet.jobs(status="done") == []
    with pytest.raises(InvalidInput):
        quiet.jobs(status="weird")
    with pytest.raises(NotFound):
        quiet.job("0190c2a4-0000-7000-8000-000000000000")


def test_engram_worker_runs_queued_jobs(tmp_path: Path, embedder: MiniLM,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "m.db"
    with memory(db, embedder, worker="off") as m:
        job = m.add("from the queue", user_id="ana", background=True).job
        assert job is not None
    monkeypatch.setitem(embedders.EMBEDDERS, "minilm", lambda: embedder)
    out = CliRunner().invoke(app, ["--db", str(db), "--json", "worker", "--until-idle"])
    assert out.exit_code == 0, out.output
    assert '"ran": 1' in out.stdout
    with memory(db, embedder, worker="off") as m:
        assert m.job(job.id).status is JobStatus.DONE
        assert [x.kind for x in m.list(user_id="ana").items] == [Kind.EPISODIC]
    out = CliRunner().invoke(app, ["--db", str(db), "jobs", "--status", "done"])
    assert out.exit_code == 0 and job.id in out.stdout


def test_a_failed_request_retried_with_its_key_runs_again(quiet: Memory,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def invalid(*args: Any, **kwargs: Any) -> Any:
        raise InvalidInput("nope")

    with monkeypatch.context() as mp:
        mp.setattr("engram.pipeline.write.add", invalid)
        job = quiet.add("x", user_id="ana", background=True, idempotency_key="k").job
        assert job is not None
        quiet.work(until_idle=True)
        assert quiet.job(job.id).status is JobStatus.FAILED
    again = quiet.add("x", user_id="ana", background=True, idempotency_key="k").job
    assert again is not None and again.id == job.id and again.status is JobStatus.QUEUED
    quiet.work(until_idle=True)
    assert quiet.job(job.id).status is JobStatus.DONE
    # ... and in the foreground, after a failure, the same key does the work in the same row
    with monkeypatch.context() as mp:
        mp.setattr("engram.pipeline.write.add", invalid)
        j2 = quiet.add("y", user_id="ana", background=True, idempotency_key="k2").job
        assert j2 is not None
        quiet.work(until_idle=True)
    r = quiet.add("y", user_id="ana", idempotency_key="k2")
    assert [m.text for m in r.memories] == ["y"] and quiet.job(j2.id).status is JobStatus.DONE


def test_engram_add_background_queues_a_job(tmp_path: Path, embedder: MiniLM,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.setitem(embedders.EMBEDDERS, "minilm", lambda: embedder)
    monkeypatch.setenv("ENGRAM_WORKER", "off")
    db = str(tmp_path / "m.db")
    out = CliRunner().invoke(app, ["--db", db, "--json", "add", "hello there", "-u", "ana",
                                   "--background", "--no-infer"])
    assert out.exit_code == 0, out.output
    job = json.loads(out.stdout)["job"]
    assert job["status"] == "queued" and job["payload"]["infer"] is False
    out = CliRunner().invoke(app, ["--db", db, "worker", "--until-idle"])
    assert out.exit_code == 0 and "ran 1 jobs" in out.stdout


def test_a_foreground_retry_of_a_queued_request_never_blocks(quiet: Memory) -> None:
    quiet.add("x", user_id="ana", background=True, idempotency_key="k")  # no worker runs it
    with pytest.raises(InProgress, match="queued; retry later") as info:
        quiet.add("x", user_id="ana", idempotency_key="k")
    assert not isinstance(info.value, Conflict)  # the same request: it will succeed later
    assert info.value.retry_after >= 1
    assert quiet.stats(user_id="ana").memories == 0
    with pytest.raises(Conflict):  # another request under the key is still a conflict
        quiet.add("y", user_id="ana", idempotency_key="k")
    quiet.work(until_idle=True)
    assert [m.text for m in quiet.add("x", user_id="ana", idempotency_key="k").memories] == ["x"]


def test_a_retry_while_the_first_request_runs_is_in_progress(
        tmp_path: Path, embedder: MiniLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the in-process worker, a retry waits for the running request (up to the lease),
    then asks the caller to come back: `InProgress`, not `Conflict`."""
    from engram.pipeline import write

    monkeypatch.setattr("engram.jobs.JOB_LEASE_S", 0.5)
    entered, release = threading.Event(), threading.Event()
    real = write.add

    def slow(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert release.wait(timeout=60)
        return real(*args, **kwargs)

    monkeypatch.setattr("engram.pipeline.write.add", slow)
    with memory(tmp_path / "m.db", embedder) as m:
        job = m.add("x", user_id="ana", background=True, idempotency_key="k").job
        assert job is not None and entered.wait(timeout=60)  # the worker runs it ...
        with pytest.raises(InProgress, match="still running") as info:
            m.add("x", user_id="ana", idempotency_key="k")  # ... and a retry must come back
        assert info.value.retry_after >= 1
        release.set()
        assert m.wait(job.id, timeout=60).status is JobStatus.DONE
        assert [r.text for r in m.add("x", user_id="ana", idempotency_key="k").memories] == ["x"]
        assert m.stats(user_id="ana").memories == 1

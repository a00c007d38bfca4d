"""The `Store` contract for the durable job queue and persisted sessions (store/base.py)."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from engram.errors import Conflict
from engram.model import Job, JobStatus, Scope, Session, new_id
from engram.store import Store

NOW = datetime(2025, 6, 1, 12, 0, 0, 123456, tzinfo=UTC)
U1, S1 = Scope("u1"), Scope("u1", None, "s1")


def job(task: str = "add", *, scope: Scope = U1, key: str | None = None,
        run_at: datetime = NOW, **fields: object) -> Job:
    base: dict[str, object] = dict(
        id=new_id(), task=task, scope=scope, payload={"messages": ["héllo ✓"], "n": 1},
        status=JobStatus.QUEUED, created_at=NOW, updated_at=NOW, run_at=run_at, key=key,
        fingerprint="f1" if key else None)
    base.update(fields)
    return Job(**base)  # type: ignore[arg-type]


def enqueue(store: Store, *jobs: Job) -> None:
    with store.write() as tx:
        for j in jobs:
            tx.put_job(j)


def test_job_round_trip(store: Store) -> None:
    j = job(key="req-1", result=None, error=None)
    enqueue(store, j)
    assert store.job(j.id) == j
    assert store.job_by_key("req-1") == j
    assert store.job("nope") is None and store.job_by_key("nope") is None


def test_put_job_replaces_by_id(store: Store) -> None:
    j = job()
    enqueue(store, j)
    done = replace(j, status=JobStatus.DONE, result={"ids": ["a", "b"]}, updated_at=NOW + timedelta(1))
    enqueue(store, done)
    assert store.job(j.id) == done


def test_taken_key_is_a_conflict_and_rolls_back(store: Store) -> None:
    enqueue(store, job(key="k"))
    other = job(key="k")
    with pytest.raises(Conflict), store.write() as tx:
        tx.put_job(job(key="fresh"))
        tx.put_job(other)
    assert store.job(other.id) is None
    assert store.job_by_key("fresh") is None  # the whole transaction rolled back


def test_claim_takes_runnable_jobs_oldest_first(store: Store) -> None:
    later = job(run_at=NOW + timedelta(minutes=5))
    first, second = job(run_at=NOW - timedelta(seconds=2)), job(run_at=NOW - timedelta(seconds=1))
    enqueue(store, later, second, first)
    lease = NOW + timedelta(seconds=30)
    a = store.claim_job(NOW, lease)
    b = store.claim_job(NOW, lease)
    assert a is not None and b is not None
    assert [a.id, b.id] == [first.id, second.id]
    assert a.status is JobStatus.RUNNING and a.attempts == 1 and a.lease_until == lease
    assert store.claim_job(NOW, lease) is None  # `later` is not due yet
    assert store.job(first.id) == a


def test_expired_lease_is_claimed_again(store: Store) -> None:
    enqueue(store, job())
    first = store.claim_job(NOW, NOW + timedelta(seconds=10))
    assert first is not None
    assert store.claim_job(NOW + timedelta(seconds=5), NOW + timedelta(seconds=40)) is None
    again = store.claim_job(NOW + timedelta(seconds=11), NOW + timedelta(seconds=40))
    assert again is not None and again.id == first.id and again.attempts == 2


def test_finished_jobs_are_not_claimed(store: Store) -> None:
    enqueue(store, job(status=JobStatus.DONE), job(status=JobStatus.FAILED))
    assert store.claim_job(NOW + timedelta(days=1), NOW + timedelta(days=2)) is None


def test_concurrent_claims_never_share_a_job(store: Store) -> None:
    enqueue(store, *[job() for _ in range(20)])
    claimed: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        while (j := store.claim_job(NOW, NOW + timedelta(minutes=1))) is not None:
            with lock:
                claimed.append(j.id)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(claimed) == 20 and len(set(claimed)) == 20


def test_jobs_by_scope_and_status(store: Store) -> None:
    a1, a2, b = job(scope=Scope("a")), job(scope=Scope("a"), status=JobStatus.DONE), job(scope=Scope("b"))
    enqueue(store, a1, a2, b)
    assert [j.id for j in store.jobs(Scope("a"))] == [a2.id, a1.id]  # newest first
    assert [j.id for j in store.jobs(Scope("a"), status="done")] == [a2.id]
    assert {j.id for j in store.jobs(Scope())} == {a1.id, a2.id, b.id}
    assert len(store.jobs(Scope(), limit=2)) == 2


def sess(scope: Scope = S1, **fields: object) -> Session:
    base: dict[str, object] = dict(scope=scope, policy={"name": "window", "n": 10},
                                   created_at=NOW, updated_at=NOW)
    base.update(fields)
    return Session(**base)  # type: ignore[arg-type]


def test_session_round_trip_and_replace(store: Store) -> None:
    s = sess(summary="Ana moved to Lisbon. ✓", summary_upto="m-9", state={"levels": ["a"]},
             metadata={"title": "trip"})
    with store.write() as tx:
        tx.put_session(s)
    assert store.session(s.scope) == s
    ended = replace(s, ended_at=NOW + timedelta(hours=1), updated_at=NOW + timedelta(hours=1))
    with store.write() as tx:
        tx.put_session(ended)
    assert store.session(s.scope) == ended
    assert store.sessions(Scope("u1")) == [ended]


def test_session_scope_is_exact(store: Store) -> None:
    """(u1, -, s1) and (u1, bot, s1) are different sessions; a NULL field is part of the key."""
    plain, with_agent = sess(), sess(Scope("u1", "bot", "s1"), updated_at=NOW + timedelta(1))
    with store.write() as tx:
        tx.put_session(plain)
        tx.put_session(with_agent)
    assert store.session(Scope("u1", None, "s1")) == plain
    assert store.session(Scope("u1", "bot", "s1")) == with_agent
    assert store.session(Scope(None, None, "s1")) is None
    assert store.sessions(Scope("u1")) == [with_agent, plain]  # most recently updated first
    assert store.sessions(Scope("u2")) == []


def test_delete_session(store: Store) -> None:
    s = sess()
    with store.write() as tx:
        tx.put_session(s)
    with store.write() as tx:
        tx.delete_session(s.scope)
    assert store.session(s.scope) is None


def test_erase_scope_takes_sessions_and_jobs(store: Store) -> None:
    mine, theirs = Scope("u1", None, "s1"), Scope("u2", None, "s1")
    jm, jt = job(scope=mine), job(scope=theirs)
    enqueue(store, jm, jt)
    with store.write() as tx:
        tx.put_session(sess(mine))
        tx.put_session(sess(theirs))
    with store.write() as tx:
        tx.erase_scope(Scope("u1"))
    assert store.session(mine) is None and store.job(jm.id) is None
    assert store.session(theirs) is not None and store.job(jt.id) is not None

"""The `Store` contract of erasure marks and of finishing a claimed job (pipeline/fence.py):
what makes an erasure a fence on every backend."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from engram.errors import Erased
from engram.model import Erasure, Job, JobStatus, Scope, new_id
from engram.pipeline import fence
from engram.pipeline.fence import Fence
from engram.store import Store

NOW = datetime(2025, 6, 1, 12, 0, 0, 123456, tzinfo=UTC)
ANA, S1 = Scope("ana"), Scope("ana", None, "s1")


def queued(scope: Scope = S1) -> Job:
    return Job(id=new_id(), task="add", scope=scope, payload={"messages": ["hi"]},
               status=JobStatus.QUEUED, created_at=NOW, updated_at=NOW, run_at=NOW)


def claimed(store: Store, scope: Scope = S1) -> Job:
    with store.write() as tx:
        tx.put_job(queued(scope))
    job = store.claim_job(NOW, NOW + timedelta(seconds=30))
    assert job is not None
    return job


def test_marks_are_numbered_in_commit_order_and_read_back(store: Store) -> None:
    assert store.erasure_seq() == 0
    with store.write() as tx:
        assert tx.erasures(0) == []
        fence.leave(tx, ANA, "scope", NOW)
    first = store.erasure_seq()
    with store.write() as tx:
        fence.leave(tx, S1, "session", NOW + timedelta(seconds=1))
        fence.leave(tx, Scope("bo", "bot"), "memory", NOW + timedelta(seconds=2))
    with store.write() as tx:
        marks = tx.erasures(0)
        since = tx.erasures(first)
    assert first > 0 and store.erasure_seq() == marks[-1].seq
    assert [m.seq for m in marks] == sorted({m.seq for m in marks}) and marks[0].seq == first
    assert [(m.target, m.at) for m in marks] == [
        ("scope", NOW), ("session", NOW + timedelta(seconds=1)),
        ("memory", NOW + timedelta(seconds=2))]
    assert since == marks[1:]
    # the scope is kept as a receipt keeps it: hashed, never the ids themselves
    assert marks[1].scope == fence.mark(S1, "session", NOW).scope
    assert marks[1].scope.user_id != "ana" and marks[1].scope.agent_id is None


def test_old_marks_are_dropped_numbers_never_reused(store: Store) -> None:
    with store.write() as tx:
        fence.leave(tx, ANA, "scope", NOW)
    old = store.erasure_seq()
    with store.write() as tx:  # a day and more later: the first mark is dropped
        fence.leave(tx, S1, "session", NOW + fence.KEEP + timedelta(seconds=1))
        marks = tx.erasures(0)
    assert [m.target for m in marks] == ["session"] and marks[0].seq > old


def test_a_rolled_back_erasure_leaves_no_mark(store: Store) -> None:
    with store.write() as tx:
        tx.put_erasure(Erasure(Scope("x"), "scope", NOW), forget_before=NOW - timedelta(1))
    seq = store.erasure_seq()
    with pytest.raises(ValueError), store.write() as tx:
        fence.leave(tx, ANA, "scope", NOW)
        raise ValueError
    assert store.erasure_seq() == seq
    with store.write() as tx:
        assert [m.scope for m in tx.erasures(0)] == [Scope("x")]


def test_finishing_a_claimed_job_updates_its_row(store: Store) -> None:
    job = claimed(store)
    done = replace(job, status=JobStatus.DONE, result={"memories": ["m1"]}, lease_until=None,
                   updated_at=NOW + timedelta(seconds=1))
    with store.write() as tx:
        assert tx.finish_job(done)
    assert store.job(job.id) == done
    with store.write() as tx:  # done: no longer running under the claim
        assert not tx.finish_job(replace(done, status=JobStatus.FAILED))
    assert store.job(job.id) == done


def test_finishing_an_erased_job_writes_nothing(store: Store) -> None:
    job = claimed(store)
    with store.write() as tx:
        tx.delete_jobs([job.id])
    with store.write() as tx:
        assert not tx.finish_job(replace(job, status=JobStatus.DONE, result={"memories": []}))
    assert store.job(job.id) is None  # never upserted back
    assert store.jobs(S1) == []


def test_finishing_a_job_another_worker_took_writes_nothing(store: Store) -> None:
    job = claimed(store)
    later = NOW + timedelta(minutes=1)  # the lease ran out: another worker claims it
    again = store.claim_job(later, later + timedelta(seconds=30))
    assert again is not None and again.id == job.id and again.attempts == job.attempts + 1
    with store.write() as tx:
        assert not tx.finish_job(replace(job, status=JobStatus.DONE))
    assert store.job(job.id) == again


@pytest.mark.parametrize(("erased", "target", "covered"), [
    (ANA, "scope", True),           # the user: every session of it
    (S1, "session", True),
    (Scope("ana", None, "s2"), "session", None),  # another session of ana
    # a session is exact (bot's, not ana's alone), but a read of S1 leaves the agent open
    (Scope("ana", "bot", "s1"), "session", False),
    (Scope("bo"), "scope", None),  # someone else
    (S1, "memory", False),          # one memory of the scope: what was read may be gone
])
def test_a_write_holds_only_if_nothing_of_its_scope_was_erased_since(
        store: Store, erased: Scope, target: str, covered: bool | None) -> None:
    f = Fence.take(store, S1)
    with store.write() as tx:
        fence.leave(tx, erased, target, NOW)
    job = queued()
    if covered is None:
        with store.write() as tx:
            f.hold(tx)
            tx.put_job(job)
        assert store.job(job.id) == job
        return
    with pytest.raises(Erased) as caught, store.write() as tx:
        f.hold(tx)
        tx.put_job(job)
    assert caught.value.covered is covered
    assert store.job(job.id) is None
    with store.write() as tx:  # only the whole scope's erasure fences a write of rows alone
        if covered:
            with pytest.raises(Erased):
                f.hold(tx, reads=False)
        else:
            f.hold(tx, reads=False)
    assert Fence.take(store, S1).seq > f.seq  # a write begun now holds
    with store.write() as tx:
        Fence.take(store, S1).hold(tx)


def test_a_reflection_over_a_user_is_fenced_by_a_session_of_it(store: Store) -> None:
    f = Fence.take(store, ANA)  # reads every session of ana
    with store.write() as tx:
        fence.leave(tx, S1, "session", NOW)
    with pytest.raises(Erased) as caught, store.write() as tx:
        f.hold(tx)
    assert not caught.value.covered  # ana is still there: run it again on what remains

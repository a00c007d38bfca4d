"""The durable job queue: enqueue, idempotent replay of keyed requests, and the worker.

Jobs are rows of the store's `jobs` table, in the same database as the memories: an add's
writes and its job's DONE mark commit in one transaction, so a retried request finds either
nothing or the whole result. Workers (a thread here, or `engram worker` processes) claim jobs
with a lease; a dead worker's job is taken again when its lease ends.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from . import redact
from . import validate as valid
from .errors import (
    Conflict,
    EngramError,
    Erased,
    InProgress,
    InvalidInput,
    KeyReused,
    NotFound,
    StoreBusy,
    StoreUnavailable,
)
from .model import AddResult, Job, JobStatus, Kind, Scope, new_id, utcnow
from .pipeline import extract as extraction
from .pipeline import learn, retention, write
from .pipeline.engine import Engine
from .pipeline.fence import Fence
from .pipeline.write import AddRequest

log = logging.getLogger("engram.memory")

JOB_LEASE_S = 300  # a claimed job whose worker died is run again after this
RETRY_AFTER_S = 1.0  # the least a caller is asked to wait before asking again
RETENTION_EVERY_S = 3600.0  # how often an idle worker enforces the retention policy
OUTAGE_WAIT_S = 10.0  # the longest a worker waits between two claims while the database is away
FENCE_TRIES = 3  # an add a partial erasure fenced is run again, at most this many times in all


def fingerprint(task: str, payload: Mapping[str, Any]) -> str:
    """A hash of a request: the same idempotency key with another request is refused."""
    return hashlib.sha256(json.dumps([task, payload], sort_keys=True, ensure_ascii=False)
                          .encode()).hexdigest()


class Queue:
    """The queue of one `Memory`: its requests and the in-process worker thread (started on
    demand with ENGRAM_WORKER=thread, the default; with `off`, jobs wait for `engram worker`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # retention (pipeline/retention.py): the tenant's policy, enforced by the worker
        self.retention: dict[str, float | None] = {}
        self._retained_at = 0.0

    # -- requests ------------------------------------------------------------------------------

    def add(self, req: AddRequest, key: str | None, background: bool,
            fence: Fence | None = None) -> AddResult:
        """Run an add now (or queue it, `background`), at most once per idempotency `key`:
        a retry gets the first result; another request under the key is `KeyReused`; a retry
        while the first is still queued or running is `InProgress`. `fence`: what the caller
        began under (else the add takes its own); an erasure of the scope since then is
        `Erased`, and one of only a part of it (a memory, a session) runs the add again."""
        if background:
            # the payload holds the redacted request: the raw text is never in the jobs table
            total = req.redacted_total()
            said = redact.describe(total)
            return AddResult(memories=[], events=[], notes=(said,) if said else (),
                             job=self.enqueue("add", req.scope, req.payload(), key),
                             redacted=total)
        fp = fingerprint("add", req.payload())
        failed = None
        if key is not None:
            known, failed = self.replay(key, fp)
            if known is not None:
                return known
        # a failed earlier attempt under this key is done again, in its own job row
        job = failed or (None if key is None else self._row(req, key, fp))
        try:
            result = self._add(req, job, fence)
        except Erased:
            raise
        except Conflict:  # another writer took the key meanwhile: its result is ours
            known, _ = self.replay(key or "", fp)
            if known is None:
                raise
            return known
        self._maybe_reflect(req)
        return result

    def _add(self, req: AddRequest, job: Job | None, fence: Fence | None) -> AddResult:
        """`write.add`, done again while a partial erasure fences it (what it read is gone)."""
        for attempt in range(FENCE_TRIES):
            try:
                return write.add(self.engine, req, job=job, fence=fence)
            except Erased as exc:
                if exc.covered or attempt == FENCE_TRIES - 1:
                    raise
                fence = Fence.take(self.engine.store, req.scope) if fence is None else \
                    replace(fence, seq=self.engine.store.erasure_seq())
        raise AssertionError("unreachable")

    def enqueue(self, task: str, scope: Scope, payload: dict[str, Any], key: str | None) -> Job:
        fp = fingerprint(task, payload)
        store = self.engine.store
        now = utcnow()
        if key is not None:
            known = store.job_by_key(key)
            if known is not None:
                if known.fingerprint != fp:
                    raise KeyReused(f"idempotency key {key!r} was used for a different request")
                if known.status is not JobStatus.FAILED:
                    return known
                return self._requeue(known)  # the same request again after it failed for good
        job = Job(id=new_id(), task=task, scope=scope, payload=payload, status=JobStatus.QUEUED,
                  created_at=now, updated_at=now, run_at=now, key=key, fingerprint=fp)
        try:
            with store.write() as tx:
                tx.put_job(job)
        except Conflict:
            known = store.job_by_key(key or "")
            if known is None or known.fingerprint != fp:
                raise
            return known
        log.info("queued %s job %s", task, job.id)
        self.start()
        return job

    def retry(self, id: str) -> Job:
        """A failed job queued again, its attempts reset (Conflict unless it failed: a queued,
        running or done job needs no retry)."""
        job = self.job(id)
        if job.status is not JobStatus.FAILED:
            raise Conflict(f"job {id} is {job.status.value}: only a failed job can be retried")
        return self._requeue(job)

    def _requeue(self, job: Job) -> Job:
        now = utcnow()
        job = replace(job, status=JobStatus.QUEUED, attempts=0, run_at=now, error=None,
                      lease_until=None, updated_at=now)
        with self.engine.store.write() as tx:
            if self.engine.store.job(job.id) is None:  # erased since it was read
                raise NotFound(f"no job with id {job.id!r}")
            tx.put_job(job)
        log.info("queued %s job %s again", job.task, job.id)
        self.start()
        return job

    def replay(self, key: str, fp: str) -> tuple[AddResult | None, Job | None]:
        """The result of an earlier request with this idempotency key; else None, with the
        earlier job if it failed (so doing it again is right)."""
        job = self.engine.store.job_by_key(key)
        if job is None:
            return None, None
        if job.fingerprint != fp:
            raise KeyReused(f"idempotency key {key!r} was used for a different request")
        if job.status is JobStatus.QUEUED and self.engine.config.worker != "thread":
            # no worker here to wait for: never block on `engram worker` processes
            raise InProgress(f"the request with idempotency key {key!r} is queued; retry later",
                             retry_after=retry_after(job, utcnow()))
        if job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
            job = self.wait(job.id, timeout=JOB_LEASE_S)
            if job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
                raise InProgress(f"the request with idempotency key {key!r} is still running; "
                                 "retry later", retry_after=retry_after(job, utcnow()))
        if job.status is not JobStatus.DONE or job.result is None:
            return None, job
        return self._result(job.result), None

    def _result(self, summary: Mapping[str, Any]) -> AddResult:
        store = self.engine.store
        ids = list(summary.get("memories", []))
        found = store.get(ids)
        # events are about the stored memories and about those they touched (a SUPERSEDE
        # closes an older memory): read the history of both, keep the order of the result
        about = dict.fromkeys([*ids, *summary.get("touched", [])])
        by_id = {e.id: e for mid in about for e in store.events(mid)}
        events = [by_id[i] for i in summary.get("events", []) if i in by_id]
        return AddResult(memories=[found[i] for i in ids if i in found], events=events,
                         notes=tuple(summary.get("notes", [])),
                         redacted=dict(summary.get("redacted", {})))

    @staticmethod
    def _row(req: AddRequest, key: str, fp: str) -> Job:
        """The job row of a keyed foreground add, written done with its result."""
        now = utcnow()
        return Job(id=new_id(), task="add", scope=req.scope, payload=req.payload(),
                   status=JobStatus.RUNNING, created_at=now, updated_at=now, run_at=now,
                   attempts=1, key=key, fingerprint=fp)

    def _maybe_reflect(self, req: AddRequest) -> None:
        """With ENGRAM_REFLECT_EVERY=N and an LLM: queue a reflection job each time a scope's
        episode count crosses a multiple of N (its idempotency key makes it one job per step).
        The add is already committed: failing to queue is logged, not raised."""
        every = self.engine.config.reflect_every
        added = len(req.messages) if req.kind is Kind.EPISODIC else 0
        if not every or not added or self.engine.llm is None:
            return
        scope = req.scope
        try:
            count = self.engine.store.stats(scope, utcnow()).by_kind.get(Kind.EPISODIC.value, 0)
            if count // every > (count - added) // every:
                step = count // every
                self.enqueue("reflect", scope, {"limit": 2 * every},
                             f"reflect:{json.dumps(list(scope.as_dict().values()))}:{step}")
        except EngramError as exc:
            log.warning("could not queue a reflection for %s: %r", scope, exc)

    # -- jobs ----------------------------------------------------------------------------------

    def job(self, id: str) -> Job:
        found = self.engine.store.job(valid.ident(id))
        if found is None:
            raise NotFound(f"no job with id {id!r}")
        return found

    def wait(self, job_id: str, timeout: float | None) -> Job:
        """Block until a job is done or failed, or until `timeout` seconds pass."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self.job(job_id)
        self.start()
        delay = 0.01
        while job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
            job = self.job(job_id)
        return job

    def work(self, *, until_idle: bool = False, stop: threading.Event | None = None,
             poll_s: float = 0.5) -> int:
        """Claim and run jobs until `stop` (or, `until_idle`, until none is runnable)."""
        stop = stop or threading.Event()
        ran = 0
        outage = 0  # tries in a row that found the database away
        while not stop.is_set():
            now = utcnow()
            try:
                job = self.engine.store.claim_job(now, now + timedelta(seconds=JOB_LEASE_S))
                if job is not None:
                    self.run(job)
            except (StoreBusy, StoreUnavailable) as exc:
                if until_idle:  # a caller waiting for the end hears why it came early
                    raise
                # The database restarted or is away: wait for it rather than end the worker,
                # which would leave this process's jobs queued until someone queued another.
                # A job whose end could not be written is run again when its lease ends.
                outage += 1
                if outage == 1:
                    log.warning("the job worker waits for the database: %s", exc)
                stop.wait(min(poll_s * 2 ** min(outage, 6), OUTAGE_WAIT_S))
                continue
            outage = 0
            if job is None:
                self._retain()  # when idle: retention (at most every RETENTION_EVERY_S)
                if until_idle:
                    break
                stop.wait(poll_s)
                continue
            ran += 1
        return ran

    def _retain(self) -> None:
        if not any(v is not None for v in self.retention.values()):
            return
        if time.monotonic() - self._retained_at < RETENTION_EVERY_S and self._retained_at:
            return
        self._retained_at = time.monotonic()
        try:
            retention.enforce(self.engine, self.retention, utcnow())
        except EngramError as exc:  # tried again next time
            log.warning("retention failed: %r", exc)

    def run(self, job: Job) -> None:
        """Run one claimed job; it ends done, queued again (with backoff) or failed. Its
        writes and its final row commit only if no erasure took its scope since it began,
        and only into its row as claimed: an erased job is gone, and stays gone."""
        store = self.engine.store
        req = None
        # before anything is read: an erasure committed after this is seen by the final check
        fence = Fence.take(store, job.scope, job)
        try:
            if job.task == "add":
                # queued redacted; redacted again in case it was queued before redaction
                # existed, or by a process with a weaker policy (idempotent otherwise)
                req = AddRequest.from_payload(job.payload).with_policy(self.engine.config.redact)
                job = replace(job, payload=req.payload())  # the row keeps what was stored
                write.add(self.engine, req, job=job, fence=fence)
            else:
                task = extraction.REFLECT if job.task == "reflect" else extraction.EXTRACT
                result = learn.learn_from(self.engine, job.scope, task, job.payload.get("limit"),
                                          fence)
                with store.write() as tx:
                    fence.finish(tx, replace(job, status=JobStatus.DONE, updated_at=utcnow(),
                                             lease_until=None, result=write.summary(result)))
        except Erased as exc:
            self._fenced(job, fence, exc)
            return
        except Exception as exc:  # a job must end in a state, whatever went wrong
            now = utcnow()
            final = (isinstance(exc, InvalidInput | NotFound | Conflict)  # asking again cannot help
                     or job.attempts > self.engine.config.job_retries)
            status = JobStatus.FAILED if final else JobStatus.QUEUED
            retry = now + timedelta(seconds=min(2 ** job.attempts, 60))
            log.warning("job %s (%s) attempt %d failed: %r%s", job.id, job.task, job.attempts, exc,
                        "" if final else f"; retrying at {retry:%H:%M:%S}")
            try:
                with store.write() as tx:
                    fence.finish(tx, replace(job, status=status, run_at=retry, lease_until=None,
                                             error=f"{type(exc).__name__}: {exc}", updated_at=now))
            except Erased as gone:
                log.info("job %s: %s", job.id, gone)
            return
        if req is not None:
            self._maybe_reflect(req)

    def _fenced(self, job: Job, fence: Fence, exc: Erased) -> None:
        """A job an erasure stopped: cancelled (its row is gone with its scope), or, when the
        erasure took only part of what it read, queued to run again at once from what remains."""
        if exc.covered:
            log.info("job %s (%s) cancelled: %s", job.id, job.task, exc)
            return
        now = utcnow()
        try:
            with self.engine.store.write() as tx:
                fence.finish(tx, replace(job, status=JobStatus.QUEUED, run_at=now,
                                         lease_until=None, updated_at=now))
            log.info("job %s (%s) runs again: %s", job.id, job.task, exc)
        except Erased as gone:
            log.info("job %s (%s) cancelled: %s", job.id, job.task, gone)

    def start(self) -> None:
        """Start the in-process worker thread if jobs run here and it is not running."""
        if self.engine.config.worker != "thread":
            return
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self.work, kwargs={"stop": self._stop},
                                                name="engram-worker", daemon=True)
                self._worker.start()

    def resume(self) -> bool:
        """Start the worker if the store holds runnable jobs (queued, or running past their
        lease: a process that died mid-job), e.g. when a service opens a tenant after a crash."""
        if self.engine.config.worker != "thread":
            return False
        jobs = self.engine.store.stats(Scope(), utcnow()).jobs
        if not (jobs.get(JobStatus.QUEUED.value) or jobs.get(JobStatus.RUNNING.value)):
            return False
        self.start()
        return True

    def stop(self) -> None:
        """Ask the worker to stop after its current job."""
        self._stop.set()

    def join(self, timeout: float | None) -> None:
        if self._worker is not None:
            self._worker.join(timeout=timeout)


def retry_after(job: Job, now: datetime) -> float:
    """Seconds until a queued or running job may be done: until its lease ends (running) or
    its run time comes (queued later), at least `RETRY_AFTER_S`."""
    until = job.lease_until if job.status is JobStatus.RUNNING else job.run_at
    left = (until - now).total_seconds() if until is not None else 0.0
    return max(RETRY_AFTER_S, round(left, 3))

"""Retention: memories older than their kind's policy are removed by the worker, as an erasure
is (rows, keys, index, history text), each leaving a DELETE event that says why, and the run
a receipt. Finished jobs older than the shortest message retention go too (their payloads
hold the messages).

`cutoffs` is the pure part: which kinds expire before which time, for a policy in days
(`Config.retention`: episodes, messages = episodes of a session, facts = semantic and
procedural memories; None keeps them).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta

from ..model import Event, EventType, JobStatus, Kind, MemoryRecord, Receipt, Scope, new_id
from ..store import Seen, Select
from .engine import Engine
from .erase import ids_digest, receipt_event, reset_summaries

log = logging.getLogger("engram.memory")

REASON = "retention"  # every retention DELETE event's reason starts with it
PAGE = 500
JOBS_SCANNED = 100_000


@dataclass(frozen=True)
class Cutoffs:
    """Created before these times, a memory has outlived its policy (None: kept)."""

    episodes: datetime | None
    messages: datetime | None  # episodes of a session: the earlier-expiring of the two applies
    facts: datetime | None
    jobs: datetime | None      # finished jobs: the shortest message retention

    def of(self, rec: MemoryRecord) -> tuple[datetime | None, str]:
        """The cutoff of a record and the policy that sets it."""
        if rec.kind is not Kind.EPISODIC:
            return self.facts, "facts"
        if rec.scope.session_id is not None and self.messages is not None and (
                self.episodes is None or self.messages > self.episodes):
            return self.messages, "messages"
        return self.episodes, "episodes"

    def any(self) -> bool:
        return any(t is not None for t in (self.episodes, self.messages, self.facts))


def cutoffs(policy: dict[str, float | None], now: datetime) -> Cutoffs:
    def before(kind: str) -> datetime | None:
        days = policy.get(kind)
        return None if days is None else now - timedelta(days=days)

    episodes, messages = before("episodes"), before("messages")
    shortest = [t for t in (episodes, messages) if t is not None]
    return Cutoffs(episodes, messages, before("facts"), max(shortest) if shortest else None)


def expired(rec: MemoryRecord, cut: Cutoffs) -> str | None:
    """The policy `rec` has outlived (its reason), or None."""
    limit, kind = cut.of(rec)
    return kind if limit is not None and rec.created_at < limit else None


def enforce(engine: Engine, policy: dict[str, float | None], now: datetime) -> Receipt | None:
    """Remove what has outlived the policy; None when nothing had (or no policy is set)."""
    cut = cutoffs(policy, now)
    if cut.jobs is None and not cut.any():
        return None
    store = engine.store
    doomed: dict[str, tuple[MemoryRecord, str]] = {}
    after = None
    while cut.any():
        page = store.read_memories(Select(seen=Seen.ALL, after_id=after, limit=PAGE))
        for rec in page:
            why = expired(rec, cut)
            if why is not None:
                doomed[rec.id] = (rec, why)
        if len(page) < PAGE:
            break
        after = page[-1].id
    old_jobs = [] if cut.jobs is None else [
        j.id for j in store.jobs(Scope(), limit=JOBS_SCANNED)
        if j.status in (JobStatus.DONE, JobStatus.FAILED) and j.updated_at < cut.jobs]
    if not doomed and not old_jobs:
        return None
    ids = list(doomed)
    sessions = {rec.scope for rec, _ in doomed.values() if rec.scope.session_id is not None}
    days = {k: v for k, v in policy.items() if v is not None}
    with store.write() as tx:
        tx.erase(ids)
        tx.delete_jobs(old_jobs)
        for scope in sessions:  # their summaries may quote what is gone: rebuilt from the rest
            reset_summaries(store, tx, scope)
        for rec, why in doomed.values():
            tx.append(Event(id=new_id(), memory_id=rec.id, type=EventType.DELETE, at=now,
                            scope=rec.scope, reason=f"{REASON}: {why} kept {days[why]:g} days"))
        kinds = Counter(rec.kind.value for rec, _ in doomed.values())
        receipt = Receipt(id=new_id(), at=now, scope=Scope(), target="retention",
                          memories=len(ids), by_kind=dict(sorted(kinds.items())), sessions=0,
                          jobs=len(old_jobs), ids_sha256=ids_digest(ids),
                          reason=f"{REASON}: " + ", ".join(f"{k} {v:g} days"
                                                          for k, v in sorted(days.items())))
        tx.append(receipt_event(receipt, None))
    store.reclaim()
    log.info("retention removed %d memories and %d jobs", len(ids), len(old_jobs))
    return receipt

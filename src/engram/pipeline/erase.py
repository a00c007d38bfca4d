"""Erasure, the one hard delete: of a memory, a scope or a session, with everything derived.

Rows, keys, lexical index and events go; so do the memories derived from them (facts, session
summaries: their provenance names the erased ids), session rows, the job rows whose payloads
hold the text, and the copies of an erased turn in its neighbours' windows. The freed bytes
are reclaimed. Each erasure leaves a receipt (`Receipt`, in its ERASE event): counts by kind,
scope, time and a hash of the erased ids, never their content.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from .. import validate as valid
from ..errors import NotFound
from ..graph import entities
from ..model import Event, EventType, Job, JobStatus, MemoryRecord, Receipt, Scope, new_id, utcnow
from ..providers.embedders import forget_texts
from ..store import Store, Tx
from . import fence, retrieve
from .engine import Engine
from .index import Keys, followers

log = logging.getLogger("engram.memory")

PAGE = 500
JOBS_SCANNED = 100_000  # jobs of a scope looked at for payloads to drop


def memory(engine: Engine, id: str, within: Scope) -> Receipt:
    """Erase one memory of the scope `within` (deleted or not; NotFound if there is none) and
    what was derived from it. Its session's summaries may quote it: they are reset, to be
    rebuilt from what remains."""
    rec = engine.store.get([id]).get(id)
    if rec is None or not valid.in_scope(rec.scope, within):
        raise NotFound(f"no memory with id {id!r}")
    return _erase(engine, lambda: [rec.id], rec.scope, followers(engine, rec, None),
                  single=rec.id)


def scope(engine: Engine, scope: Scope) -> Receipt:
    """Erase every memory of `scope` (None fields match anything), its sessions and jobs.
    Every episode's context lies within its own scope, so no surviving turn holds an erased
    one."""
    return _erase(engine, lambda: engine.store.ids(scope, include_deleted=True), scope, [])


def session(engine: Engine, scope: Scope) -> Receipt:
    """Erase one session: the memories of exactly its scope (None is "none" here: the session
    of ana alone is not ana's session with an agent), its row and its jobs. NotFound when
    there is no such session."""
    store = engine.store
    # a session whose first add is still queued has no row yet: it is its work
    if not _session_ids(store, scope) and store.session(scope) is None \
            and not _jobs_of(store, scope):
        raise NotFound(f"no session {scope.session_id!r} in this scope")
    return _erase(engine, lambda: _session_ids(store, scope), scope, [], exact=True)


def _session_ids(store: Store, scope: Scope) -> list[str]:
    ids = store.ids(scope, include_deleted=True)
    return [r.id for r in _records(store, ids).values() if r.scope == scope]


def _erase(engine: Engine, select: Callable[[], list[str]], scope: Scope,
           moved: list[tuple[MemoryRecord, Keys]], *, single: str | None = None,
           exact: bool = False) -> Receipt:
    store = engine.store
    now = utcnow()
    target = "memory" if single else "session" if exact else "scope"
    with store.write() as tx:
        # What is erased is read in the erasing transaction: a write that committed a moment
        # before is taken, one that commits after finds the mark below (and writes nothing).
        # What was derived from the erased memories goes too: facts extracted from them and
        # summaries of them (their provenance names the erased ids), wherever they are stored.
        ids = select()
        ids = [*ids, *derived(store, set(ids), scope)]
        gone = set(ids)
        moved = [(r, keys) for r, keys in moved if r.id not in gone]
        kinds = Counter(r.kind.value for r in _records(store, ids).values())
        # The fence: a write begun before this one (a job, another process's add) checks
        # this mark in its own transaction, and commits nothing into what was taken here.
        fence.leave(tx, scope, target, now)
        tx.erase(ids)
        entities.erase(store, tx, ids, scope, whole=single is None and not exact)  # the graph
        for other, (own, lexical) in moved:
            tx.update(other, own, lexical)
        # Reads in the transaction: a job queued a moment ago is counted and removed alike.
        if single is not None:
            if scope.session_id is not None:
                reset_summaries(store, tx, scope)  # rebuilt from the messages that remain
            dropped = _drop_jobs(store, tx, scope, gone, naming=True)
            sessions = 0
        elif exact:
            sessions = int(store.session(scope) is not None)
            tx.delete_session(scope)
            dropped = _drop_jobs(store, tx, scope, gone, naming=False)
        else:
            sessions = len(store.sessions(scope, limit=JOBS_SCANNED))
            dropped = store.jobs(scope, limit=JOBS_SCANNED)
            tx.erase_scope(scope)  # sessions (their summaries) and jobs (their payloads)
        jobs = len(dropped)
        cancelled = sum(j.status in (JobStatus.QUEUED, JobStatus.RUNNING) for j in dropped)
        reason = f"session deleted: {len(ids)} memories" if exact else f"erased {len(ids)} memories"
        # The record of a scope's erasure does not name whom it erased (a user id is often an
        # email address): its ids are hashed. One memory's ERASE keeps the memory's scope, so
        # its history stays readable in that scope only.
        kept = scope if single else valid.pseudonymous(scope)
        receipt = Receipt(id=new_id(), at=now, scope=kept, target=target, memories=len(ids),
                          by_kind=dict(sorted(kinds.items())), sessions=sessions, jobs=jobs,
                          cancelled=cancelled, ids_sha256=ids_digest(ids), reason=reason)
        tx.append(receipt_event(receipt, single))
    store.reclaim()
    # the process's caches keyed by text (ranking's, the embedder's LRU) hold no erased text
    retrieve.forget_texts()
    forget_texts(engine.embedder)
    log.info("erased %d memories (%s): receipt %s", len(ids), f"id {single}" if single else kept,
             json.dumps({k: v for k, v in receipt.to_dict().items() if k != "scope"}))
    return receipt


def ids_digest(ids: list[str]) -> str:
    """SHA-256 of the sorted ids, one per line: whoever holds an id list can check it against
    a receipt; the receipt alone does not list them."""
    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()


def receipt_event(receipt: Receipt, memory_id: str | None) -> Event:
    """The ERASE event that keeps a receipt (its `after`: counts, never content)."""
    body = receipt.to_dict()
    after = {k: body[k] for k in ("target", "memories", "by_kind", "sessions", "jobs",
                                  "cancelled", "ids_sha256")}
    return Event(id=receipt.id, memory_id=memory_id, type=EventType.ERASE, at=receipt.at,
                 scope=receipt.scope, after=after, reason=receipt.reason)


def receipts(store: Store, scope: Scope, limit: int) -> list[Receipt]:
    """The receipts of the erasures in `scope` (None fields match anything), newest first: a
    scope's erasure is recorded under its hashed ids, one memory's under its scope."""
    found = {e.id: e for s in (scope, valid.pseudonymous(scope))
             for e in store.events_of(EventType.ERASE.value, s, limit=limit)}
    newest = sorted(found.values(), key=lambda e: (e.at, e.id), reverse=True)[:limit]
    return [Receipt.from_event(e) for e in newest]


def derived(store: Store, erased: set[str], scope: Scope) -> list[str]:
    """Ids of memories derived from `erased` (directly or through other derived ones) among
    the memories of the scope's user or agent: facts live outside the session they came
    from."""
    if not erased:
        return []
    owner = Scope(scope.user_id, scope.agent_id, None)
    records = _records(store, [i for i in store.ids(owner, include_deleted=True) if i not in erased])
    found: list[str] = []
    gone = set(erased)
    changed = True
    while changed:
        changed = False
        for rid, rec in records.items():
            if rid not in gone and gone.intersection(rec.provenance):
                gone.add(rid)
                found.append(rid)
                changed = True
    return found


def reset_summaries(store: Store, tx: Tx, scope: Scope) -> bool:
    """Drop the running summaries of the session of `scope` (inside the caller's write
    transaction), so they are rebuilt from the messages that remain: for the erasure of one
    message, whose text a summary may quote. Returns whether there was anything to drop."""
    row = store.session(scope)
    if row is None or not (row.summary or row.summary_upto or row.state.get("levels")):
        return False
    state = {k: v for k, v in row.state.items() if k not in ("levels", "folded", "mode")}
    tx.put_session(replace(row, summary="", summary_upto=None, state=state))
    return True


def _drop_jobs(store: Store, tx: Tx, scope: Scope, erased: set[str], *,
               naming: bool) -> list[Job]:
    """Jobs keep their request (an add's messages) as payload: remove the rows of the jobs of
    exactly `scope` (`naming=False`, a session: queued or running ones are cancelled), or of
    the jobs whose result names an erased memory (its request held the text). The row goes,
    not only the payload: the job is unknown afterwards (404), and its idempotency key is free
    for new work. Returns the removed jobs."""
    doomed = [job for job in store.jobs(scope, limit=JOBS_SCANNED)
              if (erased.intersection((job.result or {}).get("memories", [])) if naming
                  else job.scope == scope)]
    tx.delete_jobs([job.id for job in doomed])
    return doomed


def _jobs_of(store: Store, scope: Scope) -> list[Job]:
    """The jobs of exactly `scope`."""
    return [job for job in store.jobs(scope, limit=JOBS_SCANNED) if job.scope == scope]


def _records(store: Store, ids: list[str]) -> dict[str, MemoryRecord]:
    out: dict[str, MemoryRecord] = {}
    for i in range(0, len(ids), PAGE):
        out.update(store.get(ids[i:i + PAGE]))
    return out

"""Erasure, the one hard delete: of a memory, a scope or a session, with everything derived.

Rows, keys, lexical index and events go; so do the memories derived from them (facts, session
summaries: their provenance names the erased ids), session rows, job payloads holding the text,
and the copies of an erased turn in its neighbours' windows. The freed bytes are reclaimed.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from .. import validate as valid
from ..errors import NotFound
from ..model import Event, EventType, Job, JobStatus, MemoryRecord, Scope, new_id, utcnow
from ..store import Store, Tx
from .engine import Engine
from .index import Keys, followers

log = logging.getLogger("engram.memory")

PAGE = 500
JOBS_SCANNED = 100_000  # jobs of a scope looked at for payloads to drop


def memory(engine: Engine, id: str, within: Scope) -> int:
    """Erase one memory of the scope `within` (deleted or not; NotFound if there is none) and
    what was derived from it. Its session's summaries may quote it: they are reset, to be
    rebuilt from what remains."""
    rec = engine.store.get([id]).get(id)
    if rec is None or not valid.in_scope(rec.scope, within):
        raise NotFound(f"no memory with id {id!r}")
    return _erase(engine, [rec.id], rec.scope, followers(engine, rec, None), single=rec.id)


def scope(engine: Engine, scope: Scope) -> int:
    """Erase every memory of `scope` (None fields match anything), its sessions and jobs.
    Every episode's context lies within its own scope, so no surviving turn holds an erased
    one."""
    return _erase(engine, engine.store.ids(scope, include_deleted=True), scope, [])


def session(engine: Engine, scope: Scope) -> int:
    """Erase one session: the memories of exactly its scope (None is "none" here: the session
    of ana alone is not ana's session with an agent), its row and its jobs. NotFound when
    there is no such session."""
    store = engine.store
    ids = store.ids(scope, include_deleted=True)
    mine = [r.id for r in _records(store, ids).values() if r.scope == scope]
    if not mine and store.session(scope) is None:
        raise NotFound(f"no session {scope.session_id!r} in this scope")
    return _erase(engine, mine, scope, [], exact=True)


def _erase(engine: Engine, ids: list[str], scope: Scope, moved: list[tuple[MemoryRecord, Keys]],
           *, single: str | None = None, exact: bool = False) -> int:
    store = engine.store
    # What was derived from the erased memories goes too: facts extracted from them and
    # summaries of them (their provenance names the erased ids), wherever they are stored.
    ids = [*ids, *derived(store, set(ids), scope)]
    gone = set(ids)
    moved = [(r, keys) for r, keys in moved if r.id not in gone]
    now = utcnow()
    with store.write() as tx:
        tx.erase(ids)
        for other, (own, lexical) in moved:
            tx.update(other, own, lexical)
        if single is not None:
            if scope.session_id is not None:
                reset_summaries(store, tx, scope)  # rebuilt from the messages that remain
            _drop_payloads(store, tx, scope, gone, naming=True)
        elif exact:
            tx.delete_session(scope)
            _drop_payloads(store, tx, scope, gone, naming=False)
        else:
            tx.erase_scope(scope)  # sessions (their summaries) and jobs (their payloads)
        reason = f"session deleted: {len(ids)} memories" if exact else f"erased {len(ids)} memories"
        # The record of a scope's erasure does not name whom it erased (a user id is often an
        # email address): its ids are hashed. One memory's ERASE keeps the memory's scope, so
        # its history stays readable in that scope only.
        tx.append(Event(id=new_id(), memory_id=single, type=EventType.ERASE, at=now,
                        scope=scope if single else valid.pseudonymous(scope), reason=reason))
    store.reclaim()
    log.info("erased %d memories (%s)", len(ids),
             f"id {single}" if single else valid.pseudonymous(scope))
    return len(ids)


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


def _drop_payloads(store: Store, tx: Tx, scope: Scope, erased: set[str], *, naming: bool) -> None:
    """Jobs keep their request (an add's messages) as payload. Drop the payload of each job
    of exactly `scope` (`naming=False`), or of the jobs whose result names an erased memory.
    A job of an erased session also gives up its idempotency key and never runs: its work is
    gone with the rest of the session."""
    for job in store.jobs(scope, limit=JOBS_SCANNED):
        if naming:
            if not erased.intersection((job.result or {}).get("memories", [])):
                continue
            tx.put_job(replace(job, payload={}, updated_at=utcnow()))
        elif job.scope == scope:
            tx.put_job(_retired(job))


def _retired(job: Job) -> Job:
    status = job.status if job.status in (JobStatus.DONE, JobStatus.FAILED) else JobStatus.FAILED
    return replace(job, payload={}, result=None, key=None, fingerprint=None, status=status,
                   error="erased with its session" if status is JobStatus.FAILED else job.error,
                   lease_until=None, updated_at=utcnow())


def _records(store: Store, ids: list[str]) -> dict[str, MemoryRecord]:
    out: dict[str, MemoryRecord] = {}
    for i in range(0, len(ids), PAGE):
        out.update(store.get(ids[i:i + PAGE]))
    return out

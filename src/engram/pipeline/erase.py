"""Erasure, the hard delete: of a memory or a scope, with everything derived from it.

Rows, keys, lexical index and events go; so do the memories derived from them (facts, session
summaries: their provenance names the erased ids), session rows and jobs of an erased scope,
and the copies of an erased turn in its neighbours' windows. The freed bytes are reclaimed.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from .. import validate as valid
from ..errors import NotFound
from ..model import Event, EventType, MemoryRecord, Scope, new_id, utcnow
from ..store import Store, Tx
from .engine import Engine
from .index import Keys, followers

log = logging.getLogger("engram.memory")

PAGE = 500


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


def _erase(engine: Engine, ids: list[str], scope: Scope, moved: list[tuple[MemoryRecord, Keys]],
           *, single: str | None = None) -> int:
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
        if single is None:
            tx.erase_scope(scope)  # sessions (their summaries) and jobs (their payloads)
        elif scope.session_id is not None:
            reset_summaries(store, tx, scope)  # rebuilt from the messages that remain
        tx.append(Event(id=new_id(), memory_id=single, type=EventType.ERASE, at=now, scope=scope,
                        reason=f"erased {len(ids)} memories"))
    store.reclaim()
    log.info("erased %d memories (%s)", len(ids), f"id {single}" if single else scope)
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


def _records(store: Store, ids: list[str]) -> dict[str, MemoryRecord]:
    out: dict[str, MemoryRecord] = {}
    for i in range(0, len(ids), PAGE):
        out.update(store.get(ids[i:i + PAGE]))
    return out

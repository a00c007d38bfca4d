"""Reindexing: every memory's retrieval keys (and entity name vectors) made again with the
configured embedder, so a database moves to another embedding space whole (`engram reindex`).

The space a database's vectors belong to is recorded on first use (`check`); a Memory whose
embedder makes another space does not open (EmbeddingMismatch). `reindex` walks the memories
in id order, a batch at a time: the model runs outside any transaction, and each batch's keys
are written with the progress (the target and the last id done) in one transaction, so a
restart continues after the last finished batch. The new space is recorded at the end.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from ..errors import EmbeddingMismatch, InvalidInput
from ..graph import rules as g
from ..model import Kind, MemoryRecord, Scope
from ..providers import embedders
from ..store import EntitySelect, Key, Seen, Select, Space, Store
from . import passages
from .engine import Engine
from .index import WINDOW, speaker_text, window_vector

log = logging.getLogger("engram.reindex")

BATCH = 256  # memories per transaction: one forward pass of a few hundred texts
FACT_PAGE = 2000  # memories per read while finding what was learned from which episode

Progress = Callable[[int, int], None]
"""Called after each batch with (memories done, memories in total)."""


def check(engine: Engine) -> Space:
    """The recorded space, recorded now when none is (an empty database, or one made before
    spaces were recorded: its vectors are taken to be the configured embedder's). Raises
    EmbeddingMismatch when the configured embedder makes another space, or while a reindex
    into another space is unfinished (the database is half one space, half the other)."""
    configured = space(engine)
    recorded = engine.store.space()
    if recorded is None:
        with engine.store.write() as tx:
            tx.put_space(Space(configured), first=True)
        recorded = engine.store.space()
        assert recorded is not None
    moving = recorded.target
    if recorded.space != configured or (moving is not None and moving != recorded.space):
        raise EmbeddingMismatch(recorded.space if moving is None
                                else f"{recorded.space} (reindex into {moving} unfinished)",
                                configured)
    return recorded


def _mark(into: str, scope: Scope) -> str:
    """What `Space.pending` holds during a reindex: its target space and scope (read back by
    `Space.target`)."""
    return json.dumps([into, scope.user_id, scope.agent_id])


def space(engine: Engine) -> str:
    """The embedding space of the engine's embedder."""
    return embedders.space(engine.embedder)


def reindex(engine: Engine, scope: Scope, progress: Progress | None = None) -> int:
    """Re-embed the keys of every live memory of `scope` (None fields: anything) with the
    configured embedder; returns how many memories were re-embedded (by this call: a resumed
    run counts what was left). Moving to another space needs the whole database (an empty
    scope): a database is one space. Other writers should be stopped meanwhile: one still
    running with the old embedder would write old-space keys."""
    store = engine.store
    configured = space(engine)
    recorded = store.space() or Space(configured)
    whole = scope.user_id is None and scope.agent_id is None
    if recorded.space != configured and not whole:
        raise InvalidInput(f"the database is in embedding space {recorded.space!r}: re-embedding "
                           f"into {configured!r} takes the whole database (no user or agent)")
    mark = _mark(configured, scope)
    cursor = recorded.cursor if recorded.pending == mark else None
    if cursor:
        log.info("resuming the reindex into %s after %s", configured, cursor)
    with store.write() as tx:
        tx.put_space(Space(recorded.space, mark, cursor))
    live = Select(scope=scope, seen=Seen.LIVE, order="id")
    total = len(store.read_ids(live))
    done = total - len(store.read_ids(replace(live, after_id=cursor))) if cursor else 0
    facts = _facts(store, live)
    count = 0
    while True:
        ids = store.read_ids(replace(live, after_id=cursor, limit=BATCH))
        if not ids:
            break
        records = store.read_memories(replace(live, ids=tuple(ids)))
        keys = memory_keys(engine, records, facts)
        with store.write() as tx:
            # Re-read in the transaction: a memory deleted or edited since is left alone (its
            # writer indexed it, and a deleted one has no keys to make).
            now = store.get(ids)
            for rec in records:
                if rec.id in now and now[rec.id] == rec:
                    tx.update(rec, keys[rec.id])
            cursor = ids[-1]
            tx.put_space(Space(recorded.space, mark, cursor))
        count += len(ids)
        done += len(ids)
        if progress is not None:
            progress(min(done, total), total)
    _entities(engine, scope)
    with store.write() as tx:
        tx.put_space(Space(configured))
    log.info("re-embedded %d memories into %s", count, configured)
    return count


def _facts(store: Store, live: Select) -> dict[str, list[MemoryRecord]]:
    """Episode id -> the live memories learned from it (their provenance names it): each is a
    `fact` key of the episode. Read a page at a time, keeping only those."""
    out: dict[str, list[MemoryRecord]] = {}
    after = None
    while page := store.read_memories(replace(live, after_id=after, limit=FACT_PAGE)):
        for fact in page:
            for source in fact.provenance:
                out.setdefault(source, []).append(fact)
        after = page[-1].id
    return out


def memory_keys(engine: Engine, records: Sequence[MemoryRecord],
                facts: dict[str, list[MemoryRecord]]) -> dict[str, list[Key]]:
    """The keys `pipeline.index` gives each record (text; window from the turn vectors, over
    the turns before it in its scope; a fact key per fact learned from an episode; a passage
    key per window of a long text past the first), with one forward pass for the batch."""
    texts: dict[str, int] = {}

    def row_of(text: str) -> int:
        return texts.setdefault(text, len(texts))

    def row(rec: MemoryRecord) -> int:
        return row_of(speaker_text(rec))

    plan: dict[str, tuple[list[int], list[int]]] = {}
    for rec in records:
        if rec.kind is not Kind.EPISODIC:
            plan[rec.id] = ([row(rec)], [])
            continue
        before = engine.store.read_memories(Select(
            scope=rec.scope, exact=True, kinds=(Kind.EPISODIC,), before=rec.id, order="newest",
            limit=WINDOW - 1))[::-1]
        plan[rec.id] = ([*map(row, before), row(rec)], [row(f) for f in facts.get(rec.id, [])])
    cut = {mid: list(map(row_of, found))
           for mid, found in passages.of(engine.embedder, records).items()}
    vectors = engine.embedder.embed_batch(list(texts))
    words = np.array([max(1, len(t.split())) for t in texts], dtype=np.float32)
    return {mid: [Key("text", vectors[rows[-1]]),
                  Key("window", window_vector(vectors[rows], words[rows])),
                  *[Key("fact", vectors[i]) for i in extra],
                  *[Key(passages.KEY, vectors[i]) for i in cut.get(mid, ())]]
            for mid, (rows, extra) in plan.items()}


def _entities(engine: Engine, scope: Scope) -> None:
    """The name vectors of the scope's entities (knowledge graph), made again."""
    store = engine.store
    owner = Scope(scope.user_id, scope.agent_id)
    ids = tuple(e for e, _ in store.entity_embeddings(owner))
    found = store.read_entities(EntitySelect(owner, ids=ids)) if ids else []
    for at in range(0, len(found), BATCH):
        part = found[at:at + BATCH]
        vectors = engine.embedder.embed_batch([e.name for e in part])
        with store.write() as tx:
            for e, vec in zip(part, vectors, strict=True):
                tx.put_entity(e, g.name_keys(e.name, e.aliases), vec)

"""The read pipeline: candidates per retriever (dense keys, lexical) -> fuse -> rank -> hits.

Also the plain reads (one memory, a page, a history) and the one visibility check for a memory
read by id. Fusion and ranking are the pure functions of `retrieve.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import partial
from typing import Any

import numpy as np

from .. import validate as valid
from ..errors import InvalidInput, NotFound
from ..filters import parse_filters
from ..graph import retrieve as graph_retrieve
from ..model import Event, Hit, Kind, MemoryRecord, Page, Scope, utcnow
from ..redact import redact
from ..store import Query, Store
from . import passages
from .engine import Engine
from .retrieve import Ranked, fuse_arrays, lexical_terms, rank_arrays

log = logging.getLogger("engram.memory")

# The dense retrievers: each matches the query vector against one key of the memories (`dense`
# against the best of the text and its passages: passages.py).
DENSE_KEYS = (("dense", "text"), ("window", "window"), ("fact", "fact"))


def query(scope: Scope, filters: Mapping[str, Any] | None, kinds: Iterable[str | Kind] | None,
          as_of: datetime | str | None) -> Query:
    """A `Query` from caller input (validated: InvalidInput / InvalidFilter before any read)."""
    if kinds is not None and isinstance(kinds, str | Kind):
        kinds = [kinds]
    chosen: list[Kind] = []
    for k in kinds or ():
        if (kind := valid.kind(k)) is None:
            raise InvalidInput(f"kinds must be some of {[k.value for k in Kind]}, not None")
        chosen.append(kind)
    return Query(scope=scope, now=utcnow(), kinds=tuple(chosen) or None,
                 conditions=parse_filters(filters), as_of=valid.moment(as_of, "as_of"))


def ranked(engine: Engine, text: str, q: Query, limit: int, vector: np.ndarray | None = None,
           pool: int | None = None) -> list[Ranked]:
    """Candidates per retriever (`pool` each, default the preset's), then fused and ranked
    over arrays; only the best `limit` are explained."""
    cfg = engine.retrieval
    store = engine.store
    n = max(pool or cfg.candidates, limit)
    weights = {"dense": cfg.dense_weight, "window": cfg.window_weight, "fact": cfg.fact_weight,
               "lexical": cfg.lexical_weight, "graph": cfg.graph_weight}
    keys = [(label, key) for label, key in DENSE_KEYS if weights[label]]
    if keys and vector is None:
        vector = engine.embedder.embed_batch([text])[0]
    asked = [key for _, key in keys] + ([passages.KEY] if weights["dense"] else [])
    words = lexical_terms(text, q.scope.user_id)
    pooled = store.pool(q, n, vector=vector, keys=asked,
                        terms=words if weights["lexical"] else (),
                        previous_weight=cfg.previous_weight)
    found = {label: pooled[key] for label, key in keys}
    won: dict[str, float] = {}
    if passages.KEY in pooled:  # a memory is as close as its best passage
        found["dense"], won = passages.closest(found["dense"], pooled[passages.KEY], n)
    if "lexical" in pooled:
        found["lexical"] = pooled["lexical"]
    if weights["graph"]:  # scaled to [0, 1] by the retriever itself
        found["graph"] = graph_retrieve.candidates(engine, text, q, n, cfg.graph_depth)
    fused = fuse_arrays(found, weights, cfg)
    best = rank_arrays(fused, store.candidates(fused.ids, q), text, cfg, q.as_of or q.now, limit,
                       vectors=partial(_text_vectors, store), query_vector=vector, asked=words)
    if won and vector is not None:
        passages.explain(store, best, won, vector)
    return best


def _text_vectors(store: Store, ids: list[str]) -> dict[str, np.ndarray]:
    """The `text` key of each memory (what newest-wins compares two statements by)."""
    return {mid: rows[-1] for mid, rows in store.key_vectors(ids, "text").items()}


def search(engine: Engine, text: str, q: Query, limit: int) -> list[Hit]:
    """The best `limit` hits for `text`, each explaining its score; counts an access."""
    best = ranked(engine, text, q, limit)
    records = engine.store.access([mid for mid, _, _ in best], q.now)
    hits = [Hit(records[mid], score, explain) for mid, score, explain in best if mid in records]
    if log.isEnabledFor(logging.DEBUG):
        said = redact(text, engine.config.redact).text  # the query is not redacted; its log line is
        for h in hits:
            log.debug("search %r -> %s %.3f %s", said[:80], h.memory.id, h.score, h.explain)
    return hits


def page(store: Store, q: Query, cursor: str | None, limit: int) -> Page:
    """Visible memories in creation order, `limit` after the id `cursor`."""
    if cursor is not None and (not isinstance(cursor, str) or len(cursor) > valid.MAX_ID_CHARS):
        raise InvalidInput("cursor must be the next_cursor of a previous page")
    items = store.select(q, after_id=cursor, limit=limit + 1)
    more = len(items) > limit
    items = items[:limit]
    return Page(items=items, next_cursor=items[-1].id if more else None)


def every(store: Store, q: Query) -> list[MemoryRecord]:
    """Every visible memory of a query, in creation order."""
    out: list[MemoryRecord] = []
    cursor = None
    while items := store.select(q, after_id=cursor, limit=500):
        out += items
        cursor = items[-1].id
    return out


def visible(store: Store, id: str, now: datetime) -> MemoryRecord | None:
    """The memory `id` if a read by id may see it: not deleted, not expired (superseded ones
    are visible by id: they are history)."""
    rec = store.get([id]).get(id)
    if rec is None or rec.deleted_at is not None:
        return None
    if rec.expires_at is not None and rec.expires_at <= now:
        return None
    return rec


def get(store: Store, id: str, within: Scope) -> MemoryRecord:
    """A visible memory of the scope `within` (None fields match anything); NotFound
    otherwise, the same for an unknown id as for another scope's."""
    rec = visible(store, valid.ident(id), utcnow())
    if rec is None or not valid.in_scope(rec.scope, within):
        raise NotFound(f"no memory with id {id!r}")
    return rec


def history(store: Store, id: str, within: Scope) -> list[Event]:
    """Every event of a memory, oldest first (also of a deleted or erased one: its ERASE
    event carries its scope)."""
    valid.ident(id)
    events = store.events(id)
    rec = store.get([id]).get(id)
    owner = rec.scope if rec is not None else events[0].scope if events else None
    if owner is None or not valid.in_scope(owner, within):
        raise NotFound(f"no memory with id {id!r}")
    return events

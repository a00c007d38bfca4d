"""Indexing: how a memory is found again, its retrieval keys (text, window, passages) and lexical
document.

Calls the embedder, never inside a transaction. An episode's window holds the turns before it,
so editing or removing a turn re-indexes the turns after it (`followers`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..model import Kind, MemoryRecord, Scope
from ..store import Key, Lexical
from . import passages
from .engine import Engine
from .text import key_text

WINDOW = 3  # turns in an episode's `window` key: itself and the two before it

Keys = tuple[list[Key], Lexical]
"""One memory's retrieval keys and lexical document, as `Tx.insert` / `Tx.update` take them."""


def speaker_text(rec: MemoryRecord) -> str:
    """The text a memory's `text` key embeds (`text.key_text`): "Tom: I moved to Leeds"."""
    return "".join(key_text(rec))


def index(engine: Engine, records: Sequence[MemoryRecord],
          history: dict[Scope, list[MemoryRecord]] | None = None) -> dict[str, Keys]:
    """How each memory is found: its retrieval keys and its lexical document.

    An episode is indexed with its conversational context, because a turn is often
    understood only with the turns before it ("Yes, since 2019!"): a `window` key stands for
    the turn with the two before it in the same scope, and the lexical index holds the
    previous turn as a lower-weighted column. A fact stands alone: its window is itself.
    `history` holds the turns before each scope's first record (read from the store when
    missing) and is advanced past `records`, so batches can be indexed one after another.

    The window key costs no forward pass of its own: it is made from the turn vectors
    (`window_vector`), so each text is embedded once (the earlier turns of a first record
    are embedded again, at most WINDOW - 1 per scope and call). A text longer than the
    embedder's window also gets a `passage` key per window past the first (passages.py),
    embedded in the same batch.
    """
    texts: dict[str, int] = {}  # speaker text -> row; a text repeated in a batch is embedded once

    def row_of(text: str) -> int:
        return texts.setdefault(text, len(texts))

    def row(rec: MemoryRecord) -> int:
        return row_of(speaker_text(rec))

    plan: dict[str, tuple[list[int], Lexical]] = {}  # id -> rows (own last), lexical
    history = {} if history is None else history  # the last turns seen, per scope
    for rec in records:
        own = speaker_text(rec)
        if rec.kind is not Kind.EPISODIC:
            plan[rec.id] = ([row(rec)], Lexical(own))
            continue
        if rec.scope not in history:
            history[rec.scope] = engine.store.recent_episodes(rec.scope, WINDOW - 1)[::-1]
        before = [r for r in history[rec.scope] if r.id != rec.id][-(WINDOW - 1):]
        plan[rec.id] = ([*map(row, before), row(rec)],
                        Lexical(own, speaker_text(before[-1]) if before else ""))
        history[rec.scope] = [*before, rec]
    extra = {mid: list(map(row_of, found))
             for mid, found in passages.of(engine.embedder, records).items()}
    vectors = engine.embedder.embed_batch(list(texts))
    words = np.array([max(1, len(t.split())) for t in texts], dtype=np.float32)
    return {mid: ([Key("text", vectors[rows[-1]]),
                   Key("window", window_vector(vectors[rows], words[rows])),
                   *[Key(passages.KEY, vectors[i]) for i in extra.get(mid, ())]], lex)
            for mid, (rows, lex) in plan.items()}


def window_vector(turns: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A window's vector from its turns' unit vectors (oldest first), each weighted by its
    length in words: mean pooling over the joined text weighs each turn by its tokens, so
    this is close to embedding the joined text, at no model cost. LoCoMo dev: recall@10 of
    the `hybrid` preset is the same as with the joined text embedded (rerun bench/locomo.py)."""
    if len(turns) == 1:
        return np.asarray(turns[0], dtype=np.float32)
    mixed = (turns * lengths[:, None]).sum(axis=0)
    return np.asarray(mixed / max(float(np.linalg.norm(mixed)), 1e-12), dtype=np.float32)


def reindex(engine: Engine, rec: MemoryRecord) -> Keys:
    """The keys of an edited memory: an old turn's window is the turns before *it*."""
    prior = engine.store.episodes_around(rec.id, WINDOW - 1)[0] if rec.kind is Kind.EPISODIC else []
    return index(engine, [rec], {rec.scope: prior})[rec.id]


def followers(engine: Engine, rec: MemoryRecord, replacement: MemoryRecord | None,
              ) -> list[tuple[MemoryRecord, Keys]]:
    """The episodes whose index holds `rec` as context, re-indexed without it (or with
    `replacement`): so a deleted, erased or edited turn leaves no trace in its neighbours."""
    if rec.kind is not Kind.EPISODIC:
        return []
    before, after = engine.store.episodes_around(rec.id, WINDOW - 1)
    if not after:
        return []
    history = {rec.scope: [*before, *([replacement] if replacement else [])]}
    keys = index(engine, after, history)
    return [(r, keys[r.id]) for r in after]

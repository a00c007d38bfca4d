"""A lexicon that follows its database, written once for both stores: the store reports the
lexical documents changed since a position of its change log (`lexical_changes`), the follower
applies them to its `Lexicon`.

A position is the store's: a commit-ordered counter of document changes (the last `lex_log`
id on SQLite, `meta.lex_position` of the tenant on PostgreSQL), so a reader that has seen
position p has seen every change at or below it. Changes a log can no longer give (pruned
past the position), or that erased a memory (its words must leave the process too), come as
the whole set of documents instead, and the follower starts again from them.

Both logs name memories, and the follower numbers its documents by memory (a document
number is never another memory's), not by a row number a store may give again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from ..bm25 import Tokenizer
from .lexicon import BATCH, MAX_DEAD, Lexicon


@dataclass(frozen=True)
class LexicalDocument:
    """A memory's lexical document as the index holds it: its tokens, by column."""

    id: str
    body: Sequence[str]     # the text's tokens, in order
    context: Sequence[str]  # the previous turn's
    scope: Sequence[str]    # its scope's tokens (bm25.scope_tokens, as the tokenizer keeps them)


@dataclass(frozen=True)
class LexicalText:
    """A memory's lexical document as texts, which the lexicon tokenises itself with FTS5's
    tokenizer (as the SQLite store's `memory_fts` holds it: tokenising a batch in FTS5 at
    once is much faster than per document in Python)."""

    id: str
    body: str     # the text
    context: str  # the previous turn
    owner: str    # its scope's tokens (bm25.scope_tokens), separated by spaces


@dataclass(frozen=True)
class LexicalChanges:
    """What changed in a store's lexical documents after position `since`, up to `position`.

    `whole`: `documents` is every document there is as of `position` (asked for with `since`
    -1, or the log could not be followed from `since`); else `changed` names each memory whose
    document changed (added, re-indexed, unindexed, erased) and `documents` holds the current
    document of those that still have one."""

    since: int
    position: int
    changed: Sequence[str] = ()
    documents: Iterable[LexicalDocument | LexicalText] = ()  # read once (a whole set may
    # come in batches)
    whole: bool = False


class LexicalFollower:
    """A `Lexicon` kept exact by `LexicalChanges`. Its `lock` guards it: hold it to apply
    changes and to search."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.lock = threading.Lock()
        self.lexicon: Lexicon | None = None
        self._tokenizer = tokenizer  # the query terms' (shared: the store's)
        self._rids: dict[str, int] = {}  # a memory's document number in the lexicon

    @property
    def position(self) -> int:
        """The position its lexicon is exact as of; -1: it has none."""
        return -1 if self.lexicon is None else self.lexicon.version

    @property
    def size(self) -> int:
        """Live documents held."""
        return 0 if self.lexicon is None else self.lexicon.count

    def stale(self) -> bool:
        """Mostly dead documents: better built again (it stays exact meanwhile)."""
        return self.lexicon is not None and self.lexicon.dead_share() > MAX_DEAD

    def apply(self, changes: LexicalChanges) -> Lexicon | None:
        """Bring the lexicon to `changes.position` (or leave it where it is if it is already
        there or past it); None when these changes cannot: they start past what it holds (it has
        none, or it was built again meanwhile from older ones). Call with `lock` held."""
        lex = self.lexicon
        if lex is not None and lex.version >= changes.position:
            return lex  # as new or newer (another search applied these, or later ones)
        if changes.whole:
            self.drop()
            lex = self.lexicon = Lexicon(self._tokenizer)
            self._rids = {}
        elif lex is None or lex.version < changes.since:
            return None
        else:
            # a re-read of a change already applied (lex.version > since) is the same document
            lex.remove([self._rids[i] for i in changes.changed if i in self._rids])
        rids = self._rids
        documents = iter(changes.documents)
        while batch := list(islice(documents, BATCH)):
            texts = [(rids.setdefault(d.id, len(rids)), d.id, d.body, d.context, d.owner)
                     for d in batch if isinstance(d, LexicalText)]
            tokens = [(rids.setdefault(d.id, len(rids)), d.id, d.body, d.context, d.scope)
                      for d in batch if isinstance(d, LexicalDocument)]
            if texts:
                lex.add(texts, merge=False)
            if tokens:
                lex.add_tokens(tokens, merge=False)
        lex.merge()
        lex.version = changes.position
        return lex

    def hold(self, lexicon: Lexicon) -> None:
        """Follow `lexicon` from its position: one this class built (its documents numbered
        by memory), saved and loaded again. Call with `lock` held."""
        self.drop()
        self.lexicon = lexicon
        self._rids = dict(zip(lexicon.ids, lexicon.rids[:lexicon.n].tolist(), strict=True))

    def take(self, other: LexicalFollower) -> bool:
        """Hold `other`'s lexicon (built aside, while searches used this one) unless this one
        is as new; the one not kept is dropped. Call with `lock` held."""
        if self.lexicon is not None and self.lexicon.version >= other.position:
            other.drop()
            return False
        self.drop()
        self.lexicon, self._rids = other.lexicon, other._rids
        other.lexicon, other._rids = None, {}
        return True

    def drop(self) -> None:
        """Forget the lexicon (its memory, its words). Call with `lock` held."""
        if self.lexicon is not None:
            self.lexicon.close()
        self.lexicon = None
        self._rids = {}

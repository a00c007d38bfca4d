"""The PostgreSQL store's in-process lexicons: one per tenant of more than `threshold`
documents, each a `LexicalFollower` (index/follow.py) kept exact by the tenant's change log
(schema.py 0010), read in the search's first round trip.

A tenant's lexicon is built on a helper thread the first time a search of it finds none (SQL
BM25 answers meanwhile, with the same scores), and again when the log cannot be followed
(pruned past it), after an erasure (the erased words leave the process at once: it is
dropped on sight), or when it is mostly dead. Tiny tenants stay on SQL: the BM25 statement's
time grows with the tenant's rows it scans, few there, while a tiny lexicon is mostly its
vocabulary (10,000 such tenants would each hold one for little gain). The lexicons of all
tenants together hold at most `rows` documents; the least recently searched go first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ...model import Scope
from ...threads import Threads
from .. import bm25
from ..index.follow import LexicalChanges, LexicalDocument, LexicalFollower

log = logging.getLogger("engram.store")

SMALL_RECHECK_S = 60.0  # a tenant found small is counted again after this long
# Every document of a tenant, or None if it is small: read while the block runs (in batches)
Source = Callable[[], AbstractContextManager[LexicalChanges | None]]


class Lexicons:
    """The followers of a process's tenants (shared by a store's `for_tenant` copies)."""

    def __init__(self, tokenizer: bm25.Tokenizer, threshold: int, rows: int) -> None:
        self.threshold = threshold
        self.rows = rows
        self._tokenizer = tokenizer
        self._followers: OrderedDict[str, LexicalFollower] = OrderedDict()
        self._lock = threading.Lock()
        self._building: set[str] = set()
        self._small: dict[str, float] = {}  # tenant: when to count its documents again
        self._scopes: dict[tuple[str | None, ...], list[str]] = {}
        self._builds = Threads(1, "engram-pg-lexicon")
        self._pid = os.getpid()

    def _forked(self) -> None:
        """A forked child starts with no lexicon: a parent's thread may have held a lock (its
        lock, a follower's) at the fork, and would never release it here."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._followers = OrderedDict()
            self._building = set()

    def wait(self) -> None:
        """Until the builds started so far are done."""
        self._builds.drain()

    def close(self) -> None:
        self._builds.close()
        with self._lock:
            followers, self._followers = list(self._followers.values()), OrderedDict()
        for f in followers:
            with f.lock:
                f.drop()

    # -- which tenants have one ------------------------------------------------------------------

    def ready(self, tenant: str, build: Source) -> LexicalFollower | None:
        """The tenant's follower if it holds a lexicon; else None (SQL answers), after starting
        its build (`build`: every document, or None if the tenant is small) unless one runs or
        the tenant was found small lately."""
        self._forked()
        with self._lock:
            f = self._followers.get(tenant)
            if f is not None:
                self._followers.move_to_end(tenant)
                if f.lexicon is not None:
                    return f
            elif self._small.get(tenant, 0.0) > time.monotonic():
                return None
        self.rebuild(tenant, build)
        return None

    def rebuild(self, tenant: str, build: Source) -> None:
        """Build the tenant's lexicon on the helper thread (once at a time)."""
        with self._lock:
            if tenant in self._building:
                return
            self._building.add(tenant)
        if self._builds.submit(self.build, tenant, build) is None:  # closing
            with self._lock:
                self._building.discard(tenant)

    def build(self, tenant: str, build: Source) -> bool:
        """Build the tenant's lexicon now: True once it holds one, False if it is small."""
        try:
            with build() as changes:
                if changes is None:
                    with self._lock:
                        self._small[tenant] = time.monotonic() + SMALL_RECHECK_S
                        if len(self._small) > 100_000:
                            self._small.clear()
                    return False
                with self._lock:
                    f = self._followers.setdefault(tenant, LexicalFollower(self._tokenizer))
                # built aside, then swapped in: searches of the old one do not wait for it
                fresh = LexicalFollower(self._tokenizer)
                fresh.apply(changes)
            with f.lock:
                if f.take(fresh):
                    log.info("built the lexicon of tenant %r over %d documents", tenant, f.size)
            self._evict(tenant)
            return True
        except Exception:
            log.warning("building the lexicon of tenant %r failed; SQL answers", tenant,
                        exc_info=True)
            return False
        finally:
            with self._lock:
                self._building.discard(tenant)

    def _evict(self, keep: str) -> None:
        """The least recently searched tenants' lexicons go while they hold more than `rows`."""
        with self._lock:
            total = sum(f.size for f in self._followers.values())
            gone = []
            for tenant, f in list(self._followers.items()):
                if total <= self.rows:
                    break
                if tenant == keep:
                    continue
                total -= f.size
                gone.append(self._followers.pop(tenant))
        for f in gone:
            with f.lock:
                f.drop()

    def forget(self, tenant: str) -> None:
        """Drop the tenant's lexicon now (an erasure: its words leave the process)."""
        with self._lock:
            f = self._followers.pop(tenant, None)
        if f is not None:
            with f.lock:
                f.drop()

    # -- reading the log ---------------------------------------------------------------------------

    def document(self, row: Sequence[Any]) -> LexicalDocument:
        """A document from (id, lex_body, lex_context, user_id, agent_id, session_id)."""
        mid, body, context, *scope = row
        key = tuple(scope)
        tokens = self._scopes.get(key)
        if tokens is None:
            # as the SQLite index keeps them, and as `Lexicon.in_scope` reads a query's
            tokens = [t for o in bm25.scope_tokens(Scope(*scope)) for t in self._tokenizer.phrase(o)]
            if len(self._scopes) > 4096:
                self._scopes.clear()
            self._scopes[key] = tokens
        return LexicalDocument(mid, bm25.untagged(body), bm25.untagged(context), tokens)

    def changes(self, since: int, rows: Sequence[Sequence[Any]]) -> LexicalChanges | None:
        """The rows of `sql.lex_changes(tenant, since)` as changes; None if they cannot be
        followed from `since` (pruned past it, an erasure, or a log that went back)."""
        top, horizon = rows[0][0] or 0, rows[0][1] or 0
        if horizon > since or top < since or any(row[4] for row in rows):
            return None
        entries = [row for row in rows if row[2] is not None]
        if not entries:
            return LexicalChanges(since, since)
        current = {row[5]: row[5:] for row in entries if row[5] is not None}
        return LexicalChanges(since, entries[-1][2],
                              changed=list(dict.fromkeys(row[3] for row in entries)),
                              documents=[self.document(d) for d in current.values()])

    def whole(self, rows: Iterable[Sequence[Any]]) -> LexicalChanges:
        """The rows of `sql.lex_documents(tenant)` as every document (read as they are
        iterated: a cursor's, in batches)."""
        rows = iter(rows)
        first = next(rows)

        def documents() -> Iterator[LexicalDocument]:
            if first[1] is not None:  # else the tenant has none
                yield self.document(first[1:])
            for row in rows:
                yield self.document(row[1:])
        return LexicalChanges(-1, first[0], documents=documents(), whole=True)

    def terms(self, terms: Sequence[str]) -> list[str]:
        """The query terms the SQL statement scores too (a token over 1 KB matches nothing)."""
        return [t for t in terms if all(bm25.fits(x) for x in self._tokenizer.phrase(t))]

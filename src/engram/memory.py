"""The facade: `Memory` (sync) and `AsyncMemory` (the same methods as coroutines).

Every face (CLI, service, adapters) calls these methods. Validation happens first; then the
embedder runs outside any transaction; then one store transaction writes the rows and their
events. `AsyncMemory` runs the very same code in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .config import Config
from .errors import EngramError, InvalidImport, InvalidInput, NotFound
from .filters import parse_filters
from .model import (
    AddResult,
    Event,
    EventType,
    Hit,
    Kind,
    MemoryRecord,
    Message,
    Page,
    Scope,
    as_utc,
    new_id,
    utcnow,
)
from .pipeline import consolidate, forget
from .pipeline.retrieve import RetrievalConfig, fuse, get_preset, rank
from .pipeline.text import content_hash, terms
from .providers.embedders import Embedder, get_embedder
from .store import Key, Lexical, Query, Stats, Store, open_store

log = logging.getLogger("engram.memory")
T = TypeVar("T")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


# Aliases: inside the classes below, `list` names the method.
Hits = list[Hit]
Events = list[Event]

UNSET: Any = _Unset()  # "not given", as opposed to an explicit None
MAX_ID_CHARS = 256
MAX_LIMIT = 1000
WINDOW = 3  # turns in an episode's `window` key: itself and the two before it
EXPORT_FORMAT = "engram-export"
EXPORT_VERSION = 1


class Memory:
    """Long-term memory for an agent, on the embedded default (one SQLite file)."""

    def __init__(self, path: str | Path | None = None, *, config: Config | None = None,
                 embedder: Embedder | None = None, store: Store | None = None,
                 retrieval: str | RetrievalConfig | None = None,
                 tenant: str | None = None) -> None:
        """`tenant` isolates a service tenant's data (see `store.open_store`); libraries and
        single-user apps leave it None."""
        self.config = config or Config.from_env(path=path)
        if self.config.log_level:
            _configure_logging(self.config.log_level)
        if tenant is not None:
            _id(tenant, "tenant")
        self.tenant = tenant
        self.store: Store = store or open_store(self.config, tenant)
        self.embedder = embedder or get_embedder(self.config.embedder)
        preset = retrieval or self.config.retrieval
        self.retrieval = get_preset(preset) if isinstance(preset, str) else preset

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Memory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- write -------------------------------------------------------------------------------

    def add(self, messages: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]], *,
            user_id: str | None = None, agent_id: str | None = None,
            session_id: str | None = None, metadata: Mapping[str, Any] | None = None,
            observed_at: datetime | None = None, infer: bool = True, kind: str | Kind | None = None,
            importance: float | None = None, expires_at: datetime | None = None) -> AddResult:
        """Store messages (episodes) or facts (`kind="semantic"` / `"procedural"`).

        With no LLM configured, `infer=True` and `infer=False` both store each message as given;
        facts are consolidated (exact duplicates add nothing, near-duplicates merge).
        """
        scope = _scope(user_id, agent_id, session_id)
        the_kind = _kind(kind) or Kind.EPISODIC
        base_meta = _metadata(metadata)
        when = _time(observed_at, "observed_at")
        expiry = _time(expires_at, "expires_at")
        weight = _importance(importance)
        if not isinstance(infer, bool):
            raise InvalidInput("infer must be a bool")
        msgs = [self._message(m) for m in _as_list(messages)]
        now = utcnow()
        records = [self._record(m, scope, the_kind, base_meta, when, weight, expiry, now)
                   for m in msgs]

        # Embed before the transaction: the write lock is held for milliseconds, not model time.
        index = self._index(records)
        with self.store.write() as tx:
            # Reads first (neighbours for consolidation), writes after.
            neighbours = {r.id: self._neighbours(r, index[r.id][0][0].vector, now)
                          for r in records if r.kind is not Kind.EPISODIC}
            stored: list[MemoryRecord] = []
            events: list[Event] = []
            batch: list[tuple[MemoryRecord, np.ndarray]] = []
            for rec in records:
                vec = index[rec.id][0][0].vector
                earlier = [(r, float(np.dot(vec, v))) for r, v in batch]
                decision = consolidate.decide(
                    rec, [*neighbours.get(rec.id, []), *earlier],
                    threshold=self.config.dedupe_threshold,
                    min_overlap=self.config.dedupe_min_overlap)
                if decision.action == "NOOP":
                    assert decision.target is not None
                    stored.append(decision.target)
                    log.info("noop %s: %s", decision.target.id, decision.reason)
                    continue
                if decision.action == "MERGE":
                    assert decision.target is not None
                    target = next((r for r, _ in batch if r.id == decision.target.id),
                                  decision.target)
                    merged = consolidate.merge(target, rec, now)
                    # The merged text is one of the two, already embedded: no model call here.
                    tx.update(merged, *(index[rec.id] if merged.text == rec.text else (None, None)))
                    ev = _event(EventType.MERGE, merged, now, before=target, after=merged,
                                reason=decision.reason)
                    batch = [(merged, v) if r.id == merged.id else (r, v) for r, v in batch]
                    stored = [merged if r.id == merged.id else r for r in stored]
                    if merged.id not in {r.id for r in stored}:
                        stored.append(merged)
                    log.info("merged into %s: %s", merged.id, decision.reason)
                else:
                    tx.insert(rec, *index[rec.id])
                    ev = _event(EventType.ADD, rec, now, after=rec, reason=decision.reason)
                    batch.append((rec, vec))
                    stored.append(rec)
                    log.info("added %s %s in %s", rec.kind.value, rec.id, scope)
                tx.append(ev)
                events.append(ev)
            events += self._evict(tx, scope, now)
        return AddResult(memories=stored, events=events)

    def _message(self, m: str | Mapping[str, Any]) -> Message:
        if isinstance(m, str):
            return Message(content=self._text(m))
        if not isinstance(m, Mapping):
            raise InvalidInput(f"a message must be a string or a mapping, not {type(m).__name__}")
        unknown = set(m) - {"role", "content", "name", "observed_at", "metadata"}
        if unknown:
            raise InvalidInput(f"unknown message fields: {sorted(unknown)}")
        if "content" not in m:
            raise InvalidInput("a message needs a 'content'")
        role = m.get("role", "user")
        if not isinstance(role, str) or not role:
            raise InvalidInput("a message 'role' must be a non-empty string")
        name = m.get("name")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise InvalidInput("a message 'name' must be a non-empty string")
        _utf8(role, "a message 'role'")
        if name is not None:
            _utf8(name, "a message 'name'")
        return Message(content=self._text(m["content"]), role=role, name=name,
                       observed_at=_time(m.get("observed_at"), "observed_at"),
                       metadata=_metadata(m.get("metadata")))

    def _text(self, text: Any) -> str:
        if not isinstance(text, str):
            raise InvalidInput(f"text must be a string, not {type(text).__name__}")
        if not text.strip():
            raise InvalidInput("text is empty")
        if len(text) > self.config.max_text_chars:
            raise InvalidInput(f"text has {len(text)} characters; the limit is "
                               f"{self.config.max_text_chars} (ENGRAM_MAX_TEXT_CHARS)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidInput(f"text is not valid unicode: {exc.reason}") from exc
        return text

    def _record(self, m: Message, scope: Scope, kind: Kind, meta: dict[str, Any],
                when: datetime | None, importance: float, expires_at: datetime | None,
                now: datetime) -> MemoryRecord:
        observed = m.observed_at or when
        return MemoryRecord(
            id=new_id(), scope=scope, kind=kind, text=m.content,
            metadata={**meta, **m.metadata}, importance=importance, role=m.role, name=m.name,
            created_at=now, updated_at=now, observed_at=observed, valid_from=observed or now,
            expires_at=expires_at, content_hash=content_hash(m.content),
        )

    def _index(self, records: Sequence[MemoryRecord],
               history: dict[Scope, list[MemoryRecord]] | None = None,
               ) -> dict[str, tuple[list[Key], Lexical]]:
        """How each memory is found: its retrieval keys and its lexical document.

        An episode is indexed with its conversational context, because a turn is often
        understood only with the turns before it ("Yes, since 2019!"): a `window` key embeds
        the turn with the two before it in the same scope, and the lexical index holds the
        previous turn as a lower-weighted column. A fact stands alone: its window is itself.
        """
        texts: list[str] = []
        plan: dict[str, tuple[int, int, Lexical]] = {}  # id -> text row, window row, lexical
        history = {} if history is None else history  # the last turns seen, per scope
        for rec in records:
            own = _speaker_text(rec)
            texts.append(own)
            if rec.kind is not Kind.EPISODIC:
                plan[rec.id] = (len(texts) - 1, len(texts) - 1, Lexical(own))
                continue
            if rec.scope not in history:
                history[rec.scope] = self.store.recent_episodes(rec.scope, WINDOW - 1)[::-1]
            before = [r for r in history[rec.scope] if r.id != rec.id][-(WINDOW - 1):]
            texts.append("\n".join([*map(_speaker_text, before), own]))
            plan[rec.id] = (len(texts) - 2, len(texts) - 1,
                            Lexical(own, _speaker_text(before[-1]) if before else ""))
            history[rec.scope] = [*before, rec]
        vectors = self.embedder.embed_batch(texts)
        return {mid: ([Key("text", vectors[t]), Key("window", vectors[w])], lex)
                for mid, (t, w, lex) in plan.items()}

    def _reindex_followers(self, rec: MemoryRecord, replacement: MemoryRecord | None,
                           ) -> list[tuple[MemoryRecord, tuple[list[Key], Lexical]]]:
        """The episodes whose index holds `rec` as context, re-indexed without it (or with
        `replacement`): so a deleted, erased or edited turn leaves no trace in its neighbours."""
        if rec.kind is not Kind.EPISODIC:
            return []
        before, after = self.store.episodes_around(rec.id, WINDOW - 1)
        if not after:
            return []
        history = {rec.scope: [*before, *([replacement] if replacement else [])]}
        index = self._index(after, history)
        return [(r, index[r.id]) for r in after]

    def _neighbours(self, rec: MemoryRecord, vec: np.ndarray,
                    now: datetime) -> list[tuple[MemoryRecord, float]]:
        """Existing memories of the same scope and kind that may repeat `rec`, with cosines."""
        same = self.store.find_hash(rec.scope, rec.kind, rec.content_hash, now)
        if same is not None:
            return [(same, 1.0)]
        found = self.store.dense(Query(scope=rec.scope, now=now, kinds=(rec.kind,)), vec, 5)
        records = self.store.get([mid for mid, _ in found])
        return [(records[mid], sim) for mid, sim in found if records[mid].scope == rec.scope]

    def _evict(self, tx: Any, scope: Scope, now: datetime) -> Events:
        cap = self.config.max_memories_per_scope
        if cap is None:
            return []
        victims = forget.to_evict(self.store.eviction_pool(scope, now), cap, now)
        if not victims:
            return []
        tx.soft_delete([v.id for v in victims], now)
        events = []
        for v in victims:
            ev = _event(EventType.DELETE, v, now, before=v,
                        reason=f"evicted: scope over capacity {cap}, "
                               f"retention {forget.retention(v, now):.3f}")
            tx.append(ev)
            events.append(ev)
            log.info("evicted %s (%s)", v.id, ev.reason)
        return events

    def update(self, id: str, *, text: str | None = UNSET, metadata: Mapping[str, Any] | None = UNSET,
               importance: float = UNSET, expires_at: datetime | None = UNSET) -> MemoryRecord:
        """Change a memory in place; the UPDATE event keeps the before and after."""
        before = self.get(id)
        changes: dict[str, Any] = {}
        if text is not UNSET:
            changes["text"] = self._text(text)
            changes["content_hash"] = content_hash(changes["text"])
        if metadata is not UNSET:
            changes["metadata"] = _metadata(metadata)
        if importance is not UNSET:
            changes["importance"] = _importance(importance)
        if expires_at is not UNSET:
            changes["expires_at"] = _time(expires_at, "expires_at")
        if not changes:
            raise InvalidInput("update needs at least one of text, metadata, importance, expires_at")
        now = utcnow()
        after = replace(before, **changes, updated_at=now)
        index, followers = None, []
        if "text" in changes:
            prior, _ = self.store.episodes_around(before.id, WINDOW - 1)  # its own context
            index = self._index([after], {after.scope: prior})[after.id]
            followers = self._reindex_followers(before, after)
        with self.store.write() as tx:
            if self._visible(before.id, now) is None:  # deleted meanwhile by another writer
                raise NotFound(f"no memory with id {id!r}")
            tx.update(after, *(index or (None, None)))
            for rec, (keys, lexical) in followers:
                tx.update(rec, keys, lexical)
            tx.append(_event(EventType.UPDATE, after, now, before=before, after=after))
        log.info("updated %s: %s", id, sorted(changes))
        return after

    def delete(self, id: str) -> None:
        """Soft delete: hidden from every read, kept in the history."""
        rec = self.get(id)
        now = utcnow()
        followers = self._reindex_followers(rec, None)
        with self.store.write() as tx:
            tx.soft_delete([rec.id], now)
            for other, (keys, lexical) in followers:
                tx.update(other, keys, lexical)
            tx.append(_event(EventType.DELETE, rec, now, before=rec, reason="deleted by caller"))
        log.info("deleted %s", id)

    def erase(self, *, id: str | None = None, user_id: str | None = None,
              agent_id: str | None = None, session_id: str | None = None) -> int:
        """Hard delete of one memory or a whole scope: rows, vectors, index, history text.

        Returns how many memories were erased. The freed bytes are overwritten (secure_delete)
        and checkpointed out of the write-ahead log.
        """
        scope = _scope(user_id, agent_id, session_id)
        if id is None and scope.is_empty():
            raise InvalidInput("erase needs an id or at least one of user_id, agent_id, session_id")
        if id is not None:
            _id(id)
            found = self.store.get([id]).get(id)
            if found is None or not _in_scope(found.scope, scope):
                raise NotFound(f"no memory with id {id!r}")
            ids = [id]
            scope = found.scope
            followers = self._reindex_followers(found, None)
        else:
            # A whole scope goes: every episode's context lies within its own scope, so no
            # surviving memory holds an erased turn.
            ids = self.store.ids(scope, include_deleted=True)
            followers = []
        now = utcnow()
        with self.store.write() as tx:
            tx.erase(ids)
            for other, (keys, lexical) in followers:
                tx.update(other, keys, lexical)
            tx.append(Event(id=new_id(), memory_id=id, type=EventType.ERASE, at=now, scope=scope,
                            reason=f"erased {len(ids)} memories"))
        self.store.reclaim()
        log.info("erased %d memories (%s)", len(ids), f"id {id}" if id else scope)
        return len(ids)

    # -- read --------------------------------------------------------------------------------

    def _visible(self, id: str, now: datetime) -> MemoryRecord | None:
        rec = self.store.get([id]).get(id)
        if rec is None or rec.deleted_at is not None:
            return None
        if rec.expires_at is not None and rec.expires_at <= now:
            return None
        return rec

    def get(self, id: str) -> MemoryRecord:
        """A memory by id (superseded ones too); NotFound if unknown, deleted or expired."""
        _id(id)
        rec = self._visible(id, utcnow())
        if rec is None:
            raise NotFound(f"no memory with id {id!r}")
        return rec

    def list(self, *, user_id: str | None = None, agent_id: str | None = None,
             session_id: str | None = None, filters: Mapping[str, Any] | None = None,
             kinds: Iterable[str | Kind] | None = None, as_of: datetime | None = None,
             cursor: str | None = None, limit: int = 50) -> Page:
        """Visible memories in creation order, one page at a time."""
        query = self._query(user_id, agent_id, session_id, filters, kinds, as_of)
        limit = _limit(limit)
        if cursor is not None and (not isinstance(cursor, str) or len(cursor) > MAX_ID_CHARS):
            raise InvalidInput("cursor must be the next_cursor of a previous page")
        items = self.store.select(query, after_id=cursor, limit=limit + 1)
        more = len(items) > limit
        items = items[:limit]
        return Page(items=items, next_cursor=items[-1].id if more else None)

    def search(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
               session_id: str | None = None, filters: Mapping[str, Any] | None = None,
               limit: int = 10, kinds: Iterable[str | Kind] | None = None,
               as_of: datetime | None = None) -> Hits:
        """Hybrid search: dense + lexical candidates, fused, adjusted; each hit explains itself."""
        text = self._text(query)
        q = self._query(user_id, agent_id, session_id, filters, kinds, as_of)
        limit = _limit(limit)
        cfg = self.retrieval
        n = max(cfg.candidates, limit)
        # Candidates per retriever, then fused and ranked on light rows; full records only for
        # the hits returned.
        ranked: dict[str, list[tuple[str, float]]] = {}
        if cfg.dense_weight or cfg.window_weight:
            vector = self.embedder.embed_batch([text])[0]
            for label, key, w in (("dense", "text", cfg.dense_weight),
                                  ("window", "window", cfg.window_weight)):
                if w:
                    ranked[label] = self.store.dense(q, vector, n, key=key)
        if cfg.lexical_weight:
            ranked["lexical"] = self.store.lexical(q, terms(text), n, cfg.context_weight)
        fused = fuse(ranked, {"dense": cfg.dense_weight, "window": cfg.window_weight,
                              "lexical": cfg.lexical_weight}, cfg)
        best = rank(fused, self.store.candidates(list(fused)), text, cfg, q.as_of or q.now)[:limit]
        records = self.store.get([mid for mid, _, _ in best])
        hits = [Hit(records[mid], score, explain) for mid, score, explain in best]
        self.store.touch([h.memory.id for h in hits], q.now)
        if log.isEnabledFor(logging.DEBUG):
            for h in hits:
                log.debug("search %r -> %s %.3f %s", text[:80], h.memory.id, h.score, h.explain)
        return hits

    def history(self, id: str) -> Events:
        """Every event of a memory, oldest first (also for deleted and erased ids)."""
        _id(id)
        events = self.store.events(id)
        if not events and not self.store.get([id]):
            raise NotFound(f"no memory with id {id!r}")
        return events

    def stats(self, *, user_id: str | None = None, agent_id: str | None = None,
              session_id: str | None = None) -> Stats:
        return self.store.stats(_scope(user_id, agent_id, session_id), utcnow())

    def _query(self, user_id: str | None, agent_id: str | None, session_id: str | None,
               filters: Mapping[str, Any] | None, kinds: Iterable[str | Kind] | None,
               as_of: datetime | None) -> Query:
        if kinds is not None and isinstance(kinds, str | Kind):
            kinds = [kinds]
        the_kinds = tuple(_kind(k) for k in kinds) if kinds is not None else None
        return Query(scope=_scope(user_id, agent_id, session_id), now=utcnow(),
                     kinds=the_kinds or None,  # type: ignore[arg-type]
                     conditions=parse_filters(filters), as_of=_time(as_of, "as_of"))

    # -- working memory: sessions and context (see working/ and context.py) -------------------

    # -- export / import ---------------------------------------------------------------------

    def export(self, path: str | Path, *, user_id: str | None = None,
               agent_id: str | None = None, session_id: str | None = None) -> int:
        """Write a scope (every memory, deleted and superseded too, with history) as JSON lines."""
        scope = _scope(user_id, agent_id, session_id)
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        count = 0
        with tmp.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"format": EXPORT_FORMAT, "version": EXPORT_VERSION,
                                "exported_at": utcnow().isoformat(),
                                "scope": scope.as_dict()}) + "\n")
            for rec, events in self.store.iter_export(scope):
                f.write(json.dumps({"memory": rec.to_dict(),
                                    "events": [e.to_dict() for e in events]},
                                   ensure_ascii=False) + "\n")
                count += 1
        tmp.replace(path)  # never leave a half-written export under the real name
        return count

    def import_(self, path: str | Path,
                progress: Callable[[int, int], None] | None = None) -> int:
        """Read an export back. All or nothing: the whole file is validated before any write.

        Memories whose id already exists are skipped. Returns how many were imported.
        """
        items = _read_export(Path(path))
        existing = self.store.get([rec.id for rec, _ in items])
        todo = [(rec, events) for rec, events in items if rec.id not in existing]
        index: dict[str, tuple[list[Key], Lexical]] = {}
        history: dict[Scope, list[MemoryRecord]] = {}
        for i in range(0, len(todo), 256):
            index.update(self._index([rec for rec, _ in todo[i:i + 256]], history))
            if progress:
                progress(min(i + 256, len(todo)), len(todo))
        with self.store.write() as tx:
            for rec, events in todo:
                tx.insert(rec, *index[rec.id])
                if rec.deleted_at is not None:
                    tx.soft_delete([rec.id], rec.deleted_at)
                for ev in events:
                    tx.append(ev)
        log.info("imported %d memories from %s (%d already present)",
                 len(todo), path, len(items) - len(todo))
        return len(todo)


class AsyncMemory:
    """`Memory` with coroutine methods. The same implementation runs in a worker thread."""

    def __init__(self, path: str | Path | None = None, **kwargs: Any) -> None:
        self.sync = Memory(path, **kwargs)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def add(self, messages: Any, **kwargs: Any) -> AddResult:
        return await self._run(self.sync.add, messages, **kwargs)

    async def search(self, query: str, **kwargs: Any) -> Hits:
        return await self._run(self.sync.search, query, **kwargs)

    async def get(self, id: str) -> MemoryRecord:
        return await self._run(self.sync.get, id)

    async def list(self, **kwargs: Any) -> Page:
        return await self._run(self.sync.list, **kwargs)

    async def update(self, id: str, **kwargs: Any) -> MemoryRecord:
        return await self._run(self.sync.update, id, **kwargs)

    async def delete(self, id: str) -> None:
        return await self._run(self.sync.delete, id)

    async def erase(self, **kwargs: Any) -> int:
        return await self._run(self.sync.erase, **kwargs)

    async def history(self, id: str) -> Events:
        return await self._run(self.sync.history, id)

    async def stats(self, **kwargs: Any) -> Stats:
        return await self._run(self.sync.stats, **kwargs)

    async def export(self, path: str | Path, **kwargs: Any) -> int:
        return await self._run(self.sync.export, path, **kwargs)

    async def import_(self, path: str | Path, **kwargs: Any) -> int:
        return await self._run(self.sync.import_, path, **kwargs)

    async def close(self) -> None:
        await self._run(self.sync.close)

    async def __aenter__(self) -> AsyncMemory:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _configure_logging(level: str) -> None:
    """ENGRAM_LOG_LEVEL opts in to engram's logs on stderr (the library is quiet otherwise)."""
    logger = logging.getLogger("engram")
    try:
        logger.setLevel(level.upper())
    except ValueError:
        raise InvalidInput(f"ENGRAM_LOG_LEVEL={level!r} is not a logging level") from None
    if not any(getattr(h, "engram", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        handler.engram = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


# -- validation helpers (pure) -----------------------------------------------------------------

def _id(value: Any, what: str = "id") -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise InvalidInput(f"{what} must be a non-empty string of at most {MAX_ID_CHARS} characters")
    return _utf8(value, what)


def _utf8(value: str, what: str) -> str:
    """Refuse lone surrogates: valid Python strings that no database or model can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{what} is not valid unicode: {exc.reason}") from None
    return value


def _scope(user_id: Any, agent_id: Any, session_id: Any) -> Scope:
    for name, value in (("user_id", user_id), ("agent_id", agent_id), ("session_id", session_id)):
        if value is not None:
            _id(value, name)
    return Scope(user_id, agent_id, session_id)


def _in_scope(rec: Scope, wanted: Scope) -> bool:
    return all(w is None or w == r for w, r in zip(wanted.as_dict().values(), rec.as_dict().values(),
                                                   strict=True))


def _kind(kind: Any) -> Kind | None:
    if kind is None:
        return None
    try:
        return Kind(kind)
    except ValueError:
        raise InvalidInput(f"kind must be one of {[k.value for k in Kind]}, not {kind!r}") from None


def _metadata(meta: Any) -> dict[str, Any]:
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise InvalidInput(f"metadata must be a mapping, not {type(meta).__name__}")
    if not all(isinstance(k, str) for k in meta):
        raise InvalidInput("metadata keys must be strings")
    try:
        encoded = json.dumps(dict(meta), allow_nan=False, ensure_ascii=False)
        encoded.encode("utf-8")  # lone surrogates pass json.dumps but not the database
        return json.loads(encoded)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"metadata must be JSON-serialisable: {exc}") from exc


def _time(value: Any, name: str) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidInput(f"{name} must be a datetime or ISO-8601 string") from None
    if not isinstance(value, datetime):
        raise InvalidInput(f"{name} must be a datetime or ISO-8601 string")
    try:
        value = as_utc(value)
        # Stores keep times as epoch seconds: refuse what cannot be read back as a datetime.
        datetime.fromtimestamp(value.timestamp(), UTC)
    except (OverflowError, ValueError, OSError):
        raise InvalidInput(f"{name} {value!r} is outside the supported range of times") from None
    return value


def _importance(value: Any) -> float:
    if value is None:
        return 0.5
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise InvalidInput("importance must be a number in [0, 1]")
    return float(value)


def _limit(limit: Any) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidInput(f"limit must be an integer in [1, {MAX_LIMIT}]")
    return limit


def _as_list(messages: Any) -> list[Any]:
    if isinstance(messages, str | Mapping):
        return [messages]
    if isinstance(messages, Sequence) and not isinstance(messages, bytes | bytearray):
        if not messages:
            raise InvalidInput("messages is empty")
        return list(messages)
    raise InvalidInput(f"messages must be a string, a mapping or a list of them, "
                       f"not {type(messages).__name__}")


def _speaker_text(rec: MemoryRecord) -> str:
    return f"{rec.name}: {rec.text}" if rec.name else rec.text


def _event(typ: EventType, rec: MemoryRecord, at: datetime, *, before: MemoryRecord | None = None,
           after: MemoryRecord | None = None, reason: str | None = None) -> Event:
    return Event(id=new_id(), memory_id=rec.id, type=typ, at=at, scope=rec.scope,
                 before=before.to_dict() if before else None,
                 after=after.to_dict() if after else None, reason=reason)


def _read_export(path: Path) -> list[tuple[MemoryRecord, list[Event]]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidImport(f"cannot read {path}: {exc}") from exc
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != EXPORT_FORMAT:
        raise InvalidImport(f"{path} is not an engram export (bad or missing header)")
    if header.get("version") != EXPORT_VERSION:
        raise InvalidImport(f"{path} has export version {header.get('version')!r}; "
                            f"this engram reads version {EXPORT_VERSION}")
    out = []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            out.append((_record_from_dict(item["memory"]),
                        [_event_from_dict(e) for e in item.get("events", [])]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, EngramError) as exc:
            raise InvalidImport(f"{path}:{n}: not a valid memory line ({exc})") from exc
    return out


def _record_from_dict(d: dict[str, Any]) -> MemoryRecord:
    times = {k: _time(d.get(k), k) for k in ("created_at", "updated_at", "observed_at",
                                             "valid_from", "valid_to", "last_accessed_at",
                                             "expires_at", "deleted_at")}
    if times["created_at"] is None or times["updated_at"] is None:
        raise ValueError("created_at and updated_at are required")
    text = d["text"]
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text must be a non-empty string")
    s = d["scope"]
    return MemoryRecord(
        id=_id(d["id"]), scope=_scope(s.get("user_id"), s.get("agent_id"), s.get("session_id")),
        kind=Kind(d["kind"]), text=text, metadata=_metadata(d.get("metadata")),
        importance=_importance(d.get("importance")), role=d.get("role"), name=d.get("name"),
        provenance=tuple(str(p) for p in d.get("provenance", [])),
        superseded_by=d.get("superseded_by"), access_count=int(d.get("access_count", 0)),
        content_hash=content_hash(text), **times,  # type: ignore[arg-type]
    )


def _event_from_dict(d: dict[str, Any]) -> Event:
    s = d.get("scope") or {}
    at = _time(d["at"], "at")
    assert at is not None
    return Event(id=_id(d["id"]), memory_id=d.get("memory_id"), type=EventType(d["type"]), at=at,
                 scope=_scope(s.get("user_id"), s.get("agent_id"), s.get("session_id")),
                 before=d.get("before"), after=d.get("after"), reason=d.get("reason"))

"""The write pipeline: messages -> records -> (learn) -> consolidate -> persist -> evict.

Model time (embedding, LLM) comes first, outside any transaction; then one store transaction
writes the rows and an event per decision. Also in-place edits (`update`) and soft `delete`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import numpy as np

from .. import redact as redaction
from .. import validate as valid
from ..errors import Conflict, InvalidInput, NotFound
from ..graph import entities
from ..model import (
    AddResult,
    Event,
    EventType,
    Job,
    JobStatus,
    Kind,
    MemoryRecord,
    Message,
    Scope,
    event,
    new_id,
    utcnow,
)
from ..store import Key, Query, Tx
from . import consolidate, forget, learn
from . import extract as extraction
from .engine import Engine
from .fence import Fence
from .index import followers, index, reindex
from .read import visible
from .text import content_hash

log = logging.getLogger("engram.memory")

NO_CHECK = "no contradiction check: {why}; pass supersedes=... to replace a fact"
BY_CALLER = "superseded by caller"


@dataclass(frozen=True)
class AddRequest:
    """A validated `add` call: what runs now, or what a background job stores and runs later."""

    messages: tuple[Message, ...]
    scope: Scope
    kind: Kind
    metadata: dict[str, Any]
    observed_at: datetime | None
    importance: float
    expires_at: datetime | None
    infer: bool
    supersedes: tuple[str, ...] = ()  # the ids the (one) new memory replaces
    # What redaction replaced (engram.redact; counts by type, never a value): in `metadata`,
    # and in each message's content and metadata. Empty when nothing was.
    redacted_metadata: dict[str, int] = field(default_factory=dict)
    redacted: tuple[dict[str, int], ...] = ()

    @classmethod
    def build(cls, messages: Any, scope: Scope, *, metadata: Any, observed_at: Any, infer: Any,
              kind: Any, importance: Any, expires_at: Any, max_text_chars: int,
              supersedes: Any = None,
              redact: redaction.Policy | str = redaction.Policy.SECRETS) -> AddRequest:
        """Caller input, validated whole before anything is written (InvalidInput), then
        redacted with the policy `redact` (pass `Config.redact`; the default is Config's
        default): what the request holds from here on (what runs now, and a background job's
        payload) never holds what was redacted."""
        valid.flag(infer, "infer")
        given = tuple(valid.message(m, max_text_chars) for m in valid.as_list(messages))
        replaced = valid.ids(supersedes, "supersedes")
        if replaced and len(given) != 1:
            raise InvalidInput(f"supersedes names what one new memory replaces; {len(given)} "
                               "messages were given")
        chosen = valid.kind(kind) or Kind.EPISODIC
        meta = valid.metadata(metadata)
        for m in given:  # a rule or pin given directly must pass the trust rules too
            extraction.check_direct(m.content, frozenset({m.role}), chosen, {**meta, **m.metadata})
        return cls(messages=given, scope=scope, kind=chosen,
                   metadata=meta,
                   observed_at=valid.moment(observed_at, "observed_at"),
                   importance=valid.importance(importance),
                   expires_at=valid.moment(expires_at, "expires_at"), infer=infer,
                   supersedes=replaced).with_policy(redact, max_text_chars)

    def with_policy(self, policy: redaction.Policy | str,
                    max_text_chars: int | None = None) -> AddRequest:
        """This request redacted with `policy`: each message's content and metadata and the
        request's metadata, the counts added to those already recorded. Idempotent: a request
        redacted once finds nothing more under the same policy (a worker applies its policy
        again to a job queued before redaction existed, or under a weaker policy). A text
        longer than `max_text_chars` once redacted is refused (InvalidInput)."""
        meta_counts: Counter[str] = Counter(self.redacted_metadata)
        meta = redaction.redact_value(self.metadata, policy, meta_counts)
        clean, counts = [], []
        for i, m in enumerate(self.messages):
            done = redaction.redact(m.content, policy)
            if max_text_chars is not None and len(done.text) > max_text_chars:
                raise InvalidInput(f"text has {len(done.text)} characters once redacted; the "
                                   f"limit is {max_text_chars} (ENGRAM_MAX_TEXT_CHARS)")
            found: Counter[str] = Counter(self.redacted[i] if self.redacted else {})
            found.update(done.counts)
            clean.append(replace(m, content=done.text,
                                 metadata=redaction.redact_value(m.metadata, policy, found)))
            counts.append(redaction.add_counts(found))
        return replace(self, messages=tuple(clean), metadata=meta,
                       redacted_metadata=redaction.add_counts(meta_counts),
                       redacted=tuple(counts) if any(counts) else ())

    def redactions(self, i: int) -> dict[str, int]:
        """What was redacted in the memory of message `i`: its content and metadata, and the
        request's metadata (which every memory of the request carries)."""
        own = self.redacted[i] if self.redacted else {}
        return redaction.add_counts(self.redacted_metadata, own)

    def redacted_total(self) -> dict[str, int]:
        """What was redacted in the whole request (the request's metadata counted once)."""
        return redaction.add_counts(self.redacted_metadata, *self.redacted)

    def start(self, now: datetime) -> datetime:
        """When the (first) new memory holds from: see `record`."""
        return self.messages[0].observed_at or self.observed_at or now

    def payload(self) -> dict[str, Any]:
        def t(value: datetime | None) -> str | None:
            return None if value is None else value.isoformat()
        return {
            "messages": [{"content": m.content, "role": m.role, "name": m.name,
                          "observed_at": t(m.observed_at), "metadata": dict(m.metadata)}
                         for m in self.messages],
            "scope": self.scope.as_dict(), "kind": self.kind.value, "metadata": self.metadata,
            "observed_at": t(self.observed_at), "importance": self.importance,
            "expires_at": t(self.expires_at), "infer": self.infer,
            # only when given: a request without it keeps the fingerprint it always had
            **({"supersedes": list(self.supersedes)} if self.supersedes else {}),
            **({"redacted": {"metadata": self.redacted_metadata,
                             "messages": list(self.redacted)}}
               if self.redacted_metadata or self.redacted else {}),
        }

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> AddRequest:
        s = d["scope"]
        return cls(
            messages=tuple(Message(content=m["content"], role=m["role"], name=m["name"],
                                   observed_at=valid.moment(m["observed_at"], "observed_at"),
                                   metadata=m["metadata"]) for m in d["messages"]),
            scope=Scope(s["user_id"], s["agent_id"], s["session_id"]), kind=Kind(d["kind"]),
            metadata=d["metadata"], observed_at=valid.moment(d["observed_at"], "observed_at"),
            importance=d["importance"], expires_at=valid.moment(d["expires_at"], "expires_at"),
            infer=d["infer"], supersedes=tuple(d.get("supersedes", ())),
            redacted_metadata=dict(d.get("redacted", {}).get("metadata", {})),
            redacted=tuple(dict(c) for c in d.get("redacted", {}).get("messages", ())))


def summary(result: AddResult) -> dict[str, Any]:
    """What a job row keeps of a result: ids and notes (the memories are in the store).
    `touched` names every memory an event is about: a SUPERSEDE event belongs to the closed
    memory, which is not one of the result's memories."""
    return {"memories": [m.id for m in result.memories], "events": [e.id for e in result.events],
            "touched": list(dict.fromkeys(e.memory_id for e in result.events if e.memory_id)),
            "notes": list(result.notes),
            **({"redacted": dict(result.redacted)} if result.redacted else {})}


def add(engine: Engine, req: AddRequest, *, job: Job | None = None,
        fence: Fence | None = None) -> AddResult:
    """Store the request's messages (episodes) or facts; with an LLM and `infer`, learn from
    the episodes, and check given facts against the known ones. `req.supersedes` closes the
    memories the new one replaces, in the same transaction. `job`, when given, is marked done
    with the result in the same transaction: a retried request finds either nothing or the
    whole result (a job a worker claimed: `fence.job`, whose row must still be there).

    An erasure of the scope committed after the add began (after `fence` was taken) makes it
    raise `Erased` with nothing written."""
    fence = fence or Fence.take(engine.store, req.scope)
    now = utcnow()
    records = [record(m, req, now) for m in req.messages]
    redacted = {r.id: req.redactions(i) for i, r in enumerate(records) if req.redactions(i)}
    keys = index(engine, records)
    notes: list[str] = []
    learned: list[learn.Learned] = []
    checked: dict[str, learn.Learned] = {}
    graph: list[entities.Staged] = []  # entities and relations the extraction returned
    if req.kind is Kind.EPISODIC:
        if req.infer:
            learned = learn.learn(engine, records, req.scope, extraction.EXTRACT, now, notes,
                                  graph)
    elif not req.supersedes:  # the caller said what the fact replaces: nothing to check
        if not req.infer:
            notes.append(NO_CHECK.format(why="infer=False"))
        elif engine.llm is None:
            notes.append(NO_CHECK.format(why="no LLM configured"))
        else:  # the same check as an extracted fact's (an exact repeat needs no model)
            fresh = [r for r in records
                     if engine.store.find_hash(r.scope, r.kind, r.content_hash, now) is None]
            checked = {item.record.id: item
                       for item in learn.consider(engine, fresh, keys, now, notes, redacted)}
    # A turn is also found by what was learned from it: each extracted fact becomes an
    # extra `fact` key of its source episodes.
    fact_keys: dict[str, list[Key]] = {}
    for item in learned:
        for source in item.record.provenance:
            fact_keys.setdefault(source, []).append(Key("fact", item.keys[0][0].vector))
    store = engine.store
    cfg = engine.config
    speakers = entities.prepare(engine, records)  # the knowledge graph: model time first
    with store.write() as tx:
        fence.hold(tx)  # first: nothing below runs if the scope was erased meanwhile
        # Reads first (neighbours for consolidation), writes after.
        near = {r.id: neighbours(engine, r, keys[r.id][0][0].vector, now)
                for r in records if r.kind is not Kind.EPISODIC and not req.supersedes}
        stored: list[MemoryRecord] = []
        events: list[Event] = []
        batch: list[tuple[MemoryRecord, np.ndarray]] = []
        # Checked here, in the transaction: a target deleted or superseded meanwhile by
        # another writer fails the whole add (nothing half-written).
        replaced = (superseded(engine, req, records[0].valid_from or now, now)
                    if req.supersedes else [])
        for rec in records:
            vec = keys[rec.id][0][0].vector
            earlier = [(r, float(np.dot(vec, v))) for r, v in batch]
            if replaced:  # a replacement is a new memory, even if it repeats a known one
                decision = consolidate.Decision("ADD", reason="supersedes "
                                                + ", ".join(t.id for t in replaced))
            else:
                decision = consolidate.decide(rec, [*near.get(rec.id, []), *earlier],
                                              threshold=cfg.dedupe_threshold,
                                              min_overlap=cfg.dedupe_min_overlap)
            if decision.action == "NOOP":
                assert decision.target is not None
                stored.append(decision.target)
                log.info("noop %s: %s", decision.target.id, decision.reason)
                continue
            if rec.id in checked:  # the LLM's plan (ADD, UPDATE, MERGE, NOOP or SUPERSEDE)
                done, written = learn.apply(engine, tx, [checked[rec.id]], now)
                stored += done
                events += written
                if any(r.id == rec.id for r in done):
                    batch.append((rec, vec))
                continue
            if decision.action == "MERGE":
                assert decision.target is not None
                target = next((r for r, _ in batch if r.id == decision.target.id), decision.target)
                merged = consolidate.merge(target, rec, now)
                # The merged text is one of the two, already embedded: no model call here.
                tx.update(merged, *(keys[rec.id] if merged.text == rec.text else (None, None)))
                ev = event(EventType.MERGE, merged, now, before=target, after=merged,
                           reason=redaction.noted(decision.reason, redacted.get(rec.id, {})))
                batch = [(merged, v) if r.id == merged.id else (r, v) for r, v in batch]
                stored = [merged if r.id == merged.id else r for r in stored]
                if merged.id not in {r.id for r in stored}:
                    stored.append(merged)
                log.info("merged into %s: %s", merged.id, decision.reason)
            else:
                reason = decision.reason
                if rec.kind is Kind.EPISODIC and notes:
                    reason = f"{reason}; {'; '.join(notes)}"  # the history says why no facts
                own, lexical = keys[rec.id]
                for target in replaced:  # closed exactly as an LLM's SUPERSEDE closes a fact
                    closed = replace(target, valid_to=rec.valid_from or now,
                                     superseded_by=rec.id, updated_at=now)
                    tx.update(closed)
                    closing = event(EventType.SUPERSEDE, closed, now, before=target,
                                    after=closed, reason=BY_CALLER)
                    tx.append(closing)
                    events.append(closing)
                    log.info("superseded %s by %s (caller)", target.id, rec.id)
                tx.insert(rec, [*own, *fact_keys.get(rec.id, [])], lexical)
                ev = event(EventType.ADD, rec, now, after=rec,
                           reason=redaction.noted(reason, redacted.get(rec.id, {})))
                batch.append((rec, vec))
                stored.append(rec)
                log.info("added %s %s in %s", rec.kind.value, rec.id, req.scope)
            tx.append(ev)
            events.append(ev)
        entities.link(engine, tx, [r for r in stored if r.kind is Kind.EPISODIC], speakers)
        facts, fact_events = learn.apply(engine, tx, learned, now)
        related = learn.apply_graph(engine, tx, graph)
        stored += facts
        events += fact_events
        events += evict(engine, tx, req.scope, now)
        total = redaction.add_counts(req.redacted_total(),
                                     *(item.redacted for item in learned))
        said = redaction.describe(total)
        result = AddResult(memories=stored, events=events,
                           notes=(said, *notes) if said else tuple(notes), redacted=total)
        if job is not None:
            finished = replace(job, status=JobStatus.DONE, result=summary(result), error=None,
                               updated_at=now, lease_until=None)
            if fence.job is not None:
                fence.finish(tx, finished)
            else:
                tx.put_job(finished)
    entities.summarize(engine, entities.ends(related), fence)  # graph_summaries="llm" only
    return result


def superseded(engine: Engine, req: AddRequest, start: datetime,
               now: datetime) -> list[MemoryRecord]:
    """The memories `req.supersedes` names, each checked: visible (NotFound if unknown,
    deleted, expired or another owner's: same user_id and agent_id; the session may differ,
    a correction often comes in a later conversation), of the request's kind (InvalidInput),
    still current (Conflict, naming the current version: replacing a successor the caller
    has not seen would lose it), and begun no later than the new memory starts at `start`
    (InvalidInput: a replacement cannot start before what it replaces)."""
    out = []
    for mid in req.supersedes:
        target = visible(engine.store, mid, now)
        if target is None or (target.scope.user_id, target.scope.agent_id) != (
                req.scope.user_id, req.scope.agent_id):
            raise NotFound(f"no memory with id {mid!r} to supersede")
        if target.kind is not req.kind:
            raise InvalidInput(f"memory {mid!r} is {target.kind.value}; a {req.kind.value} "
                               f"memory can only supersede {req.kind.value} ones")
        if target.superseded_by is not None or target.valid_to is not None:
            raise Conflict(f"memory {mid!r} is no longer current{successor(engine, target, now)}")
        since = target.valid_from or target.created_at
        if start < since:
            raise InvalidInput(f"memory {mid!r} holds from {since.isoformat()}; the memory "
                               f"replacing it cannot start before (it starts {start.isoformat()})")
        out.append(target)
    return out


def successor(engine: Engine, rec: MemoryRecord, now: datetime) -> str:
    """Where a closed memory's line of versions goes on: its successor and the current
    version, for an error message."""
    if rec.superseded_by is None:
        return f" (it held until {rec.valid_to.isoformat() if rec.valid_to else '?'})"
    first = rec.superseded_by
    current = visible(engine.store, first, now)
    for _ in range(learn.MAX_CHAIN):
        if current is None or current.superseded_by is None:
            break
        nxt = visible(engine.store, current.superseded_by, now)
        if nxt is None:
            break
        current = nxt
    if current is None or current.valid_to is not None:
        return f": superseded by {first!r}"
    if current.id == first:
        return f": superseded by {first!r}; to replace it, pass supersedes={first!r}"
    return (f": superseded by {first!r}, whose current version is {current.id!r}; to replace "
            f"it, pass supersedes={current.id!r}")


def record(m: Message, req: AddRequest, now: datetime) -> MemoryRecord:
    observed = m.observed_at or req.observed_at
    return MemoryRecord(
        id=new_id(), scope=req.scope, kind=req.kind, text=m.content,
        metadata={**req.metadata, **m.metadata}, importance=req.importance, role=m.role,
        name=m.name, created_at=now, updated_at=now, observed_at=observed,
        valid_from=observed or now, expires_at=req.expires_at, content_hash=content_hash(m.content),
    )


def neighbours(engine: Engine, rec: MemoryRecord, vec: np.ndarray,
               now: datetime) -> list[tuple[MemoryRecord, float]]:
    """Existing memories of the same scope and kind that may repeat `rec`, with cosines."""
    store = engine.store
    same = store.find_hash(rec.scope, rec.kind, rec.content_hash, now)
    if same is not None:
        return [(same, 1.0)]
    found = store.dense(Query(scope=rec.scope, now=now, kinds=(rec.kind,)), vec, 5)
    records = store.get([mid for mid, _ in found])
    return [(records[mid], sim) for mid, sim in found if records[mid].scope == rec.scope]


def evict(engine: Engine, tx: Tx, scope: Scope, now: datetime) -> list[Event]:
    """Over capacity (Config.max_memories_per_scope): soft-delete the lowest retention."""
    cap = engine.config.max_memories_per_scope
    if cap is None:
        return []
    victims = forget.to_evict(engine.store.eviction_pool(scope, now), cap, now)
    if not victims:
        return []
    tx.soft_delete([v.id for v in victims], now)
    events = []
    for v in victims:
        ev = event(EventType.DELETE, v, now, before=v,
                   reason=f"evicted: scope over capacity {cap}, "
                          f"retention {forget.retention(v, now):.3f}")
        tx.append(ev)
        events.append(ev)
        log.info("evicted %s (%s)", v.id, ev.reason)
    return events


def update(engine: Engine, before: MemoryRecord, changes: Mapping[str, Any], *,
           redacted: Mapping[str, int] | None = None) -> MemoryRecord:
    """Change a memory in place (validated and redacted `changes`); new text re-indexes it
    and the turns whose window holds it. The UPDATE event keeps the before and after, and
    says what redaction replaced (`redacted`, counts by type)."""
    now = utcnow()
    after = replace(before, **changes, updated_at=now)
    keys, moved = None, []
    if "text" in changes:
        keys = reindex(engine, after)
        moved = followers(engine, before, after)
    with engine.store.write() as tx:
        if visible(engine.store, before.id, now) is None:  # deleted meanwhile by another writer
            raise NotFound(f"no memory with id {before.id!r}")
        tx.update(after, *(keys or (None, None)))
        for rec, (own, lexical) in moved:
            tx.update(rec, own, lexical)
        tx.append(event(EventType.UPDATE, after, now, before=before, after=after,
                        reason=redaction.noted("", redacted or {}) or None))
    log.info("updated %s: %s", before.id, sorted(changes))
    return after


def delete(engine: Engine, rec: MemoryRecord) -> None:
    """Soft delete: hidden from every read, kept in the history; the turns whose window held
    it are re-indexed without it."""
    now = utcnow()
    moved = followers(engine, rec, None)
    with engine.store.write() as tx:
        tx.soft_delete([rec.id], now)
        for other, (own, lexical) in moved:
            tx.update(other, own, lexical)
        tx.append(event(EventType.DELETE, rec, now, before=rec, reason="deleted by caller"))
    log.info("deleted %s", rec.id)

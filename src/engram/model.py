"""The plain types every layer shares: messages in, memories stored, hits and events out.

All times are timezone-aware UTC datetimes; naive datetimes given by callers are taken as UTC.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from enum import Enum, StrEnum
from typing import Any


class Kind(StrEnum):
    EPISODIC = "episodic"      # what happened: a stored message or document, with its time
    SEMANTIC = "semantic"      # what is true: a fact or preference, consolidated
    PROCEDURAL = "procedural"  # how to act: a lesson or rule, consolidated


class EventType(StrEnum):
    ADD = "ADD"
    UPDATE = "UPDATE"
    SUPERSEDE = "SUPERSEDE"
    MERGE = "MERGE"
    DELETE = "DELETE"
    ERASE = "ERASE"


@dataclass(frozen=True)
class Scope:
    """Who a record belongs to. `None` in a read means "any"; in a write it means "none"."""

    user_id: str | None = None
    agent_id: str | None = None
    session_id: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {"user_id": self.user_id, "agent_id": self.agent_id, "session_id": self.session_id}

    def is_empty(self) -> bool:
        return self.user_id is None and self.agent_id is None and self.session_id is None


def json_ready(obj: Any) -> Any:
    """A copy of `obj` for JSON: a record's fields as a dict, a scope as its dict, times as
    ISO-8601 strings, enums as their values, tuples as lists; the caller may change it freely.
    (`dataclasses.asdict` did the same 20x slower: it deep-copies every value, and a search
    answer is mostly records.)"""
    if type(obj) in _PLAIN:
        return obj
    if isinstance(obj, Scope):
        return obj.as_dict()
    if isinstance(obj, datetime):
        return obj.isoformat()
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_ready(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        return record_dict(obj)
    return obj


def record_dict(obj: Any) -> dict[str, Any]:
    """A dataclass's fields, each `json_ready`."""
    return {name: json_ready(getattr(obj, name)) for name in _field_names(type(obj))}


_PLAIN = frozenset({str, int, float, bool, type(None)})
_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


@dataclass(frozen=True)
class Message:
    """One chat turn as given to `Memory.add`."""

    content: str
    role: str = "user"
    name: str | None = None
    observed_at: datetime | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryRecord:
    """A unit of long-term memory, exactly as stored."""

    id: str
    scope: Scope
    kind: Kind
    text: str
    metadata: dict[str, Any]
    importance: float
    created_at: datetime
    updated_at: datetime
    observed_at: datetime | None = None
    valid_from: datetime | None = None
    valid_to: datetime | None = None
    superseded_by: str | None = None
    provenance: tuple[str, ...] = ()
    role: str | None = None
    name: str | None = None
    access_count: int = 0
    last_accessed_at: datetime | None = None
    expires_at: datetime | None = None
    content_hash: str = ""
    deleted_at: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: times as ISO-8601 strings, enums as their values."""
        return record_dict(self)


@dataclass(frozen=True)
class Hit:
    """One search result: the memory, its final score and how each stage contributed."""

    memory: MemoryRecord
    score: float
    explain: dict[str, float]


@dataclass(frozen=True)
class Event:
    """One line of the audit history. `before` / `after` are memory snapshots (or None)."""

    id: str
    memory_id: str | None
    type: EventType
    at: datetime
    scope: Scope
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "memory_id": self.memory_id, "type": self.type.value,
            "at": self.at.isoformat(), "scope": self.scope.as_dict(),
            "before": self.before, "after": self.after, "reason": self.reason,
        }


@dataclass(frozen=True)
class Receipt:
    """What one erasure removed, kept after the erased content is gone: counts by kind, the
    scope, when, why, and a SHA-256 of the sorted erased ids (to show later that a given id
    was among them, without a list of what was there). Never any memory text."""

    id: str
    at: datetime
    scope: Scope
    target: str                  # memory | scope | session | retention
    memories: int
    by_kind: dict[str, int]
    sessions: int
    jobs: int
    ids_sha256: str
    reason: str = ""
    cancelled: int = 0           # of `jobs`, those still queued or running: they never write

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "at": self.at.isoformat(), "scope": self.scope.as_dict(),
                "target": self.target, "memories": self.memories, "by_kind": dict(self.by_kind),
                "sessions": self.sessions, "jobs": self.jobs, "cancelled": self.cancelled,
                "ids_sha256": self.ids_sha256, "reason": self.reason}

    @classmethod
    def from_event(cls, e: Event) -> Receipt:
        """The receipt an ERASE event carries in `after` (older events carry none: counts 0)."""
        a = e.after or {}
        return cls(id=e.id, at=e.at, scope=e.scope, target=str(a.get("target", "")),
                   memories=int(a.get("memories", 0)), by_kind=dict(a.get("by_kind", {})),
                   sessions=int(a.get("sessions", 0)), jobs=int(a.get("jobs", 0)),
                   ids_sha256=str(a.get("ids_sha256", "")), reason=e.reason or "",
                   cancelled=int(a.get("cancelled", 0)))


@dataclass(frozen=True)
class Erasure:
    """The mark an erasure leaves for the writes already under way (pipeline/fence.py): its
    scope, pseudonymous as in its receipt, what it took (`target`: scope | session | memory)
    and when. `seq` orders the marks in commit order (0 before one is stored)."""

    scope: Scope
    target: str
    at: datetime
    seq: int = 0


@dataclass(frozen=True)
class AddResult:
    """What one `add` call did: the memories it touched and the events it wrote."""

    memories: list[MemoryRecord]
    events: list[Event]
    notes: tuple[str, ...] = ()     # why less was learned or checked than asked (no LLM, LLM
                                    # failed, no contradiction check for a given fact, ...)
    job: Job | None = None          # with background=True: the queued job; memories come later
    redacted: dict[str, int] = field(default_factory=dict)  # placeholders written, by type
                                    # (ENGRAM_REDACT): {"api_key": 1, "card": 1}; never a value


@dataclass(frozen=True)
class Page:
    """One page of `list`; pass `next_cursor` back to get the next one (None at the end)."""

    items: list[MemoryRecord]
    next_cursor: str | None


class JobStatus(StrEnum):
    QUEUED = "queued"      # waiting for `run_at`
    RUNNING = "running"    # claimed by a worker until `lease_until`
    DONE = "done"
    FAILED = "failed"      # gave up after the retries; `error` says why


@dataclass(frozen=True)
class Job:
    """One unit of background work in the durable job table (an `add`, a reflection, a summary).

    `key` is the caller's idempotency key (unique per store): a retried request finds the job it
    already made instead of doing the work twice. `fingerprint` is a hash of the request, so the
    same key with a different request can be refused.
    """

    id: str
    task: str  # add | extract | reflect
    scope: Scope
    payload: dict[str, Any]
    status: JobStatus
    created_at: datetime
    updated_at: datetime
    run_at: datetime
    attempts: int = 0
    key: str | None = None
    fingerprint: str | None = None
    lease_until: datetime | None = None
    result: dict[str, Any] | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return record_dict(self)


@dataclass(frozen=True)
class Session:
    """A persisted conversation: its scope (with a session_id), its policy and its summaries.

    The messages themselves are episodes of the scope; the session row holds what is derived
    from them: `summary` covers every message up to and including `summary_upto` (an id).
    `state` holds policy-specific data (e.g. the levels of a progressive summary).
    """

    scope: Scope
    policy: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    summary: str = ""
    summary_upto: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    ended_at: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        return record_dict(self)


# -- entities and relations (the knowledge graph, docs/graph.md) ------------------------------

@dataclass(frozen=True)
class Entity:
    """Someone or something memories are about: a person, a place, an organisation, a ticket.

    `scope` is an owner (user_id, agent_id; never a session: an entity outlives a conversation).
    `aliases` are the other names it answers to (nicknames, acronyms); `provenance` the episodes
    that mention it (through `Mention` rows) or that a relation of it came from. `summary_by`
    says who wrote the summary: "caller" (kept as written), "rules" (composed from its type,
    aliases and relations, rewritten when they change), "llm" (generated), or "" (none yet).
    """

    id: str
    scope: Scope
    name: str
    type: str
    created_at: datetime
    updated_at: datetime
    aliases: tuple[str, ...] = ()
    summary: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    provenance: tuple[str, ...] = ()
    summary_by: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "scope": self.scope.as_dict(), "name": self.name,
                "type": self.type, "aliases": list(self.aliases), "summary": self.summary,
                "summary_by": self.summary_by,
                "attributes": self.attributes, "provenance": list(self.provenance),
                "created_at": self.created_at.isoformat(),
                "updated_at": self.updated_at.isoformat()}


@dataclass(frozen=True)
class Relation:
    """An edge: `subject` -[predicate]-> `object` (an entity, or a literal `value`), with time.

    World time: `valid_from` / `valid_to` (when it held; None = unknown start / still holds).
    engram's time: `created_at` / `expired_at` (when engram learned it / retired it: an
    `unrelate`, or a correction). A relation closed by a newer value of a single-valued
    predicate gets `valid_to` and stays: `relations(as_of=...)` finds it.
    `subject_name` / `object_name` are the entities' canonical names when read.
    """

    id: str
    scope: Scope
    subject: str                     # entity id
    predicate: str
    object: str | None               # entity id, or None for a literal
    value: str | None                # the literal object (None when `object` is an entity)
    fact: str
    created_at: datetime
    valid_from: datetime | None = None
    valid_to: datetime | None = None
    expired_at: datetime | None = None
    provenance: tuple[str, ...] = ()
    confidence: float = 1.0
    metadata: dict[str, Any] = field(default_factory=dict)
    subject_name: str = ""
    object_name: str = ""            # the object entity's name, or the literal value

    def holds(self, at: datetime) -> bool:
        """Valid at world time `at` and not retired."""
        return (self.expired_at is None
                and (self.valid_from is None or self.valid_from <= at)
                and (self.valid_to is None or self.valid_to > at))

    def to_dict(self) -> dict[str, Any]:
        t = _iso
        return {"id": self.id, "scope": self.scope.as_dict(), "subject": self.subject_name,
                "subject_id": self.subject, "predicate": self.predicate,
                "object": self.object_name or self.value, "object_id": self.object,
                "value": self.value, "fact": self.fact, "valid_from": t(self.valid_from),
                "valid_to": t(self.valid_to), "created_at": t(self.created_at),
                "expired_at": t(self.expired_at), "provenance": list(self.provenance),
                "confidence": self.confidence, "metadata": self.metadata}


@dataclass(frozen=True)
class Mention:
    """An episode mentions an entity: what links the graph to the turns."""

    episode_id: str
    entity_id: str
    scope: Scope
    at: datetime | None = None       # the episode's observed_at


@dataclass(frozen=True)
class EntityProfile:
    """What `Memory.entity` tells about one entity: itself, the relations that hold now (both
    directions) and the episodes that mention it most recently."""

    entity: Entity
    relations: list[Relation]
    mentions: list[MemoryRecord]

    def to_dict(self) -> dict[str, Any]:
        return {**self.entity.to_dict(), "relations": [r.to_dict() for r in self.relations],
                "mentions": [{"id": m.id, "text": m.text, "name": m.name,
                              "observed_at": _iso(m.observed_at)} for m in self.mentions]}


@dataclass(frozen=True)
class Subgraph:
    """Entities and the relations between them: what `neighbours` and `path` return."""

    entities: list[Entity]
    relations: list[Relation]

    def to_dict(self) -> dict[str, Any]:
        return {"entities": [e.to_dict() for e in self.entities],
                "relations": [r.to_dict() for r in self.relations]}


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def event(type: EventType, memory: MemoryRecord, at: datetime, *,
          before: MemoryRecord | None = None, after: MemoryRecord | None = None,
          reason: str | None = None) -> Event:
    """The event of one change to `memory`, with snapshots of it before and after."""
    return Event(id=new_id(), memory_id=memory.id, type=type, at=at, scope=memory.scope,
                 before=before.to_dict() if before else None,
                 after=after.to_dict() if after else None, reason=reason)


class Unset:
    """The type of `UNSET`: an argument not given, as opposed to an explicit None (`update`'s
    `expires_at=None` clears the expiry; leaving it out keeps it)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = Unset()


def is_pinned(metadata: Mapping[str, Any]) -> bool:
    """Does this metadata pin the memory (what the context's "pinned" block selects)? A pin is
    shown to the model with authority: only trusted text and, in the service, admin keys."""
    value = metadata.get("pinned")
    return value is True or (type(value) in (int, float) and value == 1)


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


_id_lock = threading.Lock()
_id_last = [0, 0]  # (unix ms, 74-bit counter) of the last id made in this process


def new_id() -> str:
    """A time-ordered UUID (v7 layout): ids sort by creation, which makes cursors trivial.

    Within one millisecond the 74 random bits are incremented rather than redrawn (RFC 9562
    "monotonic random"), so ids made by one process sort in the order they were made.
    """
    with _id_lock:
        ms = time.time_ns() // 1_000_000
        last_ms, last_tail = _id_last
        if ms <= last_ms:
            ms, tail = last_ms, last_tail + 1 + (int.from_bytes(os.urandom(2), "big") & 0xFF)
            if tail >= 1 << 74:  # counter exhausted: borrow the next millisecond
                ms, tail = ms + 1, int.from_bytes(os.urandom(10), "big") >> 7
        else:
            tail = int.from_bytes(os.urandom(10), "big") >> 7  # top bit clear: room to count
        _id_last[:] = [ms, tail]
    rand_a, rand_b = tail >> 62, tail & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

"""The storage contract: the `Store` and `Tx` protocols, and `StoreBase`, which writes every
convenience once above the few primitive operations a backend implements.

Reads take a value (`Query`, `Select`) that each backend compiles to its own SQL; writes happen
inside `write()`, one transaction that either commits whole or leaves nothing. Everything else
(consolidation, ranking, forgetting) lives above the store.

A backend implements 18 primitives (`write`, `close`, `migrations`, `read_memories`,
`read_ids`, `candidates`, `dense`, `key_vectors`, `lexical`, `events`, `events_of`, `count_events`,
`read_jobs`, `claim_job`, `read_sessions`, `stats`, `touch`, `reclaim`) and 8 of the knowledge
graph (`read_entities`, `match_names`, `entity_embeddings`, `read_relations`, `read_mentions`,
`mention_counts`, `neighbours`, `find_path`) and `space` (the embedding space), and inherits
14 conveniences from `StoreBase` (`pool`, `get`, `select`, `ids`, `find_hash`,
`recent_episodes`, `episodes_around`, `eviction_pool`, `iter_export`, `job`, `job_by_key`,
`jobs`, `session`, `sessions`; a backend may override one, as PostgreSQL does `pool`). Its
`Tx` implements the fifteen writes of `Tx` (ten of memories, jobs and sessions; five of the
graph) and `put_space`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from ..filters import Condition
from ..model import (
    Entity,
    Erasure,
    Event,
    Job,
    JobStatus,
    Kind,
    MemoryRecord,
    Mention,
    Relation,
    Scope,
    Session,
)

if TYPE_CHECKING:
    from .index.follow import LexicalChanges


@dataclass(frozen=True)
class Query:
    """Which memories a read may see.

    Visible means: in `scope` (None fields match anything), not deleted, not expired at `now`,
    of one of `kinds`, matching every filter condition, and valid at `as_of` when given
    (otherwise current: not superseded at `now`).
    """

    scope: Scope
    now: datetime
    kinds: tuple[Kind, ...] | None = None
    conditions: tuple[Condition, ...] = ()
    as_of: datetime | None = None


class Seen(StrEnum):
    """How much of the stored history a read sees; each level hides what the one before shows."""

    ALL = "all"              # every stored row: deleted, expired and superseded ones too
    LIVE = "live"            # not deleted
    UNEXPIRED = "unexpired"  # not deleted, not expired at `now`
    VISIBLE = "visible"      # ... and valid at `as_of`, or else current (not superseded) at `now`


Order = Literal["id", "newest", "oldest"]


@dataclass(frozen=True)
class Select:
    """One read of memory rows: the value every record read of the contract is built from.

    `exact`: the scope itself, a None field meaning NULL (not "anything"). `before` / `after`
    name an episode: rows observed before (after) it, ties broken by insertion order. Orders:
    `id` (creation), `newest` / `oldest` (by observation time, then insertion).
    """

    scope: Scope = Scope()
    exact: bool = False
    seen: Seen = Seen.LIVE
    now: datetime | None = None
    as_of: datetime | None = None
    kinds: tuple[Kind, ...] | None = None
    conditions: tuple[Condition, ...] = ()
    ids: tuple[str, ...] | None = None
    content_hash: str | None = None
    after_id: str | None = None
    before: str | None = None
    after: str | None = None
    order: Order | None = "id"  # None: any order (a lookup by ids)
    limit: int | None = None

    @classmethod
    def of(cls, query: Query, **fields: Any) -> Select:
        """The rows `query` may see."""
        return cls(scope=query.scope, seen=Seen.VISIBLE, now=query.now, as_of=query.as_of,
                   kinds=query.kinds, conditions=query.conditions, **fields)


@dataclass(frozen=True)
class Key:
    """One retrieval key of a memory: a vector the dense search matches against.

    Every memory has a `text` key; an episode also has a `window` key (the turn with the two
    before it in its session), so a turn can be found by what was being talked about; a text
    longer than the embedder's window has a `passage` key per further window of it
    (pipeline/passages.py). A memory may have several keys of one name (`fact`, `passage`):
    `dense` scores it by its best.
    """

    name: str  # text | window | fact | passage
    vector: np.ndarray


@dataclass(frozen=True)
class Space:
    """The embedding space a database's vectors belong to (`embedders.space`), and an
    unfinished reindex: `pending` names the space (and scope) it re-embeds into, `cursor` the
    last memory id it finished."""

    space: str
    pending: str | None = None
    cursor: str | None = None

    @property
    def target(self) -> str | None:
        """The space an unfinished reindex re-embeds into (`pending` is the JSON list of it and
        its scope's user and agent: pipeline/reindex.py), or None."""
        return str(json.loads(self.pending)[0]) if self.pending else None

    @property
    def latest(self) -> str:
        """The space new vectors belong in: an unfinished reindex's target, else `space`."""
        return self.target or self.space


@dataclass(frozen=True, slots=True)
class Candidate:
    """The few fields ranking needs, read for hundreds of candidates per search.

    Two of them derived once, when the candidate is built (a store's cache keeps it for search
    after search): `at`, its time (observed, else created) in epoch seconds, for recency; and
    `unit`, what session-level evidence groups it by (its session, or itself outside one)."""

    id: str
    scope: Scope
    name: str | None
    text: str
    observed_at: datetime | None
    created_at: datetime
    importance: float
    # the message's role ("user", "assistant", ...; None for a memory that is no message):
    # newest-wins asks who said a statement, and a message of a user need not name her
    role: str | None = None
    at: float = field(init=False, repr=False, compare=False)
    unit: tuple[str | None, ...] | str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        s = self.scope
        object.__setattr__(self, "at", (self.observed_at or self.created_at).timestamp())
        object.__setattr__(self, "unit", (s.user_id, s.agent_id, s.session_id)
                           if s.session_id is not None else self.id)


@dataclass(frozen=True)
class Lexical:
    """What the lexical index holds for a memory: its text and (weighted lower) the turn before
    it, which is often what a short answer is about ("Yes, since 2019!")."""

    body: str
    previous: str = ""


@dataclass(frozen=True)
class Stats:
    """Counts of a scope: `memories` visible now (`by_kind`), hidden ones by why, the history,
    the distinct scopes, the background jobs by status (every `JobStatus`), the database size
    (None where this scope's share is unknown)."""

    memories: int
    by_kind: dict[str, int]
    deleted: int
    superseded: int
    expired: int
    events: int
    scopes: int
    jobs: dict[str, int]
    db_bytes: int | None
    retention: dict[str, Any] | None = None  # the policy in days and what it removed so far

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def job_counts(found: dict[str, int]) -> dict[str, int]:
    """Jobs per status with every status present (0 when none)."""
    return {s.value: int(found.get(s.value, 0)) for s in JobStatus}


NameKind = Literal["name", "alias", "token"]  # what an entity_names row indexes


@dataclass(frozen=True)
class EntitySelect:
    """One read of entities. `scope`: an owner (user_id, agent_id; None fields match anything
    unless `exact`). `keys`: normalised names or aliases (exact lookups through the index);
    `tokens`: normalised name tokens (lexical candidates)."""

    scope: Scope = Scope()
    exact: bool = False
    ids: tuple[str, ...] | None = None
    keys: tuple[str, ...] | None = None
    tokens: tuple[str, ...] | None = None
    type: str | None = None
    after_id: str | None = None
    limit: int | None = None


@dataclass(frozen=True)
class RelationSelect:
    """One read of relations. `seen`: "current" (not retired, valid at `now`), "as_of" (not
    retired, valid at `at`) or "all" (every stored edge, the history). `touching`: relations
    with either end among these entity ids."""

    scope: Scope = Scope()
    ids: tuple[str, ...] | None = None
    subjects: tuple[str, ...] | None = None
    predicate: str | None = None
    objects: tuple[str, ...] | None = None
    value: str | None = None
    touching: tuple[str, ...] | None = None
    seen: Literal["current", "as_of", "all"] = "current"
    at: datetime | None = None
    limit: int | None = None


class Tx(Protocol):
    """Write operations available inside `Store.write()`. Reads on the store see them."""

    def insert(self, record: MemoryRecord, keys: Sequence[Key], lexical: Lexical) -> None: ...

    def insert_many(self, rows: Sequence[tuple[MemoryRecord, Sequence[Key], Lexical]]) -> None:
        """`insert` of each row, a statement per table (bulk loads): the same rows, keys and
        lexical index as one `insert` per row."""

    def update(self, record: MemoryRecord, keys: Sequence[Key] | None = None,
               lexical: Lexical | None = None) -> None:
        """Replace the stored record (same id); replace keys / lexical text when given."""

    def soft_delete(self, ids: Sequence[str], at: datetime) -> None:
        """Hide from reads, drop retrieval keys; the row stays for history."""

    def erase(self, ids: Sequence[str]) -> None:
        """Remove every trace: rows, keys, lexical index, events naming them."""

    def append(self, event: Event) -> None: ...

    def put_job(self, job: Job) -> None:
        """Insert or replace a job (by id). A new job whose `key` is already taken raises
        `Conflict`: callers look the key up first (`Store.job_by_key`) in the same transaction."""

    def finish_job(self, job: Job) -> bool:
        """Replace the row of a job a worker claimed (`job.attempts` is the claim's): only if
        the row is still running under that claim. False when it is gone (an erasure cancelled
        the job) or another worker took it after the lease ran out: nothing was written."""

    def put_erasure(self, erasure: Erasure, *, forget_before: datetime) -> None:
        """Record an erasure's mark (the fence later writes check), numbered after every mark
        before it; marks older than `forget_before` are dropped."""

    def erasures(self, after: int) -> list[Erasure]:
        """The erasure marks numbered above `after`, in order: read inside the transaction, so
        the fence check and the write it guards see the same commits."""

    def put_session(self, session: Session) -> None:
        """Insert or replace the session of `session.scope` (user_id, agent_id, session_id)."""

    def delete_session(self, scope: Scope) -> None:
        """Remove the session row of exactly this scope (its episodes are separate memories)."""

    def delete_jobs(self, ids: Sequence[str]) -> None:
        """Remove job rows (their payloads hold request text): for an erasure."""

    def erase_scope(self, scope: Scope) -> None:
        """Remove sessions and jobs of a scope (None fields match anything): they hold message
        text, so a scope's erasure must take them too."""

    def put_entity(self, entity: Entity, keys: Sequence[tuple[str, NameKind]],
                   embedding: np.ndarray | None = None) -> None:
        """Insert or replace an entity (by id) and its index rows (normalised names, aliases,
        tokens); without `embedding` a stored one is kept."""

    def add_entity(self, entity: Entity, keys: Sequence[tuple[str, NameKind]], key: str,
                   embedding: np.ndarray | None = None) -> str:
        """Insert a new entity (with its index rows) under its claim `key`, unless an entity of
        the same owner holds that key already: then nothing is written. Returns the id of the
        entity holding the key (`entity.id` when it was inserted). Owners' entities are unique
        by key (a unique index), so two writers creating one entity at once end with one."""

    def put_relation(self, relation: Relation) -> None:
        """Insert or replace a relation (by id)."""

    def put_mentions(self, mentions: Sequence[Mention]) -> None:
        """Record that episodes mention entities (a pair already recorded is kept)."""

    def erase_graph(self, entity_ids: Sequence[str] = (), relation_ids: Sequence[str] = ()) -> None:
        """Remove entities (their index rows, mentions and every relation touching them) and
        relations (and their history events)."""

    def drop_mentions(self, episode_ids: Sequence[str]) -> None:
        """Forget that these episodes mention anything (they are being erased)."""

    def put_space(self, space: Space, *, first: bool = False) -> None:
        """Record the embedding space (and the reindex progress); `first`: only if none is
        recorded yet (two processes opening an empty database: the first one wins)."""


class Store(Protocol):
    """What the layers above call. Backends get it by subclassing `StoreBase`: they implement
    the primitives (`write`, `close`, `migrations`, the `read_*` reads, `candidates`, `dense`,
    `lexical`, `events`, `claim_job`, `stats`, `touch`, `reclaim`) and inherit the rest."""

    def write(self) -> AbstractContextManager[Tx]: ...

    def close(self) -> None: ...

    def migrations(self) -> list[str]:
        """The names of the schema migrations applied to the database, in order."""

    def read_memories(self, sel: Select) -> list[MemoryRecord]:
        """The records `sel` selects, in its order: the one read every record read below is
        built on (a new kind of read is a new `Select`, not a new method)."""

    def read_ids(self, sel: Select) -> list[str]:
        """The ids of the records `sel` selects, in its order."""

    def read_jobs(self, *, id: str | None = None, key: str | None = None,
                  scope: Scope | None = None, status: str | None = None,
                  limit: int | None = None) -> list[Job]:
        """Jobs matching every given field (scope: None fields match anything), newest first."""

    def read_sessions(self, scope: Scope, *, exact: bool, limit: int) -> list[Session]:
        """Sessions of `scope` (exactly it, or None fields matching anything), most recently
        updated first."""

    def get(self, ids: Sequence[str]) -> dict[str, MemoryRecord]:
        """Stored records by id, whatever their state (deleted, expired, superseded)."""

    def candidates(self, ids: Sequence[str], query: Query | None = None) -> dict[str, Candidate]:
        """The ranking fields of stored records by id (`query`: the search they were found by,
        whose scope a backend may have cached them for)."""

    def select(self, query: Query, *, after_id: str | None = None,
               limit: int = 50) -> list[MemoryRecord]:
        """Visible memories ordered by id (creation order), for paging."""

    def ids(self, scope: Scope, *, include_deleted: bool = False) -> list[str]:
        """Every memory id in a scope (for erase and export)."""

    def dense(self, query: Query, vector: np.ndarray, k: int,
              key: str = "text") -> list[tuple[str, float]]:
        """Visible memories by cosine of their `key` vector, highest first."""

    def key_vectors(self, ids: Sequence[str], key: str) -> dict[str, np.ndarray]:
        """Each memory's vectors of the key name `key` (rows in the order they were written),
        for those of `ids` that have any: which of its passages a hit was found by."""

    def lexical(self, query: Query, terms: Sequence[str], k: int,
                previous_weight: float = 0.5) -> list[tuple[str, float]]:
        """Visible memories matching any of `terms` by BM25 (higher is better), the
        `previous` column weighted by `previous_weight` against the body."""

    def lexical_changes(self, since: int) -> LexicalChanges:
        """What changed in the lexical documents after position `since` of the store's
        change log (-1: every document), or every document when the log cannot be followed
        from there (pruned past it, or an erasure since): what keeps an in-process lexicon
        exact (index/follow.py). Positions grow in commit order."""

    def pool(self, query: Query, k: int, *, vector: np.ndarray | None, keys: Sequence[str],
             terms: Sequence[str], previous_weight: float = 0.5) -> dict[str, list[tuple[str, float]]]:
        """Every retriever's `k` candidates at once: `dense` for each key name in `keys`,
        and `lexical` under the name "lexical" when there are terms; in one round trip where
        the backend can (a search asks for up to four lists)."""

    def find_hash(self, scope: Scope, kind: Kind, content_hash: str,
                  now: datetime) -> MemoryRecord | None:
        """A visible, current memory of exactly this scope and kind with this content hash."""

    def recent_episodes(self, scope: Scope, n: int) -> list[MemoryRecord]:
        """The `n` most recently observed live episodes of exactly this scope, newest first."""

    def episodes_around(self, id: str, n: int) -> tuple[list[MemoryRecord], list[MemoryRecord]]:
        """Up to `n` live episodes of the same scope just before and just after the episode
        `id`, each list oldest first (their index holds `id` as context)."""

    def eviction_pool(self, scope: Scope, now: datetime) -> list[MemoryRecord]:
        """Unexpired memories of exactly this scope (superseded ones too), for eviction."""

    def events(self, memory_id: str) -> list[Event]:
        """The history of a memory, in append order."""

    def count_events(self, type: str, scope: Scope, reason_prefix: str) -> int:
        """How many events of one type in a scope have a reason starting with the prefix
        (e.g. the DELETE events of retention)."""

    def events_of(self, type: str, scope: Scope, *, limit: int = 50) -> list[Event]:
        """Events of one type (e.g. ERASE: the erasure receipts) in a scope (None fields match
        anything), newest first."""

    def touch(self, ids: Sequence[str], at: datetime) -> None:
        """Best effort: count an access (never blocks on a busy database)."""

    def access(self, ids: Sequence[str], at: datetime) -> dict[str, MemoryRecord]:
        """`get` and then `touch` what it found: the records as they were before this access
        (a search's hits), in one round trip where the backend can."""

    def stats(self, scope: Scope, now: datetime) -> Stats: ...

    def iter_export(self, scope: Scope) -> Iterator[tuple[MemoryRecord, list[Event]]]: ...

    # -- jobs (the durable queue) --------------------------------------------------------------

    def job(self, id: str) -> Job | None: ...

    def job_by_key(self, key: str) -> Job | None: ...

    def jobs(self, scope: Scope, *, status: str | None = None, limit: int = 50) -> list[Job]:
        """Jobs of a scope (None fields match anything), newest first."""

    def claim_job(self, now: datetime, lease_until: datetime) -> Job | None:
        """Atomically take the oldest runnable job: queued with `run_at <= now`, or running
        with an expired lease (its worker died). It becomes running until `lease_until`, with
        `attempts` + 1. Two workers never claim the same job."""

    def erasure_seq(self) -> int:
        """The number of the latest erasure mark (0 when none): what a write begins under."""

    # -- sessions ------------------------------------------------------------------------------

    def session(self, scope: Scope) -> Session | None:
        """The session of exactly this scope (session_id set), or None."""

    def sessions(self, scope: Scope, *, limit: int = 50) -> list[Session]:
        """Sessions of a scope (None fields match anything), most recently updated first."""

    def reclaim(self) -> None:
        """Make erased bytes unrecoverable from the files (checkpoint, purge free pages)."""

    # -- the knowledge graph -------------------------------------------------------------------

    def read_entities(self, sel: EntitySelect) -> list[Entity]:
        """The entities `sel` selects, in creation order."""

    def match_names(self, scope: Scope, keys: Sequence[str]) -> list[tuple[str, str]]:
        """(key, entity id) for every key among `keys` that is an entity's normalised name or
        alias in the owner `scope`: the index that resolution and mention linking use."""

    def entity_embeddings(self, scope: Scope, *, exact: bool = False,
                          type: str | None = None) -> list[tuple[str, np.ndarray]]:
        """(entity id, name embedding) of the owner's entities (of one type if given)."""

    def read_relations(self, sel: RelationSelect) -> list[Relation]:
        """The relations `sel` selects, with their ends' names, in creation order."""

    def read_mentions(self, scope: Scope, *, entity_ids: Sequence[str] | None = None,
                      episode_ids: Sequence[str] | None = None,
                      limit: int | None = None) -> list[Mention]:
        """Mentions of these entities / in these episodes, the most recent first."""

    def mention_counts(self, scope: Scope, entity_ids: Sequence[str]) -> dict[str, int]:
        """How many episodes mention each entity."""

    def neighbours(self, scope: Scope, start: Sequence[str], depth: int, at: datetime,
                   as_of: bool = False) -> dict[str, int]:
        """Entity id -> hops from `start` (0 for the start) of every entity within `depth`
        hops over the relations between entities that hold at `at` (current ones when not
        `as_of`), in either direction."""

    def space(self) -> Space | None:
        """The recorded embedding space of this database (tenant), None before the first."""

    def find_path(self, scope: Scope, a: str, b: str, max_depth: int, at: datetime,
             as_of: bool = False) -> list[str] | None:
        """The relation ids of a shortest path from entity `a` to `b` (either direction), or
        None when none within `max_depth` hops."""


EXPORT_CHUNK = 500  # records read per statement while exporting


class StoreBase(ABC):
    """The conveniences of `Store`, each written once over the primitives a backend implements
    (the abstract methods below). Both backends inherit it."""

    # -- primitives ----------------------------------------------------------------------------

    @abstractmethod
    def write(self) -> AbstractContextManager[Any]: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def migrations(self) -> list[str]: ...

    @abstractmethod
    def read_memories(self, sel: Select) -> list[MemoryRecord]:
        """The records `sel` selects, in its order."""

    @abstractmethod
    def read_ids(self, sel: Select) -> list[str]:
        """The ids of the records `sel` selects, in its order."""

    @abstractmethod
    def candidates(self, ids: Sequence[str], query: Query | None = None) -> dict[str, Candidate]: ...

    @abstractmethod
    def dense(self, query: Query, vector: np.ndarray, k: int,
              key: str = "text") -> list[tuple[str, float]]: ...

    @abstractmethod
    def lexical(self, query: Query, terms: Sequence[str], k: int,
                previous_weight: float = 0.5) -> list[tuple[str, float]]: ...

    @abstractmethod
    def events(self, memory_id: str) -> list[Event]: ...

    @abstractmethod
    def events_of(self, type: str, scope: Scope, *, limit: int = 50) -> list[Event]: ...

    @abstractmethod
    def count_events(self, type: str, scope: Scope, reason_prefix: str) -> int: ...

    @abstractmethod
    def read_jobs(self, *, id: str | None = None, key: str | None = None,
                  scope: Scope | None = None, status: str | None = None,
                  limit: int | None = None) -> list[Job]:
        """Jobs matching every given field (scope: None fields match anything), newest first."""

    @abstractmethod
    def claim_job(self, now: datetime, lease_until: datetime) -> Job | None: ...

    @abstractmethod
    def read_sessions(self, scope: Scope, *, exact: bool, limit: int) -> list[Session]:
        """Sessions of `scope` (exactly it, or None fields matching anything), most recently
        updated first."""

    @abstractmethod
    def stats(self, scope: Scope, now: datetime) -> Stats: ...

    @abstractmethod
    def touch(self, ids: Sequence[str], at: datetime) -> None: ...

    @abstractmethod
    def reclaim(self) -> None: ...

    @abstractmethod
    def read_entities(self, sel: EntitySelect) -> list[Entity]: ...

    @abstractmethod
    def match_names(self, scope: Scope, keys: Sequence[str]) -> list[tuple[str, str]]: ...

    @abstractmethod
    def entity_embeddings(self, scope: Scope, *, exact: bool = False,
                          type: str | None = None) -> list[tuple[str, np.ndarray]]: ...

    @abstractmethod
    def read_relations(self, sel: RelationSelect) -> list[Relation]: ...

    @abstractmethod
    def read_mentions(self, scope: Scope, *, entity_ids: Sequence[str] | None = None,
                      episode_ids: Sequence[str] | None = None,
                      limit: int | None = None) -> list[Mention]: ...

    @abstractmethod
    def mention_counts(self, scope: Scope, entity_ids: Sequence[str]) -> dict[str, int]: ...

    @abstractmethod
    def neighbours(self, scope: Scope, start: Sequence[str], depth: int, at: datetime,
                   as_of: bool = False) -> dict[str, int]: ...

    @abstractmethod
    def find_path(self, scope: Scope, a: str, b: str, max_depth: int, at: datetime,
             as_of: bool = False) -> list[str] | None: ...

    @abstractmethod
    def space(self) -> Space | None: ...

    # -- conveniences --------------------------------------------------------------------------

    def pool(self, query: Query, k: int, *, vector: np.ndarray | None, keys: Sequence[str],
             terms: Sequence[str], previous_weight: float = 0.5) -> dict[str, list[tuple[str, float]]]:
        found = {}
        if vector is not None:
            found = {key: self.dense(query, vector, k, key=key) for key in keys}
        if terms:
            found["lexical"] = self.lexical(query, terms, k, previous_weight)
        return found

    def get(self, ids: Sequence[str]) -> dict[str, MemoryRecord]:
        if not ids:
            return {}
        found = self.read_memories(Select(ids=tuple(ids), seen=Seen.ALL, order=None))
        return {r.id: r for r in found}

    def access(self, ids: Sequence[str], at: datetime) -> dict[str, MemoryRecord]:
        found = self.get(ids)
        self.touch(list(found), at)
        return found

    def select(self, query: Query, *, after_id: str | None = None,
               limit: int = 50) -> list[MemoryRecord]:
        return self.read_memories(Select.of(query, after_id=after_id, limit=limit))

    def ids(self, scope: Scope, *, include_deleted: bool = False) -> list[str]:
        return self.read_ids(Select(scope=scope, seen=Seen.ALL if include_deleted else Seen.LIVE))

    def find_hash(self, scope: Scope, kind: Kind, content_hash: str,
                  now: datetime) -> MemoryRecord | None:
        found = self.read_memories(Select.of(Query(scope, now, kinds=(kind,)), exact=True,
                                             content_hash=content_hash, order=None, limit=1))
        return found[0] if found else None

    def recent_episodes(self, scope: Scope, n: int) -> list[MemoryRecord]:
        return self.read_memories(Select(scope=scope, exact=True, kinds=(Kind.EPISODIC,),
                                         order="newest", limit=n))

    def episodes_around(self, id: str, n: int) -> tuple[list[MemoryRecord], list[MemoryRecord]]:
        anchor = self.get([id]).get(id)
        if anchor is None or anchor.kind is not Kind.EPISODIC:
            return [], []
        same = Select(scope=anchor.scope, exact=True, kinds=(Kind.EPISODIC,), limit=n)
        before = self.read_memories(replace(same, before=id, order="newest"))
        after = self.read_memories(replace(same, after=id, order="oldest"))
        return before[::-1], after

    def eviction_pool(self, scope: Scope, now: datetime) -> list[MemoryRecord]:
        return self.read_memories(Select(scope=scope, exact=True, seen=Seen.UNEXPIRED, now=now,
                                         order=None))

    def iter_export(self, scope: Scope) -> Iterator[tuple[MemoryRecord, list[Event]]]:
        ids = self.ids(scope, include_deleted=True)
        for i in range(0, len(ids), EXPORT_CHUNK):
            chunk = ids[i:i + EXPORT_CHUNK]
            records = self.get(chunk)
            for mid in chunk:
                yield records[mid], self.events(mid)

    def job(self, id: str) -> Job | None:
        found = self.read_jobs(id=id)
        return found[0] if found else None

    def job_by_key(self, key: str) -> Job | None:
        found = self.read_jobs(key=key)
        return found[0] if found else None

    def jobs(self, scope: Scope, *, status: str | None = None, limit: int = 50) -> list[Job]:
        return self.read_jobs(scope=scope, status=status, limit=limit)

    def session(self, scope: Scope) -> Session | None:
        found = self.read_sessions(scope, exact=True, limit=1)
        return found[0] if found else None

    def sessions(self, scope: Scope, *, limit: int = 50) -> list[Session]:
        return self.read_sessions(scope, exact=False, limit=limit)


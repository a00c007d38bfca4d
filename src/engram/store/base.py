"""The storage contract: a few primitive operations every backend implements.

Reads take a `Query` (a plain value: scope, kinds, filters, time) that each backend compiles
to its own SQL; writes happen inside `write()`, one transaction that either commits whole or
leaves nothing. Everything else (consolidation, ranking, forgetting) lives above the store.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import numpy as np

from ..filters import Condition
from ..model import Event, Job, Kind, MemoryRecord, Scope, Session


@dataclass(frozen=True)
class Query:
    """Which memories a read may see.

    Visible means: in `scope` (None fields match anything), not deleted, not expired at `now`,
    of one of `kinds`, matching every filter condition, and valid at `as_of` when given
    (otherwise current: not superseded).
    """

    scope: Scope
    now: datetime
    kinds: tuple[Kind, ...] | None = None
    conditions: tuple[Condition, ...] = ()
    as_of: datetime | None = None


@dataclass(frozen=True)
class Key:
    """One retrieval key of a memory: a vector the dense search matches against.

    Every memory has a `text` key; an episode also has a `window` key (the turn with the two
    before it in its session), so a turn can be found by what was being talked about.
    """

    name: str  # text | window | fact
    vector: np.ndarray


@dataclass(frozen=True, slots=True)
class Candidate:
    """The few fields ranking needs, read for hundreds of candidates per search."""

    id: str
    scope: Scope
    name: str | None
    text: str
    observed_at: datetime | None
    created_at: datetime
    importance: float


@dataclass(frozen=True)
class Lexical:
    """What the lexical index holds for a memory: its text and (weighted lower) the turn before
    it, which is often what a short answer is about ("Yes, since 2019!")."""

    body: str
    previous: str = ""


@dataclass(frozen=True)
class Stats:
    memories: int
    by_kind: dict[str, int]
    deleted: int
    superseded: int
    expired: int
    events: int
    scopes: int
    db_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Tx(Protocol):
    """Write operations available inside `Store.write()`. Reads on the store see them."""

    def insert(self, record: MemoryRecord, keys: Sequence[Key], lexical: Lexical) -> None: ...

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

    def put_session(self, session: Session) -> None:
        """Insert or replace the session of `session.scope` (user_id, agent_id, session_id)."""

    def delete_session(self, scope: Scope) -> None:
        """Remove the session row of exactly this scope (its episodes are separate memories)."""

    def erase_scope(self, scope: Scope) -> None:
        """Remove sessions and jobs of a scope (None fields match anything): they hold message
        text, so a scope's erasure must take them too."""


class Store(Protocol):
    def write(self) -> AbstractContextManager[Tx]: ...

    def close(self) -> None: ...

    def get(self, ids: Sequence[str]) -> dict[str, MemoryRecord]:
        """Stored records by id, whatever their state (deleted, expired, superseded)."""

    def candidates(self, ids: Sequence[str]) -> dict[str, Candidate]:
        """The ranking fields of stored records by id."""

    def select(self, query: Query, *, after_id: str | None = None,
               limit: int = 50) -> list[MemoryRecord]:
        """Visible memories ordered by id (creation order), for paging."""

    def ids(self, scope: Scope, *, include_deleted: bool = False) -> list[str]:
        """Every memory id in a scope (for erase and export)."""

    def dense(self, query: Query, vector: np.ndarray, k: int,
              key: str = "text") -> list[tuple[str, float]]:
        """Visible memories by cosine of their `key` vector, highest first."""

    def lexical(self, query: Query, terms: Sequence[str], k: int,
                previous_weight: float = 0.5) -> list[tuple[str, float]]:
        """Visible memories matching any of `terms` by BM25 (higher is better), the context
        `previous` column weighted by `previous_weight` against the body."""

    def find_hash(self, scope: Scope, kind: Kind, content_hash: str,
                  now: datetime) -> MemoryRecord | None:
        """A visible, current memory of exactly this scope and kind with this content hash."""

    def recent_episodes(self, scope: Scope, n: int) -> list[MemoryRecord]:
        """The `n` most recently observed visible episodes of exactly this scope, newest first."""

    def episodes_around(self, id: str, n: int) -> tuple[list[MemoryRecord], list[MemoryRecord]]:
        """Up to `n` visible episodes of the same scope just before and just after the episode
        `id`, each list oldest first (their index holds `id` as context)."""

    def eviction_pool(self, scope: Scope, now: datetime) -> list[MemoryRecord]:
        """Visible memories of exactly this scope, for capacity eviction."""

    def events(self, memory_id: str) -> list[Event]: ...

    def touch(self, ids: Sequence[str], at: datetime) -> None:
        """Best effort: count an access (never blocks on a busy database)."""

    def stats(self, scope: Scope, now: datetime) -> Stats: ...

    def iter_export(self, scope: Scope) -> Iterator[tuple[MemoryRecord, list[Event]]]: ...

    # -- jobs (the durable queue; see pipeline/jobs) ------------------------------------------

    def job(self, id: str) -> Job | None: ...

    def job_by_key(self, key: str) -> Job | None: ...

    def jobs(self, scope: Scope, *, status: str | None = None, limit: int = 50) -> list[Job]:
        """Jobs of a scope (None fields match anything), newest first."""

    def claim_job(self, now: datetime, lease_until: datetime) -> Job | None:
        """Atomically take the oldest runnable job: queued with `run_at <= now`, or running
        with an expired lease (its worker died). It becomes running until `lease_until`, with
        `attempts` + 1. Two workers never claim the same job."""

    # -- sessions ------------------------------------------------------------------------------

    def session(self, scope: Scope) -> Session | None:
        """The session of exactly this scope (session_id set), or None."""

    def sessions(self, scope: Scope, *, limit: int = 50) -> list[Session]:
        """Sessions of a scope (None fields match anything), most recently updated first."""

    def reclaim(self) -> None:
        """Make erased bytes unrecoverable from the files (checkpoint, purge free pages)."""

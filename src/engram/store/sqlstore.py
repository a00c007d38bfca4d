"""The primitives both SQL backends share, written once over the statements of `records`: a
backend gives a way to run a statement and keeps only what its engine does differently.

`SQLStore` implements the record, event, job, session and stats reads of `StoreBase`;
`SQLTx` the writes that need no index maintenance (events, jobs, sessions).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from datetime import datetime
from typing import Any

import numpy as np

from ..errors import Conflict
from ..model import (
    Entity,
    Erasure,
    Event,
    Job,
    MemoryRecord,
    Mention,
    Relation,
    Scope,
    Session,
    utcnow,
)
from . import graph as g
from . import records as r
from .base import (
    Candidate,
    EntitySelect,
    NameKind,
    Query,
    RelationSelect,
    Seen,
    Select,
    Space,
    Stats,
    StoreBase,
    job_counts,
)

Run = Callable[[str, Sequence[Any]], list[Any]]  # runs one statement, returns its rows


class SQLStore(StoreBase):
    """`StoreBase` over SQL: subclasses set `dialect` and `tenant` and implement `_reader`,
    plus the engine-specific primitives (write, dense, lexical, claim_job, touch, reclaim)."""

    dialect: r.Dialect
    tenant: str = ""

    @abstractmethod
    def _reader(self) -> AbstractContextManager[Run]:
        """Runs statements on one connection (in this thread's open write, if any)."""

    def _db_bytes(self, run: Run) -> int | None:
        """The database's size on disk, where it is this store's alone."""
        return None

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._reader() as run:
            return run(sql, params)

    def read_memories(self, sel: Select) -> list[MemoryRecord]:
        d = self.dialect
        return [r.read_memory(d, row) for row in self._rows(sel, r.MEMORY_COLUMNS)]

    def read_ids(self, sel: Select) -> list[str]:
        return [row[0] for row in self._rows(sel, ("id",))]

    def candidates(self, ids: Sequence[str], query: Query | None = None) -> dict[str, Candidate]:
        out: dict[str, Candidate] = {}
        if ids:
            rows = self._rows(Select(ids=tuple(ids), seen=Seen.ALL, order=None), r.CANDIDATE_COLUMNS)
            r.read_candidates(self.dialect, rows, out)
        return out

    def _rows(self, sel: Select, names: tuple[str, ...]) -> list[Any]:
        """The rows of `sel`; a long list of ids is read a chunk at a time (the rows come in
        `sel`'s order within each chunk, the chunks in id order)."""
        d = self.dialect
        if sel.ids is None or len(sel.ids) <= d.chunk:
            return self._read(*r.select_memories(d, sel, self.tenant, names))
        ids = sorted(set(sel.ids))
        out: list[Any] = []
        with self._reader() as run:
            for i in range(0, len(ids), d.chunk):
                chunk = replace(sel, ids=tuple(ids[i:i + d.chunk]))
                out += run(*r.select_memories(d, chunk, self.tenant, names))
        return out

    def events(self, memory_id: str) -> list[Event]:
        d = self.dialect
        return [r.read_event(d, row) for row in self._read(*r.select_events(d, self.tenant, memory_id))]

    def events_of(self, type: str, scope: Scope, *, limit: int = 50) -> list[Event]:
        d = self.dialect
        stmt = r.select_events_of(d, self.tenant, type, scope, limit)
        return [r.read_event(d, row) for row in self._read(*stmt)]

    def count_events(self, type: str, scope: Scope, reason_prefix: str) -> int:
        ((n,),) = self._read(*r.count_events(self.dialect, self.tenant, type, scope, reason_prefix))
        return int(n)

    def read_jobs(self, *, id: str | None = None, key: str | None = None,
                  scope: Scope | None = None, status: str | None = None,
                  limit: int | None = None) -> list[Job]:
        d = self.dialect
        stmt = r.select_jobs(d, self.tenant, id=id, key=key, scope=scope, status=status, limit=limit)
        return [r.read_job(d, row) for row in self._read(*stmt)]

    def erasure_seq(self) -> int:
        ((seq,),) = self._read(*r.erasure_seq(self.dialect, self.tenant))
        return int(seq)

    def read_sessions(self, scope: Scope, *, exact: bool, limit: int) -> list[Session]:
        d = self.dialect
        stmt = r.select_sessions(d, self.tenant, scope, exact=exact, limit=limit)
        return [r.read_session(d, row) for row in self._read(*stmt)]

    def stats(self, scope: Scope, now: datetime) -> Stats:
        stmts = r.stats_statements(self.dialect, self.tenant, scope, now)
        with self._reader() as run:  # one connection: on PostgreSQL, one snapshot
            by_kind = {kind: int(n) for kind, n in run(*stmts["by_kind"])}
            ((deleted, superseded, expired),) = run(*stmts["hidden"])
            ((scopes,),) = run(*stmts["scopes"])
            ((events,),) = run(*stmts["events"])
            jobs = {status: int(n) for status, n in run(*stmts["jobs"])}
            size = self._db_bytes(run)
        return Stats(memories=sum(by_kind.values()), by_kind=by_kind, deleted=int(deleted),
                     superseded=int(superseded), expired=int(expired), events=int(events),
                     scopes=int(scopes), jobs=job_counts(jobs), db_bytes=size)


    def space(self) -> Space | None:
        rows = self._read(*r.select_space(self.dialect, self.tenant))
        return Space(*rows[0]) if rows else None

    # -- the knowledge graph (store/graph.py) ------------------------------------------------

    def read_entities(self, sel: EntitySelect) -> list[Entity]:
        d = self.dialect
        return [g.read_entity(d, row) for row in self._read(*g.select_entities(d, self.tenant, sel))]

    def match_names(self, scope: Scope, keys: Sequence[str]) -> list[tuple[str, str]]:
        d = self.dialect
        keys = sorted(set(keys))
        out: list[tuple[str, str]] = []
        with self._reader() as run:
            for i in range(0, len(keys), d.chunk):
                out += [(k, e) for k, e in run(*g.match_names(d, self.tenant, scope,
                                                              keys[i:i + d.chunk]))]
        return out

    def entity_embeddings(self, scope: Scope, *, exact: bool = False,
                          type: str | None = None) -> list[tuple[str, np.ndarray]]:
        rows = self._read(*g.select_embeddings(self.dialect, self.tenant, scope, exact, type))
        return [(eid, np.frombuffer(bytes(blob), dtype=np.float32)) for eid, blob in rows]

    def read_relations(self, sel: RelationSelect) -> list[Relation]:
        d = self.dialect
        return [g.read_relation(d, row)
                for row in self._read(*g.select_relations(d, self.tenant, sel))]

    def read_mentions(self, scope: Scope, *, entity_ids: Sequence[str] | None = None,
                      episode_ids: Sequence[str] | None = None,
                      limit: int | None = None) -> list[Mention]:
        d = self.dialect
        stmt = g.select_mentions(d, self.tenant, scope, entity_ids=entity_ids,
                                 episode_ids=episode_ids, limit=limit)
        return [g.read_mention(d, row) for row in self._read(*stmt)]

    def mention_counts(self, scope: Scope, entity_ids: Sequence[str]) -> dict[str, int]:
        if not entity_ids:
            return {}
        rows = self._read(*g.mention_counts(self.dialect, self.tenant, scope, entity_ids))
        return {eid: int(n) for eid, n in rows}

    def neighbours(self, scope: Scope, start: Sequence[str], depth: int, at: datetime,
                   as_of: bool = False) -> dict[str, int]:
        if not start:
            return {}
        stmt = g.neighbours(self.dialect, self.tenant, scope, start, depth,
                            "as_of" if as_of else "current", at)
        return {eid: int(n) for eid, n in self._read(*stmt)}

    def find_path(self, scope: Scope, a: str, b: str, max_depth: int, at: datetime,
             as_of: bool = False) -> list[str] | None:
        if a == b:
            return []
        stmt = g.path(self.dialect, self.tenant, scope, a, b, max_depth,
                      "as_of" if as_of else "current", at)
        rows = self._read(*stmt)
        return [x for x in rows[0][0].split(",") if x] if rows else None


class SQLTx:
    """The writes of `Tx` that are plain statements; a backend adds insert, update, soft_delete
    and erase (they maintain its indexes)."""

    dialect: r.Dialect
    tenant: str = ""
    unique_violation: type[Exception]  # what the driver raises on a taken unique key

    def _exec(self, sql: str, params: Sequence[Any] = ()) -> None:
        raise NotImplementedError

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        """The rows of a read inside the transaction. Both backends' transactions hold their
        connection as `conn` (sqlite3 or psycopg: `execute(...).fetchall()`)."""
        conn: Any = self.__dict__["conn"]
        return list(conn.execute(sql, params).fetchall())

    def _savepoint(self) -> AbstractContextManager[Any]:
        """Around a statement that may fail while the transaction should go on."""
        return nullcontext()

    def append(self, event: Event) -> None:
        self._exec(*r.insert_event(self.dialect, self.tenant, event))

    def put_job(self, job: Job) -> None:
        try:
            with self._savepoint():
                self._exec(*r.upsert_job(self.dialect, self.tenant, job))
        except self.unique_violation as exc:
            raise Conflict(f"idempotency key {job.key!r} is already used by another job") from exc

    def finish_job(self, job: Job) -> bool:
        return bool(self._rows(*r.finish_job(self.dialect, self.tenant, job)))

    def put_erasure(self, erasure: Erasure, *, forget_before: datetime) -> None:
        for stmt in r.put_erasure(self.dialect, self.tenant, erasure, forget_before):
            self._exec(*stmt)

    def erasures(self, after: int) -> list[Erasure]:
        d = self.dialect
        return [r.read_erasure(d, row) for row in self._rows(*r.select_erasures(d, self.tenant, after))]

    def put_session(self, session: Session) -> None:
        self._exec(*r.upsert_session(self.dialect, self.tenant, session))

    def delete_session(self, scope: Scope) -> None:
        self._exec(*r.delete_session(self.dialect, self.tenant, scope))

    def delete_jobs(self, ids: Sequence[str]) -> None:
        for i in range(0, len(ids), self.dialect.chunk):
            self._exec(*r.delete_jobs(self.dialect, self.tenant, ids[i:i + self.dialect.chunk]))

    def erase_scope(self, scope: Scope) -> None:
        for stmt in r.erase_scope(self.dialect, self.tenant, scope):
            self._exec(*stmt)

    def put_space(self, space: Space, *, first: bool = False) -> None:
        self._exec(*r.put_space(self.dialect, self.tenant, space, utcnow(), first=first))

    # -- the knowledge graph (store/graph.py) ------------------------------------------------

    def put_entity(self, entity: Entity, keys: Sequence[tuple[str, NameKind]],
                   embedding: np.ndarray | None = None) -> None:
        d = self.dialect
        self._exec(*g.upsert_entity(d, self.tenant, entity, embedding))
        for stmt in g.put_names(d, self.tenant, entity, keys):
            self._exec(*stmt)

    def add_entity(self, entity: Entity, keys: Sequence[tuple[str, NameKind]], key: str,
                   embedding: np.ndarray | None = None) -> str:
        d = self.dialect
        self._exec(*g.insert_entity(d, self.tenant, entity, embedding, key))
        rows = self._rows(*g.key_holder(d, self.tenant, entity.scope, key))
        holder = str(rows[0][0]) if rows else entity.id
        if holder == entity.id:
            for stmt in g.put_names(d, self.tenant, entity, keys):
                self._exec(*stmt)
        return holder

    def put_relation(self, relation: Relation) -> None:
        self._exec(*g.upsert_relation(self.dialect, self.tenant, relation))

    def put_mentions(self, mentions: Sequence[Mention]) -> None:
        for m in mentions:
            self._exec(*g.insert_mention(self.dialect, self.tenant, m))

    def erase_graph(self, entity_ids: Sequence[str] = (), relation_ids: Sequence[str] = ()) -> None:
        d = self.dialect
        for i in range(0, max(len(entity_ids), len(relation_ids)), d.chunk // 2):
            for stmt in g.erase_statements(d, self.tenant, list(entity_ids[i:i + d.chunk // 2]),
                                           list(relation_ids[i:i + d.chunk // 2])):
                self._exec(*stmt)

    def drop_mentions(self, episode_ids: Sequence[str]) -> None:
        d = self.dialect
        for i in range(0, len(episode_ids), d.chunk):
            self._exec(*g.drop_mentions(d, self.tenant, list(episode_ids[i:i + d.chunk])))

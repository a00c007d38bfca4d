"""What a stored row is, for every backend: column lists, row <-> value codecs and the visibility
rule, each written once; and the SQL both backends share, built without I/O for either dialect.

A `Dialect` holds what differs between SQLite and PostgreSQL (placeholders, how times and JSON
travel, tenants, how a list binds); every statement here renders for either.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal, NamedTuple

from ..filters import Condition
from ..model import Erasure, Event, EventType, Job, JobStatus, Kind, MemoryRecord, Scope, Session
from .base import Candidate, Query, Seen, Select, Space

Stmt = tuple[str, list[Any]]

MEMORY_COLUMNS = (
    "id", "user_id", "agent_id", "session_id", "kind", "text", "metadata", "importance", "role",
    "name", "created_at", "updated_at", "observed_at", "valid_from", "valid_to", "superseded_by",
    "provenance", "access_count", "last_accessed_at", "expires_at", "content_hash", "deleted_at",
)
CANDIDATE_COLUMNS = ("id", "user_id", "agent_id", "session_id", "name", "text", "observed_at",
                     "created_at", "importance", "role")
EVENT_COLUMNS = ("id", "memory_id", "type", "at", "user_id", "agent_id", "session_id", "before",
                 "after", "reason")
# `kind` holds `Job.task`: the column kept the name it was released with.
JOB_COLUMNS = ("id", "key", "fingerprint", "kind", "user_id", "agent_id", "session_id", "payload",
               "status", "attempts", "run_at", "lease_until", "result", "error", "created_at",
               "updated_at")
# `scope_key` makes (user_id, agent_id, session_id) one key even where some are NULL.
SESSION_COLUMNS = ("scope_key", "user_id", "agent_id", "session_id", "policy", "summary",
                   "summary_upto", "state", "metadata", "created_at", "updated_at", "ended_at")


def scope_key(scope: Scope) -> str:
    """One text key for a session's (user_id, agent_id, session_id), NULLs included."""
    return json.dumps([scope.user_id, scope.agent_id, scope.session_id])


@lru_cache(maxsize=64)
def columns(alias: str, names: tuple[str, ...]) -> str:
    return ", ".join(f"{alias}.{c}" for c in names)


@dataclass(frozen=True)
class Dialect:
    """What differs between the backends' SQL, as values and small conversion functions."""

    name: str
    mark: str        # the parameter placeholder
    tenant: bool     # every row carries a `tenant` column, and every statement filters on it
    seq: str         # the column that orders memories and events by insertion
    arrays: bool     # a list binds as one array parameter (`= ANY(%s)`), else as `IN (?, ...)`
    chunk: int       # ids per statement
    nulls_last: str  # what makes a DESC order put NULLs last ("" where it already does)
    time: Callable[[datetime], Any]
    read_time: Callable[[Any], datetime]
    json: Callable[[Any], Any]       # a JSON document as a parameter
    jsonb: Callable[[Any], Any]      # ... of `memories.metadata` (indexed as jsonb on PostgreSQL)
    read_json: Callable[[Any], Any]
    array: Callable[[Sequence[str]], Any]
    read_array: Callable[[Any], Iterable[str]]
    condition: Callable[[Condition], tuple[str, list[Any]]]  # a filter over alias `m`

    def marks(self, n: int) -> str:
        return ", ".join([self.mark] * n)

    def opt_time(self, value: datetime | None) -> Any:
        return None if value is None else self.time(value)

    def opt_read_time(self, value: Any) -> datetime | None:
        return None if value is None else self.read_time(value)

    def opt_json(self, value: Any) -> Any:
        return None if value is None else self.json(value)


class Where:
    """The conjuncts of a WHERE clause with their parameters, in order; the tenant first."""

    def __init__(self, d: Dialect, tenant: str, alias: str = "m") -> None:
        self.d = d
        self.alias = alias
        self.parts: list[str] = []
        self.params: list[Any] = []
        if d.tenant:
            self.add(f"{alias}.tenant = {d.mark}", tenant)

    def add(self, sql: str, *params: Any) -> Where:
        self.parts.append(sql)
        self.params.extend(params)
        return self

    def one_of(self, column: str, values: Sequence[Any]) -> Where:
        if self.d.arrays:
            return self.add(f"{column} = ANY({self.d.mark})", list(values))
        return self.add(f"{column} IN ({self.d.marks(len(values))})", *values)

    def scope(self, scope: Scope, exact: bool = False) -> Where:
        """A None field matches anything, unless `exact` (then it means NULL)."""
        for col, value in scope.as_dict().items():
            if value is not None:
                self.add(f"{self.alias}.{col} = {self.d.mark}", value)
            elif exact:
                self.add(f"{self.alias}.{col} IS NULL")
        return self

    @property
    def sql(self) -> str:
        return " AND ".join(self.parts) or "TRUE"


# -- the visibility rule ------------------------------------------------------------------------

class Bound(NamedTuple):
    """`column IS NULL OR column <op> at`: one time bound of the visibility rule."""

    column: Literal["expires_at", "valid_from", "valid_to"]
    op: Literal[">", "<="]
    at: datetime


def time_bounds(seen: Seen, now: datetime | None, as_of: datetime | None = None) -> tuple[Bound, ...]:
    """The time part of the visibility rule (SQL renders it in `visibility`, the SQLite dense
    cache in numpy): UNEXPIRED is not expired at `now`; VISIBLE adds valid at `as_of` when
    given, else current (not superseded) at `now`."""
    if seen in (Seen.ALL, Seen.LIVE):
        return ()
    if now is None:
        raise ValueError(f"a {seen.value} read needs `now`")
    bounds = [Bound("expires_at", ">", now)]
    if seen is Seen.VISIBLE:
        if as_of is not None:
            bounds += [Bound("valid_from", "<=", as_of), Bound("valid_to", ">", as_of)]
        else:
            bounds.append(Bound("valid_to", ">", now))
    return tuple(bounds)


def visibility(w: Where, sel: Select) -> Where:
    """Add the visibility rule to `w`: in scope, not deleted (unless everything is seen), the
    time bounds, of one of the kinds, matching every filter condition."""
    a, mark = w.alias, w.d.mark
    if sel.seen is not Seen.ALL:
        w.add(f"{a}.deleted_at IS NULL")
    for b in time_bounds(sel.seen, sel.now, sel.as_of):
        w.add(f"({a}.{b.column} IS NULL OR {a}.{b.column} {b.op} {mark})", w.d.time(b.at))
    w.scope(sel.scope, sel.exact)
    if sel.kinds:
        w.one_of(f"{a}.kind", [k.value for k in sel.kinds])
    for c in sel.conditions:
        sql, params = w.d.condition(c)
        w.add(sql, *params)
    return w


def where_memories(d: Dialect, sel: Select, tenant: str) -> Where:
    """Everything `sel` selects, over alias `m`."""
    w = Where(d, tenant)
    if sel.ids is not None:
        w.one_of("m.id", sel.ids)
    visibility(w, sel)
    if sel.content_hash is not None:
        w.add(f"m.content_hash = {d.mark}", sel.content_hash)
    if sel.after_id is not None:
        w.add(f"m.id > {d.mark}", sel.after_id)
    for anchor, op in ((sel.before, "<"), (sel.after, ">")):
        if anchor is not None:
            a = Where(d, tenant, alias="a").add(f"a.id = {d.mark}", anchor)
            w.add(f"(m.valid_from, m.{d.seq}) {op} "
                  f"(SELECT a.valid_from, a.{d.seq} FROM memories a WHERE {a.sql})", *a.params)
    return w


def compile_query(d: Dialect, query: Query, tenant: str) -> Stmt:
    """The WHERE clause (over alias `m`) selecting the memories `query` may see."""
    w = where_memories(d, Select.of(query), tenant)
    return w.sql, w.params


def select_memories(d: Dialect, sel: Select, tenant: str,
                    names: tuple[str, ...] = MEMORY_COLUMNS) -> Stmt:
    w = where_memories(d, sel, tenant)
    sql = f"SELECT {columns('m', names)} FROM memories m WHERE {w.sql}"
    if sel.order is not None:
        sql += " ORDER BY " + {"id": "m.id",
                               "newest": f"m.valid_from DESC{d.nulls_last}, m.{d.seq} DESC",
                               "oldest": f"m.valid_from, m.{d.seq}"}[sel.order]
    if sel.limit is not None:
        return f"{sql} LIMIT {d.mark}", [*w.params, sel.limit]
    return sql, w.params


# -- memory rows -----------------------------------------------------------------------------------

def memory_values(d: Dialect, r: MemoryRecord) -> list[Any]:
    """A record as the parameters of MEMORY_COLUMNS."""
    t = d.opt_time
    s = r.scope
    return [r.id, s.user_id, s.agent_id, s.session_id, r.kind.value, r.text, d.jsonb(r.metadata),
            r.importance, r.role, r.name, d.time(r.created_at), d.time(r.updated_at),
            t(r.observed_at), t(r.valid_from), t(r.valid_to), r.superseded_by,
            d.array(r.provenance), r.access_count, t(r.last_accessed_at), t(r.expires_at),
            r.content_hash, t(r.deleted_at)]


def read_memory(d: Dialect, row: Sequence[Any]) -> MemoryRecord:
    (mid, uid, aid, sid, kind, text, metadata, importance, role, name, created, updated, observed,
     valid_from, valid_to, superseded_by, provenance, access_count, accessed, expires, chash,
     deleted) = row
    t = d.opt_read_time
    return MemoryRecord(
        id=mid, scope=Scope(uid, aid, sid), kind=Kind(kind), text=text,
        metadata=d.read_json(metadata), importance=importance, role=role, name=name,
        created_at=d.read_time(created), updated_at=d.read_time(updated), observed_at=t(observed),
        valid_from=t(valid_from), valid_to=t(valid_to), superseded_by=superseded_by,
        provenance=tuple(d.read_array(provenance)), access_count=access_count,
        last_accessed_at=t(accessed), expires_at=t(expires), content_hash=chash,
        deleted_at=t(deleted))


def read_candidates(d: Dialect, rows: Iterable[Sequence[Any]], out: dict[str, Candidate]) -> None:
    """Rows of CANDIDATE_COLUMNS into `out`. Hundreds of candidates share a few scopes and
    times: each value is built once."""
    scopes: dict[tuple[Any, ...], Scope] = {}
    times: dict[Any, datetime | None] = {}
    for mid, uid, aid, sid, name, text, observed, created, importance, role in rows:
        scope = scopes.get((uid, aid, sid))
        if scope is None:
            scope = scopes[(uid, aid, sid)] = Scope(uid, aid, sid)
        if observed not in times:
            times[observed] = d.opt_read_time(observed)
        if created not in times:
            times[created] = d.read_time(created)
        out[mid] = Candidate(mid, scope, name, text, times[observed],
                             times[created], importance, role)  # type: ignore[arg-type]


# -- events -----------------------------------------------------------------------------------------

def insert_event(d: Dialect, tenant: str, e: Event) -> Stmt:
    s = e.scope
    values = [e.id, e.memory_id, e.type.value, d.time(e.at), s.user_id, s.agent_id, s.session_id,
              d.opt_json(e.before), d.opt_json(e.after), e.reason]
    return _insert(d, tenant, "events", EVENT_COLUMNS, values)


def select_events(d: Dialect, tenant: str, memory_id: str) -> Stmt:
    w = Where(d, tenant, "e").add(f"e.memory_id = {d.mark}", memory_id)
    return (f"SELECT {columns('e', EVENT_COLUMNS)} FROM events e WHERE {w.sql} "
            f"ORDER BY e.{d.seq}", w.params)


def select_events_of(d: Dialect, tenant: str, type: str, scope: Scope, limit: int) -> Stmt:
    """Events of one type in a scope (None fields match anything), newest first."""
    w = Where(d, tenant, "e").add(f"e.type = {d.mark}", type).scope(scope)
    return (f"SELECT {columns('e', EVENT_COLUMNS)} FROM events e WHERE {w.sql} "
            f"ORDER BY e.{d.seq} DESC LIMIT {int(limit)}", w.params)


def count_events(d: Dialect, tenant: str, type: str, scope: Scope, reason_prefix: str) -> Stmt:
    """How many events of a type in a scope have a reason starting with `reason_prefix`."""
    w = Where(d, tenant, "e").add(f"e.type = {d.mark}", type).scope(scope)
    w.add(f"substr(e.reason, 1, {len(reason_prefix)}) = {d.mark}", reason_prefix)
    return f"SELECT count(*) FROM events e WHERE {w.sql}", w.params


def delete_jobs(d: Dialect, tenant: str, ids: Sequence[str]) -> Stmt:
    w = Where(d, tenant).one_of("m.id", ids)
    return f"DELETE FROM jobs AS m WHERE {w.sql}", w.params


def read_event(d: Dialect, row: Sequence[Any]) -> Event:
    eid, mid, typ, at, uid, aid, sid, before, after, reason = row
    return Event(id=eid, memory_id=mid, type=EventType(typ), at=d.read_time(at),
                 scope=Scope(uid, aid, sid),
                 before=None if before is None else d.read_json(before),
                 after=None if after is None else d.read_json(after), reason=reason)


# -- jobs -------------------------------------------------------------------------------------------

def upsert_job(d: Dialect, tenant: str, j: Job) -> Stmt:
    s = j.scope
    values = [j.id, j.key, j.fingerprint, j.task, s.user_id, s.agent_id, s.session_id,
              d.json(j.payload), j.status.value, j.attempts, d.time(j.run_at),
              d.opt_time(j.lease_until), d.opt_json(j.result), j.error, d.time(j.created_at),
              d.time(j.updated_at)]
    return _upsert(d, tenant, "jobs", JOB_COLUMNS, values, "id")


def select_jobs(d: Dialect, tenant: str, *, id: str | None = None, key: str | None = None,
                scope: Scope | None = None, status: str | None = None,
                limit: int | None = None) -> Stmt:
    w = Where(d, tenant)
    if id is not None:
        w.add(f"m.id = {d.mark}", id)
    if key is not None:
        w.add(f"m.key = {d.mark}", key)
    if scope is not None:
        w.scope(scope)
    if status is not None:
        w.add(f"m.status = {d.mark}", status)
    sql = f"SELECT {columns('m', JOB_COLUMNS)} FROM jobs m WHERE {w.sql} ORDER BY m.id DESC"
    if limit is not None:
        return f"{sql} LIMIT {d.mark}", [*w.params, limit]
    return sql, w.params


def runnable_jobs(d: Dialect, tenant: str, now: datetime) -> Where:
    """Jobs a worker may claim at `now`: queued and due, or running with an expired lease."""
    t = d.time(now)
    return Where(d, tenant).add(f"((m.status = 'queued' AND m.run_at <= {d.mark}) OR "
                                f"(m.status = 'running' AND m.lease_until <= {d.mark}))", t, t)


def read_job(d: Dialect, row: Sequence[Any]) -> Job:
    (jid, key, fingerprint, task, uid, aid, sid, payload, status, attempts, run_at, lease_until,
     result, error, created, updated) = row
    return Job(id=jid, key=key, fingerprint=fingerprint, task=task, scope=Scope(uid, aid, sid),
               payload=d.read_json(payload), status=JobStatus(status), attempts=attempts,
               run_at=d.read_time(run_at), lease_until=d.opt_read_time(lease_until),
               result=None if result is None else d.read_json(result), error=error,
               created_at=d.read_time(created), updated_at=d.read_time(updated))


def finish_job(d: Dialect, tenant: str, j: Job) -> Stmt:
    """Replace a claimed job's row, only while it is running under the same claim."""
    names = ("payload", "status", "run_at", "lease_until", "result", "error", "updated_at")
    values = [d.json(j.payload), j.status.value, d.time(j.run_at), d.opt_time(j.lease_until),
              d.opt_json(j.result), j.error, d.time(j.updated_at)]
    w = Where(d, tenant, "jobs").add(f"jobs.id = {d.mark}", j.id)
    w.add(f"jobs.attempts = {d.mark}", j.attempts).add("jobs.status = 'running'")
    sets = ", ".join(f"{c} = {d.mark}" for c in names)
    return f"UPDATE jobs SET {sets} WHERE {w.sql} RETURNING jobs.id", [*values, *w.params]


# -- erasure marks (pipeline/fence.py) --------------------------------------------------------------

ERASURE_COLUMNS = ("user_id", "agent_id", "session_id", "target", "at")


def put_erasure(d: Dialect, tenant: str, e: Erasure, forget_before: datetime) -> list[Stmt]:
    old = Where(d, tenant).add(f"m.at < {d.mark}", d.time(forget_before))
    s = e.scope
    return [(f"DELETE FROM erasures AS m WHERE {old.sql}", old.params),
            _insert(d, tenant, "erasures", ERASURE_COLUMNS,
                    [s.user_id, s.agent_id, s.session_id, e.target, d.time(e.at)])]


def erasure_seq(d: Dialect, tenant: str) -> Stmt:
    w = Where(d, tenant)
    return f"SELECT coalesce(max(m.seq), 0) FROM erasures m WHERE {w.sql}", w.params


def select_erasures(d: Dialect, tenant: str, after: int) -> Stmt:
    w = Where(d, tenant).add(f"m.seq > {d.mark}", after)
    return (f"SELECT m.seq, {columns('m', ERASURE_COLUMNS)} FROM erasures m WHERE {w.sql} "
            "ORDER BY m.seq", w.params)


def read_erasure(d: Dialect, row: Sequence[Any]) -> Erasure:
    seq, uid, aid, sid, target, at = row
    return Erasure(scope=Scope(uid, aid, sid), target=target, at=d.read_time(at), seq=int(seq))


# -- sessions ---------------------------------------------------------------------------------------

def upsert_session(d: Dialect, tenant: str, sess: Session) -> Stmt:
    s = sess.scope
    values = [scope_key(s), s.user_id, s.agent_id, s.session_id, d.json(sess.policy), sess.summary,
              sess.summary_upto, d.json(sess.state), d.json(sess.metadata),
              d.time(sess.created_at), d.time(sess.updated_at), d.opt_time(sess.ended_at)]
    return _upsert(d, tenant, "sessions", SESSION_COLUMNS, values, "scope_key")


def select_sessions(d: Dialect, tenant: str, scope: Scope, *, exact: bool, limit: int) -> Stmt:
    w = Where(d, tenant)
    if exact:
        w.add(f"m.scope_key = {d.mark}", scope_key(scope))
    else:
        w.scope(scope)
    return (f"SELECT {columns('m', SESSION_COLUMNS)} FROM sessions m WHERE {w.sql} "
            f"ORDER BY m.updated_at DESC, m.scope_key LIMIT {d.mark}", [*w.params, limit])


def delete_session(d: Dialect, tenant: str, scope: Scope) -> Stmt:
    w = Where(d, tenant).add(f"m.scope_key = {d.mark}", scope_key(scope))
    return f"DELETE FROM sessions AS m WHERE {w.sql}", w.params


def erase_scope(d: Dialect, tenant: str, scope: Scope) -> list[Stmt]:
    """Sessions and jobs of a scope (None fields match anything)."""
    w = Where(d, tenant).scope(scope)
    return [(f"DELETE FROM {table} AS m WHERE {w.sql}", w.params) for table in ("sessions", "jobs")]


def read_session(d: Dialect, row: Sequence[Any]) -> Session:
    (_, uid, aid, sid, policy, summary, summary_upto, state, metadata, created, updated,
     ended) = row
    return Session(scope=Scope(uid, aid, sid), policy=d.read_json(policy), summary=summary,
                   summary_upto=summary_upto, state=d.read_json(state),
                   metadata=d.read_json(metadata), created_at=d.read_time(created),
                   updated_at=d.read_time(updated), ended_at=d.opt_read_time(ended))


# -- stats ------------------------------------------------------------------------------------------

def stats_statements(d: Dialect, tenant: str, scope: Scope, now: datetime) -> dict[str, Stmt]:
    """The counts of `Stats`: visible memories by kind; deleted, superseded and expired ones
    (one row); distinct scopes; events; jobs by status."""
    visible = where_memories(d, Select(scope=scope, seen=Seen.VISIBLE, now=now), tenant)
    mine = Where(d, tenant).scope(scope)
    events = Where(d, tenant, "e").scope(scope)
    t = d.time(now)
    return {
        "by_kind": (f"SELECT m.kind, count(*) FROM memories m WHERE {visible.sql} GROUP BY m.kind",
                    visible.params),
        "hidden": ("SELECT count(CASE WHEN m.deleted_at IS NOT NULL THEN 1 END), "
                   f"count(CASE WHEN m.deleted_at IS NULL AND m.valid_to <= {d.mark} THEN 1 END), "
                   f"count(CASE WHEN m.deleted_at IS NULL AND m.expires_at <= {d.mark} THEN 1 END) "
                   f"FROM memories m WHERE {mine.sql}", [t, t, *mine.params]),
        "scopes": ("SELECT count(*) FROM (SELECT DISTINCT m.user_id, m.agent_id, m.session_id "
                   f"FROM memories m WHERE {mine.sql}) s", mine.params),
        "events": (f"SELECT count(*) FROM events e WHERE {events.sql}", events.params),
        "jobs": (f"SELECT m.status, count(*) FROM jobs m WHERE {mine.sql} GROUP BY m.status",
                 mine.params),
    }


# -- the embedding space ------------------------------------------------------------------------------

def select_space(d: Dialect, tenant: str) -> Stmt:
    return f"SELECT space, pending, cursor FROM embedding_space WHERE tenant = {d.mark}", [tenant]


def put_space(d: Dialect, tenant: str, space: Space, now: datetime, *, first: bool) -> Stmt:
    """Name the space (`first`: only where none is named yet), and its unfinished reindex."""
    update = ("DO NOTHING" if first else "DO UPDATE SET space = excluded.space, "
              "pending = excluded.pending, cursor = excluded.cursor, "
              "updated_at = excluded.updated_at")
    return (f"INSERT INTO embedding_space (tenant, space, pending, cursor, updated_at) "
            f"VALUES ({d.marks(5)}) ON CONFLICT (tenant) {update}",
            [tenant, space.space, space.pending, space.cursor, d.time(now)])


# -- helpers ----------------------------------------------------------------------------------------

def _insert(d: Dialect, tenant: str, table: str, names: Sequence[str], values: list[Any]) -> Stmt:
    if d.tenant:
        names, values = ("tenant", *names), [tenant, *values]
    return f"INSERT INTO {table} ({', '.join(names)}) VALUES ({d.marks(len(names))})", values


def _upsert(d: Dialect, tenant: str, table: str, names: Sequence[str], values: list[Any],
            key: str) -> Stmt:
    """Insert, or replace every column of the row with the same `key` (in the same tenant)."""
    sql, params = _insert(d, tenant, table, names, values)
    target = f"tenant, {key}" if d.tenant else key
    sets = ", ".join(f"{c} = excluded.{c}" for c in names if c != key)
    return f"{sql} ON CONFLICT ({target}) DO UPDATE SET {sets}", params

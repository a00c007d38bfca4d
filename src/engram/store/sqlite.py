"""The embedded default store: one SQLite file (WAL, FTS5, vectors as float32 blobs).

The database is the source of truth. Dense search runs over an in-process matrix per scope,
a cache that is rebuilt (incrementally) from the `memory_keys` table whenever another writer
has changed it; a stale cache entry is caught by re-checking candidates against the table.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import Conflict, StoreBusy, StoreError
from ..filters import Condition
from ..model import Event, EventType, Job, JobStatus, Kind, MemoryRecord, Scope, Session
from .base import Candidate, Key, Lexical, Query, Stats

log = logging.getLogger("engram.store")

# Named migrations, applied in order, each in its own transaction. Never edit a released one:
# append a new one.
MIGRATIONS: list[tuple[str, list[str]]] = [
    ("0001_initial", [
        """CREATE TABLE memories (
            rid INTEGER PRIMARY KEY,
            id TEXT NOT NULL UNIQUE,
            user_id TEXT, agent_id TEXT, session_id TEXT,
            kind TEXT NOT NULL,
            text TEXT NOT NULL,
            metadata TEXT NOT NULL DEFAULT '{}',
            importance REAL NOT NULL,
            role TEXT, name TEXT,
            created_at REAL NOT NULL, updated_at REAL NOT NULL, observed_at REAL,
            valid_from REAL, valid_to REAL, superseded_by TEXT,
            provenance TEXT NOT NULL DEFAULT '[]',
            access_count INTEGER NOT NULL DEFAULT 0, last_accessed_at REAL,
            expires_at REAL,
            content_hash TEXT NOT NULL,
            deleted_at REAL)""",
        "CREATE INDEX memories_user ON memories(user_id, kind)",
        "CREATE INDEX memories_agent ON memories(agent_id)",
        "CREATE INDEX memories_session ON memories(session_id, valid_from)",
        "CREATE INDEX memories_hash ON memories(content_hash)",
        # AUTOINCREMENT: a key seq is never reused, because the dense cache loads only seqs
        # above the highest it has seen (a reused seq would keep its old cached vector).
        """CREATE TABLE memory_keys (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            memory_id TEXT NOT NULL REFERENCES memories(id) ON DELETE CASCADE,
            kind TEXT NOT NULL,
            vector BLOB NOT NULL)""",
        "CREATE INDEX memory_keys_memory ON memory_keys(memory_id)",
        # `owner` holds opaque scope tokens, so a lexical search intersects with its scope
        # inside the index instead of scoring every tenant's matches and dropping most.
        "CREATE VIRTUAL TABLE memory_fts USING fts5(body, context, owner, "
        "tokenize='porter unicode61 remove_diacritics 2')",
        """CREATE TABLE events (
            rid INTEGER PRIMARY KEY,
            id TEXT NOT NULL UNIQUE,
            memory_id TEXT,
            type TEXT NOT NULL,
            at REAL NOT NULL,
            user_id TEXT, agent_id TEXT, session_id TEXT,
            before TEXT, after TEXT, reason TEXT)""",
        "CREATE INDEX events_memory ON events(memory_id)",
        "CREATE INDEX events_scope ON events(user_id, agent_id, session_id)",
        "CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
        "INSERT INTO meta(name, value) VALUES ('keys_version', 0)",
    ]),
    # What the dense cache needs to follow the database without asking it about each
    # candidate: a deleted key leaves a tombstone (its seq, nothing else), and a change to a
    # column that visibility depends on bumps `rows_version`.
    ("0002_dense_cache_log", [
        "CREATE TABLE key_tombstones (id INTEGER PRIMARY KEY AUTOINCREMENT, seq INTEGER NOT NULL)",
        "CREATE TRIGGER memory_keys_tombstone AFTER DELETE ON memory_keys "
        "BEGIN INSERT INTO key_tombstones(seq) VALUES (old.seq); END",
        "INSERT INTO meta(name, value) VALUES ('rows_version', 0)",
        """CREATE TRIGGER memories_visibility AFTER UPDATE OF deleted_at, expires_at, valid_from,
               valid_to, kind, user_id, agent_id, session_id ON memories
           WHEN old.deleted_at IS NOT new.deleted_at OR old.expires_at IS NOT new.expires_at
             OR old.valid_from IS NOT new.valid_from OR old.valid_to IS NOT new.valid_to
             OR old.kind IS NOT new.kind OR old.user_id IS NOT new.user_id
             OR old.agent_id IS NOT new.agent_id OR old.session_id IS NOT new.session_id
           BEGIN UPDATE meta SET value = value + 1 WHERE name = 'rows_version'; END""",
    ]),
    ("0003_jobs_sessions", [
        """CREATE TABLE jobs (
            id TEXT PRIMARY KEY,
            key TEXT UNIQUE,
            fingerprint TEXT,
            kind TEXT NOT NULL,
            user_id TEXT, agent_id TEXT, session_id TEXT,
            payload TEXT NOT NULL,
            status TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            run_at REAL NOT NULL,
            lease_until REAL,
            result TEXT, error TEXT,
            created_at REAL NOT NULL, updated_at REAL NOT NULL)""",
        "CREATE INDEX jobs_runnable ON jobs(status, run_at)",
        "CREATE INDEX jobs_scope ON jobs(user_id, agent_id, session_id)",
        # `scope_key` makes (user_id, agent_id, session_id) one key even where some are NULL.
        """CREATE TABLE sessions (
            scope_key TEXT PRIMARY KEY,
            user_id TEXT, agent_id TEXT, session_id TEXT NOT NULL,
            policy TEXT NOT NULL, summary TEXT NOT NULL, summary_upto TEXT,
            state TEXT NOT NULL, metadata TEXT NOT NULL,
            created_at REAL NOT NULL, updated_at REAL NOT NULL, ended_at REAL)""",
        "CREATE INDEX sessions_user ON sessions(user_id, updated_at)",
    ]),
]

_JOB_COLUMNS = ("id", "key", "fingerprint", "kind", "user_id", "agent_id", "session_id", "payload",
                "status", "attempts", "run_at", "lease_until", "result", "error", "created_at",
                "updated_at")
_SESSION_COLUMNS = ("scope_key", "user_id", "agent_id", "session_id", "policy", "summary",
                    "summary_upto", "state", "metadata", "created_at", "updated_at", "ended_at")

_COLUMNS = (
    "id", "user_id", "agent_id", "session_id", "kind", "text", "metadata", "importance", "role",
    "name", "created_at", "updated_at", "observed_at", "valid_from", "valid_to", "superseded_by",
    "provenance", "access_count", "last_accessed_at", "expires_at", "content_hash", "deleted_at",
)
_SELECT = "SELECT " + ", ".join(f"m.{c}" for c in _COLUMNS) + " FROM memories m"
_RECORD_COLUMNS = {"created_at", "updated_at", "observed_at", "valid_from", "valid_to",
                   "expires_at", "last_accessed_at", "importance", "access_count", "role",
                   "name", "kind", "id"}


def _ts(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def _dt(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def _row_to_record(row: Sequence[Any]) -> MemoryRecord:
    r = dict(zip(_COLUMNS, row, strict=True))
    return MemoryRecord(
        id=r["id"], scope=Scope(r["user_id"], r["agent_id"], r["session_id"]),
        kind=Kind(r["kind"]), text=r["text"], metadata=json.loads(r["metadata"]),
        importance=r["importance"], role=r["role"], name=r["name"],
        created_at=_dt(r["created_at"]), updated_at=_dt(r["updated_at"]),  # type: ignore[arg-type]
        observed_at=_dt(r["observed_at"]), valid_from=_dt(r["valid_from"]),
        valid_to=_dt(r["valid_to"]), superseded_by=r["superseded_by"],
        provenance=tuple(json.loads(r["provenance"])), access_count=r["access_count"],
        last_accessed_at=_dt(r["last_accessed_at"]), expires_at=_dt(r["expires_at"]),
        content_hash=r["content_hash"], deleted_at=_dt(r["deleted_at"]),
    )


def _record_values(rec: MemoryRecord) -> list[Any]:
    return [
        rec.id, rec.scope.user_id, rec.scope.agent_id, rec.scope.session_id, rec.kind.value,
        rec.text, json.dumps(rec.metadata, ensure_ascii=False), rec.importance, rec.role,
        rec.name, _ts(rec.created_at), _ts(rec.updated_at), _ts(rec.observed_at),
        _ts(rec.valid_from), _ts(rec.valid_to), rec.superseded_by, json.dumps(list(rec.provenance)),
        rec.access_count, _ts(rec.last_accessed_at), _ts(rec.expires_at), rec.content_hash,
        _ts(rec.deleted_at),
    ]


def _row_to_event(row: Sequence[Any]) -> Event:
    eid, mid, typ, at, uid, aid, sid, before, after, reason = row
    return Event(id=eid, memory_id=mid, type=EventType(typ), at=_dt(at),  # type: ignore[arg-type]
                 scope=Scope(uid, aid, sid), before=json.loads(before) if before else None,
                 after=json.loads(after) if after else None, reason=reason)


def _job_values(job: Job) -> list[Any]:
    s = job.scope
    return [job.id, job.key, job.fingerprint, job.task, s.user_id, s.agent_id, s.session_id,
            json.dumps(job.payload, ensure_ascii=False), job.status.value, job.attempts,
            _ts(job.run_at), _ts(job.lease_until),
            None if job.result is None else json.dumps(job.result, ensure_ascii=False), job.error,
            _ts(job.created_at), _ts(job.updated_at)]


def _row_to_job(row: Sequence[Any]) -> Job:
    r = dict(zip(_JOB_COLUMNS, row, strict=True))
    return Job(id=r["id"], key=r["key"], fingerprint=r["fingerprint"], task=r["kind"],
               scope=Scope(r["user_id"], r["agent_id"], r["session_id"]),
               payload=json.loads(r["payload"]), status=JobStatus(r["status"]),
               attempts=r["attempts"], run_at=_dt(r["run_at"]),  # type: ignore[arg-type]
               lease_until=_dt(r["lease_until"]),
               result=None if r["result"] is None else json.loads(r["result"]), error=r["error"],
               created_at=_dt(r["created_at"]), updated_at=_dt(r["updated_at"]))  # type: ignore[arg-type]


def scope_key(scope: Scope) -> str:
    return json.dumps([scope.user_id, scope.agent_id, scope.session_id])


def _session_values(sess: Session) -> list[Any]:
    s = sess.scope
    return [scope_key(s), s.user_id, s.agent_id, s.session_id,
            json.dumps(sess.policy, ensure_ascii=False), sess.summary, sess.summary_upto,
            json.dumps(sess.state, ensure_ascii=False), json.dumps(sess.metadata, ensure_ascii=False),
            _ts(sess.created_at), _ts(sess.updated_at), _ts(sess.ended_at)]


def _row_to_session(row: Sequence[Any]) -> Session:
    r = dict(zip(_SESSION_COLUMNS, row, strict=True))
    return Session(scope=Scope(r["user_id"], r["agent_id"], r["session_id"]),
                   policy=json.loads(r["policy"]), summary=r["summary"],
                   summary_upto=r["summary_upto"], state=json.loads(r["state"]),
                   metadata=json.loads(r["metadata"]),
                   created_at=_dt(r["created_at"]), updated_at=_dt(r["updated_at"]),  # type: ignore[arg-type]
                   ended_at=_dt(r["ended_at"]))


def owner_tokens(scope: Scope) -> list[str]:
    """Opaque full-text tokens for the set fields of a scope (letters and digits only, so the
    tokenizer keeps each whole; hashed, so ids of any shape fit)."""
    return ["o" + hashlib.sha256(f"{field}\x1f{value}".encode()).hexdigest()[:24]
            for field, value in scope.as_dict().items() if value is not None]


def _scope_sql(scope: Scope, exact: bool = False) -> tuple[list[str], list[Any]]:
    """Scope conditions. A `None` field matches anything, unless `exact` (then it means NULL)."""
    sql: list[str] = []
    params: list[Any] = []
    for col, value in scope.as_dict().items():
        if value is not None:
            sql.append(f"m.{col} = ?")
            params.append(value)
        elif exact:
            sql.append(f"m.{col} IS NULL")
    return sql, params


def _condition_sql(c: Condition) -> tuple[str, list[Any]]:
    target = "json_extract(m.metadata, ?)" if c.metadata else f"m.{c.field}"
    tparams: list[Any] = [f'$."{c.field}"'] if c.metadata else []
    if c.field in _RECORD_COLUMNS and not c.metadata:
        assert c.field in _RECORD_COLUMNS  # column names come from a closed set
    if c.op == "eq":
        if c.value is None:
            return f"{target} IS NULL", tparams
        return f"{target} = ?", [*tparams, c.value]
    if c.op == "ne":
        return f"{target} IS NOT ?", [*tparams, c.value]
    if c.op in ("in", "nin"):
        marks = ", ".join("?" * len(c.value))
        if c.op == "in":
            return f"{target} IN ({marks})", [*tparams, *c.value]
        return f"({target} IS NULL OR {target} NOT IN ({marks}))", [*tparams, *tparams, *c.value]
    sym = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}[c.op]
    return f"{target} {sym} ?", [*tparams, c.value]


def compile_query(q: Query) -> tuple[str, list[Any]]:
    """The WHERE clause (over alias `m`) selecting the memories `q` may see."""
    now = q.now.timestamp()
    sql = ["m.deleted_at IS NULL", "(m.expires_at IS NULL OR m.expires_at > ?)"]
    params: list[Any] = [now]
    s_sql, s_params = _scope_sql(q.scope)
    sql += s_sql
    params += s_params
    if q.kinds:
        sql.append(f"m.kind IN ({', '.join('?' * len(q.kinds))})")
        params += [k.value for k in q.kinds]
    if q.as_of is not None:
        t = q.as_of.timestamp()
        sql.append("(m.valid_from IS NULL OR m.valid_from <= ?) AND (m.valid_to IS NULL OR m.valid_to > ?)")
        params += [t, t]
    else:
        sql.append("(m.valid_to IS NULL OR m.valid_to > ?)")
        params.append(now)
    for c in q.conditions:
        c_sql, c_params = _condition_sql(c)
        sql.append(c_sql)
        params += c_params
    return " AND ".join(sql), params


_KIND_CODES = {k.value: i for i, k in enumerate(Kind)}


class _Slab:
    """Vectors of one scope and key kind in a growable float32 matrix (a cache of `memory_keys`).

    Each row also caches what visibility depends on (its memory's kind, expiry and validity,
    and whether the key and memory still exist), so a search outside a write filters in numpy
    instead of asking the database about each candidate. The cache is exact as of the
    `keys_version` / `rows_version` it was refreshed at: new keys are loaded by seq, deleted
    ones cleared from `key_tombstones`, and a changed row (`rows_version`) reloads the
    attributes of the whole slab.
    """

    def __init__(self, dim: int) -> None:
        cap = 1024
        self.mat = np.zeros((cap, dim), dtype=np.float32)
        self.seqs = np.zeros(cap, dtype=np.int64)
        self.alive = np.zeros(cap, dtype=bool)     # the key row exists (and its memory did)
        self.ok = np.zeros(cap, dtype=bool)        # its memory is in scope and not deleted
        self.kind = np.zeros(cap, dtype=np.int8)
        self.expires = np.full(cap, np.nan)
        self.valid_from = np.full(cap, np.nan)
        self.valid_to = np.full(cap, np.nan)
        self.memory_ids: list[str] = []
        self.n = 0
        self.max_seq = 0
        self.version = -1
        self.rows_version = -1  # the rows_version the attributes are exact for; -1: unknown
        self.tomb_max = -1      # the last tombstone applied; -1: not read yet

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * len(self.seqs))
        self.mat = np.resize(self.mat, (cap, self.mat.shape[1]))
        for name in ("seqs", "alive", "ok", "kind", "expires", "valid_from", "valid_to"):
            setattr(self, name, np.resize(getattr(self, name), cap))

    def append(self, seqs: list[int], mids: list[str], vecs: np.ndarray,
               attrs: Sequence[Sequence[Any]] = ()) -> None:
        """Add rows in seq order; `attrs` holds (kind, expires_at, valid_from, valid_to) each."""
        need = self.n + len(seqs)
        if need > len(self.seqs):
            self._grow(need)
        self.mat[self.n:need] = vecs
        self.seqs[self.n:need] = seqs
        self.alive[self.n:need] = True
        self.ok[self.n:need] = True
        if attrs:
            self._set_attrs(np.arange(self.n, need), attrs)
        self.memory_ids.extend(mids)
        self.n = need
        if seqs:
            self.max_seq = max(self.max_seq, max(seqs))

    def _set_attrs(self, idx: np.ndarray, attrs: Sequence[Sequence[Any]]) -> None:
        self.kind[idx] = [_KIND_CODES.get(a[0], -1) for a in attrs]
        for col, name in enumerate(("expires", "valid_from", "valid_to"), start=1):
            getattr(self, name)[idx] = np.array([a[col] for a in attrs], dtype=np.float64)

    def rows_of(self, seqs: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Slab row of each seq (seqs are stored ascending) and which of them are held."""
        want = np.asarray(seqs, dtype=np.int64)
        pos = np.searchsorted(self.seqs[:self.n], want)
        held = pos < self.n
        held[held] = self.seqs[pos[held]] == want[held]
        return pos, held

    def kill(self, seqs: Sequence[int]) -> None:
        pos, held = self.rows_of(seqs)
        self.alive[pos[held]] = False

    def reset_attrs(self, rows: Sequence[Sequence[Any]]) -> None:
        """Replace every row's attributes: `rows` are (seq, kind, expires, valid_from, valid_to)
        of the keys whose memory is in scope and not deleted; the others are not ok."""
        self.ok[:self.n] = False
        if not rows:
            return
        pos, held = self.rows_of([r[0] for r in rows])
        idx = pos[held]
        self.ok[idx] = True
        self._set_attrs(idx, [r[1:] for r, h in zip(rows, held, strict=True) if h])

    def visible(self, query: Query) -> np.ndarray:
        """Rows `query` may see, except for its metadata conditions (what `compile_query`
        selects, on the cached attributes; NaN stands for NULL)."""
        n = self.n
        now = query.now.timestamp()
        mask = self.alive[:n] & self.ok[:n]
        exp = self.expires[:n]
        mask &= np.isnan(exp) | (exp > now)
        if query.kinds:
            mask &= np.isin(self.kind[:n], [_KIND_CODES[k.value] for k in query.kinds])
        vt = self.valid_to[:n]
        if query.as_of is not None:
            t = query.as_of.timestamp()
            vf = self.valid_from[:n]
            mask &= (np.isnan(vf) | (vf <= t)) & (np.isnan(vt) | (vt > t))
        else:
            mask &= np.isnan(vt) | (vt > now)
        return mask


class SQLiteStore:
    """`Store` over one SQLite file; safe across threads and processes."""

    MAX_SLABS = 16

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._slabs: OrderedDict[tuple[Any, ...], _Slab] = OrderedDict()
        self._slabs_lock = threading.Lock()
        self._closed = False
        self._migrate()

    # -- connections -------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise StoreError("the store is closed")
            try:
                conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s,
                                       isolation_level=None, check_same_thread=False)
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = FULL")
                conn.execute("PRAGMA secure_delete = ON")
                conn.execute("PRAGMA foreign_keys = ON")
            except sqlite3.Error as exc:
                raise StoreError(f"cannot open {self.path}: {exc}") from exc
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def close(self) -> None:
        self._closed = True
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        self._local = threading.local()

    @contextmanager
    def write(self) -> Iterator[_SQLiteTx]:
        """One write transaction (BEGIN IMMEDIATE), retried while another process holds the lock."""
        conn = self._conn()
        deadline = time.monotonic() + self.busy_timeout_s
        delay = 0.005
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise StoreError(str(exc)) from exc
                if time.monotonic() > deadline:
                    raise StoreBusy(f"{self.path} stayed locked for {self.busy_timeout_s}s") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
        tx = _SQLiteTx(conn, self._local)
        try:
            yield tx
            if tx.keys_changed:
                conn.execute("UPDATE meta SET value = value + 1 WHERE name = 'keys_version'")
            conn.execute("COMMIT")
        except BaseException as exc:
            conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"write failed and was rolled back: {exc}") from exc
            raise
        finally:
            self._local.dirty = False

    def _migrate(self) -> None:
        with self.write() as tx:
            c = tx.conn
            c.execute("CREATE TABLE IF NOT EXISTS schema_migrations "
                      "(name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
            done = {r[0] for r in c.execute("SELECT name FROM schema_migrations")}
            for name, statements in MIGRATIONS:
                if name in done:
                    continue
                for stmt in statements:
                    c.execute(stmt)
                c.execute("INSERT INTO schema_migrations VALUES (?, ?)", (name, time.time()))
                log.info("applied migration %s to %s", name, self.path)

    def migrations(self) -> list[str]:
        return [r[0] for r in self._conn().execute("SELECT name FROM schema_migrations ORDER BY name")]

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        try:
            return self._conn().execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(str(exc)) from exc

    # -- reads -------------------------------------------------------------------------------

    def get(self, ids: Sequence[str]) -> dict[str, MemoryRecord]:
        out: dict[str, MemoryRecord] = {}
        for chunk in _chunks(list(ids), 500):
            rows = self._read(f"{_SELECT} WHERE m.id IN ({', '.join('?' * len(chunk))})", chunk)
            out.update((r[0], _row_to_record(r)) for r in rows)
        return out

    def candidates(self, ids: Sequence[str]) -> dict[str, Candidate]:
        out: dict[str, Candidate] = {}
        # Hundreds of candidates share a few scopes and times: build each value once.
        scopes: dict[tuple[Any, ...], Scope] = {}
        times: dict[float | None, datetime | None] = {}
        for chunk in _chunks(list(ids), 900):
            rows = self._read(
                "SELECT id, user_id, agent_id, session_id, name, text, observed_at, created_at, "
                f"importance FROM memories WHERE id IN ({', '.join('?' * len(chunk))})", chunk)
            for mid, uid, aid, sid, name, text, obs, created, imp in rows:
                scope = scopes.get((uid, aid, sid))
                if scope is None:
                    scope = scopes[(uid, aid, sid)] = Scope(uid, aid, sid)
                if obs not in times:
                    times[obs] = _dt(obs)
                if created not in times:
                    times[created] = _dt(created)
                out[mid] = Candidate(mid, scope, name, text, times[obs],
                                     times[created], imp)  # type: ignore[arg-type]
        return out

    def select(self, query: Query, *, after_id: str | None = None,
               limit: int = 50) -> list[MemoryRecord]:
        where, params = compile_query(query)
        if after_id is not None:
            where += " AND m.id > ?"
            params.append(after_id)
        rows = self._read(f"{_SELECT} WHERE {where} ORDER BY m.id LIMIT ?", [*params, limit])
        return [_row_to_record(r) for r in rows]

    def ids(self, scope: Scope, *, include_deleted: bool = False) -> list[str]:
        sql, params = _scope_sql(scope)
        if not include_deleted:
            sql.append("m.deleted_at IS NULL")
        where = " AND ".join(sql) or "1"
        return [r[0] for r in self._read(f"SELECT m.id FROM memories m WHERE {where} ORDER BY m.id", params)]

    def _visible(self, query: Query, ids: Sequence[str]) -> set[str]:
        where, params = compile_query(query)
        out: set[str] = set()
        for chunk in _chunks(list(ids), 500):
            rows = self._read(f"SELECT m.id FROM memories m WHERE m.id IN ({', '.join('?' * len(chunk))}) "
                              f"AND {where}", [*chunk, *params])
            out.update(r[0] for r in rows)
        return out

    def _slab(self, scope: Scope, key_name: str, dim: int) -> tuple[_Slab, bool]:
        """The scope's cache, refreshed; and whether it is exact (its visibility attributes
        may be used instead of re-checking candidates against the tables)."""
        meta = dict(self._read("SELECT name, value FROM meta"))
        version: int = meta["keys_version"]
        rows_version: int = meta["rows_version"]
        in_tx = self._conn().in_transaction
        key = (scope.user_id, scope.agent_id, scope.session_id, key_name)
        s_sql, s_params = _scope_sql(scope)
        with self._slabs_lock:
            slab = self._slabs.get(key)
            if slab is None or slab.mat.shape[1] != dim:
                slab = _Slab(dim)
                self._slabs[key] = slab
            self._slabs.move_to_end(key)
            while len(self._slabs) > self.MAX_SLABS:
                self._slabs.popitem(last=False)
            # Inside a write that already changed keys, this connection sees rows that may yet
            # roll back: use the cache as it is (committed state) rather than load them.
            if slab.version != version and not getattr(self._local, "dirty", False):
                # Tombstones first, then keys: a key deleted in between is either not
                # loaded or leaves a tombstone past `tomb_max`, applied next time.
                if slab.tomb_max < 0:
                    slab.tomb_max = self._read(
                        "SELECT coalesce(max(id), 0) FROM key_tombstones")[0][0]
                else:
                    dead = self._read("SELECT id, seq FROM key_tombstones WHERE id > ? "
                                      "ORDER BY id", [slab.tomb_max])
                    if dead:
                        slab.kill([r[1] for r in dead])
                        slab.tomb_max = dead[-1][0]
                where = " AND ".join(["k.seq > ?", "k.kind = ?", "m.deleted_at IS NULL", *s_sql])
                rows = self._read(
                    "SELECT k.seq, k.memory_id, k.vector, m.kind, m.expires_at, m.valid_from, "
                    f"m.valid_to FROM memory_keys k JOIN memories m ON m.id = k.memory_id "
                    f"WHERE {where} ORDER BY k.seq", [slab.max_seq, key_name, *s_params])
                if rows:
                    vecs = np.frombuffer(b"".join(r[2] for r in rows), dtype=np.float32)
                    slab.append([r[0] for r in rows], [r[1] for r in rows],
                                vecs.reshape(len(rows), dim), [r[3:] for r in rows])
                    if in_tx:  # their rows may carry this write's uncommitted changes
                        slab.rows_version = -1
                slab.version = version
            if not in_tx and slab.rows_version != rows_version:
                where = " AND ".join(["k.kind = ?", "k.seq <= ?", "m.deleted_at IS NULL", *s_sql])
                slab.reset_attrs(self._read(
                    "SELECT k.seq, m.kind, m.expires_at, m.valid_from, m.valid_to "
                    f"FROM memory_keys k JOIN memories m ON m.id = k.memory_id WHERE {where}",
                    [key_name, slab.max_seq, *s_params]))
                slab.rows_version = rows_version
            exact = not in_tx and slab.version == version and slab.rows_version == rows_version
            return slab, exact

    def dense(self, query: Query, vector: np.ndarray, k: int,
              key: str = "text") -> list[tuple[str, float]]:
        vector = np.asarray(vector, dtype=np.float32)
        slab, exact = self._slab(query.scope, key, vector.shape[0])
        if exact:
            with self._slabs_lock:
                rows = np.flatnonzero(slab.visible(query))
                sims = slab.mat[rows] @ vector if len(rows) < slab.n // 2 else \
                    (slab.mat[:slab.n] @ vector)[rows]
                mids = slab.memory_ids
                # Without metadata conditions the cache decides; with them, the database
                # checks the best candidates in growing pools.
                pool = min(len(rows), k if not query.conditions else 4 * k + 64)
                while True:
                    top = np.argpartition(-sims, pool - 1)[:pool] if pool < len(rows) \
                        else np.arange(len(rows))
                    top = top[np.argsort(-sims[top], kind="stable")]
                    best: dict[str, float] = {}
                    for i in top:
                        best.setdefault(mids[rows[i]], float(sims[i]))
                    if query.conditions:
                        visible = self._visible(query, list(best))
                        best = {mid: s for mid, s in best.items() if mid in visible}
                    if len(best) >= k or pool >= len(rows):
                        return list(best.items())[:k]
                    pool = min(len(rows), pool * 4)
        # Inside a write: check each candidate against the tables.
        with self._slabs_lock:
            n = slab.n
            sims = slab.mat[:n] @ vector
            sims[~slab.alive[:n]] = -np.inf
            seqs = slab.seqs[:n].copy()
            mids = slab.memory_ids[:n]
        pool = min(n, 4 * k + 64)
        while True:
            top = np.argpartition(-sims, pool - 1)[:pool] if pool < n else np.arange(n)
            top = top[np.isfinite(sims[top])]
            top = top[np.argsort(-sims[top], kind="stable")]
            alive = self._alive_seqs([int(seqs[i]) for i in top])
            dead = [i for i in top if int(seqs[i]) not in alive]
            # Not from inside a write: a key it deleted comes back if the write rolls back.
            if dead and not self._conn().in_transaction:
                with self._slabs_lock:
                    slab.alive[dead] = False
            best = {}
            for i in top:
                if int(seqs[i]) in alive and mids[i] not in best:
                    best[mids[i]] = float(sims[i])
            visible = self._visible(query, list(best))
            hits = [(mid, s) for mid, s in best.items() if mid in visible]
            if len(hits) >= k or pool >= n:
                return hits[:k]
            pool = min(n, pool * 4)

    def _alive_seqs(self, seqs: list[int]) -> set[int]:
        out: set[int] = set()
        for chunk in _chunks(seqs, 500):
            marks = ", ".join("?" * len(chunk))
            rows = self._read(f"SELECT seq FROM memory_keys WHERE seq IN ({marks})", chunk)
            out.update(r[0] for r in rows)
        return out

    def lexical(self, query: Query, terms: Sequence[str], k: int,
                previous_weight: float = 0.5) -> list[tuple[str, float]]:
        if not terms:
            return []
        match = "(" + " OR ".join('"' + t.replace('"', '""') + '"' for t in terms) + ")"
        owners = owner_tokens(query.scope)
        if owners:
            match = " AND ".join([*(f'owner : "{o}"' for o in owners), match])
        where, params = compile_query(query)
        rows = self._read(
            "SELECT m.id, -bm25(memory_fts, 1.0, ?, 0.0) AS s FROM memory_fts "
            f"JOIN memories m ON m.rid = memory_fts.rowid WHERE memory_fts MATCH ? AND {where} "
            "ORDER BY s DESC LIMIT ?", [previous_weight, match, *params, k])
        return [(r[0], float(r[1])) for r in rows]

    def find_hash(self, scope: Scope, kind: Kind, content_hash: str,
                  now: datetime) -> MemoryRecord | None:
        s_sql, s_params = _scope_sql(scope, exact=True)
        t = now.timestamp()
        rows = self._read(
            f"{_SELECT} WHERE m.content_hash = ? AND m.kind = ? AND m.deleted_at IS NULL "
            "AND (m.expires_at IS NULL OR m.expires_at > ?) AND (m.valid_to IS NULL OR m.valid_to > ?) "
            f"AND {' AND '.join(s_sql)} LIMIT 1", [content_hash, kind.value, t, t, *s_params])
        return _row_to_record(rows[0]) if rows else None

    def recent_episodes(self, scope: Scope, n: int) -> list[MemoryRecord]:
        s_sql, s_params = _scope_sql(scope, exact=True)
        rows = self._read(
            f"{_SELECT} WHERE m.kind = 'episodic' AND m.deleted_at IS NULL AND {' AND '.join(s_sql)} "
            "ORDER BY m.valid_from DESC, m.rid DESC LIMIT ?", [*s_params, n])
        return [_row_to_record(r) for r in rows]

    def episodes_around(self, id: str, n: int) -> tuple[list[MemoryRecord], list[MemoryRecord]]:
        rows = self._read("SELECT m.user_id, m.agent_id, m.session_id, m.valid_from, m.rid "
                          "FROM memories m WHERE m.id = ? AND m.kind = 'episodic'", [id])
        if not rows:
            return [], []
        uid, aid, sid, vf, rid = rows[0]
        same = ("m.kind = 'episodic' AND m.deleted_at IS NULL AND m.user_id IS ? "
                "AND m.agent_id IS ? AND m.session_id IS ?")
        before = self._read(
            f"{_SELECT} WHERE {same} AND (m.valid_from < ? OR (m.valid_from = ? AND m.rid < ?)) "
            "ORDER BY m.valid_from DESC, m.rid DESC LIMIT ?", [uid, aid, sid, vf, vf, rid, n])
        after = self._read(
            f"{_SELECT} WHERE {same} AND (m.valid_from > ? OR (m.valid_from = ? AND m.rid > ?)) "
            "ORDER BY m.valid_from, m.rid LIMIT ?", [uid, aid, sid, vf, vf, rid, n])
        return [_row_to_record(r) for r in reversed(before)], [_row_to_record(r) for r in after]

    def eviction_pool(self, scope: Scope, now: datetime) -> list[MemoryRecord]:
        s_sql, s_params = _scope_sql(scope, exact=True)
        t = now.timestamp()
        rows = self._read(
            f"{_SELECT} WHERE m.deleted_at IS NULL AND (m.expires_at IS NULL OR m.expires_at > ?) "
            f"AND {' AND '.join(s_sql)}", [t, *s_params])
        return [_row_to_record(r) for r in rows]

    def events(self, memory_id: str) -> list[Event]:
        rows = self._read(
            "SELECT id, memory_id, type, at, user_id, agent_id, session_id, before, after, reason "
            "FROM events WHERE memory_id = ? ORDER BY rid", [memory_id])
        return [_row_to_event(r) for r in rows]

    def touch(self, ids: Sequence[str], at: datetime) -> None:
        if not ids:
            return
        conn = self._conn()
        try:
            conn.execute("PRAGMA busy_timeout = 20")
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                "UPDATE memories SET access_count = access_count + 1, last_accessed_at = ? "
                f"WHERE id IN ({', '.join('?' * len(ids))})", [at.timestamp(), *ids])
            conn.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            log.debug("access tracking skipped: %s", exc)
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")

    def stats(self, scope: Scope, now: datetime) -> Stats:
        s_sql, s_params = _scope_sql(scope)
        where = " AND ".join(s_sql) or "1"
        t = now.timestamp()
        by_kind = dict(self._read(
            f"SELECT m.kind, count(*) FROM memories m WHERE {where} AND m.deleted_at IS NULL "
            "AND (m.expires_at IS NULL OR m.expires_at > ?) AND (m.valid_to IS NULL OR m.valid_to > ?) "
            "GROUP BY m.kind", [*s_params, t, t]))
        (deleted, superseded, expired, scopes), = self._read(
            "SELECT sum(m.deleted_at IS NOT NULL), "
            "sum(m.deleted_at IS NULL AND m.valid_to IS NOT NULL AND m.valid_to <= ?), "
            "sum(m.deleted_at IS NULL AND m.expires_at IS NOT NULL AND m.expires_at <= ?), "
            "count(DISTINCT coalesce(m.user_id, '') || '\x1f' || coalesce(m.agent_id, '') || '\x1f' "
            f"|| coalesce(m.session_id, '')) FROM memories m WHERE {where}", [t, t, *s_params])
        e_sql = where.replace("m.", "e.")
        (events,), = self._read(f"SELECT count(*) FROM events e WHERE {e_sql}", s_params)
        size = None
        if self.path.exists():
            size = sum(p.stat().st_size for p in self.path.parent.glob(self.path.name + "*"))
        return Stats(memories=sum(by_kind.values()), by_kind=by_kind, deleted=deleted or 0,
                     superseded=superseded or 0, expired=expired or 0, events=events,
                     scopes=scopes, db_bytes=size)

    def iter_export(self, scope: Scope) -> Iterator[tuple[MemoryRecord, list[Event]]]:
        for chunk in _chunks(self.ids(scope, include_deleted=True), 500):
            records = self.get(chunk)
            for mid in chunk:
                yield records[mid], self.events(mid)

    # -- jobs and sessions ---------------------------------------------------------------------

    def job(self, id: str) -> Job | None:
        rows = self._read(f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs WHERE id = ?", (id,))
        return _row_to_job(rows[0]) if rows else None

    def job_by_key(self, key: str) -> Job | None:
        rows = self._read(f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs WHERE key = ?", (key,))
        return _row_to_job(rows[0]) if rows else None

    def jobs(self, scope: Scope, *, status: str | None = None, limit: int = 50) -> list[Job]:
        sql, params = _scope_sql(scope)
        if status is not None:
            sql.append("m.status = ?")
            params.append(status)
        where = " AND ".join(sql) or "1"
        rows = self._read(f"SELECT {', '.join('m.' + c for c in _JOB_COLUMNS)} FROM jobs m "
                          f"WHERE {where} ORDER BY m.id DESC LIMIT ?", [*params, limit])
        return [_row_to_job(r) for r in rows]

    def claim_job(self, now: datetime, lease_until: datetime) -> Job | None:
        with self.write() as tx:  # BEGIN IMMEDIATE: one claimer at a time across processes
            rows = tx.conn.execute(
                f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs WHERE (status = 'queued' AND run_at <= ?)"
                " OR (status = 'running' AND lease_until <= ?) ORDER BY run_at, id LIMIT 1",
                (now.timestamp(), now.timestamp())).fetchall()
            if not rows:
                return None
            job = _row_to_job(rows[0])
            claimed = replace(job, status=JobStatus.RUNNING, attempts=job.attempts + 1,
                              lease_until=lease_until, updated_at=now)
            tx.put_job(claimed)
        return claimed

    def session(self, scope: Scope) -> Session | None:
        rows = self._read(f"SELECT {', '.join(_SESSION_COLUMNS)} FROM sessions WHERE scope_key = ?",
                          (scope_key(scope),))
        return _row_to_session(rows[0]) if rows else None

    def sessions(self, scope: Scope, *, limit: int = 50) -> list[Session]:
        sql, params = _scope_sql(scope)
        where = " AND ".join(sql) or "1"
        rows = self._read(f"SELECT {', '.join('m.' + c for c in _SESSION_COLUMNS)} FROM sessions m "
                          f"WHERE {where} ORDER BY m.updated_at DESC, m.scope_key LIMIT ?",
                          [*params, limit])
        return [_row_to_session(r) for r in rows]

    def reclaim(self) -> None:
        conn = self._conn()
        try:
            with self.write() as tx:
                tx.conn.execute("INSERT INTO memory_fts(memory_fts) VALUES ('optimize')")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            raise StoreError(f"reclaim failed: {exc}") from exc


class _SQLiteTx:
    def __init__(self, conn: sqlite3.Connection, local: threading.local) -> None:
        self.conn = conn
        self.local = local
        self.keys_changed = False

    def insert(self, record: MemoryRecord, keys: Sequence[Key], lexical: Lexical) -> None:
        cur = self.conn.execute(
            f"INSERT INTO memories ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
            _record_values(record))
        self.conn.execute("INSERT INTO memory_fts(rowid, body, context, owner) VALUES (?, ?, ?, ?)",
                          (cur.lastrowid, lexical.body, lexical.previous,
                           " ".join(owner_tokens(record.scope))))
        self._put_keys(record.id, keys)

    def _put_keys(self, memory_id: str, keys: Sequence[Key]) -> None:
        self.conn.executemany(
            "INSERT INTO memory_keys(memory_id, kind, vector) VALUES (?, ?, ?)",
            [(memory_id, k.name, np.asarray(k.vector, dtype=np.float32).tobytes()) for k in keys])
        self.keys_changed = True
        self.local.dirty = True

    def update(self, record: MemoryRecord, keys: Sequence[Key] | None = None,
               lexical: Lexical | None = None) -> None:
        sets = ", ".join(f"{c} = ?" for c in _COLUMNS[1:])
        self.conn.execute(f"UPDATE memories SET {sets} WHERE id = ?",
                          [*_record_values(record)[1:], record.id])
        if keys is not None:
            self.conn.execute("DELETE FROM memory_keys WHERE memory_id = ?", (record.id,))
            self._put_keys(record.id, keys)
        if lexical is not None:
            (rid,), = self.conn.execute("SELECT rid FROM memories WHERE id = ?", (record.id,))
            self.conn.execute("DELETE FROM memory_fts WHERE rowid = ?", (rid,))
            self.conn.execute("INSERT INTO memory_fts(rowid, body, context, owner) "
                              "VALUES (?, ?, ?, ?)",
                              (rid, lexical.body, lexical.previous,
                               " ".join(owner_tokens(record.scope))))

    def soft_delete(self, ids: Sequence[str], at: datetime) -> None:
        for chunk in _chunks(list(ids), 500):
            marks = ", ".join("?" * len(chunk))
            self.conn.execute(f"UPDATE memories SET deleted_at = ?, updated_at = ? WHERE id IN ({marks})",
                              [at.timestamp(), at.timestamp(), *chunk])
            self._drop_index(chunk)

    def _drop_index(self, ids: Sequence[str]) -> None:
        marks = ", ".join("?" * len(ids))
        self.conn.execute(f"DELETE FROM memory_keys WHERE memory_id IN ({marks})", list(ids))
        self.conn.execute(f"DELETE FROM memory_fts WHERE rowid IN "
                          f"(SELECT rid FROM memories WHERE id IN ({marks}))", list(ids))
        self.keys_changed = True
        self.local.dirty = True

    def erase(self, ids: Sequence[str]) -> None:
        for chunk in _chunks(list(ids), 500):
            marks = ", ".join("?" * len(chunk))
            self._drop_index(chunk)
            self.conn.execute(f"DELETE FROM events WHERE memory_id IN ({marks})", chunk)
            self.conn.execute(f"DELETE FROM memories WHERE id IN ({marks})", chunk)

    def append(self, event: Event) -> None:
        s = event.scope
        self.conn.execute(
            "INSERT INTO events (id, memory_id, type, at, user_id, agent_id, session_id, before, "
            "after, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (event.id, event.memory_id, event.type.value, event.at.timestamp(), s.user_id,
             s.agent_id, s.session_id,
             json.dumps(event.before, ensure_ascii=False) if event.before is not None else None,
             json.dumps(event.after, ensure_ascii=False) if event.after is not None else None,
             event.reason))


    def put_job(self, job: Job) -> None:
        try:
            self.conn.execute(f"INSERT INTO jobs ({', '.join(_JOB_COLUMNS)}) VALUES "
                              f"({', '.join('?' * len(_JOB_COLUMNS))}) ON CONFLICT(id) DO UPDATE SET "
                              + ", ".join(f"{c} = excluded.{c}" for c in _JOB_COLUMNS[1:]),
                              _job_values(job))
        except sqlite3.IntegrityError as exc:
            raise Conflict(f"idempotency key {job.key!r} is already used by another job") from exc

    def put_session(self, session: Session) -> None:
        self.conn.execute(f"INSERT OR REPLACE INTO sessions ({', '.join(_SESSION_COLUMNS)}) VALUES "
                          f"({', '.join('?' * len(_SESSION_COLUMNS))})", _session_values(session))

    def delete_session(self, scope: Scope) -> None:
        self.conn.execute("DELETE FROM sessions WHERE scope_key = ?", (scope_key(scope),))

    def erase_scope(self, scope: Scope) -> None:
        sql, params = _scope_sql(scope)
        where = " AND ".join(sql) or "1"
        self.conn.execute(f"DELETE FROM sessions AS m WHERE {where}", params)
        self.conn.execute(f"DELETE FROM jobs AS m WHERE {where}", params)


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]

"""The PostgreSQL backend's SQL, built without I/O: the schema migrations and the compilers
from `Query` / filter `Condition`s to WHERE clauses (tested without a database)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from psycopg.types.json import Jsonb

from ..filters import Condition
from ..model import Scope
from .base import Query

# Identifiers, hashes and scope fields compare byte-wise, as in SQLite (BINARY): paging by id
# must follow UUIDv7 order whatever the database's default collation is.
TEXT = 'text COLLATE "C"'
TS_CONFIG = "english"  # the text search configuration of `memories.lex` (stemming, stop words)
MAX_INDEXED_DIM = 2000  # pgvector's HNSW limit for `vector`; wider keys are searched exactly

# Tables whose rows belong to a tenant: each gets the tenant policy below.
TENANT_TABLES = ("memories", "memory_keys", "events", "meta", "jobs", "sessions")


def _tenant_policy(table: str) -> list[str]:
    # FORCE: the policy binds the table owner too (the role engram usually connects as);
    # superusers and BYPASSRLS roles are never bound, so the SQL filters come first anyway.
    # current_setting(..., true) is NULL when unset: an unconfigured session sees nothing.
    return [
        f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY",
        f"ALTER TABLE {table} FORCE ROW LEVEL SECURITY",
        f"CREATE POLICY {table}_tenant ON {table} "
        "USING (tenant = current_setting('engram.tenant', true)) "
        "WITH CHECK (tenant = current_setting('engram.tenant', true))",
    ]


# Named migrations, applied in order, each in its own transaction under an advisory lock.
# Never edit a released one: append a new one.
MIGRATIONS: list[tuple[str, list[str]]] = [
    ("0001_initial", [
        "CREATE EXTENSION IF NOT EXISTS vector",
        f"""CREATE TABLE memories (
            tenant {TEXT} NOT NULL,
            id {TEXT} NOT NULL,
            seq bigint GENERATED ALWAYS AS IDENTITY,
            user_id {TEXT}, agent_id {TEXT}, session_id {TEXT},
            kind {TEXT} NOT NULL,
            text text NOT NULL,
            metadata jsonb NOT NULL DEFAULT '{{}}',
            importance double precision NOT NULL,
            role {TEXT}, name {TEXT},
            created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL,
            observed_at timestamptz, valid_from timestamptz, valid_to timestamptz,
            superseded_by {TEXT},
            provenance text[] NOT NULL DEFAULT '{{}}',
            access_count integer NOT NULL DEFAULT 0, last_accessed_at timestamptz,
            expires_at timestamptz,
            content_hash {TEXT} NOT NULL,
            deleted_at timestamptz,
            lex tsvector,
            PRIMARY KEY (tenant, id))""",
        "CREATE INDEX memories_user ON memories (tenant, user_id, kind)",
        "CREATE INDEX memories_agent ON memories (tenant, agent_id)",
        "CREATE INDEX memories_session ON memories (tenant, session_id, valid_from)",
        "CREATE INDEX memories_hash ON memories (tenant, content_hash)",
        "CREATE INDEX memories_lex ON memories USING gin (lex)",
        # The vector column is untyped: the dimension is only known at the first insert, and
        # one database may hold keys of several embedders. Each dimension gets its own partial
        # HNSW index over `vector::vector(dim)`, made at the first insert of that dimension
        # (see `hnsw_index_sql`).
        f"""CREATE TABLE memory_keys (
            tenant {TEXT} NOT NULL,
            seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            memory_id {TEXT} NOT NULL,
            kind {TEXT} NOT NULL,
            dim integer NOT NULL,
            vector vector NOT NULL,
            FOREIGN KEY (tenant, memory_id) REFERENCES memories (tenant, id) ON DELETE CASCADE)""",
        "CREATE INDEX memory_keys_memory ON memory_keys (tenant, memory_id)",
        "CREATE INDEX memory_keys_kind ON memory_keys (tenant, dim, kind)",
        f"""CREATE TABLE events (
            tenant {TEXT} NOT NULL,
            id {TEXT} NOT NULL,
            seq bigint GENERATED ALWAYS AS IDENTITY,
            memory_id {TEXT},
            type {TEXT} NOT NULL,
            at timestamptz NOT NULL,
            user_id {TEXT}, agent_id {TEXT}, session_id {TEXT},
            before json, after json, reason text,
            PRIMARY KEY (tenant, id))""",
        "CREATE INDEX events_memory ON events (tenant, memory_id, seq)",
        "CREATE INDEX events_scope ON events (tenant, user_id, agent_id, session_id)",
        f"""CREATE TABLE meta (
            tenant {TEXT} NOT NULL,
            name {TEXT} NOT NULL,
            value jsonb NOT NULL,
            PRIMARY KEY (tenant, name))""",
        f"""CREATE TABLE jobs (
            tenant {TEXT} NOT NULL,
            id {TEXT} NOT NULL,
            key {TEXT},
            fingerprint {TEXT},
            kind {TEXT} NOT NULL,
            user_id {TEXT}, agent_id {TEXT}, session_id {TEXT},
            payload json NOT NULL,
            status {TEXT} NOT NULL,
            attempts integer NOT NULL DEFAULT 0,
            run_at timestamptz NOT NULL,
            lease_until timestamptz,
            result json, error text,
            created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL,
            PRIMARY KEY (tenant, id),
            UNIQUE (tenant, key))""",
        "CREATE INDEX jobs_runnable ON jobs (tenant, status, run_at)",
        "CREATE INDEX jobs_scope ON jobs (tenant, user_id, agent_id, session_id)",
        # `scope_key` makes (user_id, agent_id, session_id) one key even where some are NULL.
        f"""CREATE TABLE sessions (
            tenant {TEXT} NOT NULL,
            scope_key {TEXT} NOT NULL,
            user_id {TEXT}, agent_id {TEXT}, session_id {TEXT} NOT NULL,
            policy json NOT NULL, summary text NOT NULL, summary_upto {TEXT},
            state json NOT NULL, metadata json NOT NULL,
            created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL,
            ended_at timestamptz,
            PRIMARY KEY (tenant, scope_key))""",
        "CREATE INDEX sessions_user ON sessions (tenant, user_id, updated_at)",
        *[stmt for table in TENANT_TABLES for stmt in _tenant_policy(table)],
    ]),
]

MIGRATIONS_TABLE = f"""CREATE TABLE IF NOT EXISTS schema_migrations (
    name {TEXT} PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"""


def hnsw_index_name(dim: int) -> str:
    return f"memory_keys_hnsw_{int(dim)}"


def hnsw_index_sql(dim: int) -> str:
    d = int(dim)  # inlined, never a parameter: the planner must see the partial predicate
    return (f"CREATE INDEX IF NOT EXISTS {hnsw_index_name(d)} ON memory_keys "
            f"USING hnsw ((vector::vector({d})) vector_cosine_ops) WHERE dim = {d}")


def dense_source(dim: int, where: str) -> str:
    """FROM/WHERE of a dense search over the keys of one kind and dimension; parameters:
    tenant, key kind, then those of `where` (a `compile_query` clause)."""
    return ("FROM memory_keys k JOIN memories m ON m.tenant = k.tenant AND m.id = k.memory_id "
            f"WHERE k.tenant = %s AND k.kind = %s AND k.dim = {int(dim)} AND {where}")


def dense_exact_sql(source: str) -> str:
    """Every visible key scored (the untyped expression matches no index, so this is a scan);
    parameters: the query vector, `source`'s, k."""
    return (f"SELECT k.memory_id, max(1 - (k.vector <=> %s::vector)) AS s {source} "
            "GROUP BY k.memory_id ORDER BY s DESC, k.memory_id LIMIT %s")


def dense_ann_sql(dim: int, source: str) -> str:
    """The nearest keys by the dimension's HNSW index (the ORDER BY matches its expression);
    parameters: the query vector, `source`'s, the query vector again, the pool size, k.
    Iterative scans in relaxed order may return a few rows out of order: sorted again outside."""
    d = int(dim)
    typed = f"(k.vector::vector({d})) <=> %s::vector({d})"
    return (f"WITH c AS MATERIALIZED (SELECT k.memory_id, {typed} AS d {source} "
            f"ORDER BY (k.vector::vector({d})) <=> %s::vector({d}) LIMIT %s) "
            "SELECT memory_id, 1 - min(d) AS s FROM c GROUP BY memory_id "
            "ORDER BY s DESC, memory_id LIMIT %s")


# -- record columns --------------------------------------------------------------------------

COLUMNS = (
    "id", "user_id", "agent_id", "session_id", "kind", "text", "metadata", "importance", "role",
    "name", "created_at", "updated_at", "observed_at", "valid_from", "valid_to", "superseded_by",
    "provenance", "access_count", "last_accessed_at", "expires_at", "content_hash", "deleted_at",
)
SELECT = "SELECT " + ", ".join(f"m.{c}" for c in COLUMNS) + " FROM memories m"

# The SQL type family of each record field a filter may name (filters.RECORD_FIELDS).
_FIELD_TYPES = {
    "created_at": "time", "updated_at": "time", "observed_at": "time", "valid_from": "time",
    "valid_to": "time", "expires_at": "time", "last_accessed_at": "time",
    "importance": "num", "access_count": "num",
    "role": "text", "name": "text", "kind": "text", "id": "text",
}
_RANGE = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
_MISMATCH = object()  # a filter value of a type the column can never equal


def vector_literal(vector: Any) -> str:
    """pgvector's text form; float32 values printed exactly (as doubles) so they round-trip."""
    return "[" + ",".join(repr(float(x)) for x in vector) + "]"


def tsquery_text(terms: Sequence[str]) -> str:
    """`to_tsquery` input matching ANY of the terms, each a quoted (so inert) value.

    Inside quotes, `'` is doubled and `\\` escaped; operators and parentheses are then data,
    and the text search parser turns each term into lexemes (stemmed, stop words dropped)."""
    quoted = ["'" + t.replace("\\", "\\\\").replace("'", "''") + "'" for t in terms if t.strip()]
    return " | ".join(quoted)


def scope_sql(scope: Scope, alias: str = "m", exact: bool = False) -> tuple[list[str], list[Any]]:
    """Scope conditions. A `None` field matches anything, unless `exact` (then it means NULL)."""
    sql: list[str] = []
    params: list[Any] = []
    for col, value in scope.as_dict().items():
        if value is not None:
            sql.append(f"{alias}.{col} = %s")
            params.append(value)
        elif exact:
            sql.append(f"{alias}.{col} IS NULL")
    return sql, params


def compile_query(q: Query, tenant: str) -> tuple[str, list[Any]]:
    """The WHERE clause (over alias `m`) selecting the memories `q` may see in `tenant`."""
    sql = ["m.tenant = %s", "m.deleted_at IS NULL", "(m.expires_at IS NULL OR m.expires_at > %s)"]
    params: list[Any] = [tenant, q.now]
    s_sql, s_params = scope_sql(q.scope)
    sql += s_sql
    params += s_params
    if q.kinds:
        sql.append("m.kind = ANY(%s)")
        params.append([k.value for k in q.kinds])
    if q.as_of is not None:
        sql.append("(m.valid_from IS NULL OR m.valid_from <= %s) AND (m.valid_to IS NULL OR m.valid_to > %s)")
        params += [q.as_of, q.as_of]
    else:
        sql.append("(m.valid_to IS NULL OR m.valid_to > %s)")
        params.append(q.now)
    for c in q.conditions:
        c_sql, c_params = condition_sql(c)
        sql.append(c_sql)
        params += c_params
    return " AND ".join(sql), params


def condition_sql(c: Condition) -> tuple[str, list[Any]]:
    """One filter condition, with the semantics of the SQLite store's `json_extract` compare:
    a missing key and a JSON null are NULL (`eq None` matches them, `ne x` keeps them), and
    `nin` keeps rows without the key.

    Where SQLite would compare across types (a string against a number), this compares only
    values of the same JSON type: `{"score": {"gt": 3}}` never matches `"score": "high"`, and
    `true` does not equal `1`."""
    if c.metadata:
        return _json_condition(c)
    typ = _FIELD_TYPES[c.field]  # a closed set: the column name below is never user text
    col = f"m.{c.field}"
    if typ == "text" and c.op in _RANGE:
        col = f'{col} COLLATE "C"'
    if c.op in ("in", "nin"):
        values = [_coerce(typ, v) for v in c.value]
        keep = [v for v in values if v is not None and v is not _MISMATCH]
        if c.op == "in":
            return (f"{col} = ANY(%s)", [keep]) if keep else ("FALSE", [])
        if any(v is None for v in values):  # x NOT IN (NULL, ...) is never true in SQL
            return f"{col} IS NULL", []
        return (f"({col} IS NULL OR NOT ({col} = ANY(%s)))", [keep]) if keep else ("TRUE", [])
    v = _coerce(typ, c.value)
    if c.op == "eq":
        if v is None:
            return f"{col} IS NULL", []
        return ("FALSE", []) if v is _MISMATCH else (f"{col} = %s", [v])
    if c.op == "ne":
        if v is None:
            return f"{col} IS NOT NULL", []
        return ("TRUE", []) if v is _MISMATCH else (f"{col} IS DISTINCT FROM %s", [v])
    if v is _MISMATCH or v is None:
        return "FALSE", []
    return f"{col} {_RANGE[c.op]} %s", [v]


def _coerce(typ: str, value: Any) -> Any:
    """A filter value as the column's type, `None` for NULL, `_MISMATCH` if it cannot be one."""
    if value is None:
        return None
    if typ == "time":  # filters.py turned every time into epoch seconds
        return datetime.fromtimestamp(value, UTC) if isinstance(value, int | float) else _MISMATCH
    if typ == "num":
        return float(value) if isinstance(value, int | float) else _MISMATCH
    if isinstance(value, bool):  # as SQLite binds it: 1 / 0
        return str(int(value))
    return str(value)


def _json_condition(c: Condition) -> tuple[str, list[Any]]:
    j = "(m.metadata -> %s)"
    is_null = f"coalesce(jsonb_typeof({j}), 'null') = 'null'"
    key = c.field
    if c.op in ("in", "nin"):
        keep = [Jsonb(v) for v in c.value if v is not None]
        if c.op == "in":
            return (f"{j} = ANY(%s::jsonb[])", [key, keep]) if keep else ("FALSE", [])
        if any(v is None for v in c.value):
            return is_null, [key]
        return f"({is_null} OR NOT ({j} = ANY(%s::jsonb[])))", [key, key, keep]
    v = c.value
    if c.op == "eq":
        return (is_null, [key]) if v is None else (f"{j} = %s", [key, Jsonb(v)])
    if c.op == "ne":
        if v is None:
            return f"NOT {is_null}", [key]
        return f"({j} IS NULL OR {j} <> %s)", [key, key, Jsonb(v)]
    sym = _RANGE[c.op]
    # CASE, not AND: PostgreSQL may evaluate AND operands in any order, and casting a JSON
    # string to numeric raises.
    if isinstance(v, int | float) and not isinstance(v, bool):
        return (f"CASE WHEN jsonb_typeof({j}) = 'number' THEN ({j})::numeric {sym} %s::numeric "
                "ELSE FALSE END", [key, key, v])
    if isinstance(v, str):
        return (f"CASE WHEN jsonb_typeof({j}) = 'string' THEN (m.metadata ->> %s) COLLATE \"C\" "
                f"{sym} %s ELSE FALSE END", [key, key, v])
    return "FALSE", []


def scope_key(scope: Scope) -> str:
    """One text key for a session's (user_id, agent_id, session_id), NULLs included."""
    return json.dumps([scope.user_id, scope.agent_id, scope.session_id])

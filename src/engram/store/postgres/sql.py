"""The PostgreSQL backend's SQL, built without I/O (tested without a database): its dialect
(times as timestamptz, JSON as json / jsonb, lists as arrays, a tenant on every row), typed
filter conditions, the text search query, and the dense search over pgvector."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from psycopg.types.json import Json, Jsonb

from ...filters import Condition
from ...model import MemoryRecord
from .. import records as r
from ..base import Query
from .schema import TS_CONFIG

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


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo is UTC else value.astimezone(UTC)


DIALECT = r.Dialect(
    name="postgres", mark="%s", tenant=True, seq="seq", arrays=True, chunk=10_000,
    nulls_last=" NULLS LAST", time=lambda v: v, read_time=_utc, json=Json, jsonb=Jsonb,
    read_json=lambda v: v, array=list, read_array=lambda v: v, condition=condition_sql,
)

# The lexical index of a memory: its body (weight A) and the previous turn (weight B).
LEX = (f"setweight(to_tsvector('{TS_CONFIG}', %s), 'A') || "
       f"setweight(to_tsvector('{TS_CONFIG}', %s), 'B')")


def insert_memory(tenant: str, rec: MemoryRecord, body: str, previous: str) -> r.Stmt:
    names = ", ".join(["tenant", *r.MEMORY_COLUMNS, "lex"])
    return (f"INSERT INTO memories ({names}) VALUES ({DIALECT.marks(len(r.MEMORY_COLUMNS) + 1)}, {LEX})",
            [tenant, *r.memory_values(DIALECT, rec), body, previous])


def update_memory(tenant: str, rec: MemoryRecord, lexical: tuple[str, str] | None) -> r.Stmt:
    sets = ", ".join(f"{c} = %s" for c in r.MEMORY_COLUMNS[1:])
    params = r.memory_values(DIALECT, rec)[1:]
    if lexical is not None:
        sets += f", lex = {LEX}"
        params += list(lexical)
    return f"UPDATE memories SET {sets} WHERE tenant = %s AND id = %s", [*params, tenant, rec.id]


def lexical(tenant: str, query: Query, text: str, k: int, previous_weight: float) -> r.Stmt:
    """`ts_rank` over the body and (weighted by `previous_weight`) the previous turn."""
    # ts_rank takes weights in [0, 1] ({D, C, B, A}): scale both down, and the rank back up.
    cw = max(0.0, float(previous_weight))
    scale = max(1.0, cw)
    weights = [0.0, 0.0, cw / scale, 1.0 / scale]
    where, params = r.compile_query(DIALECT, query, tenant)
    return ("SELECT m.id, ts_rank(%s::real[], m.lex, tq, 1) * %s AS s "
            f"FROM memories m, to_tsquery('{TS_CONFIG}', %s) tq "
            f"WHERE {where} AND m.lex @@ tq ORDER BY s DESC, m.id LIMIT %s",
            [weights, scale, text, *params, k])


def claim_job(tenant: str, now: datetime, lease_until: datetime) -> r.Stmt:
    """Take the oldest runnable job. SKIP LOCKED: concurrent workers each take a different
    one instead of queueing behind the row the first of them locked."""
    runnable = r.runnable_jobs(DIALECT, tenant, now)
    return ("UPDATE jobs SET status = 'running', attempts = attempts + 1, lease_until = %s, "
            "updated_at = %s WHERE tenant = %s AND id = (SELECT m.id FROM jobs m WHERE "
            f"{runnable.sql} ORDER BY m.run_at, m.id LIMIT 1 FOR UPDATE SKIP LOCKED) "
            f"RETURNING {', '.join(r.JOB_COLUMNS)}",
            [lease_until, now, tenant, *runnable.params])

"""The PostgreSQL backend's SQL, built without I/O (tested without a database): its dialect
(times as timestamptz, JSON as json / jsonb, lists as arrays, a tenant on every row), typed
filter conditions, the lexical index and its BM25 search (see bm25.py), and the dense search
over pgvector."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format
from psycopg.types.json import Json, Jsonb

from ...filters import Condition
from ...model import MemoryRecord, Scope
from .. import bm25
from .. import records as r
from ..base import Query
from ..bm25 import Document, Phrase

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


def dense_counted_sql(source: str) -> str:
    """`dense_exact_sql` that also counts the keys it scored (on every row); parameters: the
    query vector, `source`'s, k."""
    return (f"SELECT k.memory_id, max(1 - (k.vector <=> %s::vector)) AS s, "
            f"(sum(count(*)) OVER ())::bigint AS n {source} "
            "GROUP BY k.memory_id ORDER BY s DESC, k.memory_id LIMIT %s")


# Whether the index named by the parameter can answer queries: NULL if there is none, false if
# a concurrent build of it did not finish (INVALID: the planner ignores it).
INDEX_VALID_SQL = ("SELECT i.indisvalid AND i.indisready FROM pg_index i "
                   "WHERE i.indexrelid = to_regclass(%s)")


def dense_guarded_sql(source: str) -> str:
    """`dense_exact_sql` and the count that decides whether it is the right search, in one
    statement: the exact scan runs if at most a limit of keys are visible (or the dimension has
    no valid index); rows (memory_id, score, keys counted up to the limit + 1, index exists), or one
    row (NULL, NULL, count, index exists) if it did not run or found nothing. Parameters: the
    index name, `source`'s, the limit + 1, the query vector, `source`'s, the limit, k."""
    return (f"WITH n AS MATERIALIZED (SELECT coalesce(({INDEX_VALID_SQL}), false) AS indexed, "
            f"(SELECT count(*) FROM (SELECT 1 {source} LIMIT %s) c) AS n) "
            "SELECT e.memory_id, e.s, n.n, n.indexed FROM n LEFT JOIN LATERAL "
            f"(SELECT k.memory_id, max(1 - (k.vector <=> %s::vector)) AS s {source} "
            "AND (n.n <= %s OR NOT n.indexed) GROUP BY k.memory_id "
            "ORDER BY s DESC, k.memory_id LIMIT %s) e ON TRUE ORDER BY e.s DESC, e.memory_id")


INDEX_LOCK = 0x656E6773  # pg_try_advisory_lock key (with the dimension): one builder at a time
# An index build's session (a connection of its own): minutes at a million keys, and it waits
# for the writes in flight to end (CONCURRENTLY), never blocking them
NO_TIMEOUTS = ["SET statement_timeout = 0", "SET lock_timeout = 0"]


def index_lock(dim: int) -> r.Stmt:
    """Try to become the builder of `dim`'s index (true or false), until `index_unlock`."""
    return "SELECT pg_try_advisory_lock(%s, %s)", [INDEX_LOCK, int(dim)]


def index_unlock(dim: int) -> r.Stmt:
    return "SELECT pg_advisory_unlock(%s, %s)", [INDEX_LOCK, int(dim)]


def drop_index(name: str) -> str:
    """Drop an index a build left INVALID (`name`: schema.hnsw_index_name's, never user text)."""
    return f"DROP INDEX CONCURRENTLY IF EXISTS {name}"


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


# -- the dense cache's reads (store.py; the same as sqlite/sql.py's) ------------------------------

# Visibility's time columns as epoch seconds (NaN-able floats in the cache)
_ATTRS = ("m.kind, extract(epoch FROM m.expires_at)::float8, "
          "extract(epoch FROM m.valid_from)::float8, extract(epoch FROM m.valid_to)::float8")


def _attrs(rich: bool) -> str:
    return f"{_ATTRS}, {r.columns('m', r.CANDIDATE_COLUMNS)}" if rich else _ATTRS


def versions(tenant: str) -> r.Stmt:
    """The tenant's `keys_version` and `rows_version` (absent: never bumped, 0)."""
    return ("SELECT name, value::bigint FROM meta WHERE tenant = %s "
            "AND name IN ('keys_version', 'rows_version')", [tenant])


def _key_where(tenant: str, scope: Scope, key_name: str, dim: int) -> r.Where:
    w = r.Where(DIALECT, tenant).add("k.tenant = m.tenant").add("k.kind = %s", key_name)
    return w.add(f"k.dim = {int(dim)}").add("m.deleted_at IS NULL").scope(scope)


def count_keys(tenant: str, scope: Scope, key_name: str, dim: int, limit: int) -> r.Stmt:
    """How many keys of live memories of the scope there are, counted up to `limit`."""
    w = _key_where(tenant, scope, key_name, dim)
    return (f"SELECT count(*) FROM (SELECT 1 FROM memory_keys k JOIN memories m ON m.id = "
            f"k.memory_id WHERE {w.sql} LIMIT %s) c", [*w.params, limit])


def new_keys(tenant: str, scope: Scope, key_name: str, dim: int, after_seq: int,
             rich: bool, limit: int) -> r.Stmt:
    """Keys added since `after_seq` of live memories of the scope (the first `limit`), their
    vectors in pgvector's binary form, with what visibility (and, `rich`, ranking) needs."""
    w = _key_where(tenant, scope, key_name, dim).add("k.seq > %s", after_seq)
    return (f"SELECT k.seq, k.memory_id, vector_send(k.vector), {_attrs(rich)} FROM memory_keys k "
            f"JOIN memories m ON m.id = k.memory_id WHERE {w.sql} ORDER BY k.seq LIMIT %s",
            [*w.params, limit])


def key_attrs(tenant: str, scope: Scope, key_name: str, dim: int, rich: bool = False,
              upto_seq: int | None = None) -> r.Stmt:
    """What visibility (and, `rich`, ranking) needs, for every key of live memories of the
    scope (up to `upto_seq`)."""
    w = _key_where(tenant, scope, key_name, dim)
    if upto_seq is not None:
        w.add("k.seq <= %s", upto_seq)
    return (f"SELECT k.seq, {_attrs(rich)} FROM memory_keys k JOIN memories m "
            f"ON m.id = k.memory_id WHERE {w.sql}", w.params)


def changed_keys(tenant: str, scope: Scope, key_name: str, dim: int, since: int, upto_seq: int,
                 rich: bool, limit: int) -> r.Stmt:
    """What visibility (and, `rich`, ranking) needs, for the tenant's keys up to `upto_seq`
    whose memory changed after rows version `since` (`memories.changed`), in any scope, each
    with whether its memory is still live and in this scope; at most `limit`."""
    ok = r.Where(DIALECT, "", "m")
    ok.parts.clear()  # the tenant is the statement's, not the flag's
    ok.params.clear()
    ok.add("m.deleted_at IS NULL").scope(scope)
    return (f"SELECT k.seq, coalesce({ok.sql}, false), {_attrs(rich)} FROM memories m "
            "JOIN memory_keys k ON k.tenant = m.tenant AND k.memory_id = m.id "
            f"WHERE m.tenant = %s AND m.changed > %s AND k.kind = %s AND k.dim = {int(dim)} "
            "AND k.seq <= %s LIMIT %s", [*ok.params, tenant, since, key_name, upto_seq, limit])


class KeyReads:
    """The dense cache's reads (index/refresh.py, index/cache.py) of one tenant, in this
    dialect."""

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.dialect = DIALECT
        self.owner = (tenant,)  # the tenants of a process share its cache

    def count_keys(self, scope: Scope, key_name: str, dim: int, limit: int) -> r.Stmt:
        return count_keys(self.tenant, scope, key_name, dim, limit)

    def versions(self) -> r.Stmt:
        return versions(self.tenant)

    def tombstones(self, after_id: int) -> r.Stmt:
        return tombstones(self.tenant, after_id)

    def new_keys(self, scope: Scope, key_name: str, dim: int, after_seq: int, rich: bool,
                 limit: int) -> r.Stmt:
        return new_keys(self.tenant, scope, key_name, dim, after_seq, rich, limit)

    def changed_keys(self, scope: Scope, key_name: str, dim: int, since: int, upto_seq: int,
                     rich: bool, limit: int) -> r.Stmt:
        return changed_keys(self.tenant, scope, key_name, dim, since, upto_seq, rich, limit)

    def key_attrs(self, scope: Scope, key_name: str, dim: int, upto_seq: int,
                  rich: bool) -> r.Stmt:
        return key_attrs(self.tenant, scope, key_name, dim, rich, upto_seq)

    def vectors(self, blobs: Sequence[Any], dim: int) -> np.ndarray:
        return read_vectors(blobs, dim)


_HORIZON = "SELECT value::bigint FROM meta WHERE tenant = %s AND name = 'tombstone_horizon'"


def tombstones(tenant: str, after_id: int) -> r.Stmt:
    """Keys deleted since tombstone `after_id`, in order, led by (-1, horizon) if tombstones
    after it have been pruned (schema 0007: the caller cannot know what it missed). -1: none,
    only the last id (or the horizon, if every tombstone has been pruned). One statement, so
    the tombstones and the horizon are of one snapshot."""
    if after_id < 0:
        return (f"SELECT greatest((SELECT coalesce(max(id), 0) FROM key_tombstones "
                f"WHERE tenant = %s), coalesce(({_HORIZON}), 0)), NULL", [tenant, tenant])
    return (f"SELECT -1, h.value FROM ({_HORIZON}) h WHERE h.value > %s UNION ALL "
            "SELECT id, seq FROM key_tombstones WHERE tenant = %s AND id > %s ORDER BY 1",
            [tenant, after_id, tenant, after_id])


def key_vectors(tenant: str, ids: Sequence[str], key_name: str) -> r.Stmt:
    """The vectors of one key name of these memories (pgvector's binary form, with their
    dimension), in the order they were written."""
    return ("SELECT memory_id, vector_send(vector), dim FROM memory_keys WHERE tenant = %s AND "
            "kind = %s AND memory_id = ANY(%s) ORDER BY seq", [tenant, key_name, list(ids)])


def read_vectors(blobs: Sequence[bytes], dim: int) -> np.ndarray:
    """pgvector's binary form (int16 dim, int16 unused, dim big-endian float4) as a float32
    matrix."""
    raw = np.frombuffer(b"".join(blobs), dtype=np.uint8).reshape(len(blobs), 4 + 4 * dim)
    return raw[:, 4:].copy().view(">f4").astype(np.float32)


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo is UTC else value.astimezone(UTC)


DIALECT = r.Dialect(
    name="postgres", mark="%s", tenant=True, seq="seq", arrays=True, chunk=10_000,
    nulls_last=" NULLS LAST", time=lambda v: v, read_time=_utc, json=Json, jsonb=Jsonb,
    read_json=lambda v: v, array=list, read_array=lambda v: v, condition=condition_sql,
)

# -- memory rows and their lexical index (see bm25.py) -------------------------------------------

LEX_COLUMNS = ("lex", "lex_body", "lex_context", "lex_len")
LEX_VALUES = "array_to_tsvector(%s::text[]), %s, %s, %s"


def _lex_values(doc: Document) -> list[Any]:
    return [doc.terms, doc.body, doc.context, doc.length]


def insert_memory(tenant: str, rec: MemoryRecord, doc: Document) -> r.Stmt:
    names = ", ".join(["tenant", *r.MEMORY_COLUMNS, *LEX_COLUMNS])
    return (f"INSERT INTO memories ({names}) "
            f"VALUES ({DIALECT.marks(len(r.MEMORY_COLUMNS) + 1)}, {LEX_VALUES})",
            [tenant, *r.memory_values(DIALECT, rec), *_lex_values(doc)])


def update_memory(tenant: str, rec: MemoryRecord, doc: Document | None) -> r.Stmt:
    sets = ", ".join(f"{c} = %s" for c in r.MEMORY_COLUMNS[1:])
    params = r.memory_values(DIALECT, rec)[1:]
    if doc is not None:
        sets += ", lex = array_to_tsvector(%s::text[]), lex_body = %s, lex_context = %s, lex_len = %s"
        params += _lex_values(doc)
    return f"UPDATE memories SET {sets} WHERE tenant = %s AND id = %s", [*params, tenant, rec.id]


UNINDEX = "lex = NULL, lex_body = NULL, lex_context = NULL, lex_len = NULL"


def soft_delete(tenant: str, ids: Sequence[str], at: datetime) -> r.Stmt:
    """Mark the memories deleted and take them out of the lexical index."""
    return (f"UPDATE memories SET deleted_at = %s, updated_at = %s, {UNINDEX} "
            "WHERE tenant = %s AND id = ANY(%s)", [at, at, tenant, list(ids)])


def drop_keys(tenant: str, ids: Sequence[str]) -> r.Stmt:
    return "DELETE FROM memory_keys WHERE tenant = %s AND memory_id = ANY(%s)", [tenant, list(ids)]


def drop_keys_of(tenant: str, memory_id: str) -> r.Stmt:
    """The keys of one memory (an update replacing them)."""
    return "DELETE FROM memory_keys WHERE tenant = %s AND memory_id = %s", [tenant, memory_id]


def erase_events(tenant: str, ids: Sequence[str]) -> r.Stmt:
    return "DELETE FROM events WHERE tenant = %s AND memory_id = ANY(%s)", [tenant, list(ids)]


def erase_memories(tenant: str, ids: Sequence[str]) -> r.Stmt:
    return "DELETE FROM memories WHERE tenant = %s AND id = ANY(%s)", [tenant, list(ids)]


def count_in(tenant: str, doc: Document) -> r.Stmt:
    """Add a newly indexed row to the tenant's statistics: one more row, and its length."""
    return ("INSERT INTO lex_stats (tenant, rows, tokens) VALUES (%s, 1, %s) "
            "ON CONFLICT (tenant) DO UPDATE SET rows = lex_stats.rows + 1, "
            "tokens = lex_stats.tokens + excluded.tokens", [tenant, doc.length])


# -- bulk writes (PgTx.insert_many): a statement per table for many rows -------------------------

# The SQL type of each memory column as a bulk insert's arrays carry it (the rest are text).
# `provenance` travels as JSON: arrays of arrays of different lengths do not exist in SQL.
_BULK_TYPES = {"metadata": "jsonb", "importance": "float8", "access_count": "int4",
               "provenance": "jsonb", "created_at": "timestamptz", "updated_at": "timestamptz",
               "observed_at": "timestamptz", "valid_from": "timestamptz",
               "valid_to": "timestamptz", "last_accessed_at": "timestamptz",
               "expires_at": "timestamptz", "deleted_at": "timestamptz"}
_PROVENANCE = r.MEMORY_COLUMNS.index("provenance")


def tsvector_literal(terms: Sequence[str]) -> str:
    """`array_to_tsvector(terms)` as tsvector's input text: the same lexemes, no positions."""
    return " ".join(_lexeme(t) for t in terms)


def insert_memories(tenant: str, recs: Sequence[MemoryRecord], docs: Sequence[Document]) -> r.Stmt:
    """`insert_memory` of many rows in one statement: a column array each, unnested."""
    cols = [*r.MEMORY_COLUMNS, *LEX_COLUMNS]
    types = [_BULK_TYPES.get(c, "text") for c in r.MEMORY_COLUMNS] + ["text", "text", "text", "int4"]
    values = []
    for rec in recs:
        row = r.memory_values(DIALECT, rec)
        row[_PROVENANCE] = Jsonb(list(rec.provenance))
        values.append(row)
    columns: list[list[Any]] = [list(c) for c in zip(*values, strict=True)] if values else [
        [] for _ in r.MEMORY_COLUMNS]
    columns += [[tsvector_literal(d.terms) for d in docs], [d.body for d in docs],
                [d.context for d in docs], [d.length for d in docs]]
    picks = ["ARRAY(SELECT jsonb_array_elements_text(u.provenance))" if c == "provenance"
             else "u.lex::tsvector" if c == "lex" else f"u.{c}" for c in cols]
    return (f"INSERT INTO memories (tenant, {', '.join(cols)}) SELECT %s, {', '.join(picks)} "
            f"FROM unnest({', '.join(f'%s::{t}[]' for t in types)}) AS u({', '.join(cols)})",
            [tenant, *columns])


def count_in_many(tenant: str, docs: Sequence[Document]) -> r.Stmt:
    """`count_in` of many newly indexed rows at once."""
    return ("INSERT INTO lex_stats (tenant, rows, tokens) VALUES (%s, %s, %s) "
            "ON CONFLICT (tenant) DO UPDATE SET rows = lex_stats.rows + excluded.rows, "
            "tokens = lex_stats.tokens + excluded.tokens",
            [tenant, len(docs), sum(d.length for d in docs)])


def insert_keys(tenant: str, dim: int, ids: Sequence[str], kinds: Sequence[str],
                vectors: Binary) -> r.Stmt:
    """Keys of one dimension, their vectors a `vector[]` in binary form (`vector_array`)."""
    return ("INSERT INTO memory_keys (tenant, memory_id, kind, dim, vector) "
            "SELECT %s, u.m, u.k, %s, u.v FROM unnest(%s::text[], %s::text[], %s::vector[]) "
            "AS u(m, k, v)", [tenant, int(dim), list(ids), list(kinds), vectors])


class Binary:
    """A parameter already in PostgreSQL's binary form, of the type its statement casts it to
    (sent with no type: the server takes the cast's)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class _BinaryDumper(Dumper):
    format = Format.BINARY

    def dump(self, obj: Any) -> bytes:
        return bytes(obj.data)


psycopg.adapters.register_dumper(Binary, _BinaryDumper)  # every connection made after import


def vector_array(oid: int, vectors: np.ndarray) -> Binary:
    """A float matrix as PostgreSQL's binary form of a `vector[]` (`oid`: pgvector's `vector`
    type): array_recv's header, then each element's length and vector_recv's form (int16
    dim, int16 unused, dim big-endian float4). Formatting 384 floats as text costs ~0.6 ms a
    vector; this costs a copy."""
    n, d = vectors.shape
    body = np.empty(n, dtype=[("len", ">i4"), ("dim", ">i2"), ("unused", ">i2"), ("v", ">f4", (d,))])
    body["len"], body["dim"], body["unused"], body["v"] = 4 + 4 * d, d, 0, vectors
    return Binary(struct.pack(">iiiii", 1, 0, oid, n, 1) + body.tobytes())


def count_out(tenant: str, ids: Sequence[str]) -> r.Stmt:
    """Take rows out of the tenant's statistics, before they lose their index (deleted,
    erased, re-indexed)."""
    return ("UPDATE lex_stats s SET rows = s.rows - o.n, tokens = s.tokens - o.len "
            "FROM (SELECT count(*) AS n, coalesce(sum(lex_len), 0) AS len FROM memories "
            "WHERE tenant = %s AND id = ANY(%s) AND lex IS NOT NULL) o "
            "WHERE s.tenant = %s AND o.n > 0", [tenant, list(ids), tenant])


def _lexeme(token: str) -> str:
    """A token as a quoted tsquery lexeme: data, never operators."""
    return "'" + token.replace("\\", "\\\\").replace("'", "''") + "'"


def tsquery(phrases: Sequence[Phrase]) -> str:
    """The rows that may hold any of the phrases: those with every key term of one of them
    (exact for a phrase of one or two tokens; longer ones are checked when counted)."""
    return " | ".join("(" + " & ".join(_lexeme(t) for t in dict.fromkeys(bm25.keys(p))) + ")"
                      for p in phrases)


def _regex(phrase: Phrase) -> str:
    """`<a>(?=<b><a>)`: each occurrence of the phrase, overlapping ones too (the match takes
    only the first token, the lookahead checks the rest)."""
    def esc(token: str) -> str:
        return "".join(ch if ch.isalnum() else "\\" + ch for ch in token)
    first, *rest = phrase
    return f"<{esc(first)}>(?=" + "".join(f"<{esc(t)}>" for t in rest) + ")"


def _occurrences(column: str, phrase: Phrase) -> tuple[str, list[Any]]:
    """How often `phrase` occurs in a tagged column, as a float8 expression."""
    if bm25.overlaps_itself(phrase):
        return (f"(SELECT count(*) FROM regexp_matches({column}, %s, 'g'))::float8",
                [_regex(phrase)])
    pat = bm25.tagged(phrase)  # replace() returns its input untouched when the phrase is absent
    return (f"((octet_length({column}) - octet_length(replace({column}, %s, ''))) / %s::float8)",
            [pat, float(len(pat.encode("utf-8")))])


def _float(x: float) -> str:
    return f"{x!r}::float8"  # repr: the exact double


def lexical(tenant: str, query: Query, phrases: Sequence[Phrase], k: int,
            previous_weight: float) -> r.Stmt:
    """The `k` visible rows best by BM25 as bm25.py states it that hold any of `phrases`, each
    phrase scored once per time it is given; ties by id. One statement, so the statistics and
    the rows are of one snapshot. The tsquery finds the rows with the key terms of a phrase
    (exact for one or two tokens); a row where a longer phrase's pairs are not in order
    is then left out."""
    distinct = list(dict.fromkeys(phrases))
    slot = {p: i for i, p in enumerate(distinct)}
    hits, hparams = [], []  # rows of the tenant whose text holds each phrase
    for i, p in enumerate(distinct):
        hits.append("(SELECT count(*) FROM memories x WHERE x.tenant = %s AND x.lex @@ %s::tsquery "
                    f"AND strpos(x.lex_body, %s) > 0)::float8 AS d{i}")
        hparams += [tenant, tsquery([p]), bm25.tagged(p)]
    half, floor = _float(0.5), _float(bm25.MIN_IDF)
    idfs = [f"CASE WHEN ln((c.n - c.d{i} + {half}) / (c.d{i} + {half})) > 0 "
            f"THEN ln((c.n - c.d{i} + {half}) / (c.d{i} + {half})) ELSE {floor} END AS i{i}"
            for i in range(len(distinct))]
    counts, cparams = [], []  # occurrences of each phrase in the text and the previous turn
    for i, p in enumerate(distinct):
        for col, name in (("m.lex_body", "b"), ("m.lex_context", "c")):
            expr, params = _occurrences(col, p)
            counts.append(f"{expr} AS {name}{i}")
            cparams += params
    # idf * (f * (k1 + 1)) / (f + k1 * (1 - b + b * D / avgdl)), summed in order, f = each
    # column's tf (1 + ln of its occurrences, 0 for none) weighted by column
    k1p1, k1, omb, b = (_float(v) for v in (bm25.K1 + 1.0, bm25.K1, 1 - bm25.B, bm25.B))
    norm = f"{k1} * ({omb} + {b} * x.len / w.avgdl)"

    def tf(count: str) -> str:
        return f"(CASE WHEN {count} > 0 THEN 1::float8 + ln({count}) ELSE 0::float8 END)"

    def term(i: int) -> str:
        f = f"({tf(f'x.b{i}')} + w.pw * {tf(f'x.c{i}')})"
        return f"w.i{i} * (({f} * {k1p1}) / ({f} + {norm}))"

    score = " + ".join(term(slot[p]) for p in phrases)
    found = " OR ".join(f"x.b{i} > 0 OR x.c{i} > 0" for i in range(len(distinct)))
    where, wparams = r.compile_query(DIALECT, query, tenant)
    sql = (f"WITH c AS MATERIALIZED (SELECT s.rows::float8 AS n, s.tokens::float8 / s.rows AS avgdl, "
           f"{', '.join(hits)} FROM lex_stats s WHERE s.tenant = %s AND s.rows > 0), "
           f"w AS MATERIALIZED (SELECT c.avgdl, %s::float8 AS pw, {', '.join(idfs)} FROM c) "
           f"SELECT x.id, {score} AS s FROM w, "
           f"(SELECT m.id, m.lex_len AS len, {', '.join(counts)} FROM memories m "
           f"WHERE {where} AND m.lex @@ %s::tsquery OFFSET 0) x "
           f"WHERE {found} ORDER BY s DESC, x.id LIMIT %s")
    return sql, [*hparams, tenant, float(previous_weight), *cparams, *wparams, tsquery(distinct), k]


# -- the in-process lexicon's reads (index/follow.py; the log: schema.py 0010) ------------------

_DOCUMENT = "m.id, m.lex_body, m.lex_context, m.user_id, m.agent_id, m.session_id"


def lex_changes(tenant: str, since: int) -> r.Stmt:
    """The tenant's lexicon log past position `since`, in one snapshot: first the log's
    position and horizon (on every row; one row with no entry when nothing is new), then each
    entry with its memory's current document (none: unindexed or gone)."""
    return ("WITH h AS (SELECT (SELECT value::bigint FROM meta WHERE tenant = %s "
            "AND name = 'lex_position') AS pos, (SELECT value::bigint FROM meta WHERE tenant = %s "
            "AND name = 'lex_horizon') AS horizon) "
            f"SELECT h.pos, h.horizon, l.pos, l.memory_id, l.erased, {_DOCUMENT} FROM h "
            "LEFT JOIN lex_log l ON l.tenant = %s AND l.pos > %s "
            "LEFT JOIN memories m ON m.tenant = l.tenant AND m.id = l.memory_id "
            "AND m.lex IS NOT NULL ORDER BY l.pos",
            [tenant, tenant, tenant, since])


def lex_documents(tenant: str) -> r.Stmt:
    """Every lexical document of the tenant and the log's position, in one snapshot (a row
    with no document when there are none)."""
    return ("WITH p AS (SELECT coalesce((SELECT value::bigint FROM meta WHERE tenant = %s "
            f"AND name = 'lex_position'), 0) AS pos) SELECT p.pos, {_DOCUMENT} FROM p "
            "LEFT JOIN memories m ON m.tenant = %s AND m.lex IS NOT NULL", [tenant, tenant])


def lex_rows(tenant: str) -> r.Stmt:
    """How many lexical documents the tenant holds (its BM25 statistics' N)."""
    return "SELECT coalesce(max(rows), 0) FROM lex_stats WHERE tenant = %s", [tenant]


def claim_job(tenant: str, now: datetime, lease_until: datetime) -> r.Stmt:
    """Take the oldest runnable job. SKIP LOCKED: concurrent workers each take a different
    one instead of queueing behind the row the first of them locked."""
    runnable = r.runnable_jobs(DIALECT, tenant, now)
    return ("UPDATE jobs SET status = 'running', attempts = attempts + 1, lease_until = %s, "
            "updated_at = %s WHERE tenant = %s AND id = (SELECT m.id FROM jobs m WHERE "
            f"{runnable.sql} ORDER BY m.run_at, m.id LIMIT 1 FOR UPDATE SKIP LOCKED) "
            f"RETURNING {', '.join(r.JOB_COLUMNS)}",
            [lease_until, now, tenant, *runnable.params])


# -- the store's transactions, access counts and upkeep ------------------------------------------

def settings(tenant: str, statement_timeout_ms: int, lock_timeout_ms: int) -> r.Stmt:
    """A transaction's settings, the tenant first (row-level security reads it). SET LOCAL
    semantics (is_local = true): nothing outlives the transaction, so a pooled connection
    (or a pgbouncer in transaction mode) never carries one tenant to another."""
    return ("SELECT set_config('engram.tenant', %s, true), set_config('statement_timeout', %s, true),"
            " set_config('lock_timeout', %s, true), set_config('TimeZone', 'UTC', true),"
            " set_config('client_min_messages', 'warning', true)",
            [tenant, str(statement_timeout_ms), str(lock_timeout_ms)])


WRITE_LOCK = 0x656E6774  # pg_advisory_xact_lock key: one writer per tenant (with hashtext(tenant))


def write_turn(tenant: str) -> r.Stmt:
    """Wait for the tenant's turn to write, held until the transaction ends."""
    return "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [WRITE_LOCK, tenant]


def ef_search(count: int) -> r.Stmt:
    """How many candidates an HNSW walk keeps (pgvector's default 40; 100 to 1000 here)."""
    return "SELECT set_config('hnsw.ef_search', %s, true)", [str(min(1000, max(100, count)))]


# pgvector 0.8's iterative index scans: a walk whose filter left too few rows goes on
ITERATIVE_SCAN = "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true)"


def touch(tenant: str, ids: Sequence[str], at: datetime) -> r.Stmt:
    """Count an access of the memories `ids`."""
    return ("UPDATE memories SET access_count = access_count + 1, last_accessed_at = %s "
            "WHERE tenant = %s AND id = ANY(%s)", [at, tenant, sorted(set(ids))])


def access(tenant: str, ids: Sequence[str], at: datetime) -> r.Stmt:
    """`touch`, returning each record as its statement's snapshot saw it (the self-join `o`),
    i.e. before this access."""
    return ("UPDATE memories m SET access_count = m.access_count + 1, last_accessed_at = %s "
            "FROM memories o WHERE m.tenant = %s AND m.id = ANY(%s) AND o.tenant = m.tenant "
            f"AND o.id = m.id RETURNING {r.columns('o', r.MEMORY_COLUMNS)}",
            [at, tenant, sorted(set(ids))])


MIGRATIONS = "SELECT name FROM schema_migrations ORDER BY name"
DATABASE_SIZE = "SELECT pg_database_size(current_database())"
VECTOR_OID = "SELECT 'vector'::regtype::oid"  # pgvector's `vector` type: it differs by database
ANALYZE = "ANALYZE memories, memory_keys"  # the tables a search plans over

# What `reclaim` runs on the tables an erase touched, by mode (docs/postgres.md)
RECLAIM_MODES = {"vacuum": "INDEX_CLEANUP ON", "full": "FULL", "none": ""}


def vacuum(mode: str, tables: Sequence[str]) -> str:
    """VACUUM of `tables` (names of ours, never user text); SKIP_LOCKED: never waits behind
    another lock. Runs outside any transaction."""
    return f"VACUUM ({RECLAIM_MODES[mode]}, SKIP_LOCKED) {', '.join(tables)}"

"""The SQLite backend's SQL, built without I/O: its dialect (times as epoch seconds, JSON as
text), filter conditions over `json_extract`, the FTS5 match and the dense cache's reads."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np

from ...filters import RECORD_FIELDS, Condition
from ...model import MemoryRecord, Scope
from .. import bm25
from .. import records as r
from ..base import Key, Query

BUMP_KEYS = "UPDATE meta SET value = value + 1 WHERE name = 'keys_version'"
BUMP_ROWS = "UPDATE meta SET value = value + 1 WHERE name = 'rows_version'"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def condition_sql(c: Condition) -> tuple[str, list[Any]]:
    """One filter condition over alias `m`, with SQLite's comparison of JSON values."""
    if c.metadata:
        target, tparams = "json_extract(m.metadata, ?)", [f'$."{c.field}"']
    else:
        if c.field not in RECORD_FIELDS:  # a closed set: the column name is never user text
            raise ValueError(f"not a record field: {c.field!r}")
        target, tparams = f"m.{c.field}", []
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


def _read_array(value: str) -> list[str]:
    out: list[str] = json.loads(value)
    return out


DIALECT = r.Dialect(
    name="sqlite", mark="?", tenant=False, seq="rid", arrays=False, chunk=900,
    nulls_last="",  # NULL sorts first, so last in a DESC order
    time=lambda v: v.timestamp(), read_time=lambda v: datetime.fromtimestamp(v, UTC),
    json=_dumps, jsonb=_dumps, read_json=json.loads, array=lambda v: _dumps(list(v)),
    read_array=_read_array, condition=condition_sql,
)


# -- memory rows and their lexical index -------------------------------------------------------------

def insert_memory(rec: MemoryRecord) -> r.Stmt:
    names = r.MEMORY_COLUMNS
    return (f"INSERT INTO memories ({', '.join(names)}) VALUES ({DIALECT.marks(len(names))})",
            r.memory_values(DIALECT, rec))


def update_memory(rec: MemoryRecord) -> r.Stmt:
    sets = ", ".join(f"{c} = ?" for c in r.MEMORY_COLUMNS[1:])
    return f"UPDATE memories SET {sets} WHERE id = ?", [*r.memory_values(DIALECT, rec)[1:], rec.id]


# The largest rid given so far (a bulk insert, holding the write lock, gives the next ones)
TOP_RID = "SELECT coalesce(max(rid), 0) FROM memories"
RID = "SELECT rid FROM memories WHERE id = ?"


def insert_memories(first_rid: int, recs: Sequence[MemoryRecord]) -> tuple[str, list[list[Any]]]:
    """`insert_memory` of many rows (executemany), with the rids `first_rid` on."""
    names = ("rid", *r.MEMORY_COLUMNS)
    return (f"INSERT INTO memories ({', '.join(names)}) VALUES ({DIALECT.marks(len(names))})",
            [[rid, *r.memory_values(DIALECT, rec)] for rid, rec in enumerate(recs, first_rid)])


def insert_keys(keys: Sequence[tuple[str, Key]]) -> tuple[str, list[tuple[str, str, bytes]]]:
    """Keys, each with its memory's id (executemany), their vectors as float32 blobs."""
    return ("INSERT INTO memory_keys(memory_id, kind, vector) VALUES (?, ?, ?)",
            [(mid, k.name, np.asarray(k.vector, dtype=np.float32).tobytes()) for mid, k in keys])


def soft_delete(ids: Sequence[str], at: datetime) -> r.Stmt:
    return (f"UPDATE memories SET deleted_at = ?, updated_at = ? WHERE id IN "
            f"({DIALECT.marks(len(ids))})", [at.timestamp(), at.timestamp(), *ids])


def drop_keys(ids: Sequence[str]) -> r.Stmt:
    return f"DELETE FROM memory_keys WHERE memory_id IN ({DIALECT.marks(len(ids))})", list(ids)


def drop_keys_of(memory_id: str) -> r.Stmt:
    """The keys of one memory (an update replacing them)."""
    return "DELETE FROM memory_keys WHERE memory_id = ?", [memory_id]


def drop_texts(ids: Sequence[str]) -> r.Stmt:
    """The FTS5 rows of these memories (before the memories themselves go)."""
    return (f"DELETE FROM memory_fts WHERE rowid IN "
            f"(SELECT rid FROM memories WHERE id IN ({DIALECT.marks(len(ids))}))", list(ids))


def drop_text(rid: int) -> r.Stmt:
    return "DELETE FROM memory_fts WHERE rowid = ?", [rid]


def erase_events(ids: Sequence[str]) -> r.Stmt:
    return f"DELETE FROM events WHERE memory_id IN ({DIALECT.marks(len(ids))})", list(ids)


def erase_memories(ids: Sequence[str]) -> r.Stmt:
    return f"DELETE FROM memories WHERE id IN ({DIALECT.marks(len(ids))})", list(ids)


def owner_tokens(scope: Scope) -> list[str]:
    """The scope's tokens `memory_fts` keeps in its `owner` column (bm25.scope_tokens: the
    PostgreSQL store's lexicon gives its documents the same)."""
    return bm25.scope_tokens(scope)


_INDEX_TEXT = "INSERT INTO memory_fts(rowid, body, context, owner) VALUES (?, ?, ?, ?)"


def index_text(rid: int, scope: Scope, body: str, previous: str) -> r.Stmt:
    return _INDEX_TEXT, [rid, body, previous, " ".join(owner_tokens(scope))]


def index_texts(rows: Sequence[tuple[int, Scope, str, str]]) -> tuple[str, list[list[Any]]]:
    """`index_text` of many rows (executemany): each its rid, scope, body and previous turn."""
    return _INDEX_TEXT, [index_text(*row)[1] for row in rows]


def lexical_documents(ids: Sequence[str] | None = None) -> r.Stmt:
    """The lexical documents (index/follow.py `LexicalText`) of every memory indexed, or of
    these memories: their memory_fts row."""
    if ids is None:
        return ("SELECT m.id, f.body, f.context, f.owner FROM memory_fts f "
                "JOIN memories m ON m.rid = f.rowid"), []
    return ("SELECT m.id, f.body, f.context, f.owner FROM memories m "
            f"JOIN memory_fts f ON f.rowid = m.rid WHERE m.id IN ({DIALECT.marks(len(ids))})",
            list(ids))


def _varints(block: bytes) -> list[int]:
    """The SQLite varints a record is made of."""
    out, value, i = [], 0, 0
    for byte in block:
        if i == 8:
            out.append((value << 8) | byte)
            value, i = 0, 0
            continue
        value, i = (value << 7) | (byte & 0x7F), i + 1
        if byte < 0x80:
            out.append(value)
            value, i = 0, 0
    return out


def fts_row_count(block: bytes | None) -> int:
    """The rows FTS5 holds, from its averages record."""
    return fts_averages(block)[0]


def fts_averages(block: bytes | None) -> tuple[int, int]:
    """The rows FTS5 holds and their tokens (every column's), from its averages record: the
    row count, then each column's total."""
    values = _varints(block or b"")
    return (values[0], sum(values[1:])) if values else (0, 0)


def visible_ids(query: Query, ids: Sequence[str]) -> r.Stmt:
    """Which of `ids` `query` may see. Looked up id by id: the CROSS JOIN keeps that order
    (without statistics SQLite would rather walk the whole scope through its user index,
    1.3 s at 1M memories in one scope, than look up a thousand ids)."""
    where, params = r.compile_query(DIALECT, query, "")
    return ("SELECT m.id FROM json_each(?) AS i CROSS JOIN memories m ON m.id = i.value "
            f"WHERE {where}", [_dumps(list(ids)), *params])


def _quoted(term: str) -> str:
    """A query term as an FTS5 phrase: quoted, so FTS syntax in it is data."""
    return '"' + term.replace('"', '""') + '"'


def lexical(query: Query, terms: Sequence[str]) -> r.Stmt:
    """The rows of the scope that `query` may see and any term matches (in the text or the
    previous turn), with what their BM25 score is made of (store/bm25.py, scored by
    `lexical_hits`): FTS5's averages record (its rows and their tokens) and, per term, the rows
    whose text holds it. The scope's owner tokens go into the MATCH, so the index intersects
    with the scope itself instead of reading every tenant's matches. One statement: one
    snapshot of the rows and the statistics."""
    match = "(" + " OR ".join(map(_quoted, terms)) + ")"
    owners = owner_tokens(query.scope)
    if owners:
        match = " AND ".join([*(f'owner : "{o}"' for o in owners), match])
    where, params = r.compile_query(DIALECT, query, "")
    distinct = list(dict.fromkeys(terms))
    hits = ", ".join("(SELECT count(*) FROM memory_fts WHERE memory_fts MATCH ?)" for _ in distinct)
    return (f"SELECT m.id, memory_fts.body, memory_fts.context, memory_fts.owner, "
            f"(SELECT block FROM memory_fts_data WHERE id = 1), {hits} FROM memory_fts "
            f"JOIN memories m ON m.rid = memory_fts.rowid WHERE memory_fts MATCH ? AND {where}",
            [*(f"body : {_quoted(t)}" for t in distinct), match, *params])


def lexical_hits(rows: Sequence[Sequence[Any]], tokenizer: bm25.Tokenizer, terms: Sequence[str],
                 k: int, previous_weight: float) -> list[tuple[str, float]]:
    """The best `k` of `lexical`'s rows by BM25, as the in-memory index scores them."""
    if not rows:
        return []
    distinct = list(dict.fromkeys(terms))
    phrase = {t: tokenizer.phrase(t) for t in distinct}
    count, tokens = fts_averages(rows[0][4])
    hits = {phrase[t]: rows[0][5 + i] for i, t in enumerate(distinct)}
    docs = ((mid, *tokenizer.tokens(body, context), len(owner.split()))
            for mid, body, context, owner, *_ in rows)
    return bm25.best(docs, [phrase[t] for t in terms if phrase[t]], hits, count, tokens / count,
                     k, previous_weight)


# -- the dense cache's reads (see slab.py) ------------------------------------------------------------

_ATTRS = "m.kind, m.expires_at, m.valid_from, m.valid_to"


def _attrs(rich: bool) -> str:
    return f"{_ATTRS}, {r.columns('m', r.CANDIDATE_COLUMNS)}" if rich else _ATTRS


def new_keys(scope: Scope, key_name: str, after_seq: int, rich: bool, limit: int) -> r.Stmt:
    """Keys added since `after_seq` of live memories of the scope (the first `limit`),
    with what visibility needs (and, `rich`, what ranking needs: the CANDIDATE_COLUMNS)."""
    w = r.Where(DIALECT, "").add("k.seq > ?", after_seq).add("k.kind = ?", key_name)
    w.add("m.deleted_at IS NULL").scope(scope)
    return (f"SELECT k.seq, k.memory_id, k.vector, {_attrs(rich)} FROM memory_keys k "
            f"JOIN memories m ON m.id = k.memory_id WHERE {w.sql} ORDER BY k.seq LIMIT ?",
            [*w.params, limit])


def key_attrs(scope: Scope, key_name: str, upto_seq: int, rich: bool = False) -> r.Stmt:
    """What visibility (and, `rich`, ranking) needs, for every key up to `upto_seq` of live
    memories of the scope."""
    w = r.Where(DIALECT, "").add("k.kind = ?", key_name).add("k.seq <= ?", upto_seq)
    w.add("m.deleted_at IS NULL").scope(scope)
    return (f"SELECT k.seq, {_attrs(rich)} "
            f"FROM memory_keys k JOIN memories m ON m.id = k.memory_id WHERE {w.sql}", w.params)


def changed_keys(scope: Scope, key_name: str, since: int, upto_seq: int, rich: bool,
                 limit: int) -> r.Stmt:
    """What visibility (and, `rich`, ranking) needs, for the keys up to `upto_seq` whose
    memory changed after rows version `since` (`memories.changed`), in any scope, each with
    whether its memory is still live and in this scope; at most `limit`."""
    ok = r.Where(DIALECT, "").add("m.deleted_at IS NULL").scope(scope)
    return (f"SELECT k.seq, CASE WHEN {ok.sql} THEN 1 ELSE 0 END, {_attrs(rich)} "
            "FROM memories m JOIN memory_keys k ON k.memory_id = m.id "
            "WHERE m.changed > ? AND k.kind = ? AND k.seq <= ? LIMIT ?",
            [*ok.params, since, key_name, upto_seq, limit])


def tombstones(after_id: int) -> r.Stmt:
    """Keys deleted since tombstone `after_id`, in order (SQLite never prunes them); -1: only
    the last id."""
    if after_id < 0:
        return "SELECT coalesce(max(id), 0), NULL FROM key_tombstones", []
    return "SELECT id, seq FROM key_tombstones WHERE id > ? ORDER BY id", [after_id]


# A row's cached columns changed (`update`, whose bump of rows_version comes first): its mark
MARK_CHANGED = ("UPDATE memories SET changed = (SELECT value FROM meta WHERE name = 'rows_version') "
                "WHERE id = ?")


class KeyReads:
    """The dense cache's reads (index/refresh.py, index/cache.py), in this dialect."""

    dialect = DIALECT
    owner: tuple[Any, ...] = ()  # one database, one owner

    def count_keys(self, scope: Scope, key_name: str, dim: int, limit: int) -> r.Stmt:
        w = r.Where(DIALECT, "").add("k.kind = ?", key_name).add("m.deleted_at IS NULL").scope(scope)
        return (f"SELECT count(*) FROM (SELECT 1 FROM memory_keys k JOIN memories m ON m.id = "
                f"k.memory_id WHERE {w.sql} LIMIT ?)", [*w.params, limit])

    def versions(self) -> r.Stmt:
        return "SELECT name, value FROM meta WHERE name IN ('keys_version', 'rows_version')", []

    def tombstones(self, after_id: int) -> r.Stmt:
        return tombstones(after_id)

    def new_keys(self, scope: Scope, key_name: str, dim: int, after_seq: int, rich: bool,
                 limit: int) -> r.Stmt:
        return new_keys(scope, key_name, after_seq, rich, limit)

    def changed_keys(self, scope: Scope, key_name: str, dim: int, since: int, upto_seq: int,
                     rich: bool, limit: int) -> r.Stmt:
        return changed_keys(scope, key_name, since, upto_seq, rich, limit)

    def key_attrs(self, scope: Scope, key_name: str, dim: int, upto_seq: int,
                  rich: bool) -> r.Stmt:
        return key_attrs(scope, key_name, upto_seq, rich)

    def vectors(self, blobs: Sequence[Any], dim: int) -> np.ndarray:
        return np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(blobs), dim)


def key_vectors(ids: Sequence[str], key_name: str) -> r.Stmt:
    """The vectors of one key name of these memories, in the order they were written."""
    return (f"SELECT memory_id, vector FROM memory_keys WHERE kind = ? AND memory_id IN "
            f"({DIALECT.marks(len(ids))}) ORDER BY seq", [key_name, *ids])


def alive_keys(seqs: Sequence[int]) -> r.Stmt:
    return f"SELECT seq FROM memory_keys WHERE seq IN ({DIALECT.marks(len(seqs))})", list(seqs)


# -- the store's bookkeeping: meta, access counts, jobs, maintenance ----------------------------------

META = "SELECT name, value FROM meta"
ERASURES = "SELECT value FROM meta WHERE name = 'erasures'"
LEX_FILE = "SELECT value FROM meta WHERE name = 'lex_file'"  # the saved lexicon's token
SLAB_FILES = "SELECT name FROM meta WHERE name GLOB 'slab_file:*' AND value <> 0"


def set_meta(name: str, value: int) -> r.Stmt:
    return ("INSERT INTO meta(name, value) VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET value = excluded.value", [name, value])


def access_counts(counts: Sequence[tuple[Sequence[str], datetime]]) -> tuple[str, list[Any]]:
    """The accesses `counts` holds (each a search's ids and time) as one row per memory
    (executemany): how many, and the latest time."""
    by_id: dict[str, tuple[int, float]] = {}
    for ids, at in counts:
        t = at.timestamp()
        for mid in ids:
            n, last = by_id.get(mid, (0, t))
            by_id[mid] = (n + 1, max(last, t))
    return ("UPDATE memories SET access_count = access_count + ?1, "
            "last_accessed_at = max(ifnull(last_accessed_at, ?2), ?2) WHERE id = ?3",
            [(n, last, mid) for mid, (n, last) in by_id.items()])


AUTOCHECKPOINT_PAGES = 1000  # SQLite's default, which conn.py leaves in place


def counting_pragmas(wait_s: float) -> list[str]:
    """The connection's settings while it commits access counts: waiting for other processes'
    writers at most `wait_s`; without an fsync per commit (in WAL mode NORMAL: a power cut
    may lose the last counts, never corrupt the file) nor a checkpoint (the background
    thread's, every so many commits)."""
    return [f"PRAGMA busy_timeout = {int(wait_s * 1000)}", "PRAGMA synchronous = NORMAL",
            "PRAGMA wal_autocheckpoint = 0"]


def writing_pragmas(busy_timeout_s: float) -> list[str]:
    """The settings `counting_pragmas` changed, back as conn.py sets them for every write."""
    return ["PRAGMA synchronous = FULL", f"PRAGMA wal_autocheckpoint = {AUTOCHECKPOINT_PAGES}",
            f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}"]


CHECKPOINT = "PRAGMA wal_checkpoint(PASSIVE)"  # as far as no reader needs the WAL; never waits
CHECKPOINT_TRUNCATE = "PRAGMA wal_checkpoint(TRUNCATE)"  # and empties it (reclaim)


def next_job(now: datetime) -> r.Stmt:
    """The oldest runnable job (read inside a write: one claimer at a time)."""
    runnable = r.runnable_jobs(DIALECT, "", now)
    return (f"SELECT {r.columns('m', r.JOB_COLUMNS)} FROM jobs m "
            f"WHERE {runnable.sql} ORDER BY m.run_at, m.id LIMIT 1", runnable.params)


FTS_OPTIMIZE = "INSERT INTO memory_fts(memory_fts) VALUES ('optimize')"  # merge its segments
FTS_SECURE_DELETE = "SELECT v FROM memory_fts_config WHERE k = 'secure-delete'"
FTS_SECURE_DELETE_ON = "INSERT INTO memory_fts(memory_fts, rank) VALUES ('secure-delete', 1)"

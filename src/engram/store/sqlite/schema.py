"""The SQLite schema: named migrations, applied in order and recorded in `schema_migrations`,
so a database made by an older version upgrades itself when opened."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable

from .. import graph
from . import sql
from .conn import Connections

log = logging.getLogger("engram.store")

Step = str | Callable[[sqlite3.Connection], None]  # a statement, or a function rewriting data


def _merge_entities(conn: sqlite3.Connection) -> None:
    graph.merge_duplicates(sql.DIALECT, conn)


# Never edit a released migration: append a new one.
MIGRATIONS: list[tuple[str, list[Step]]] = [
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
    # The knowledge graph (docs/graph.md): entities with a name/alias index, relations with
    # world and engram time, and the mentions that link entities to episodes.
    ("0003_graph", [
        """CREATE TABLE entities (
            rid INTEGER PRIMARY KEY,
            id TEXT NOT NULL UNIQUE,
            user_id TEXT, agent_id TEXT,
            name TEXT NOT NULL, type TEXT NOT NULL,
            aliases TEXT NOT NULL, summary TEXT NOT NULL, attributes TEXT NOT NULL,
            embedding BLOB, provenance TEXT NOT NULL,
            created_at REAL NOT NULL, updated_at REAL NOT NULL)""",
        "CREATE INDEX entities_owner ON entities(user_id, agent_id, type)",
        # One row per normalised name, alias or name token of an entity: exact resolution and
        # mention linking look keys up here instead of scanning names.
        """CREATE TABLE entity_names (
            entity_id TEXT NOT NULL REFERENCES entities(id) ON DELETE CASCADE,
            user_id TEXT, agent_id TEXT,
            key TEXT NOT NULL, kind TEXT NOT NULL)""",
        "CREATE INDEX entity_names_key ON entity_names(key, user_id, agent_id)",
        "CREATE INDEX entity_names_entity ON entity_names(entity_id)",
        """CREATE TABLE relations (
            rid INTEGER PRIMARY KEY,
            id TEXT NOT NULL UNIQUE,
            user_id TEXT, agent_id TEXT,
            subject_id TEXT NOT NULL, predicate TEXT NOT NULL,
            object_id TEXT, value TEXT, fact TEXT NOT NULL,
            valid_from REAL, valid_to REAL, created_at REAL NOT NULL, expired_at REAL,
            provenance TEXT NOT NULL, confidence REAL NOT NULL, metadata TEXT NOT NULL)""",
        "CREATE INDEX relations_sp ON relations(subject_id, predicate)",
        "CREATE INDEX relations_op ON relations(object_id, predicate)",
        "CREATE INDEX relations_p ON relations(predicate, user_id, agent_id)",
        """CREATE TABLE mentions (
            episode_id TEXT NOT NULL, entity_id TEXT NOT NULL,
            user_id TEXT, agent_id TEXT, session_id TEXT, at REAL,
            PRIMARY KEY (episode_id, entity_id))""",
        "CREATE INDEX mentions_entity ON mentions(entity_id, at)",
    ]),
    # The embedding space the stored vectors belong to (engram.providers.embedders.space),
    # recorded on first use: a Memory whose embedder makes another space refuses to open
    # instead of mixing vectors. `pending` / `cursor`: an unfinished `reindex` (its target
    # space and the last memory id it re-embedded), so a restart continues where it stopped.
    # One row per tenant ('' here), as on PostgreSQL, so both share the statements.
    ("0004_embedding_space", [
        """CREATE TABLE embedding_space (
            tenant TEXT PRIMARY KEY,
            space TEXT NOT NULL, pending TEXT, cursor TEXT,
            updated_at REAL NOT NULL)""",
    ]),
    # An owner's entities are unique by name (docs/graph.md, "One entity per name"): `key` is
    # the claim a new entity is inserted under (graph/rules.py::claim_keys), so two writers
    # naming one new entity at once end with one. Duplicates an older version made are merged
    # first. `summary_by`: who wrote the summary (summaries written so far were the caller's).
    ("0005_entity_keys", [
        "ALTER TABLE entities ADD COLUMN key TEXT",
        "ALTER TABLE entities ADD COLUMN summary_by TEXT NOT NULL DEFAULT ''",
        "UPDATE entities SET summary_by = 'caller' WHERE summary <> ''",
        _merge_entities,
        "CREATE UNIQUE INDEX entities_key ON entities "
        "(coalesce(user_id, ''), coalesce(agent_id, ''), key)",
    ]),
    # What the in-memory lexical index (lexicon.py) needs to follow `memory_fts`: a write that
    # may change a row's entry logs the row (its rid, the entry's rowid), in the same
    # transaction. A trigger cannot watch the FTS5 table, but every change to it comes with a
    # change to its memory: an insert, an update that sets the text (`update` sets every
    # column; access counts do not), a soft delete, an erase.
    ("0005_lexicon_log", [
        "CREATE TABLE lex_log (id INTEGER PRIMARY KEY AUTOINCREMENT, rid INTEGER NOT NULL)",
        "CREATE TRIGGER memories_lex_insert AFTER INSERT ON memories "
        "BEGIN INSERT INTO lex_log(rid) VALUES (new.rid); END",
        "CREATE TRIGGER memories_lex_update AFTER UPDATE OF text, deleted_at ON memories "
        "BEGIN INSERT INTO lex_log(rid) VALUES (new.rid); END",
        "CREATE TRIGGER memories_lex_delete AFTER DELETE ON memories "
        "BEGIN INSERT INTO lex_log(rid) VALUES (old.rid); END",
    ]),
    # The lexicon's log is pruned (lexlog.py::prune_log): `lex_horizon` is the last entry
    # deleted, so an index older than it knows it missed some. Its saved file is trusted only
    # while `lex_file` holds the file's token; deleting a memory (an erasure) counts in
    # `erasures` and unnames the file in the same transaction, since the file, like an index
    # built before, may hold the erased words.
    ("0006_lexicon_file", [
        "INSERT INTO meta(name, value) VALUES ('lex_horizon', 0)",
        "INSERT INTO meta(name, value) VALUES ('lex_file', 0)",
        "INSERT INTO meta(name, value) VALUES ('erasures', 0)",
        "CREATE TRIGGER memories_erased AFTER DELETE ON memories BEGIN "
        "UPDATE meta SET value = value + 1 WHERE name = 'erasures'; "
        "UPDATE meta SET value = 0 WHERE name = 'lex_file'; END",
    ]),
    # The large dense caches (slab.py) are saved beside the database too, each trusted while
    # its `meta` row `slab_file:<name>` holds the file's token: an erasure unnames them all
    # in the erasing transaction (they hold vectors and texts).
    ("0007_slab_files", [
        "CREATE TRIGGER memories_erased_slabs AFTER DELETE ON memories BEGIN "
        "UPDATE meta SET value = 0 WHERE name GLOB 'slab_file:*' AND value <> 0; END",
    ]),
    # The mark each erasure leaves in its own transaction, which a write begun before it
    # checks in its own (pipeline/fence.py). AUTOINCREMENT: a number is never given twice,
    # even after the oldest marks are dropped.
    ("0008_erasure_marks", [
        """CREATE TABLE erasures (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            user_id TEXT, agent_id TEXT, session_id TEXT,
            target TEXT NOT NULL,
            at REAL NOT NULL)""",
    ]),
    # Which rows changed since a rows version (store/index/refresh.py): each memory's `changed`
    # holds the rows version of its last change to a column the dense cache holds, so a
    # cache reloads those rows only. Set by the visibility trigger (which bumps the version
    # first) and by `update` (the ranking columns, after its own bump).
    ("0009_row_changes", [
        "ALTER TABLE memories ADD COLUMN changed INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX memories_changed ON memories(changed)",
        "DROP TRIGGER memories_visibility",
        """CREATE TRIGGER memories_visibility AFTER UPDATE OF deleted_at, expires_at, valid_from,
               valid_to, kind, user_id, agent_id, session_id ON memories
           WHEN old.deleted_at IS NOT new.deleted_at OR old.expires_at IS NOT new.expires_at
             OR old.valid_from IS NOT new.valid_from OR old.valid_to IS NOT new.valid_to
             OR old.kind IS NOT new.kind OR old.user_id IS NOT new.user_id
             OR old.agent_id IS NOT new.agent_id OR old.session_id IS NOT new.session_id
           BEGIN UPDATE meta SET value = value + 1 WHERE name = 'rows_version';
           UPDATE memories SET changed = (SELECT value FROM meta WHERE name = 'rows_version')
           WHERE rid = new.rid; END""",
    ]),    # `lex_log` names the memory whose lexical document changed, and whether it was erased, as
    # PostgreSQL's does (the lexicon follows both the same way: index/follow.py). It named the
    # `memory_fts` rowid, which is `memories.rid`: SQLite gives a rid again once the highest
    # row is deleted, so an entry could stand for two memories (an erasure's rebuild covered
    # it). The old entries cannot be read by memory: the log starts empty past them (the
    # horizon moves to the last, the ids go on after it, so no position is given twice), and
    # the saved lexicon (numbered by rowid) is unnamed: it is built again.
    ("0010_lexicon_log_ids", [
        "DROP TRIGGER memories_lex_insert",
        "DROP TRIGGER memories_lex_update",
        "DROP TRIGGER memories_lex_delete",
        "UPDATE meta SET value = max(value, (SELECT coalesce(max(id), 0) FROM lex_log)) "
        "WHERE name = 'lex_horizon'",
        "DROP TABLE lex_log",
        "CREATE TABLE lex_log (id INTEGER PRIMARY KEY AUTOINCREMENT, memory_id TEXT NOT NULL, "
        "erased INTEGER NOT NULL DEFAULT 0)",
        "INSERT INTO sqlite_sequence(name, seq) SELECT 'lex_log', value FROM meta "
        "WHERE name = 'lex_horizon'",
        "UPDATE meta SET value = 0 WHERE name = 'lex_file'",
        "CREATE TRIGGER memories_lex_insert AFTER INSERT ON memories "
        "BEGIN INSERT INTO lex_log(memory_id) VALUES (new.id); END",
        "CREATE TRIGGER memories_lex_update AFTER UPDATE OF text, deleted_at ON memories "
        "BEGIN INSERT INTO lex_log(memory_id) VALUES (new.id); END",
        "CREATE TRIGGER memories_lex_delete AFTER DELETE ON memories "
        "BEGIN INSERT INTO lex_log(memory_id, erased) VALUES (old.id, 1); END",
    ]),
]


def migrate(db: Connections, migrations: list[tuple[str, list[Step]]] | None = None) -> None:
    """Apply the pending migrations (the store's, by default), all in one transaction (an
    upgrade happens whole or not)."""
    with db.transaction() as c:
        apply(c, MIGRATIONS if migrations is None else migrations, db.label)


def apply(c: sqlite3.Connection, migrations: list[tuple[str, list[Step]]], label: str) -> None:
    """Apply the pending `migrations` inside the caller's write transaction, each recorded
    by name in the file's `schema_migrations`."""
    c.execute("CREATE TABLE IF NOT EXISTS schema_migrations "
              "(name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    done = {r[0] for r in c.execute("SELECT name FROM schema_migrations")}
    for name, statements in migrations:
        if name in done:
            continue
        for stmt in statements:
            if isinstance(stmt, str):
                c.execute(stmt)
            else:
                stmt(c)
        c.execute("INSERT INTO schema_migrations VALUES (?, ?)", (name, time.time()))
        log.info("applied migration %s to %s", name, label)


def applied(db: Connections) -> list[str]:
    # In the order they were applied (rowid): names need not sort that way ("0003_graph"
    # comes after "0003_jobs_sessions" here, as the PostgreSQL store names it 0003 too).
    return [r[0] for r in db.read("SELECT name FROM schema_migrations ORDER BY rowid")]

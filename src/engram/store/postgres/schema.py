"""The PostgreSQL schema: named migrations (applied in order, each in its own transaction under
an advisory lock, so concurrent openers migrate once), row-level security per tenant, and the
HNSW index each vector dimension gets once a search needs it (ann.py).

A migration is a list of SQL statements and, where data must be rewritten by Python, of
functions called with the migration's connection."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

from psycopg import errors as pgerr

from ...errors import StoreError
from ...model import Scope
from .. import bm25, graph
from . import sql
from .pool import Connection

log = logging.getLogger("engram.store")

_MIGRATION_LOCK = 0x656E6772  # pg_advisory_xact_lock key: one migrator at a time ("engr")

# Identifiers, hashes and scope fields compare byte-wise, as in SQLite (BINARY): paging by id
# must follow UUIDv7 order whatever the database's default collation is.
TEXT = 'text COLLATE "C"'
MAX_INDEXED_DIM = 2000  # pgvector's HNSW limit for `vector`; wider keys are searched exactly
# Key tombstones a tenant keeps (the dense caches' record of deleted keys, 0006/0007): a cache
# that has missed more deletions than these reloads its scope instead of applying them.
TOMBSTONES_KEPT = 10_000
TOMBSTONES_SETTING = "engram.tombstones_kept"  # a database or role may set another number

# Tables whose rows belong to a tenant: each gets the tenant policy below.
TENANT_TABLES = ("memories", "memory_keys", "events", "meta", "jobs", "sessions", "lex_stats",
                 "entities", "entity_names", "relations", "mentions", "embedding_space",
                 "key_tombstones", "erasures", "lex_log")
_GRAPH_TABLES = ("entities", "entity_names", "relations", "mentions")
# The columns of `memories` the dense cache holds (visibility, then ranking: CANDIDATE_COLUMNS)
_CACHED_COLUMNS = ("deleted_at", "expires_at", "valid_from", "valid_to", "kind", "user_id",
                   "agent_id", "session_id", "name", "text", "observed_at", "created_at",
                   "importance")
# The columns of `memories` a lexicon's document is made of (its tokens, and its scope: the
# scope's tokens are in it) and whether it has one
_LEX_COLUMNS = ("lex_body", "lex_context", "lex_len", "user_id", "agent_id", "session_id")
LEX_LOG_KEPT = 100_000  # lex_log entries a tenant keeps (0010)
LEX_LOG_SETTING = "engram.lex_log_kept"  # a database or role may set another number
_TENANT_TABLES_0001 = ("memories", "memory_keys", "events", "meta", "jobs", "sessions")

Step = str | Callable[[Connection], None]  # a statement, or a function that rewrites data


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


def _reindex_0001(conn: Connection) -> None:
    """Give the rows indexed by 0001 (an `english` tsvector with ts_rank weights) the index of
    0002 (see bm25.py), from their lexical document as engram 0.1 wrote it: the text after its
    speaker's name, and for an episode the previous live episode of its exact scope (by time,
    then insertion) as context. Every tenant's rows: row-level security is off meanwhile."""
    speaker = "CASE WHEN m.name IS NULL OR m.name = '' THEN m.text ELSE m.name || ': ' || m.text END"
    tokenizer = bm25.Tokenizer()
    try:
        with conn.cursor(name="engram_reindex_0001") as rows:
            rows.itersize = 500
            rows.execute(
                f"SELECT m.tenant, m.id, m.user_id, m.agent_id, m.session_id, {speaker}, "
                f"CASE WHEN m.kind = 'episodic' THEN lag({speaker}) OVER (PARTITION BY m.tenant, "
                "m.user_id, m.agent_id, m.session_id, m.kind = 'episodic' "
                "ORDER BY m.valid_from NULLS FIRST, m.seq) END "
                "FROM memories m WHERE m.deleted_at IS NULL AND m.lex IS NOT NULL")
            batch: list[tuple[object, ...]] = []
            for tenant, mid, uid, aid, sid, body, previous in rows:
                doc = bm25.document(tokenizer, body, previous or "", Scope(uid, aid, sid))
                batch.append((doc.terms, doc.body, doc.context, doc.length, tenant, mid))
                if len(batch) >= 500:
                    _set_lex(conn, batch)
                    batch = []
            _set_lex(conn, batch)
    finally:
        tokenizer.close()


def _set_lex(conn: Connection, batch: list[tuple[object, ...]]) -> None:
    if batch:
        with conn.cursor() as cur:
            cur.executemany("UPDATE memories SET lex = array_to_tsvector(%s::text[]), lex_body = %s, "
                            "lex_context = %s, lex_len = %s WHERE tenant = %s AND id = %s", batch)


def _merge_entities(conn: Connection) -> None:
    graph.merge_duplicates(sql.DIALECT, conn)


# Named migrations, applied in order, each in its own transaction under an advisory lock.
# Never edit a released one: append a new one.
MIGRATIONS: list[tuple[str, list[Step]]] = [
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
        # HNSW index over `vector::vector(dim)`, made once a search of that dimension needs
        # it (see `hnsw_index_sql` and ann.py).
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
        *[stmt for table in _TENANT_TABLES_0001 for stmt in _tenant_policy(table)],
    ]),
    # Lexical search ranks as on SQLite: FTS5's tokens and BM25 statistics (see bm25.py).
    ("0002_bm25", [
        "ALTER TABLE memories ADD COLUMN lex_body text, ADD COLUMN lex_context text, "
        "ADD COLUMN lex_len integer",
        f"""CREATE TABLE lex_stats (
            tenant {TEXT} PRIMARY KEY,
            rows bigint NOT NULL,
            tokens bigint NOT NULL)""",
        f"""CREATE TABLE lex_terms (
            tenant {TEXT} NOT NULL,
            term {TEXT} NOT NULL,
            df bigint NOT NULL,
            PRIMARY KEY (tenant, term))""",
        "ALTER TABLE memories NO FORCE ROW LEVEL SECURITY",  # the owner re-indexes every tenant
        _reindex_0001,
        "INSERT INTO lex_stats (tenant, rows, tokens) SELECT tenant, count(*), sum(lex_len) "
        "FROM memories WHERE lex IS NOT NULL GROUP BY tenant",
        "INSERT INTO lex_terms (tenant, term, df) SELECT m.tenant, t, count(*) "
        "FROM memories m, unnest(tsvector_to_array(m.lex)) t WHERE m.lex IS NOT NULL "
        "GROUP BY m.tenant, t",
        "ALTER TABLE memories FORCE ROW LEVEL SECURITY",
        *_tenant_policy("lex_stats"),
        *_tenant_policy("lex_terms"),
    ]),
    # The knowledge graph (docs/graph.md): entities with a name/alias index, relations with
    # world and engram time, and the mentions that link entities to episodes.
    ("0003_graph", [
        f"""CREATE TABLE entities (
            tenant {TEXT} NOT NULL,
            id {TEXT} NOT NULL,
            seq bigint GENERATED ALWAYS AS IDENTITY,
            user_id {TEXT}, agent_id {TEXT},
            name text NOT NULL, type {TEXT} NOT NULL,
            aliases json NOT NULL, summary text NOT NULL, attributes json NOT NULL,
            embedding bytea, provenance json NOT NULL,
            created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL,
            PRIMARY KEY (tenant, id))""",
        "CREATE INDEX entities_owner ON entities (tenant, user_id, agent_id, type)",
        f"""CREATE TABLE entity_names (
            tenant {TEXT} NOT NULL,
            entity_id {TEXT} NOT NULL,
            user_id {TEXT}, agent_id {TEXT},
            key {TEXT} NOT NULL, kind {TEXT} NOT NULL,
            FOREIGN KEY (tenant, entity_id) REFERENCES entities (tenant, id) ON DELETE CASCADE)""",
        "CREATE INDEX entity_names_key ON entity_names (tenant, key, user_id, agent_id)",
        "CREATE INDEX entity_names_entity ON entity_names (tenant, entity_id)",
        f"""CREATE TABLE relations (
            tenant {TEXT} NOT NULL,
            id {TEXT} NOT NULL,
            seq bigint GENERATED ALWAYS AS IDENTITY,
            user_id {TEXT}, agent_id {TEXT},
            subject_id {TEXT} NOT NULL, predicate {TEXT} NOT NULL,
            object_id {TEXT}, value text, fact text NOT NULL,
            valid_from timestamptz, valid_to timestamptz,
            created_at timestamptz NOT NULL, expired_at timestamptz,
            provenance json NOT NULL, confidence double precision NOT NULL,
            metadata json NOT NULL,
            PRIMARY KEY (tenant, id))""",
        "CREATE INDEX relations_sp ON relations (tenant, subject_id, predicate)",
        "CREATE INDEX relations_op ON relations (tenant, object_id, predicate)",
        "CREATE INDEX relations_p ON relations (tenant, predicate, user_id, agent_id)",
        f"""CREATE TABLE mentions (
            tenant {TEXT} NOT NULL,
            episode_id {TEXT} NOT NULL, entity_id {TEXT} NOT NULL,
            user_id {TEXT}, agent_id {TEXT}, session_id {TEXT}, at timestamptz,
            PRIMARY KEY (tenant, episode_id, entity_id))""",
        "CREATE INDEX mentions_entity ON mentions (tenant, entity_id, at)",
        *[stmt for table in _GRAPH_TABLES for stmt in _tenant_policy(table)],
    ]),
    # The embedding space of each tenant's vectors, and its unfinished reindex (sqlite/schema.py).
    ("0004_embedding_space", [
        f"""CREATE TABLE embedding_space (
            tenant {TEXT} PRIMARY KEY,
            space text NOT NULL, pending text, cursor {TEXT},
            updated_at timestamptz NOT NULL)""",
        *_tenant_policy("embedding_space"),
    ]),
    # An owner's entities are unique by name; duplicates an older version made are merged first,
    # in every tenant (sqlite/schema.py says why; `summary_by` too).
    ("0005_entity_keys", [
        f"ALTER TABLE entities ADD COLUMN key {TEXT}",
        "ALTER TABLE entities ADD COLUMN summary_by text NOT NULL DEFAULT ''",
        *[f"ALTER TABLE {table} NO FORCE ROW LEVEL SECURITY" for table in _GRAPH_TABLES],
        "UPDATE entities SET summary_by = 'caller' WHERE summary <> ''",
        _merge_entities,
        *[f"ALTER TABLE {table} FORCE ROW LEVEL SECURITY" for table in _GRAPH_TABLES],
        "CREATE UNIQUE INDEX entities_key ON entities "
        "(tenant, coalesce(user_id, ''), coalesce(agent_id, ''), key)",
    ]),
    # What a process's in-memory cache of a scope's keys (store.py, "the dense cache") needs to
    # follow the database, as on SQLite (sqlite/schema.py 0002): a version per tenant bumped by
    # every statement that adds or deletes keys, a tombstone per deleted key, and a version
    # bumped by every change to a column that visibility or ranking reads. Triggers, so that
    # cascades and every write path are covered. Writes of one tenant take turns (store.py,
    # `write`), so its keys' and tombstones' sequence numbers grow in commit order: a cache
    # loads what is new by number.
    ("0006_dense_cache", [
        f"""CREATE TABLE key_tombstones (
            tenant {TEXT} NOT NULL,
            id bigint GENERATED ALWAYS AS IDENTITY,
            seq bigint NOT NULL,
            PRIMARY KEY (tenant, id))""",
        *_tenant_policy("key_tombstones"),
        """CREATE FUNCTION engram_bump(t text, n text) RETURNS void LANGUAGE sql AS $$
            INSERT INTO meta (tenant, name, value) VALUES (t, n, '1'::jsonb)
            ON CONFLICT (tenant, name) DO UPDATE SET value = to_jsonb(meta.value::bigint + 1) $$""",
        """CREATE FUNCTION engram_keys_added() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
            PERFORM engram_bump(t, 'keys_version') FROM (SELECT DISTINCT tenant AS t FROM added) x;
            RETURN NULL; END $$""",
        """CREATE FUNCTION engram_keys_gone() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
            INSERT INTO key_tombstones (tenant, seq) SELECT tenant, seq FROM gone ORDER BY seq;
            PERFORM engram_bump(t, 'keys_version') FROM (SELECT DISTINCT tenant AS t FROM gone) x;
            RETURN NULL; END $$""",
        f"""CREATE FUNCTION engram_rows_changed() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
            PERFORM engram_bump(t, 'rows_version') FROM (SELECT DISTINCT n.tenant AS t
                FROM changed_to n JOIN changed_from o ON o.tenant = n.tenant AND o.id = n.id
                WHERE {" OR ".join(f"o.{c} IS DISTINCT FROM n.{c}" for c in _CACHED_COLUMNS)}) x;
            RETURN NULL; END $$""",
        "CREATE TRIGGER memory_keys_added AFTER INSERT ON memory_keys REFERENCING NEW TABLE AS "
        "added FOR EACH STATEMENT EXECUTE FUNCTION engram_keys_added()",
        "CREATE TRIGGER memory_keys_gone AFTER DELETE ON memory_keys REFERENCING OLD TABLE AS "
        "gone FOR EACH STATEMENT EXECUTE FUNCTION engram_keys_gone()",
        "CREATE TRIGGER memories_changed AFTER UPDATE ON memories REFERENCING OLD TABLE AS "
        "changed_from NEW TABLE AS changed_to FOR EACH STATEMENT EXECUTE FUNCTION "
        "engram_rows_changed()",
    ]),
    # 0006's tombstones were never pruned. Each tenant now keeps its newest TOMBSTONES_KEPT
    # (or the `engram.tombstones_kept` setting's number: `ALTER DATABASE ... SET`), and meta
    # records `tombstones`, how many it holds, and `tombstone_horizon`, the largest id
    # pruned. The trigger prunes when a tenant holds twice as many: one index scan of
    # TOMBSTONES_KEPT entries per TOMBSTONES_KEPT deletions. A cache that has applied the
    # tombstones up to an id below the horizon can no longer know what it missed: it
    # reloads the scope (store.py, `_refresh`). The backlog an older version left is pruned
    # here once.
    ("0007_tombstone_horizon", [
        "ALTER TABLE key_tombstones NO FORCE ROW LEVEL SECURITY",  # every tenant's backlog
        "ALTER TABLE meta NO FORCE ROW LEVEL SECURITY",
        f"""INSERT INTO meta (tenant, name, value)
            SELECT tenant, 'tombstone_horizon', to_jsonb(max(id)) FROM (SELECT tenant, id,
                row_number() OVER (PARTITION BY tenant ORDER BY id DESC) AS n FROM key_tombstones) t
            WHERE n > {TOMBSTONES_KEPT} GROUP BY tenant""",
        "DELETE FROM key_tombstones k USING meta h WHERE h.tenant = k.tenant "
        "AND h.name = 'tombstone_horizon' AND k.id <= h.value::bigint",
        "INSERT INTO meta (tenant, name, value) SELECT tenant, 'tombstones', to_jsonb(count(*)) "
        "FROM key_tombstones GROUP BY tenant",
        "ALTER TABLE key_tombstones FORCE ROW LEVEL SECURITY",
        "ALTER TABLE meta FORCE ROW LEVEL SECURITY",
        f"""CREATE OR REPLACE FUNCTION engram_keys_gone() RETURNS trigger LANGUAGE plpgsql AS $$
            DECLARE g record; held bigint; horizon bigint; kept bigint := coalesce(nullif(
                current_setting('{TOMBSTONES_SETTING}', true), '')::bigint, {TOMBSTONES_KEPT});
            BEGIN
            INSERT INTO key_tombstones (tenant, seq) SELECT tenant, seq FROM gone ORDER BY seq;
            FOR g IN SELECT tenant AS t, count(*) AS n FROM gone GROUP BY tenant LOOP
                PERFORM engram_bump(g.t, 'keys_version');
                INSERT INTO meta (tenant, name, value) VALUES (g.t, 'tombstones', to_jsonb(g.n))
                    ON CONFLICT (tenant, name) DO UPDATE SET value = to_jsonb(meta.value::bigint + g.n)
                    RETURNING value::bigint INTO held;
                IF held > 2 * kept THEN
                    SELECT id INTO horizon FROM key_tombstones WHERE tenant = g.t
                        ORDER BY id DESC OFFSET kept LIMIT 1;
                    IF horizon IS NOT NULL THEN
                        DELETE FROM key_tombstones WHERE tenant = g.t AND id <= horizon;
                        INSERT INTO meta (tenant, name, value)
                            VALUES (g.t, 'tombstone_horizon', to_jsonb(horizon))
                            ON CONFLICT (tenant, name) DO UPDATE SET value = excluded.value;
                    END IF;
                    UPDATE meta SET value = to_jsonb((SELECT count(*) FROM key_tombstones
                        WHERE tenant = g.t)) WHERE tenant = g.t AND name = 'tombstones';
                END IF;
            END LOOP;
            RETURN NULL; END $$""",
    ]),
    # The mark each erasure leaves in its own transaction, which a write begun before it
    # checks in its own (pipeline/fence.py). Erasures of one tenant take the tenant's turn,
    # so its marks are numbered in commit order.
    ("0008_erasure_marks", [
        f"""CREATE TABLE erasures (
            tenant {TEXT} NOT NULL,
            seq bigint GENERATED ALWAYS AS IDENTITY,
            user_id {TEXT}, agent_id {TEXT}, session_id {TEXT},
            target {TEXT} NOT NULL,
            at timestamptz NOT NULL,
            PRIMARY KEY (tenant, seq))""",
        *_tenant_policy("erasures"),
    ]),
    # Which rows changed since a rows version (store/index/refresh.py): each memory's `changed`
    # holds the tenant's rows version of its last change to a column the dense cache holds
    # (the columns 0006's statement trigger compares), so a cache reloads those rows only.
    # Set before the row is written, as the version the statement's bump makes: the tenant's
    # writers take turns, so the version read is the last committed one or this
    # transaction's own.
    ("0009_row_changes", [
        "ALTER TABLE memories ADD COLUMN changed bigint NOT NULL DEFAULT 0",
        "CREATE INDEX memories_changed ON memories (tenant, changed)",
        f"""CREATE FUNCTION engram_row_changed() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
            IF ROW({", ".join(f"OLD.{c}" for c in _CACHED_COLUMNS)}) IS DISTINCT FROM
               ROW({", ".join(f"NEW.{c}" for c in _CACHED_COLUMNS)}) THEN
                NEW.changed := coalesce((SELECT value::bigint FROM meta WHERE tenant = NEW.tenant
                    AND name = 'rows_version'), 0) + 1;
            END IF;
            RETURN NEW; END $$""",
        "CREATE TRIGGER memories_mark_changed BEFORE UPDATE ON memories FOR EACH ROW "
        "EXECUTE FUNCTION engram_row_changed()",
    ]),
    # What a process's in-memory lexicon of a tenant (index/follow.py) needs to follow the
    # database, as `lex_log` does on SQLite: every statement that changes rows' lexical
    # documents (inserted, re-indexed, unindexed, moved to another scope, deleted) logs each row
    # at the next positions of the tenant's counter (`meta.lex_position`). The counter's row
    # stays locked from that update to the commit, so positions follow commit order even for
    # writers outside the tenant's turn: a reader that sees position p sees every one below.
    # The log keeps a tenant's newest LEX_LOG_KEPT entries (or the `engram.lex_log_kept`
    # setting's number), pruned each time the counter passes another half of that;
    # `meta.lex_horizon` is the last position pruned (a lexicon older than it reloads).
    ("0010_lexicon_log", [
        f"""CREATE TABLE lex_log (
            tenant {TEXT} NOT NULL,
            pos bigint NOT NULL,
            memory_id {TEXT} NOT NULL,
            erased boolean NOT NULL,
            PRIMARY KEY (tenant, pos))""",
        *_tenant_policy("lex_log"),
        f"""CREATE FUNCTION engram_lex_log(t text, ids text[], erased boolean) RETURNS void
            LANGUAGE plpgsql AS $$
            DECLARE n bigint := cardinality(ids); top bigint; kept bigint := greatest(2, coalesce(
                nullif(current_setting('{LEX_LOG_SETTING}', true), '')::bigint, {LEX_LOG_KEPT}));
            BEGIN
            INSERT INTO meta (tenant, name, value) VALUES (t, 'lex_position', to_jsonb(n))
                ON CONFLICT (tenant, name) DO UPDATE SET value = to_jsonb(meta.value::bigint + n)
                RETURNING value::bigint INTO top;
            INSERT INTO lex_log (tenant, pos, memory_id, erased)
                SELECT t, top - n + i, u.id, erased FROM unnest(ids) WITH ORDINALITY AS u(id, i);
            IF top / (kept / 2) > (top - n) / (kept / 2) AND top > kept THEN
                DELETE FROM lex_log WHERE tenant = t AND pos <= top - kept;
                INSERT INTO meta (tenant, name, value) VALUES (t, 'lex_horizon', to_jsonb(top - kept))
                    ON CONFLICT (tenant, name) DO UPDATE SET value = excluded.value;
            END IF; END $$""",
        """CREATE FUNCTION engram_lex_added() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
            PERFORM engram_lex_log(tenant, array_agg(id ORDER BY id), false) FROM added
                WHERE lex IS NOT NULL GROUP BY tenant;
            RETURN NULL; END $$""",
        f"""CREATE FUNCTION engram_lex_changed() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
            PERFORM engram_lex_log(n.tenant, array_agg(n.id ORDER BY n.id), false)
                FROM changed_to n JOIN changed_from o ON o.tenant = n.tenant AND o.id = n.id
                WHERE (o.lex IS NULL) <> (n.lex IS NULL)
                    OR {" OR ".join(f"o.{c} IS DISTINCT FROM n.{c}" for c in _LEX_COLUMNS)}
                GROUP BY n.tenant;
            RETURN NULL; END $$""",
        """CREATE FUNCTION engram_lex_gone() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
            PERFORM engram_lex_log(tenant, array_agg(id ORDER BY id), true) FROM gone
                WHERE lex IS NOT NULL GROUP BY tenant;
            RETURN NULL; END $$""",
        "CREATE TRIGGER memories_lex_added AFTER INSERT ON memories REFERENCING NEW TABLE AS "
        "added FOR EACH STATEMENT EXECUTE FUNCTION engram_lex_added()",
        "CREATE TRIGGER memories_lex_changed AFTER UPDATE ON memories REFERENCING OLD TABLE AS "
        "changed_from NEW TABLE AS changed_to FOR EACH STATEMENT EXECUTE FUNCTION "
        "engram_lex_changed()",
        "CREATE TRIGGER memories_lex_gone AFTER DELETE ON memories REFERENCING OLD TABLE AS "
        "gone FOR EACH STATEMENT EXECUTE FUNCTION engram_lex_gone()",
    ]),
    # A phrase's IDF counts the rows whose text holds it (bm25.py), from `lex_body` at search
    # time (and in the lexicons); nothing reads `lex_terms`, the document frequency of every
    # token per tenant, any more, and every write paid for it: it goes.
    ("0011_drop_lex_terms", [
        "DROP TABLE lex_terms",
    ]),
]

MIGRATIONS_TABLE = f"""CREATE TABLE IF NOT EXISTS schema_migrations (
    name {TEXT} PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"""


def hnsw_index_name(dim: int) -> str:
    return f"memory_keys_hnsw_{int(dim)}"


def hnsw_index_sql(dim: int, *, concurrently: bool = False) -> str:
    d = int(dim)  # inlined, never a parameter: the planner must see the partial predicate
    how = "CONCURRENTLY " if concurrently else ""
    return (f"CREATE INDEX {how}IF NOT EXISTS {hnsw_index_name(d)} ON memory_keys "
            f"USING hnsw ((vector::vector({d})) vector_cosine_ops) WHERE dim = {d}")



def migrate(transaction: Callable[[], AbstractContextManager[Connection]]) -> tuple[int, ...]:
    """Apply the pending migrations, each in a `transaction()`; returns pgvector's version."""
    apply(transaction, MIGRATIONS)
    with transaction() as conn:
        row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    version = tuple(int(p) for p in row[0].split(".")[:2] if p.isdigit()) if row else (0, 0)
    if version < (0, 8):
        log.warning("pgvector %s has no iterative index scans (0.8+): filtered approximate "
                    "searches fall back to exact scans more often", row[0] if row else "?")
    return version


def apply(transaction: Callable[[], AbstractContextManager[Connection]],
          migrations: list[tuple[str, list[Step]]]) -> None:
    """Apply the pending `migrations`, each in a `transaction()` under the migration lock,
    recorded by name in `schema_migrations` (the store's and the service's share it: their
    names differ)."""
    pending = [name for name, _ in migrations]
    with transaction() as conn:
        if conn.execute("SELECT to_regclass('schema_migrations')").fetchone()[0]:  # type: ignore[index]
            done = {r[0] for r in conn.execute("SELECT name FROM schema_migrations")}
            pending = [name for name in pending if name not in done]
    for name, statements in migrations:
        if name not in pending:
            continue
        with transaction() as conn:
            conn.execute("SET LOCAL statement_timeout = 0")  # a migration may rebuild tables
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute(MIGRATIONS_TABLE)
            if conn.execute("SELECT 1 FROM schema_migrations WHERE name = %s", (name,)).fetchone():
                continue  # another process applied it while we waited for the lock
            for stmt in statements:
                try:
                    if isinstance(stmt, str):
                        conn.execute(stmt)
                    else:
                        stmt(conn)
                except pgerr.InsufficientPrivilege as exc:
                    raise StoreError(
                        f"migration {name} needs a privilege this role lacks ({exc}); pgvector "
                        "must be installed by an administrator: CREATE EXTENSION vector") from exc
            conn.execute("INSERT INTO schema_migrations (name) VALUES (%s)", (name,))
            log.info("applied migration %s", name)

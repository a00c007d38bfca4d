"""The PostgreSQL schema: named migrations (applied in order, each in its own transaction under
an advisory lock, so concurrent openers migrate once), row-level security per tenant, and the
HNSW index each vector dimension gets at its first insert."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

from psycopg import errors as pgerr

from ...errors import StoreError
from .pool import Connection

log = logging.getLogger("engram.store")

_MIGRATION_LOCK = 0x656E6772  # pg_advisory_xact_lock key: one migrator at a time ("engr")

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


def migrate(transaction: Callable[[], AbstractContextManager[Connection]]) -> tuple[int, ...]:
    """Apply the pending migrations, each in a `transaction()`; returns pgvector's version."""
    pending = [name for name, _ in MIGRATIONS]
    with transaction() as conn:
        if conn.execute("SELECT to_regclass('schema_migrations')").fetchone()[0]:  # type: ignore[index]
            done = {r[0] for r in conn.execute("SELECT name FROM schema_migrations")}
            pending = [name for name in pending if name not in done]
    for name, statements in MIGRATIONS:
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
                    conn.execute(stmt)
                except pgerr.InsufficientPrivilege as exc:
                    raise StoreError(
                        f"migration {name} needs a privilege this role lacks ({exc}); pgvector "
                        "must be installed by an administrator: CREATE EXTENSION vector") from exc
            conn.execute("INSERT INTO schema_migrations (name) VALUES (%s)", (name,))
            log.info("applied migration %s", name)
    with transaction() as conn:
        row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    version = tuple(int(p) for p in row[0].split(".")[:2] if p.isdigit()) if row else (0, 0)
    if version < (0, 8):
        log.warning("pgvector %s has no iterative index scans (0.8+): filtered approximate "
                    "searches fall back to exact scans more often", row[0] if row else "?")
    return version

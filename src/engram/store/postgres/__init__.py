"""The PostgreSQL backend (pgvector + full-text): `schema` (named migrations, row-level
security, HNSW indexes), `sql` (its SQL, built without I/O), `pool` (the one connection pool)
and `store` (the `Store`). Importing it imports psycopg."""

from . import schema, sql
from .pool import NO_FLUSH, Pool, translate
from .schema import create_tables
from .store import PostgresStore

__all__ = ["NO_FLUSH", "Pool", "PostgresStore", "create_tables", "schema", "sql", "translate"]

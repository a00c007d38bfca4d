"""The PostgreSQL backend (pgvector + full-text): `schema` (named migrations, row-level
security, HNSW indexes), `sql` (its SQL, built without I/O), `pool` (the one connection pool),
`store` (the `Store`) and `service` (the REST service's tables). Importing it imports psycopg."""

from . import schema, sql
from .pool import NO_FLUSH, Pool, translate
from .service import PostgresAudit, PostgresKeys, PostgresRateBuckets
from .store import PostgresStore

__all__ = ["NO_FLUSH", "Pool", "PostgresAudit", "PostgresKeys", "PostgresRateBuckets",
           "PostgresStore", "schema", "sql", "translate"]

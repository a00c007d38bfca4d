"""The SQLite backend: `schema` (named migrations), `sql` (its SQL, built without I/O), `conn`
(the one connection layer), `slab` (the dense search cache), `store` (the `Store`) and
`service` (the REST service's tables)."""

from .conn import Connections, private_file
from .service import SQLiteAudit, SQLiteKeys, SQLiteRateBuckets
from .store import SQLiteStore

__all__ = ["Connections", "SQLiteAudit", "SQLiteKeys", "SQLiteRateBuckets", "SQLiteStore",
           "private_file"]

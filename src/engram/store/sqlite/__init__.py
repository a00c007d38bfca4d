"""The SQLite backend: `schema` (named migrations), `sql` (its SQL, built without I/O), `conn`
(the one connection layer), `slab` (the dense search cache) and `store` (the `Store`)."""

from .conn import Connections, private_file
from .store import SQLiteStore

__all__ = ["Connections", "SQLiteStore", "private_file"]

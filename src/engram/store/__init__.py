"""Storage backends behind one `Store` contract."""

from .base import Key, Query, Stats, Store, Tx
from .sqlite import SQLiteStore

__all__ = ["Key", "Query", "SQLiteStore", "Stats", "Store", "Tx"]

"""Storage backends behind one `Store` contract."""

from .base import Key, Lexical, Query, Stats, Store, Tx
from .sqlite import SQLiteStore

__all__ = ["Key", "Lexical", "Query", "SQLiteStore", "Stats", "Store", "Tx"]

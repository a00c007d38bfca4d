"""Storage backends behind one `Store` contract."""

from .base import Candidate, Key, Lexical, Query, Stats, Store, Tx
from .sqlite import SQLiteStore

__all__ = ["Candidate", "Key", "Lexical", "Query", "SQLiteStore", "Stats", "Store", "Tx"]

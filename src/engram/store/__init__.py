"""Storage backends behind one `Store` contract."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from .base import Candidate, Key, Lexical, Query, Stats, Store, Tx
from .sqlite import SQLiteStore

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["Candidate", "Key", "Lexical", "Query", "SQLiteStore", "Stats", "Store", "Tx", "open_store"]


def open_store(config: Config, tenant: str | None = None) -> Store:
    """The store a `Memory` uses: PostgreSQL when `database_url` is set, else the SQLite file.

    A tenant (the service's unit of isolation) gets its own SQLite file next to the default
    one; on PostgreSQL every row carries the tenant and every query filters on it (with
    row-level security behind it).
    """
    if config.database_url:
        from .postgres import PostgresStore  # psycopg is only imported when used

        return PostgresStore(config.database_url, tenant=tenant or "",
                             busy_timeout_s=config.busy_timeout_s)
    path = config.path
    if tenant:
        digest = hashlib.sha256(tenant.encode()).hexdigest()[:32]
        path = path.parent / "tenants" / f"{digest}.db"
    return SQLiteStore(path, busy_timeout_s=config.busy_timeout_s)

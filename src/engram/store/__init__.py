"""Storage backends behind one `Store` contract, and the ways to open them from a `Config`."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from .base import (
    Candidate,
    EntitySelect,
    Key,
    Lexical,
    Query,
    RelationSelect,
    Seen,
    Select,
    Space,
    Stats,
    Store,
    StoreBase,
    Tx,
)
from .sqlite import SQLiteStore

if TYPE_CHECKING:
    from ..config import Config
    from .postgres import PostgresStore

__all__ = ["Candidate", "EntitySelect", "RelationSelect",
           "Key", "Lexical", "Query", "SQLiteStore", "Seen", "Select", "Space", "Stats", "Store",
           "StoreBase", "Stores", "Tx", "open_store"]


def open_store(config: Config, tenant: str | None = None) -> Store:
    """The store a `Memory` uses: PostgreSQL when `database_url` is set, else the SQLite file.

    A tenant (the service's unit of isolation) gets its own SQLite file next to the default
    one; on PostgreSQL every row carries the tenant and every query filters on it (with
    row-level security behind it).
    """
    if config.database_url:
        from .postgres import PostgresStore  # psycopg is only imported when used

        return PostgresStore.from_config(config, tenant=tenant or "")
    return SQLiteStore(tenant_path(config.path, tenant), busy_timeout_s=config.busy_timeout_s,
                       key=config.encryption_key, ann_threshold=config.ann_threshold,
                       lexicon_threshold=config.lexicon_threshold, cache_rows=config.cache_rows)


def tenant_path(path: Path, tenant: str | None) -> Path:
    """The SQLite file of a tenant: the default file for None, else one beside it."""
    if not tenant:
        return path
    digest = hashlib.sha256(tenant.encode()).hexdigest()[:32]
    return path.parent / "tenants" / f"{digest}.db"


class Stores:
    """Opens the stores of many tenants of one `Config` (the service's): on PostgreSQL every
    tenant's store shares one connection pool (a pool per tenant would hold idle connections
    for every tenant ever served); on SQLite each tenant has its own file.

    Each opened store is closed by its user; `close()` then releases the shared pool.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._base: PostgresStore | None = None

    def open(self, tenant: str | None = None) -> Store:
        if not self.config.database_url:
            return open_store(self.config, tenant)
        with self._lock:
            if self._base is None:
                from .postgres import PostgresStore

                self._base = PostgresStore.from_config(self.config)
            base = self._base
        return base.for_tenant(tenant or "")

    def close(self) -> None:
        with self._lock:
            base, self._base = self._base, None
        if base is not None:
            base.close()

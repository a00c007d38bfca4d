"""One `Memory` per tenant, opened on first use and kept: all of them share one embedder
(the model is the big part), one `Config` and, on PostgreSQL, one connection pool.

The tenant `None` is the single-user database itself (`engram serve --no-auth`), so the
service and the CLI see the same memories.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .. import Memory
from ..config import Config
from ..errors import StoreUnavailable
from ..store import Stores

if TYPE_CHECKING:
    from ..providers.embedders import Embedder


class Tenants:
    def __init__(self, config: Config, embedder: Embedder) -> None:
        self.config = config
        self.embedder = embedder
        self._open: dict[str | None, Memory] = {}
        self._lock = threading.Lock()
        self._opening: dict[str | None, threading.Lock] = {}
        self._stores = Stores(config)  # on PostgreSQL: one connection pool for every tenant

    def get(self, tenant: str | None) -> Memory:
        mem = self._open.get(tenant)
        if mem is not None:
            return mem
        with self._lock:
            gate = self._opening.setdefault(tenant, threading.Lock())
        with gate:  # one open per tenant; other tenants are not held up by a slow one
            mem = self._open.get(tenant)
            if mem is None:
                try:
                    mem = Memory(config=self.config, tenant=tenant, embedder=self.embedder,
                                 store=self._stores.open(tenant))
                except OSError as exc:
                    # e.g. the data directory is gone or not writable: the database cannot be
                    # reached. Nothing is cached, so the next request tries again.
                    raise StoreUnavailable(f"cannot open the tenant's database: {exc}") from exc
                self._open[tenant] = mem
        return mem

    def __iter__(self) -> Iterator[Memory]:
        return iter(list(self._open.values()))

    def close(self) -> None:
        with self._lock:
            for mem in self._open.values():
                mem.close()
            self._open.clear()
        self._stores.close()

"""One `Memory` per tenant, opened on first use and kept: all of them share one `Config`, on
PostgreSQL one connection pool, and the embedders (the model is the big part): one per space.
On PostgreSQL a node keeps the `OPEN_TENANTS` most recently served open and closes the others
(nothing of a tenant's data lives in its `Memory`: the dense cache is the shared store's).

The tenant `None` is the single-user database itself (`engram serve --no-auth`), so the
service and the CLI see the same memories.

The embedders are taken in turns (one `FairGate` for all: the cores are what is shared): each
tenant's calls wait in the tenant's own line and the lines are served round-robin, a bounded
chunk of texts a turn, so one tenant's flood of long adds delays another tenant's search by at
most one chunk, not by the whole flood.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from .. import Memory
from ..config import Config
from ..errors import StoreUnavailable
from ..providers.embedders import Embedder, choose, get_embedder
from ..store import Stores

OPEN_TENANTS = 16_384  # tenants a node keeps open on PostgreSQL (each `Memory` ~6 KB)
CHUNK = 32  # texts embedded per turn: ~0.1-0.3 s of MiniLM on a 2-core machine
EMBED_SLOTS = 2  # turns at the embedder at once


class FairGate:
    """Turns at a shared resource, round-robin across tenants (FIFO within a tenant), with up to
    `slots` turns at once (two let the embedder's group commit merge concurrent calls into one
    forward pass; a waiting tenant still waits for at most the turns in progress).

    `granted` keeps the order of the last turns given (for tests and debugging)."""

    def __init__(self, slots: int = 1, history: int = 1000) -> None:
        self._cond = threading.Condition()
        self._lines: dict[str | None, deque[object]] = {}
        self._ring: deque[str | None] = deque()  # tenants with someone waiting, next first
        self._free = slots
        self.granted: deque[str | None] = deque(maxlen=history)

    def waiting(self) -> dict[str | None, int]:
        with self._cond:
            return {t: len(q) for t, q in self._lines.items()}

    @contextmanager
    def turn(self, tenant: str | None) -> Iterator[None]:
        ticket = object()
        with self._cond:
            if tenant not in self._lines:
                self._lines[tenant] = deque()
                self._ring.append(tenant)
            self._lines[tenant].append(ticket)
            while not self._free or self._lines[self._ring[0]][0] is not ticket:
                self._cond.wait()
            self._free -= 1
            line = self._lines[tenant]
            line.popleft()
            self._ring.popleft()
            if line:
                self._ring.append(tenant)  # its next call waits behind every other tenant's
            else:
                del self._lines[tenant]
            self.granted.append(tenant)
        try:
            yield
        finally:
            with self._cond:
                self._free += 1
                self._cond.notify_all()


class TenantEmbedder:
    """The shared embedder as one tenant sees it: its calls cut into chunks of `CHUNK` texts,
    each chunk embedded in the tenant's turn at the `FairGate`."""

    def __init__(self, embedder: Embedder, gate: FairGate, tenant: str | None) -> None:
        self.inner = embedder
        self.gate = gate
        self.tenant = tenant
        self.name = embedder.name
        self.dim = embedder.dim

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        parts = []
        for i in range(0, max(len(texts), 1), CHUNK):
            with self.gate.turn(self.tenant):
                parts.append(self.inner.embed_batch(texts[i:i + CHUNK]))
        return parts[0] if len(parts) == 1 else np.vstack(parts)


class Tenants:
    """`embedder`: the one every tenant shares; None: the configured one, by name, and with
    `auto` the one each tenant's database was made with (a tenant whose database predates
    int8 as the default keeps fp32 MiniLM), each loaded once and shared by its tenants."""

    def __init__(self, config: Config, embedder: Embedder | None = None, *,
                 open_limit: int = OPEN_TENANTS) -> None:
        """`open_limit`: on PostgreSQL, the tenants kept open; the least recently served go
        (closed in the background: a job their worker runs ends first, and the jobs still
        queued run when the tenant is next opened, as after a restart). A request still using
        a closed tenant's `Memory` finishes: its store's connections are the shared pool's.
        On SQLite each tenant's `Memory` holds its own file open, and all stay open."""
        self.config = config
        self._given = embedder
        self._embedders: dict[str, Embedder] = {}
        self.gate = FairGate(slots=EMBED_SLOTS)
        self._lock = threading.Lock()
        self._open: OrderedDict[str | None, Memory] = OrderedDict()  # the least recent first
        self.open_limit = open_limit if config.database_url else None
        self._closing: list[threading.Thread] = []  # closing tenants no longer kept open
        # a tenant's lock while someone opens it or waits to
        self._opening: weakref.WeakValueDictionary[str | None, _Opening] = \
            weakref.WeakValueDictionary()
        self._stores = Stores(config)  # on PostgreSQL: one connection pool for every tenant
        self.embedder()  # an unknown embedder fails now, not at the first request

    def get(self, tenant: str | None) -> Memory:
        mem = self._open.get(tenant)
        if mem is not None:
            if self.open_limit is not None:
                with self._lock:
                    if tenant in self._open:
                        self._open.move_to_end(tenant)
            return mem
        with self._lock:
            gate = self._opening.get(tenant)
            if gate is None:
                gate = self._opening[tenant] = _Opening()
        with gate.lock:  # one open per tenant; other tenants are not held up by a slow one
            mem = self._open.get(tenant)
            if mem is None:
                try:
                    store = self._stores.open(tenant)
                    try:
                        recorded = store.space()
                        embedder = self.embedder(recorded.latest if recorded else None)
                    except BaseException:
                        store.close()
                        raise
                    mem = Memory(config=self.config, tenant=tenant, store=store,
                                 embedder=TenantEmbedder(embedder, self.gate, tenant))
                except OSError as exc:
                    # e.g. the data directory is gone or not writable: the database cannot be
                    # reached. Nothing is cached, so the next request tries again.
                    raise StoreUnavailable(f"cannot open the tenant's database: {exc}") from exc
                # Jobs a crashed process left queued (or running past their lease) run now,
                # not when the tenant next queues one.
                mem.resume()
                with self._lock:
                    self._open[tenant] = mem
                    evicted = self._evict()
                if evicted:
                    self._close_later(evicted)
        return mem

    def _close_later(self, mems: list[Memory]) -> None:
        """Close on a thread of their own (a job their worker runs ends first), not in the
        request that opened another tenant."""
        def close() -> None:
            for mem in mems:
                mem.close()
        thread = threading.Thread(target=close, daemon=True, name="engram-tenant-close")
        with self._lock:
            self._closing = [t for t in self._closing if t.is_alive()] + [thread]
        thread.start()

    def _evict(self) -> list[Memory]:
        """The least recently served tenants beyond `open_limit`, out of the map."""
        out: list[Memory] = []
        while self.open_limit is not None and len(self._open) > max(1, self.open_limit):
            out.append(self._open.popitem(last=False)[1])
        return out

    def embedder(self, recorded: str | None = None) -> Embedder:
        """The embedder for a database recorded in space `recorded` (None: a new one)."""
        if self._given is not None:
            return self._given
        name = choose(self.config.embedder, recorded)
        with self._lock:
            if name not in self._embedders:
                self._embedders[name] = get_embedder(name, self.config)
            return self._embedders[name]

    def __iter__(self) -> Iterator[Memory]:
        return iter(list(self._open.values()))

    def close(self) -> None:
        with self._lock:
            closing, self._closing = self._closing, []
        for thread in closing:
            thread.join()
        with self._lock:
            for mem in self._open.values():
                mem.close()
            self._open.clear()
        self._stores.close()


class _Opening:
    """A lock of one tenant being opened (a weak map holds it only while it is in use)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

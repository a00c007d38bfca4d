"""A process's dense cache, written once for both stores: the slabs (slab.py) of the scopes it
searched, their lock, which go first when the rows held pass a budget, and their refresh from
the database (refresh.py) by statements each backend builds without I/O and runs its own way
(`Run`: SQLite one after another on its reader, PostgreSQL in one round trip, or ahead of time
inside a search's first one: `ahead`)."""

from __future__ import annotations

import enum
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ...model import Scope
from ..base import Candidate, Query
from ..records import Stmt
from . import dense, refresh
from .slab import Slab, evict

SlabKey = tuple[Any, ...]  # the backend's owner (a tenant), the scope's fields, the key name
Run = Callable[[Sequence[Stmt]], list[list[Any]]]  # the rows of each statement, in order
Load = Callable[[SlabKey, int], Slab | None]  # a slab saved for a key and dimension, if any
# Per key name: the mark reads were made from, and their rows (`ahead`)
Fetched = Mapping[str, tuple[refresh.Mark, Sequence[Any]]]
# Runs work on another thread (a `Threads.submit`); None: it cannot (closing)
Aside = Callable[[Callable[[], None]], object]
OVER_HINTS = 4096  # scopes remembered as over the limit; then all are counted again

log = logging.getLogger("engram.store")


class KeyReads(refresh.KeyReads, Protocol):
    """A backend's reads for its dense cache (its sql.py): the refresh's, and two more."""

    owner: tuple[Any, ...]  # what leads its slabs' keys in a cache shared by owners (tenants)

    def count_keys(self, scope: Scope, key_name: str, dim: int, limit: int) -> Stmt:
        """(count,) of the keys of live memories of the scope, counted up to `limit`."""
        ...


class Follow(enum.Enum):
    """How far a refresh follows the database, by where its reads run."""

    EXACT = "exact"  # outside a write: keys and attributes, exact as of the versions read
    # inside a write that changed no keys: the keys it reads are committed ones, but their
    # rows may carry the write's changes: keys only, the attributes of new rows not trusted
    KEYS = "keys"
    NONE = "none"  # inside a write that changed keys (they may roll back): the cache as held


def _follows(slab: Slab, versions: tuple[int, int], follow: Follow) -> bool:
    if follow is Follow.EXACT:
        return (slab.version, slab.rows_version) == versions
    return follow is Follow.NONE or slab.version == versions[0]


class DenseCache:
    """The slabs of one process (shared by a PostgreSQL store's tenants: the owner leads each
    slab's key), at most `rows` keys held in all (the least recently searched scopes go first,
    never the one being searched); with a `limit`, a scope of more keys is left out (counted
    before it is loaded) and searched elsewhere. Searches above `ann_threshold` keys go through
    the slab's HNSW index (dense.py)."""

    def __init__(self, rows: int, ann_threshold: int, limit: int | None = None) -> None:
        self.rows = rows
        self.ann_threshold = ann_threshold
        self.limit = limit
        self.lock = threading.Lock()  # the map and the slabs' contents
        # Per slab being refreshed, its turn and the threads that want it: one refresh of a
        # slab at a time (it appends by seq), while other slabs' go on (a large scope's first
        # load must not hold up every other scope's searches, of every tenant)
        self._turns: dict[SlabKey, tuple[threading.Lock, list[int]]] = {}
        self.slabs: OrderedDict[SlabKey, Slab] = OrderedDict()
        self.over: dict[SlabKey, bool] = {}  # scopes known to hold more than `limit` keys
        self.loading: set[SlabKey] = set()  # new slabs being loaded aside (`refresh`)
        _CACHES.add(self)

    @staticmethod
    def key(k: KeyReads, scope: Scope, name: str) -> SlabKey:
        return (*k.owner, scope.user_id, scope.agent_id, scope.session_id, name)

    def get(self, k: KeyReads, scope: Scope, name: str) -> Slab | None:
        with self.lock:
            return self.slabs.get(self.key(k, scope, name))

    def held(self, k: KeyReads, scope: Scope, names: Sequence[str]) -> dict[str, Slab | None]:
        with self.lock:
            return {name: self.slabs.get(self.key(k, scope, name)) for name in names}

    def current(self, k: KeyReads, scope: Scope, name: str,
                versions: tuple[int, int] | None) -> Slab | None:
        """The slab held for the key name if it is exact as of `versions` (no I/O)."""
        with self.lock:
            slab = self.slabs.get(self.key(k, scope, name))
        if slab is None or versions is None or (slab.version, slab.rows_version) != versions:
            return None
        return slab

    def elsewhere(self, k: KeyReads, scope: Scope, name: str) -> bool:
        """Whether the scope's keys of this name are searched elsewhere (in the database) for
        now: it was found to hold more than `limit` of them, or its first load runs aside."""
        key = self.key(k, scope, name)
        return bool(self.over.get(key)) or key in self.loading

    def being_loaded(self, k: KeyReads, scope: Scope, name: str) -> bool:
        """Whether the scope's first load of these keys runs aside now (`refresh`)."""
        return self.key(k, scope, name) in self.loading

    def indexed(self, k: KeyReads, scope: Scope) -> bool:
        """Whether the scope's cached `text` keys are more than the ANN threshold (its dense
        searches go through the HNSW index)."""
        slab = self.get(k, scope, "text")
        return slab is not None and slab.n > self.ann_threshold

    def candidates(self, slab: Slab, ids: Sequence[str]) -> tuple[dict[str, Candidate], list[str]]:
        with self.lock:
            return slab.candidates(ids)

    def visible_ids(self, slab: Slab, query: Query, ids: Sequence[str]) -> set[str]:
        with self.lock:
            return slab.visible_ids(query, ids)

    # -- following the database --------------------------------------------------------------

    def ahead(self, k: KeyReads, scope: Scope, names: Sequence[str],
              dim: int) -> dict[str, tuple[refresh.Mark, list[Stmt]]]:
        """The reads of the held slabs of `names`, each with the mark they start from, for a
        caller to run before it knows they are stale (`refresh(fetched=...)` uses them if no
        other refresh moved the slab meanwhile)."""
        out = {}
        with self.lock:
            for name in names:
                slab = self.slabs.get(self.key(k, scope, name))
                if slab is not None and slab.version >= 0 and slab.tomb_max >= 0 \
                        and slab.mat.shape[1] == dim:
                    out[name] = (refresh.Mark.of(slab),
                                 refresh.reads(k, scope, name, dim, slab, attrs=True))
        return out

    def refresh(self, k: KeyReads, scope: Scope, names: Sequence[str], dim: int,
                versions: tuple[int, int], run: Run, *, follow: Follow = Follow.EXACT,
                fetched: Fetched | None = None, load: Load | None = None,
                aside: Aside | None = None) -> dict[str, Slab]:
        """The scope's slab of each key name, exact as of `versions` (the database's, read
        before) or later; with `Follow.KEYS` its keys only, with `Follow.NONE` as held. A
        name is left out where the scope holds more than `limit` keys. Stale slabs are read
        together (one `run`), or not at all with what `fetched` holds for them; a slab not
        held is `load`ed (a saved one: it then catches up) or read whole. With `aside`, a new
        slab of more keys than one read takes (refresh.CHUNK: its load is many statements,
        minutes at a million) is read whole there, and left out until it is held: the
        searches meanwhile go `elsewhere`."""
        wanted = {name: self.key(k, scope, name) for name in names}
        wanted = {name: key for name, key in wanted.items()
                  if not self.over.get(key) and key not in self.loading}
        with self.lock:
            held = {name: self.slabs.get(key) for name, key in wanted.items()}
            for key in wanted.values():
                if key in self.slabs:
                    self.slabs.move_to_end(key)  # the least recently searched go first
        usable = {name: slab for name, slab in held.items()
                  if slab is not None and slab.mat.shape[1] == dim}
        if follow is Follow.NONE:
            return {name: usable.get(name) or Slab(dim, rich=name == "text") for name in wanted}
        fresh = {name: slab for name, slab in usable.items() if _follows(slab, versions, follow)}
        if len(fresh) == len(wanted):
            return fresh
        stale = {name: key for name, key in wanted.items() if name not in fresh}
        with self._turn(stale.values()):  # another thread may have refreshed them meanwhile
            got, pruned = self._refresh(k, scope, stale, dim, versions, run, follow,
                                        fetched or {}, load, aside)
            if pruned:  # what was deleted meanwhile is unknown: loaded afresh (never pruned)
                again, _ = self._refresh(k, scope, {name: wanted[name] for name in pruned},
                                         dim, versions, run, follow, {}, None, aside)
                got |= again
        return got | fresh

    def _refresh(self, k: KeyReads, scope: Scope, wanted: dict[str, SlabKey], dim: int,
                 versions: tuple[int, int], run: Run, follow: Follow, fetched: Fetched,
                 load: Load | None, aside: Aside | None) -> tuple[dict[str, Slab], list[str]]:
        """Bring the slabs of `wanted` up to `versions` (refresh.py); new ones are counted
        first when there is a limit or an `aside`. Returns them, and the names whose slab was
        dropped because tombstones it had not applied were pruned, or is loaded aside. Call
        with their `_turn` held."""
        with self.lock:
            slabs: dict[str, Slab | None] = {name: self.slabs.get(key)
                                             for name, key in wanted.items()}
        for name, slab in slabs.items():
            if slab is None or slab.mat.shape[1] != dim:
                slab = load(wanted[name], dim) if load is not None else None
                slabs[name] = slab if slab is not None else Slab(dim, rich=name == "text")
        held: dict[str, Slab] = {name: slab for name, slab in slabs.items() if slab is not None}
        new = [name for name, slab in held.items() if slab.version < 0]
        if new and (self.limit is not None or aside is not None):
            upto = max(self.limit or 0, refresh.CHUNK) + 1
            counts = run([k.count_keys(scope, name, dim, upto) for name in new])
            for name, rows in zip(new, counts, strict=True):
                if self.limit is not None and rows[0][0] > self.limit:
                    self._mark_over(wanted[name])
                    del held[name]
                elif aside is not None and rows[0][0] > refresh.CHUNK:
                    self._load_aside(k, scope, name, wanted[name], dim, versions, run, aside)
                    del held[name]
                else:
                    held[name].reserve(rows[0][0])
        stale = {name: slab for name, slab in held.items()
                 if not _follows(slab, versions, follow)}
        statements: list[Stmt] = []
        got: dict[str, Sequence[Any]] = {}
        planned: dict[str, int] = {}
        for name, slab in stale.items():
            ahead = fetched.get(name)
            if ahead is not None and slab.version >= 0 and ahead[0] == refresh.Mark.of(slab):
                got[name] = ahead[1]
                continue
            reads = refresh.reads(k, scope, name, dim, slab, attrs=follow is Follow.EXACT
                                  and slab.rows_version != versions[1])
            planned[name] = len(reads)
            statements += reads
        results = iter(run(statements) if statements else [])
        for name, n in planned.items():
            got[name] = [next(results) for _ in range(n)]
        before = {name: slab.n for name, slab in stale.items()}
        with self.lock:
            applied = {name: refresh.apply(slab, k, dim, got[name])
                       for name, slab in stale.items()}
        for name, slab in stale.items():  # a large load's later chunks, the lock let go between
            if applied[name] is not refresh.Applied.PRUNED:
                refresh.rest(slab, k, scope, name, dim, got[name],
                             lambda stmt: run([stmt])[0], self.lock)
        reload: dict[str, Slab] = {}
        pruned: list[str] = []
        grew = False
        with self.lock:
            for name, slab in stale.items():
                key, n, done = wanted[name], before[name], applied[name]
                if done is refresh.Applied.PRUNED:
                    del held[name]
                    self.slabs.pop(key, None)
                    pruned.append(name)
                    continue
                slab.version = versions[0]
                if follow is Follow.EXACT:
                    slab.rows_version = versions[1]
                elif slab.n > n:  # their rows may carry the write's uncommitted changes
                    slab.rows_version = -1
                if done is refresh.Applied.RELOAD:
                    slab.rows_version = -1  # not exact (nor trusted by others) until reloaded
                    reload[name] = slab
                if self.limit is not None and \
                        int(np.count_nonzero(slab.alive[:slab.n])) > self.limit:
                    self._mark_over(key)
                    del held[name]
                    self.slabs.pop(key, None)
                    continue
                grew = grew or slab.n > n
            for name, slab in held.items():  # the refreshed, and any loaded already current
                key = wanted[name]
                grew = grew or key not in self.slabs
                self.slabs[key] = slab
                self.slabs.move_to_end(key)
            if grew:  # only rows added can overflow
                evict(self.slabs, self.rows, self.key(k, scope, "")[:-1])
        reload = {name: slab for name, slab in reload.items() if name in held}
        if reload:
            attrs = run([k.key_attrs(scope, name, dim, slab.max_seq, slab.rich)
                         for name, slab in reload.items()])
            with self.lock:
                for slab, rows in zip(reload.values(), attrs, strict=True):
                    slab.reset_attrs(rows, k.dialect)
                    slab.rows_version = versions[1]
        return held, pruned

    @contextmanager
    def _turn(self, keys: Iterable[SlabKey]) -> Iterator[None]:
        """Hold the refresh turn of each slab of `keys` (taken in one order: two refreshes of
        the same slabs never wait for each other crosswise)."""
        with self.lock:
            turns = []
            for key in sorted(set(keys), key=repr):
                turn = self._turns.setdefault(key, (threading.Lock(), [0]))
                turn[1][0] += 1
                turns.append((key, turn))
        try:
            with ExitStack() as held:
                for _, (lock, _) in turns:
                    held.enter_context(lock)
                yield
        finally:
            with self.lock:
                for key, (_, waiting) in turns:
                    waiting[0] -= 1
                    if not waiting[0]:
                        self._turns.pop(key, None)

    def _load_aside(self, k: KeyReads, scope: Scope, name: str, key: SlabKey, dim: int,
                    versions: tuple[int, int], run: Run, aside: Aside) -> None:
        """Load a new slab whole on `aside`'s thread, from `versions` (it catches up at the
        next search after); the searches of its keys go `elsewhere` until it is held."""
        def load() -> None:  # a new slab, read whole: it has no tombstones to miss (pruned)
            try:
                with self._turn([key]):
                    self._refresh(k, scope, {name: key}, dim, versions, run, Follow.EXACT, {},
                                  None, None)
            except Exception as exc:  # the database answers its searches; the next one tries
                # again (a store closed during the load ends it so too)
                log.warning("loading the %s keys of a large scope stopped: %s", name, exc)
                log.debug("the load's error", exc_info=True)
            finally:
                with self.lock:
                    self.loading.discard(key)

        with self.lock:
            self.loading.add(key)
        if aside(load) is None:  # closing: nothing is loaded any more
            with self.lock:
                self.loading.discard(key)

    def _mark_over(self, key: SlabKey) -> None:
        if len(self.over) > OVER_HINTS:
            self.over.clear()  # scopes shrink too: count them again now and then
        self.over[key] = True

    # -- searching ---------------------------------------------------------------------------

    def search(self, key: SlabKey, slab: Slab, query: Query, vector: np.ndarray, k: int,
               visible: dense.Visible, *, ann_file: Path | None = None,
               build: Callable[[Callable[[], None]], object] | None = None,
               ) -> list[tuple[str, float]]:
        """The best `k` memories `query` may see in an exact slab (dense.py): its first HNSW
        index built by `build` off the search when given (then no file), else under the lock
        and saved to `ann_file`. `vector` is a unit vector."""
        if build is not None:
            return dense.search_aside(slab, self.lock, query, vector, k, visible,
                                      self.ann_threshold, key, build)
        with self.lock:
            return dense.search(slab, query, vector, k, visible, self.ann_threshold, ann_file, key)

    def complete(self, slabs: Mapping[str, Slab | None], vector: np.ndarray, k: int,
                 found: dict[str, list[tuple[str, float]]]) -> None:
        """A large scope's lists completed from the search's other candidates (dense.py)."""
        dense.complete(slabs, self.lock, vector, k, self.ann_threshold, found)

    # -- dropping ----------------------------------------------------------------------------

    def forget_ann(self, also: Callable[[], None] = lambda: None) -> None:
        """Drop every slab's HNSW index (it may hold an erased memory's vectors: built again
        from the slab), and run `also` under the lock (files of them go with no search
        saving one meanwhile)."""
        with self.lock:
            for slab in self.slabs.values():
                slab.ann = None
                slab.saved_n = 0  # unnamed by the erasure: saved again once exact
            also()

    def clear(self) -> None:
        with self.lock:
            self.slabs.clear()
            self.over.clear()

    def _after_fork(self) -> None:
        """In a forked child: a lock a parent thread held at the fork would never be released
        here, and what it guarded may be half-changed: it is replaced, and the slabs it
        guarded dropped (read again on use)."""
        if self.lock.locked():
            self.lock, self.slabs = threading.Lock(), OrderedDict()
        self._turns = {}  # a parent's refreshes and loads: their threads are not in the child
        self.loading = set()


_CACHES: weakref.WeakSet[DenseCache] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for cache in list(_CACHES):
        cache._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)

"""The embedded default store: one SQLite file (WAL, FTS5, vectors as float32 blobs).

The database is the source of truth. Dense search runs over an in-process matrix per scope,
a cache that is rebuilt (incrementally) from the `memory_keys` table whenever another writer
has changed it; a stale cache entry is caught by re-checking candidates against the table.
"""

from __future__ import annotations

import logging
import os
import secrets
import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import wait
from contextlib import AbstractContextManager, closing, contextmanager, nullcontext, suppress
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import StoreError
from ...model import Job, JobStatus, MemoryRecord
from ...threads import Threads
from .. import records as r
from ..base import Candidate, Key, Lexical, Query, Seen, Select
from ..bm25 import Tokenizer
from ..index import ann, lexicon
from ..index.cache import DenseCache, Follow
from ..index.follow import LexicalChanges, LexicalFollower, LexicalText
from ..index.lexicon import BATCH, Lexicon
from ..index.slab import Slab, unit
from ..sqlstore import Run, SQLStore, SQLTx
from . import lexlog, schema, sql
from .conn import DB_ERRORS, Connections, is_busy
from .slabfiles import SlabFiles

log = logging.getLogger("engram.store")

COUNTS_EVERY_S = 0.2  # how often the background thread writes the access counts of searches
# How long a read waits for the write turn to write the counts pending first (and see them):
# this process's short writes (an add, a cache file named), not a long one.
COUNTS_READ_WAIT_S = 0.05
# A commit that finds the WAL past SQLite's autocheckpoint (1,000 pages, its default) copies
# it into the database and fsyncs, a cost per search: access counts leave that to the background
# thread, once every this many counting commits.
COUNTS_CHECKPOINT_EVERY = 64


class SQLiteStore(SQLStore):
    """`Store` over one SQLite file; safe across threads and processes."""

    dialect = sql.DIALECT

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0,
                 key: str | None = None, ann_threshold: int = 20_000,
                 lexicon_threshold: int = 0, lexicon_log: int = lexlog.LOG_KEEP,
                 cache_rows: int = 2_000_000) -> None:
        """`ann_threshold`: a dense search over a scope of at most this many keys is exact (a
        scan of the cached matrix); above it an HNSW index answers (approximate; the `ann`
        extra, else always exact), saved beside the database in `<file>.ann/` (not when
        encrypted: it holds the vectors); the dense cache
        of such a scope is saved too, in `<file>.slabs/` (not when encrypted), so a new
        process loads it from there instead of the tables.
        `lexicon_threshold`: once the full-text index holds more rows than this, lexical
        searches run on an in-memory copy of it (lexicon.py: the same scores as FTS5), saved
        beside the database in `<file>.lexicon` (not when it is encrypted: it holds words).
        `lexicon_log`: the entries `lex_log` keeps (then the older half is pruned).
        `cache_rows`: the dense cache keeps searched scopes' keys up to this many in all
        (least recently searched scopes go first; the one being searched always stays)."""
        self.path = Path(path)
        self._ann_dir: Path | None = None
        self._lex_path: Path | None = None
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._ann_dir = self.path.parent / f"{self.path.name}.ann"
            self._lex_path = self.path.parent / f"{self.path.name}.lexicon"
        self.lexicon_threshold = lexicon_threshold
        self.lexicon_log = lexicon_log
        self._follower = LexicalFollower()  # the lexicon, kept exact by `lexical_changes`
        self.busy_timeout_s = busy_timeout_s
        self._db = Connections(self.path, busy_timeout_s=busy_timeout_s, key=key)
        self._local = threading.local()  # .dirty: this thread's open write changed keys
        self._cache = DenseCache(cache_rows, ann_threshold)  # index/cache.py
        self._keys = sql.KeyReads()  # the dense cache's reads
        self._saver = Threads(1, "engram-cache-save")  # cache files and counts (`_in_background`)
        self._helper = Threads(1, "engram-search")  # a search's lexical side (`pool`)
        self._helper_free = threading.Semaphore(1)  # taken while a search uses the helper
        self._count_commits = 0  # commits of access counts since the last background checkpoint
        # Access counts not yet written, (ids, at): `touch`
        self._counts: list[tuple[Sequence[str], datetime]] = []
        self._counts_due = False  # the background thread is to write them
        self._counts_lock = threading.Lock()
        self._closing = threading.Event()  # set by `close`: no more background work
        self._slab_files = SlabFiles(
            None if str(path) == ":memory:" else self.path.parent / f"{self.path.name}.slabs",
            encrypted=self._db.encrypted, dialect=self.dialect, cache=self._cache,
            save=self._save_cache, background=self._in_background, read=self._read,
            closing=self._closing)
        _STORES.add(self)
        schema.migrate(self._db)
        # lex_log is bounded once its horizon exists (always after `migrate`; the upgrade test
        # writes through a store it stopped at the first migration)
        self._bounded_log = "0006_lexicon_file" in schema.applied(self._db)
        if self._db.encrypted:
            secure_fts_delete(self._db)
        # a saved index the database no longer names (an erasure whose process died before
        # removing it), or any beside an encrypted database (saved while it was plain), goes
        named = self._read(sql.LEX_FILE)  # none: too old
        if self._db.encrypted or not named or not named[0][0]:
            self._forget_lexicon_files()
        self._slab_files.forget(keep=not self._db.encrypted)
        if self._db.encrypted:
            ann.forget_files(self._ann_dir)

    @property
    def ann_threshold(self) -> int:
        """A scope of more keys than this is searched through its HNSW index."""
        return self._cache.ann_threshold

    @property
    def connections(self) -> Connections:
        """The connection layer (for backup, rekey and integrity checks: store.sqlite.files)."""
        return self._db

    # -- connections and transactions ----------------------------------------------------------

    def _reader(self) -> AbstractContextManager[Run]:
        return nullcontext(self._db.read)

    def _quiet_for_fork(self) -> None:
        """Before a fork: let the saving thread finish what it was given (waiting at most the
        busy timeout), so that no thread of this process is inside SQLite (whose mutexes
        the child would inherit locked) or half-way through a file when the child is made."""
        with suppress(Exception):  # slow: the fork goes on
            self._saver.drain(timeout=self.busy_timeout_s)

    def _after_fork(self) -> None:
        """In a forked child. A lock that a parent thread held at the fork (a search, a cache
        save) would never be released here, and what it guarded may be half-changed: such a
        lock is replaced and its state dropped (loaded again on use). The threads stay the
        parent's: the child starts its own (threads.py)."""
        if self._follower.lock.locked():
            self._follower = LexicalFollower()
        self._helper_free = threading.Semaphore(1)  # a parent's search may have held it
        # the parent's to write
        self._counts, self._counts_due, self._counts_lock = [], False, threading.Lock()

    def close(self) -> None:
        """Close the connections, after the access counts and cache files pending are written."""
        self._closing.set()  # the background waits end now
        self._helper.close()
        self._saver.close()  # after the work given to it
        try:
            self._apply_counts()
        except Exception as exc:  # a hint for forgetting: closing goes on
            log.warning("access counts not written at close: %s", exc)
        with self._follower.lock:
            self._follower.drop()
        self._db.close()

    @contextmanager
    def write(self) -> Iterator[SQLiteTx]:
        """One write transaction (BEGIN IMMEDIATE), retried while another process holds the lock."""
        with self._db.transaction() as conn:
            tx = SQLiteTx(conn, self._local)
            try:
                yield tx
                if tx.keys_changed:
                    conn.execute(sql.BUMP_KEYS)
                if self._bounded_log:
                    lexlog.prune_log(conn, self.lexicon_log)
            finally:
                self._local.dirty = False
        if tx.erased:
            self._forget_ann()

    def _forget_ann(self) -> None:
        """Drop the ANN indexes, in memory and on disk: they may hold an erased memory's
        vectors (they are rebuilt from the table by the next large search); and the lexical
        index, whose vocabulary may hold its words."""
        with self._follower.lock:
            self._follower.drop()
            self._forget_lexicon_files()
        def forget_files() -> None:
            ann.forget_files(self._ann_dir)
            self._slab_files.forget(keep=False)
        self._cache.forget_ann(forget_files)

    def _forget_lexicon_files(self) -> None:
        """Remove the saved lexical index and any half-written one."""
        if self._lex_path is not None:
            for f in self._lex_path.parent.glob(f"{self._lex_path.name}*"):
                f.unlink(missing_ok=True)

    def _save_cache(self, path: Path, name: str, erasures: int,
                    write: Callable[[int], Path | None]) -> bool:
        """Save a cache file beside the database (cachefile.py): `write` writes it with a new
        token to a temporary file; renamed into place and named in `meta` (row `name`) in one
        write transaction, so the file named is the last renamed, and none is named once an
        erasure committed after the cache was last exact (`erasures`, the count then). Never
        beside an encrypted database (the file would hold its contents in clear)."""
        if self._db.encrypted:
            return False
        token = secrets.randbits(62) + 1
        tmp: Path | None = None
        try:
            tmp = write(token)
            if tmp is None:
                return False
            with self._db.transaction() as conn:
                (now,), = conn.execute(sql.ERASURES)
                if now != erasures:
                    return False
                tmp.replace(path)
                conn.execute(*sql.set_meta(name, token))
            return True
        except (OSError, StoreError) as exc:  # a cache: the next build or save tries again
            log.warning("could not save %s: %s", path, exc)
            return False
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def migrations(self) -> list[str]:
        return schema.applied(self._db)

    def _db_bytes(self, run: Run) -> int | None:
        if not self.path.exists():
            return None
        total = 0
        for p in self.path.parent.glob(self.path.name + "*"):
            with suppress(FileNotFoundError):  # a cache file's temporary, renamed meanwhile
                total += p.stat().st_size
        return total

    # -- dense search over the in-process cache ------------------------------------------------

    def _slab(self, query: Query, key_name: str, dim: int) -> tuple[Slab, bool]:
        """The scope's cache, refreshed (index/cache.py); and whether it is exact (its
        visibility attributes may be used instead of re-checking candidates against the
        tables). Inside a write that changed keys, this connection sees rows that may yet roll
        back: the cache is used as it is (committed state); inside one that did not, its keys
        are committed ones, but their rows may carry its changes: their attributes are not
        taken as exact."""
        meta = dict(self._read(sql.META))
        follow = (Follow.NONE if getattr(self._local, "dirty", False) else
                  Follow.KEYS if self._db.get().in_transaction else Follow.EXACT)
        slab = self._cache.refresh(
            self._keys, query.scope, [key_name], dim, (meta["keys_version"], meta["rows_version"]),
            lambda stmts: [self._read(*stmt) for stmt in stmts], follow=follow,
            load=lambda key, dim: self._slab_files.load(key, dim, meta))[key_name]
        exact = follow is Follow.EXACT
        if exact:  # saved beside the database once large (slabfiles.py)
            with self._cache.lock:
                self._slab_files.keep(slab, self._cache.key(self._keys, query.scope, key_name),
                                      meta["erasures"])
        return slab, exact

    def _in_background(self, job: Callable[[], None]) -> None:
        """Run cache work (saving a file, building a loaded cache's candidates) on the store's
        one background thread, in order, not the caller's; none once it is closing."""
        def run() -> None:
            try:
                job()
            except Exception:  # a cache: logged, and the next search or save tries again
                log.exception("background cache work failed")

        self._saver.submit(run)

    def wait_for_saves(self) -> None:
        """Wait until the background cache work asked for so far is done (files written and
        named, loaded caches' candidates built)."""
        self._saver.drain()

    def candidates(self, ids: Sequence[str], query: Query | None = None) -> dict[str, Candidate]:
        """From the scope's `text` cache when it is exact (a search's pool costs no SQL); the
        ids it does not hold, and every id outside a search, from the table."""
        if query is None or not ids:
            return super().candidates(ids)
        slab = self._cache.get(self._keys, query.scope, "text")
        if slab is None:
            return super().candidates(ids)
        slab, exact = self._slab(query, "text", slab.mat.shape[1])
        if not exact:
            return super().candidates(ids)
        found, missing = self._cache.candidates(slab, ids)
        if missing:
            found.update(super().candidates(missing))
        return found

    def _visible(self, query: Query, ids: Sequence[str]) -> set[str]:
        return {row[0] for row in self._read(*sql.visible_ids(query, ids))} if ids else set()

    def dense(self, query: Query, vector: np.ndarray, k: int,
              key: str = "text") -> list[tuple[str, float]]:
        vector = unit(np.asarray(vector, dtype=np.float32))  # cosine, as the protocol says
        slab, exact = self._slab(query, key, vector.shape[0])
        if exact:
            name = self._cache.key(self._keys, query.scope, key)
            # never beside an encrypted database: the index holds its vectors in clear
            path = (ann.file_for(self._ann_dir, name)
                    if self._ann_dir is not None and not self._db.encrypted else None)
            return self._cache.search(name, slab, query, vector, k,
                                      lambda ids: self._visible(query, ids), ann_file=path)
        # Inside a write: check each candidate against the tables.
        with self._cache.lock:
            n = slab.n
            sims = slab.mat[:n] @ vector
            sims[~slab.alive[:n]] = -np.inf
            seqs = slab.seqs[:n].copy()
            mids = slab.memory_ids[:n]
        pool = min(n, 4 * k + 64)
        while True:
            top = np.argpartition(-sims, pool - 1)[:pool] if pool < n else np.arange(n)
            top = top[np.isfinite(sims[top])]
            top = top[np.argsort(-sims[top], kind="stable")]
            alive = self._alive_seqs([int(seqs[i]) for i in top])
            dead = [i for i in top if int(seqs[i]) not in alive]
            # Not from inside a write: a key it deleted comes back if the write rolls back.
            if dead and not self._db.get().in_transaction:
                with self._cache.lock:
                    slab.alive[dead] = False
            best = {}
            for i in top:
                if int(seqs[i]) in alive and mids[i] not in best:
                    best[mids[i]] = float(sims[i])
            visible = self._visible(query, list(best))
            hits = [(mid, s) for mid, s in best.items() if mid in visible]
            if len(hits) >= k or pool >= n:
                return hits[:k]
            pool = min(n, pool * 4)

    def key_vectors(self, ids: Sequence[str], key: str) -> dict[str, np.ndarray]:
        out: dict[str, list[np.ndarray]] = {}
        for i in range(0, len(ids), self.dialect.chunk):
            for mid, blob in self._read(*sql.key_vectors(ids[i:i + self.dialect.chunk], key)):
                out.setdefault(mid, []).append(np.frombuffer(blob, dtype=np.float32))
        return {mid: np.stack(rows) for mid, rows in out.items()}

    def _alive_seqs(self, seqs: list[int]) -> set[int]:
        out: set[int] = set()
        for i in range(0, len(seqs), self.dialect.chunk):
            out.update(row[0] for row in self._read(*sql.alive_keys(seqs[i:i + self.dialect.chunk])))
        return out

    # -- the rest of the engine-specific primitives --------------------------------------------

    def pool(self, query: Query, k: int, *, vector: np.ndarray | None, keys: Sequence[str],
             terms: Sequence[str], previous_weight: float = 0.5) -> dict[str, list[tuple[str, float]]]:
        """The lexical ranking on the store's helper thread while this one searches the dense
        keys, when the scope is large (its dense search goes through the HNSW index); this
        thread then checks what the query may see of it. The two overlap where they let go of
        the GIL (numpy, SQLite, usearch's walk), so the search takes less than their sum.
        The second dense key stays on this thread: on two cores a third thread has no core
        to run on, and the walks are bound by memory (at 1M in one scope: bench/scale.py). On a small
        scope, where each takes a millisecond or two, handing over costs more than it saves
        (LoCoMo's p95 12-13 ms rose to 16-17). Not during the query's embedding either: ONNX
        Runtime's threads take the cores then. A search that finds the helper taken by another
        does both itself (searches never queue for it: concurrent searches already share the
        cores). Inside a write transaction both stay on this thread, whose connection sees
        the write."""
        large = vector is not None and self._large(query) and not self._db.get().in_transaction
        if not (large and vector is not None and keys and terms
                and self._helper_free.acquire(blocking=False)):
            found = super().pool(query, k, vector=vector, keys=keys, terms=terms,
                                 previous_weight=previous_weight)
        else:
            try:
                lexical = self._helper.submit(self._lexical_ranked, query, terms, k,
                                              previous_weight)
                if lexical is None:  # closing
                    found = super().pool(query, k, vector=vector, keys=keys, terms=terms,
                                         previous_weight=previous_weight)
                else:
                    try:
                        found = {key: self.dense(query, vector, k, key=key) for key in keys}
                    except BaseException:
                        wait([lexical])  # never left running; this error is the search's
                        raise
                    ranked = lexical.result()
                    hits = [] if ranked is None else ranked.visible(
                        lambda ids: self._lexical_visible(query, ids))
                    if ranked is None or (len(hits) < k and not ranked.whole):
                        hits = self.lexical(query, terms, k, previous_weight)  # FTS5, or more
                    found["lexical"] = hits[:k]
            finally:
                self._helper_free.release()
        if large and vector is not None:
            self._complete(query, vector, k, keys, found)
        return found

    def _complete(self, query: Query, vector: np.ndarray, k: int, keys: Sequence[str],
                  found: dict[str, list[tuple[str, float]]]) -> None:
        """Each dense key's list of a large scope completed from the pool (index/dense.py)."""
        self._cache.complete(self._cache.held(self._keys, query.scope, keys), vector, k, found)

    def _large(self, query: Query) -> bool:
        """Whether the scope's cached `text` keys are more than the ANN threshold."""
        return self._cache.indexed(self._keys, query.scope)

    def lexical(self, query: Query, terms: Sequence[str], k: int,
                previous_weight: float = 0.5) -> list[tuple[str, float]]:
        if not terms or k <= 0:
            return []
        # Not inside a write: its changes may yet roll back (FTS5 sees them, and answers).
        if not self._db.get().in_transaction:
            with self._follower.lock:
                lex = self._lexicon()
                hits = None if lex is None else lex.search(
                    terms, sql.owner_tokens(query.scope), k, previous_weight,
                    lambda ids: self._lexical_visible(query, ids))
            if hits is not None:
                return hits
        rows = self._read(*sql.lexical(query, terms))
        with closing(Tokenizer()) as tokenizer:  # per search: writes, small files
            return sql.lexical_hits(rows, tokenizer, terms, k, previous_weight)

    def _lexicon(self) -> Lexicon | None:
        """The in-memory lexical index, brought up to date with `lex_log` (index/follow.py);
        None while the database is small. Held in memory, else loaded from its file, else
        built (and saved). Call with the follower's lock held."""
        f = self._follower
        with self._snapshot() as conn:
            (position, block, horizon, erasures, named), = conn.execute(lexlog.STATE).fetchall()
            if f.lexicon is None and sql.fts_row_count(block) <= self.lexicon_threshold:
                return None
            if f.stale():
                f.drop()  # mostly dead: built again
            loaded = False
            if f.lexicon is None and named and self._lex_path is not None \
                    and not self._db.encrypted:
                lex = Lexicon.load(self._lex_path, named)
                # one saved before an erasure is never named: this is a second guard
                if lex is not None and lex.erasures == erasures:
                    f.hold(lex)
                    loaded = True
                elif lex is not None:
                    lex.close()
            with self._changes(conn, f.position, position, horizon) as changes:
                lex = f.apply(changes)
        assert lex is not None  # changes from its own position, or every document
        if changes.whole:
            lex.erasures = erasures  # as of the snapshot its documents were read from
            log.info("built the lexical index over %d rows", lex.count)
            self._save_lexicon(lex)
        else:
            if loaded:
                log.info("loaded the lexical index over %d rows", lex.count)
            if lex.version - lex.saved > self.lexicon_log // 4:
                self._save_lexicon(lex)  # keep the file within the log's reach
        return lex

    def lexical_changes(self, since: int) -> LexicalChanges:
        """What changed in the lexical documents after log position `since` (-1: every
        document), from `lex_log`, in one snapshot; every document again when the log cannot
        be followed from there (pruned past it, or an erasure since). Documents come as
        `LexicalText` (the lexicon tokenises them with FTS5's tokenizer)."""
        with self._snapshot() as conn:
            (position, _, horizon, _, _), = conn.execute(lexlog.STATE).fetchall()
            with self._changes(conn, since, position, horizon) as changes:
                return replace(changes, documents=list(changes.documents))

    @contextmanager
    def _changes(self, conn: sqlite3.Connection, since: int, position: int,
                 horizon: int) -> Iterator[LexicalChanges]:
        """`lexical_changes` on an open snapshot, whose documents are read while the block
        runs (every document of a large file comes in batches, never all at once)."""
        entries = conn.execute(lexlog.ENTRIES, [since]).fetchall() \
            if 0 <= since < position else []
        changes = lexlog.changes(since, position, horizon, entries)
        if changes is None:
            cur = conn.execute(*sql.lexical_documents())
            try:
                yield LexicalChanges(-1, position, documents=(
                    LexicalText(*row) for rows in iter(lambda: cur.fetchmany(BATCH), [])
                    for row in rows), whole=True)
            finally:
                cur.close()
            return
        chunk = self.dialect.chunk
        ids = list(changes.changed)
        yield replace(changes, documents=[
            LexicalText(*row) for i in range(0, len(ids), chunk)
            for row in conn.execute(*sql.lexical_documents(ids[i:i + chunk]))])

    @contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection in a read transaction: its reads see one state of the
        file (inside this thread's write, that write's)."""
        conn = self._db.get()
        if conn.in_transaction:
            yield conn
            return
        try:
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("COMMIT")  # it wrote nothing
        except DB_ERRORS as exc:
            raise StoreError(f"{self._db.label}: {exc}") from exc

    def _save_lexicon(self, lex: Lexicon) -> None:
        """Save the index's file and name it in the database (`meta.lex_file`): `_save_cache`,
        off the request path. Call with the lexicon's lock held: its state is taken now."""
        if self._lex_path is None or self._db.encrypted:
            return
        path, state = self._lex_path, lex.state()
        lex.saved = lex.version  # saved, or not possible now: tried again once it moved on
        if state is None:
            return

        def save() -> None:
            if self._save_cache(path, "lex_file", state[0]["erasures"],
                                lambda token: Lexicon.write(path, token, state)):
                log.info("saved the lexical index (%d rows) to %s", state[0]["count"], path)
        self._in_background(save)

    def _lexical_ranked(self, query: Query, terms: Sequence[str], k: int,
                        previous_weight: float) -> lexicon.Ranked | None:
        """On the helper thread: the lexicon's first ranking for a search of `k` (None: there
        is no lexicon). Its visibility is checked by the searching thread
        once its dense keys are done: the check reads the `text` cache, whose lock the dense
        search holds throughout, and waiting for it here made the lexical side 4 ms longer at
        1M in one scope."""
        with self._follower.lock:
            lex = self._lexicon()
            return None if lex is None else lex.ranked(
                terms, sql.owner_tokens(query.scope), lexicon.first_pool(k), previous_weight)

    def _lexical_visible(self, query: Query, ids: list[str]) -> set[str]:
        """The ids `query` may see: from the `text` cache when it is exact (no SQL), else the
        tables decide (as the FTS5 query's conditions do)."""
        slab = self._cache.get(self._keys, query.scope, "text")
        if slab is not None and not query.conditions:
            slab, exact = self._slab(query, "text", slab.mat.shape[1])
            if exact:
                return self._cache.visible_ids(slab, query, ids)
        return self._visible(query, ids)

    def read_memories(self, sel: Select) -> list[MemoryRecord]:
        self._apply_counts(COUNTS_READ_WAIT_S)  # a read sees this process's access counts
        return super().read_memories(sel)

    def access(self, ids: Sequence[str], at: datetime) -> dict[str, MemoryRecord]:
        # the records as they are (not waiting for counts pending: a search never waits for a
        # write), then this access counted
        found = {rec.id: rec for rec in super().read_memories(
            Select(ids=tuple(ids), seen=Seen.ALL, order=None))} if ids else {}
        self.touch(list(found), at)
        return found

    def touch(self, ids: Sequence[str], at: datetime) -> None:
        """Count an access of `ids`, written with the other counts of the next `COUNTS_EVERY_S`
        by the background thread (or first by a read, which sees them, or `close`): a search
        writes nothing, so it never waits for a writer, nor makes one wait."""
        if not ids:
            return
        with self._counts_lock:
            self._counts.append((list(ids), at))
        self._counts_soon()

    def _counts_soon(self) -> None:
        """Have the background thread write the pending counts (once for all of them)."""
        with self._counts_lock:
            due, self._counts_due = self._counts_due, True
        if not due:
            self._in_background(self._apply_due)

    def _apply_due(self) -> None:
        self._closing.wait(COUNTS_EVERY_S)  # the counts of the searches meanwhile go in one commit
        with self._counts_lock:
            self._counts_due = False
        self._apply_counts()

    def _apply_counts(self, wait_s: float | None = None) -> None:
        """Write the pending access counts in one transaction, in this process's write turn
        (waiting for it, and for other processes' writers, up to `wait_s`, else the busy
        timeout; not taken, they stay pending). Best effort: counts a database error other than
        a busy one refuses are logged and dropped."""
        if not self._counts:
            return
        if self._db.get().in_transaction:  # a read inside this thread's write: after it
            return
        wait_s = self.busy_timeout_s if wait_s is None else wait_s
        if not self._db.try_writer(wait_s):
            return
        with self._counts_lock:
            counts, self._counts = self._counts, []
        update, rows = sql.access_counts(counts)
        conn = self._db.get()
        try:
            # An access count is not worth an fsync per search (nor a checkpoint): sql.py
            for pragma in sql.counting_pragmas(wait_s):
                conn.execute(pragma)
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(update, rows)
            conn.execute("COMMIT")
            self._count_commits += 1
            if self._count_commits >= COUNTS_CHECKPOINT_EVERY:
                self._count_commits = 0
                self._in_background(self._checkpoint)
        except DB_ERRORS as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if is_busy(exc):  # another process writing: later
                with self._counts_lock:
                    self._counts[:0] = counts
                self._counts_soon()
            else:
                log.debug("access counts of %d memories skipped: %s", len(rows), exc)
        finally:
            for pragma in sql.writing_pragmas(self.busy_timeout_s):
                conn.execute(pragma)
            self._db.release_writer()

    def _checkpoint(self) -> None:
        """Copy the WAL into the database as far as no reader still needs it (PASSIVE: it
        waits for no one and blocks no one)."""
        self._db.get().execute(sql.CHECKPOINT)

    def claim_job(self, now: datetime, lease_until: datetime) -> Job | None:
        with self.write() as tx:  # BEGIN IMMEDIATE: one claimer at a time across processes
            rows = tx.conn.execute(*sql.next_job(now)).fetchall()
            if not rows:
                return None
            job = r.read_job(self.dialect, rows[0])
            claimed = replace(job, status=JobStatus.RUNNING, attempts=job.attempts + 1,
                              lease_until=lease_until, updated_at=now)
            tx.put_job(claimed)
        return claimed

    def reclaim(self) -> None:
        try:
            with self.write() as tx:
                tx.conn.execute(sql.FTS_OPTIMIZE)
            self._db.get().execute(sql.CHECKPOINT_TRUNCATE)
            self._forget_ann()
        except DB_ERRORS as exc:
            raise StoreError(f"reclaim failed: {exc}") from exc


class SQLiteTx(SQLTx):
    """The writes of one transaction (see `Tx` in store/base.py): rows, their FTS5 entry and
    their keys; a key change marks the thread dirty, so the dense cache waits for the commit."""

    dialect = sql.DIALECT
    def __init__(self, conn: sqlite3.Connection, local: threading.local) -> None:
        self.conn = conn
        self.unique_violation = conn.IntegrityError  # the driver's own (sqlite3 or SQLCipher)
        self.local = local
        self.keys_changed = False
        self.erased = False  # the saved ANN indexes must go once this commits

    def _exec(self, stmt: str, params: Sequence[Any] = ()) -> None:
        self.conn.execute(stmt, params)

    def insert(self, record: MemoryRecord, keys: Sequence[Key], lexical: Lexical) -> None:
        cur = self.conn.execute(*sql.insert_memory(record))
        assert cur.lastrowid is not None
        self._exec(*sql.index_text(cur.lastrowid, record.scope, lexical.body, lexical.previous))
        self._put_keys(record.id, keys)

    def insert_many(self, rows: Sequence[tuple[MemoryRecord, Sequence[Key], Lexical]]) -> None:
        """`insert` of each row, a statement per table (bulk loads: the same rows, keys and
        FTS5 entries as one `insert` per row). The transaction holds the write lock, so
        the rids SQLite would give them one by one are the next ones after the largest."""
        if not rows:
            return
        c = self.conn
        (top,), = c.execute(sql.TOP_RID)
        c.executemany(*sql.insert_memories(top + 1, [rec for rec, _, _ in rows]))
        c.executemany(*sql.index_texts([(rid, rec.scope, lex.body, lex.previous)
                                        for rid, (rec, _, lex) in enumerate(rows, top + 1)]))
        c.executemany(*sql.insert_keys([(rec.id, k) for rec, keys, _ in rows for k in keys]))
        self.keys_changed = True
        self.local.dirty = True

    def _put_keys(self, memory_id: str, keys: Sequence[Key]) -> None:
        self.conn.executemany(*sql.insert_keys([(memory_id, k) for k in keys]))
        self.keys_changed = True
        self.local.dirty = True

    def update(self, record: MemoryRecord, keys: Sequence[Key] | None = None,
               lexical: Lexical | None = None) -> None:
        # The text cache holds ranking fields (name, importance, times) that may change with
        # no key changing: the row is marked changed at a new rows version, and reloaded.
        self._exec(sql.BUMP_ROWS)
        self._exec(*sql.update_memory(record))
        self._exec(sql.MARK_CHANGED, (record.id,))
        if keys is not None:
            self._exec(*sql.drop_keys_of(record.id))
            self._put_keys(record.id, keys)
        if lexical is not None:
            (rid,), = self.conn.execute(sql.RID, (record.id,))
            self._exec(*sql.drop_text(rid))
            self._exec(*sql.index_text(rid, record.scope, lexical.body, lexical.previous))

    def soft_delete(self, ids: Sequence[str], at: datetime) -> None:
        for chunk in _chunks(ids, self.dialect.chunk):
            self._exec(*sql.soft_delete(chunk, at))
            self._drop_index(chunk)

    def _drop_index(self, ids: Sequence[str]) -> None:
        self._exec(*sql.drop_keys(ids))
        self._exec(*sql.drop_texts(ids))
        self.keys_changed = True
        self.local.dirty = True

    def erase(self, ids: Sequence[str]) -> None:
        self.erased = True
        for chunk in _chunks(ids, self.dialect.chunk):
            self._drop_index(chunk)
            self._exec(*sql.erase_events(chunk))
            self._exec(*sql.erase_memories(chunk))


_STORES: weakref.WeakSet[SQLiteStore] = weakref.WeakSet()


def _before_fork() -> None:
    for store in list(_STORES):
        store._quiet_for_fork()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._after_fork()


# registered after conn.py's: before a fork the saves end first, then the writers' turns are taken
os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def secure_fts_delete(db: Connections) -> None:
    """Turn on FTS5 `secure-delete` (SQLite 3.44+: the SQLCipher build has it, the system
    SQLite of Python 3.11 may not): a deleted entry's terms are removed from the index's pages
    at once, not left until the segments merge. Encrypted databases only, since a file with it
    cannot be written by an older SQLite, and only SQLCipher opens an encrypted file anyway."""
    on = db.read(sql.FTS_SECURE_DELETE)
    if not on or not on[0][0]:
        with db.transaction() as conn:
            conn.execute(sql.FTS_SECURE_DELETE_ON)


def _chunks(items: Sequence[str], size: int) -> Iterator[list[str]]:
    items = list(items)
    for i in range(0, len(items), size):
        yield items[i:i + size]

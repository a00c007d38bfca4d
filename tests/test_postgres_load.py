"""PostgreSQL under concurrent adds and searches (issue 13, the service under load): writers
of a process wait for their turn without holding a connection, a write's statements go out
pipelined and commit whole, a forked child starts with no turn taken, and a search after
another process's write refreshes its cache in its first round trip."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest

from conformance.test_store import NOW, put, q, rec, vec
from engram.errors import StoreError
from engram.model import Scope
from engram.store import Key, Lexical
from engram.store.postgres import PostgresStore


@pytest.fixture
def db(pg_server: Any) -> Any:
    url = pg_server.url(pg_server.create_database())
    yield url
    with pg_server.admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {url.split('/')[3].split('?')[0]} WITH (FORCE)")


def test_writers_waiting_for_their_turn_leave_the_connections_to_readers(db: str) -> None:
    """Two connections, one writer inside its write and three more queued behind it: a read
    still gets a connection at once. Writers queued on the database's lock each held one, and
    the reads of a busy service waited for them."""
    store = PostgresStore(db, max_connections=2, pool_wait_s=1.0)
    try:
        put(store, rec("seed"))  # the dimension's index exists: no writer makes it
        inside, release = threading.Event(), threading.Event()
        first = rec("first")
        queued = [rec(f"queued {i}") for i in range(3)]
        errors: list[BaseException] = []

        def hold() -> None:
            try:
                with store.write() as tx:
                    tx.insert(first, [Key("text", vec(1, 0))], Lexical(first.text))
                    inside.set()
                    release.wait(10)
            except BaseException as exc:  # reported below
                errors.append(exc)
                inside.set()

        def write(r: Any) -> None:
            try:
                put(store, r)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=hold)]
        threads[0].start()
        assert inside.wait(10)
        threads += [threading.Thread(target=write, args=(r,)) for r in queued]
        for t in threads[1:]:
            t.start()
        try:
            # the queued writers are waiting; a read finds the second connection free
            assert store.get([first.id]) == {}  # not committed yet
        finally:
            release.set()
            for t in threads:
                t.join(30)
        assert not errors
        assert set(store.get([first.id, *(r.id for r in queued)])) == {
            first.id, *(r.id for r in queued)}
    finally:
        store.close()


def test_a_write_reads_its_own_statements_and_an_error_after_leaves_nothing(db: str) -> None:
    """Pipelined: a read inside the write sees what the write sent before it; a statement that
    fails after it, or an exception in the block, rolls the whole transaction back."""
    store = PostgresStore(db)
    try:
        put(store, rec("seed"))
        a, b = rec("a"), rec("b")
        with pytest.raises(StoreError), store.write() as tx:
            tx.insert(a, [Key("text", vec(1, 0))], Lexical(a.text))
            assert set(store.get([a.id])) == {a.id}  # through the write's own transaction
            tx.insert(a, [Key("text", vec(1, 0))], Lexical(a.text))  # the same id again
        with pytest.raises(RuntimeError), store.write() as tx:
            tx.insert(b, [Key("text", vec(0, 1))], Lexical(b.text))
            raise RuntimeError("the caller gives up")
        assert store.get([a.id, b.id]) == {}
        with store.write() as tx:  # and the connections are fine for the next write
            tx.insert(a, [Key("text", vec(1, 0))], Lexical(a.text))
        assert set(store.get([a.id])) == {a.id}
    finally:
        store.close()


def test_a_forked_child_starts_with_no_turn_taken(db: str) -> None:
    store = PostgresStore(db, busy_timeout_s=1.0)
    try:
        turn = store._turns.lock(store.tenant)
        with turn:  # a parent's thread is writing when the child is forked
            pid = os.fork()
            if pid == 0:  # the child: its own turns, and it can write
                code = 1
                try:
                    r = rec("from the child")
                    put(store, r)
                    code = 0 if set(store.get([r.id])) == {r.id} else 2
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        store.close()


def test_a_search_after_another_writer_refreshes_its_cache_in_its_first_round_trip(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a stream of adds, the versions have moved at nearly every search: the cached
    slabs' tombstones and new keys ride with the versions and BM25 (one round trip, not two),
    and the hits are those of a search in the database."""
    writer, cached, tables = (PostgresStore(db), PostgresStore(db), PostgresStore(db, cache_limit=0))
    calls: list[int] = []
    real = PostgresStore._batch

    def counted(self: PostgresStore, statements: Any, **kw: Any) -> Any:
        if self is cached:
            calls.append(len(statements))
        return real(self, statements, **kw)

    def search(store: PostgresStore, probe: np.ndarray) -> list[tuple[str, float]]:
        return store.pool(q(Scope("u1")), 10, vector=probe, keys=["text"], terms=["note"])["text"]

    try:
        rng = np.random.default_rng(5)
        vectors = rng.normal(size=(20, 8)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        records = [rec(f"note {i}") for i in range(20)]
        put(writer, *records[:10], vectors=list(vectors[:10]))
        search(cached, vectors[0])  # loads the slab
        monkeypatch.setattr(PostgresStore, "_batch", counted)
        for i in range(10, 20):
            put(writer, records[i], vectors=[vectors[i]])
            if i % 3 == 0:  # and a delete: a tombstone to apply
                with writer.write() as tx:
                    tx.soft_delete([records[i - 10].id], NOW)
            calls.clear()
            got, want = search(cached, vectors[i]), search(tables, vectors[i])
            assert [m for m, _ in got] == [m for m, _ in want]
            assert np.allclose([s for _, s in got], [s for _, s in want], atol=1e-6)
            assert got[0][0] == records[i].id
            # a delete changed a row too: the rows changed ride along as well (no second trip)
            assert len(calls) == 1
    finally:
        for s in (writer, cached, tables):
            s.close()


def test_writers_of_a_process_get_their_turn_in_the_order_they_came(db: str) -> None:
    """A writer that has waited is not overtaken by one that came later; one that gives up
    (its busy timeout) leaves the queue, and the next one is served."""
    store = PostgresStore(db, busy_timeout_s=0.3)
    try:
        turn = store._turns.lock(store.tenant)
        order: list[int] = []
        started = []
        with turn:
            threads = []
            for i in range(5):
                ready = threading.Event()
                started.append(ready)

                def take(i: int = i, ready: threading.Event = ready) -> None:
                    ready.set()
                    with turn:
                        order.append(i)

                threads.append(threading.Thread(target=take))
                threads[-1].start()
                ready.wait(5)
                # queued before the next one starts (it is waiting, or about to)
                deadline = time.monotonic() + 5
                while len(turn._waiting) < i + 1 and time.monotonic() < deadline:
                    time.sleep(0.001)
            assert not turn.acquire(timeout=0.05)  # busy: a caller with a short wait gives up
            assert len(turn._waiting) == 5  # and leaves the queue
        for t in threads:
            t.join(10)
        assert order == [0, 1, 2, 3, 4]
        with store.write() as tx:  # the turn is free again for the store's writes
            r = rec("after")
            tx.insert(r, [Key("text", vec(1, 0))], Lexical(r.text))
        assert set(store.get([r.id])) == {r.id}
    finally:
        store.close()

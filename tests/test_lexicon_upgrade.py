"""SQLite's lexicon log before and after 0010_lexicon_log_ids: the log named `memory_fts`
rowids, which SQLite gives again once the highest row is deleted; it now names memories (as
PostgreSQL's does), and a database made before upgrades in place."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from engram.model import Scope
from engram.store import Key, Lexical, Query
from engram.store.sqlite import SQLiteStore, schema
from engram.store.sqlite import sql as sqlite_sql
from test_lexicon import NOW, SCOPES, fill, fts5, queries, record, same


def test_an_old_log_of_rowids_upgrades_to_one_of_memories(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(31)
    path, file = tmp_path / "old.db", tmp_path / "old.db.lexicon"
    names = [name for name, _ in schema.MIGRATIONS]
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:names.index("0010_lexicon_log_ids")])
        old = SQLiteStore(path)
        recs = fill(old, 50, rng)
        (top,), = old._read("SELECT max(rid) FROM memories")
        with old.write() as tx:  # the newest row erased, then a new memory: the same rowid
            tx.erase([recs[-1].id])
        new = record("a kayak on the Tagus", SCOPES[0], rng)
        with old.write() as tx:
            tx.insert(new, [Key("text", np.ones(4, dtype=np.float32) / 2)], Lexical(new.text))
        assert old._read("SELECT rid FROM memories WHERE id = ?", (new.id,)) == [(top,)]
        entries = old._read("SELECT id, rid FROM lex_log ORDER BY id")
        assert [rid for _, rid in entries[-2:]] == [top, top]  # one rowid, two memories
        last = entries[-1][0]
        # a saved index of that version, named by the database
        file.write_bytes(b"an index numbered by rowid")
        with old.connections.transaction() as conn:
            conn.execute("UPDATE meta SET value = 77 WHERE name = 'lex_file'")
        old.close()
    s = SQLiteStore(path, lexicon_threshold=0)
    try:
        assert s.migrations() == names
        assert not file.exists()  # unnamed by the upgrade, and removed
        assert [r[1] for r in s._read("PRAGMA table_info(lex_log)")] == ["id", "memory_id",
                                                                         "erased"]
        meta = dict(s._read("SELECT name, value FROM meta"))
        assert (meta["lex_horizon"], meta["lex_file"]) == (last, 0)
        first = s.lexical_changes(-1)
        assert first.whole and first.position == last
        assert {d.id for d in first.documents} == {r.id for r in recs[:-1]} | {new.id}
        later = record("the ferry to Cacilhas", SCOPES[1], rng)
        with s.write() as tx:  # the ids go on after the old ones: no position given twice
            tx.insert(later, [Key("text", np.ones(4, dtype=np.float32) / 2)],
                      Lexical(later.text))
        assert s._read("SELECT id, memory_id, erased FROM lex_log") == [(last + 1, later.id, 0)]
        ch = s.lexical_changes(last)
        assert (ch.whole, list(ch.changed), ch.position) == (False, [later.id], last + 1)
        for words in queries(rng, 20):
            for scope in [*SCOPES, Scope()]:
                q = Query(scope=scope, now=NOW)
                same(s.lexical(q, words, 10, 0.5), fts5(s, q, words, 10, 0.5), 10)
        lex = s._follower.lexicon
        assert lex is not None
        (block,), = s._read("SELECT block FROM memory_fts_data WHERE id = 1")
        assert lex.count == sqlite_sql.fts_row_count(block) == 51
        s.wait_for_saves()
        assert file.exists()  # saved again, in the new numbering
    finally:
        s.close()

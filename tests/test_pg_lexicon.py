"""The PostgreSQL store's in-process lexicon (postgres/lexicon.py over index/follow.py): the
same scores as its BM25 statement, exact across writers (another store's add, update and erase
are seen by the next search; an erasure drops it at once), and its change log never skips a
change that commits after a later-numbered one."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from engram.model import Scope
from engram.store import Key, Lexical, Query
from engram.store.bm25 import Tokenizer, scope_tokens, tagged
from engram.store.index.follow import LexicalChanges, LexicalDocument, LexicalFollower
from engram.store.index.lexicon import Lexicon
from engram.store.postgres import PostgresStore, sql
from test_lexicon import NOW, SCOPES, fill, queries, record, same, sentence


@pytest.fixture
def url(pg_server: Any) -> Iterator[str]:
    name = pg_server.create_database()
    yield pg_server.url(name)
    with pg_server.admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def open_store(url: str, **kw: Any) -> PostgresStore:
    return PostgresStore(url, lexicon_threshold=0, **kw)


@pytest.fixture
def store(url: str) -> Iterator[PostgresStore]:
    s = open_store(url)
    yield s
    s.close()


def by_sql(store: PostgresStore, q: Query, words: list[str], k: int, w: float) -> list[tuple[str, float]]:
    phrases = [p for p in (store._tokenizer.phrase(t) for t in words) if p]
    if not phrases:
        return []
    return [(row[0], float(row[1])) for row in store._read(*sql.lexical(store.tenant, q, phrases, k, w))]


def held(store: PostgresStore) -> LexicalFollower | None:
    return store._lexicons._followers.get(store.tenant)


def check(store: PostgresStore, rng: random.Random, n: int = 30) -> int:
    """The lexicon's hits against the BM25 statement's over `n` queries in every scope."""
    compared = 0
    for words in queries(rng, n):
        for scope in [*SCOPES, Scope()]:
            for k, w in ((5, 0.5), (40, 0.3)):
                q = Query(scope=scope, now=NOW)
                ours = store.lexical(q, words, k, w)
                same(ours, by_sql(store, q, words, k, w), k)
                compared += len(ours)
    return compared


# -- the lexicon fed tokens ---------------------------------------------------------------------

def test_a_lexicon_fed_tokens_ranks_as_one_fed_texts() -> None:
    rng = random.Random(3)
    tok = Tokenizer()
    texts, tokens = Lexicon(), Lexicon(tok)
    try:
        docs = []
        for i in range(300):
            scope = SCOPES[i % len(SCOPES)]
            body, prev = sentence(rng), sentence(rng) if i % 3 else ""
            docs.append((i + 1, f"m{i}", body, prev, " ".join(scope_tokens(scope))))
        texts.add(docs)
        tokens.add_tokens([(rid, mid, *tok.tokens(body, prev),
                            [t for o in owner.split() for t in tok.phrase(o)])
                           for rid, mid, body, prev, owner in docs])
        assert (tokens.count, tokens.total) == (texts.count, texts.total)
        for words in queries(rng, 40):
            for scope in SCOPES:
                a = texts.top(words, scope_tokens(scope), 20, 0.5)
                b = tokens.top(words, scope_tokens(scope), 20, 0.5)
                assert (a is None) == (b is None)
                if a is not None and b is not None:
                    same(list(zip(a[0].tolist(), a[1].tolist(), strict=True)),
                         list(zip(b[0].tolist(), b[1].tolist(), strict=True)), 20)
    finally:
        texts.close()
        tokens.close()
        tok.close()


def test_a_follower_applies_changes_and_refuses_a_gap() -> None:
    f = LexicalFollower()
    doc = LexicalDocument("a", ["ramen"], [], ["o1"])
    assert f.apply(LexicalChanges(5, 9, ["b"], [])) is None  # nothing to apply them to
    lex = f.apply(LexicalChanges(-1, 4, documents=[doc], whole=True))
    assert lex is not None and f.position == 4 and f.size == 1
    assert f.apply(LexicalChanges(5, 9, ["b"], [])) is None  # 5 is past 4: a gap
    f.apply(LexicalChanges(4, 6, ["a", "b"], [LexicalDocument("b", ["ramen"], [], ["o1"])]))
    assert f.position == 6 and f.size == 1
    assert lex.ranked(["ramen"], [], 5, 0.5).ids == ["b"]  # type: ignore[union-attr]
    f.apply(LexicalChanges(3, 5, ["b"], []))  # older than what it holds: left as it is
    assert f.position == 6 and f.size == 1
    f.drop()
    assert f.lexicon is None and f.position == -1


# -- on PostgreSQL ------------------------------------------------------------------------------

def test_the_lexicon_scores_as_the_bm25_statement(store: PostgresStore,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    fill(store, 400, rng)  # type: ignore[arg-type]
    assert store.build_lexicon()
    statements: list[int] = []
    real = sql.lexical
    monkeypatch.setattr(sql, "lexical", lambda *a: statements.append(1) or real(*a))
    ours = [store.lexical(Query(scope=s, now=NOW), ["ramen", "lisbon"], 10, 0.5) for s in SCOPES]
    assert not statements  # the lexicon answered
    assert any(ours)
    monkeypatch.undo()
    assert check(store, rng) > 500


def test_phrases_of_three_tokens_or_more_score_as_the_bm25_statement(
        store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lexicon counts `o'neil's` (`o neil s`) in its documents' tokens, as the statement
    counts it in `lex_body`: overlapping occurrences too, never the pairs apart."""
    rng = random.Random(9)
    fill(store, 200, rng)  # type: ignore[arg-type]
    said = [("we met o'neil's friend at o'neil's place", ""), ("o neil went, neil s later", "o'neil's"),
            ("s s s s", "s s"), ("rock'n'roll'n'roll rock'n'roll", "o'neil's o'neil's"),
            ("ramen at o'neil's place today", "")]
    with store.write() as tx:
        for i, (text, prev) in enumerate(said * 3):
            r = record(text, SCOPES[i % 2], rng)
            tx.insert(r, [Key("text", np.ones(4, dtype=np.float32) / 2)], Lexical(text, prev))
    assert store.build_lexicon()
    asked = [["o'neil's"], ["s's's"], ["rock'n'roll'n'roll", "ramen"], ["o'neil's place", "went"],
             ["neil's o'neil"]]
    statements: list[int] = []
    real = sql.lexical
    monkeypatch.setattr(sql, "lexical", lambda *a: statements.append(1) or real(*a))
    ours = {(i, j): store.lexical(Query(scope=s, now=NOW), words, 10, 0.5)
            for i, words in enumerate(asked) for j, s in enumerate((SCOPES[0], Scope()))}
    assert not statements  # the lexicon answered
    monkeypatch.undo()
    for (i, j), hits in ours.items():
        q = Query(scope=(SCOPES[0], Scope())[j], now=NOW)
        same(hits, by_sql(store, q, asked[i], 10, 0.5), 10)
    assert ours[(0, 1)] and ours[(1, 1)]


def test_small_tenants_stay_on_the_statement(url: str) -> None:
    s = PostgresStore(url, lexicon_threshold=50)
    try:
        fill(s, 40, random.Random(1))  # type: ignore[arg-type]
        assert not s.build_lexicon()
        assert s.lexical(Query(scope=SCOPES[0], now=NOW), ["ramen"], 5) == \
            by_sql(s, Query(scope=SCOPES[0], now=NOW), ["ramen"], 5, 0.5)
        assert held(s) is None
    finally:
        s.close()


def test_another_writer_is_seen_by_the_next_search(url: str) -> None:
    rng = random.Random(11)
    reader, writer = open_store(url), open_store(url)
    try:
        fill(writer, 200, rng)  # type: ignore[arg-type]
        assert reader.build_lexicon()
        scope = SCOPES[0]
        q = Query(scope=scope, now=NOW)
        position = held(reader).position  # type: ignore[union-attr]
        # an add
        new = record("the zeppelin landed in Lisbon", scope, rng)
        with writer.write() as tx:
            tx.insert(new, [Key("text", np.ones(4, dtype=np.float32) / 2)], Lexical(new.text))
        hits = reader.lexical(q, ["zeppelin"], 5)
        assert [h[0] for h in hits] == [new.id]
        assert held(reader).position > position  # type: ignore[union-attr]  # followed, not rebuilt
        assert hits == by_sql(reader, q, ["zeppelin"], 5, 0.5)
        # an update of its text
        moved = record("the airship left Porto", scope, rng)
        with writer.write() as tx:
            tx.update(replace(new, text=moved.text), None, Lexical(moved.text))
        assert reader.lexical(q, ["zeppelin"], 5) == []
        assert [h[0] for h in reader.lexical(q, ["airship"], 5)] == [new.id]
        check(reader, rng, 8)
        # an erasure: the lexicon is dropped at once, the statement answers, and it is built again
        with writer.write() as tx:
            tx.erase([new.id])
        assert reader.lexical(q, ["airship"], 5) == []
        f = held(reader)
        assert f is None or f.lexicon is None or new.id not in f.lexicon.ids
        reader.wait_for_saves()
        assert held(reader) is not None and held(reader).lexicon is not None  # type: ignore[union-attr]
        assert new.id not in held(reader).lexicon.ids  # type: ignore[union-attr]
        check(reader, rng, 8)
    finally:
        reader.close()
        writer.close()


def raw(url: str) -> Any:
    """A plain connection of the tenant '' (no turn, no store): a writer the log alone orders."""
    import psycopg

    conn = psycopg.connect(url)
    conn.execute("SELECT set_config('engram.tenant', '', false)")
    return conn


def test_a_change_committed_after_a_later_numbered_one_is_never_skipped(url: str) -> None:
    """Two writers outside the tenant's turn re-index a row each: with positions drawn from a
    sequence, the second would commit first with the higher number, a search would move past
    it, and the first's lower number, committed after, would never be read. The counter's
    row lock makes the second wait for the first's commit instead."""
    rng = random.Random(5)
    reader = open_store(url)
    a, b = raw(url), raw(url)
    try:
        x, y = fill(reader, 30, rng)[:2]  # type: ignore[arg-type]
        assert reader.build_lexicon()
        q = Query(scope=Scope(), now=NOW)
        a.execute("UPDATE memories SET lex_body = %s WHERE id = %s", (tagged(["quokka"]), x.id))
        done = threading.Event()

        def second() -> None:
            b.execute("UPDATE memories SET lex_body = %s WHERE id = %s", (tagged(["quokka"]), y.id))
            b.commit()
            done.set()
        t = threading.Thread(target=second)
        t.start()
        try:
            time.sleep(0.5)
            assert not done.is_set()  # it waits for the first writer's commit
            assert reader.lexical(q, ["quokka"], 5) == []  # neither is committed
        finally:
            a.commit()
            t.join(10)
        assert done.is_set()
        assert {h[0] for h in reader.lexical(q, ["quokka"], 5)} == {x.id, y.id}
        (pos,), = reader._read("SELECT value::bigint FROM meta WHERE name = 'lex_position'")
        assert held(reader).position == pos  # type: ignore[union-attr]
    finally:
        a.close()
        b.close()
        reader.close()


def test_a_lexicon_past_the_log_horizon_is_built_again(pg_server: Any, url: str) -> None:
    with pg_server.admin() as conn:
        conn.execute(f"ALTER DATABASE {url.split('/')[3].split('?')[0]} SET engram.lex_log_kept = 20")
    rng = random.Random(9)
    reader, writer = open_store(url), open_store(url)
    try:
        fill(writer, 30, rng)  # type: ignore[arg-type]
        assert reader.build_lexicon()
        f = held(reader)
        assert f is not None
        before = f.lexicon
        fill(writer, 40, rng)  # type: ignore[arg-type]  # 70 entries: pruned to the newest 20-30
        (horizon,), = writer._read("SELECT value::bigint FROM meta WHERE name = 'lex_horizon'")
        (entries,), = writer._read("SELECT count(*) FROM lex_log")
        assert horizon > f.position and entries <= 30
        assert check(reader, rng, 5) > 0  # the statement answered meanwhile, with equal scores
        reader.wait_for_saves()
        f = held(reader)
        assert f is not None and f.lexicon is not None and f.lexicon is not before
        assert f.position >= horizon and f.size == 70
        assert check(reader, rng, 5) > 0
    finally:
        reader.close()
        writer.close()


def test_a_forked_child_searches_without_the_parents_lexicon(store: PostgresStore) -> None:
    """A lock a parent's thread holds at the fork (here the lexicon's own) is never released
    in the child: the child starts with no lexicon, and the statement answers it."""
    import os
    import signal

    fill(store, 100, random.Random(2))  # type: ignore[arg-type]
    assert store.build_lexicon()
    q = Query(scope=SCOPES[0], now=NOW)
    want = [s for _, s in store.lexical(q, ["ramen", "lisbon"], 5)]
    f = held(store)
    assert f is not None and want
    with f.lock:
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                signal.alarm(30)  # a hang ends the child, not the test run
                got = [s for _, s in store.lexical(q, ["ramen", "lisbon"], 5)]
                code = 0 if got == pytest.approx(want, abs=1e-9, rel=0) else 2
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_lexical_changes_since_a_position(store: PostgresStore) -> None:
    """The primitive itself: every document from -1; past a position, the memories changed
    and their current documents; after an erasure, every document again."""
    rng = random.Random(4)
    recs = fill(store, 10, rng)  # type: ignore[arg-type]
    first = store.lexical_changes(-1)
    assert first.whole and sorted(d.id for d in first.documents) == sorted(r.id for r in recs)
    new = record("a kayak on the Tagus", SCOPES[2], rng)
    with store.write() as tx:
        tx.insert(new, [], Lexical(new.text))
        tx.update(replace(recs[0], text="the ferry to Cacilhas"), None, Lexical("the ferry to Cacilhas"))
        tx.soft_delete([recs[1].id], NOW)
    ch = store.lexical_changes(first.position)
    assert not ch.whole and ch.since == first.position and ch.position == first.position + 3
    assert set(ch.changed) == {new.id, recs[0].id, recs[1].id}
    docs = {d.id: d for d in ch.documents}
    assert set(docs) == {new.id, recs[0].id}  # the deleted one has none
    assert list(docs[recs[0].id].body) == ["the", "ferri", "to", "cacilha"]
    assert list(docs[new.id].scope) == [t for o in scope_tokens(SCOPES[2])
                                        for t in store._tokenizer.phrase(o)]
    again = store.lexical_changes(ch.position)
    assert (again.position, list(again.changed), list(again.documents)) == (ch.position, [], [])
    with store.write() as tx:
        tx.erase([new.id])
    after = store.lexical_changes(ch.position)
    assert after.whole and after.position == ch.position + 1
    assert new.id not in {d.id for d in after.documents}


def test_a_warm_search_with_the_lexicon_still_makes_two_round_trips(
        url: str, embedder: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The log's new entries ride in the first round trip instead of the BM25 statement, and
    visibility comes from the cached text keys: no round trip is added."""
    from engram import Config, Memory

    config = Config.from_env(database_url=url, path=tmp_path / "unused.db", pg_lexicon_threshold=0)
    with Memory(config=config, embedder=embedder) as mem:
        mem.add(["Ana moved to Lisbon in May.", "Ben plays the cello.", "Ana likes jazz."],
                user_id="ana", infer=False)
        mem.search("where does Ana live?", user_id="ana")  # loads the caches, starts the build
        mem.store.wait_for_saves()  # type: ignore[attr-defined]
        mem.search("where does Ana live?", user_id="ana")
        calls: list[int] = []
        real = PostgresStore._batch
        statements: list[int] = []
        real_lexical = sql.lexical

        def counted(self: PostgresStore, stmts: Any, **kw: Any) -> Any:
            calls.append(len(stmts))
            return real(self, stmts, **kw)
        monkeypatch.setattr(PostgresStore, "_batch", counted)
        monkeypatch.setattr(sql, "lexical", lambda *a: statements.append(1) or real_lexical(*a))
        hits = mem.search("where does Ana live?", user_id="ana")
        assert hits[0].memory.text == "Ana moved to Lisbon in May."
        assert len(calls) == 2 and not statements


def test_a_database_with_lex_terms_drops_it_and_writes_never_touch_it_again(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """0011 drops `lex_terms` (written by every write, read by nothing): a database made
    before it upgrades in place, and ranks as it did; its writes keep `lex_stats` exact."""
    from engram.store.postgres import schema

    rng = random.Random(21)
    names = [name for name, _ in schema.MIGRATIONS]
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:names.index("0011_drop_lex_terms")])
        old = open_store(url)
        recs = fill(old, 120, rng)  # type: ignore[arg-type]
        assert old._read("SELECT to_regclass('lex_terms')") != [(None,)]
        q = Query(scope=SCOPES[0], now=NOW)
        before = by_sql(old, q, ["ramen", "lisbon"], 20, 0.5)
        old.close()
    new = open_store(url)
    try:
        assert new.migrations() == names
        assert new._read("SELECT to_regclass('lex_terms')") == [(None,)]
        assert by_sql(new, q, ["ramen", "lisbon"], 20, 0.5) == before and before
        more = fill(new, 30, rng)  # type: ignore[arg-type]
        with new.write() as tx:
            tx.update(replace(recs[0], text="ramen in Lisbon"), None, Lexical("ramen in Lisbon"))
            tx.soft_delete([recs[1].id], NOW)
            tx.erase([recs[2].id, more[0].id])
        (rows, tokens), = new._read("SELECT rows, tokens FROM lex_stats WHERE tenant = %s",
                                    (new.tenant,))
        assert (rows, tokens) == tuple(new._read(
            "SELECT count(*), sum(lex_len) FROM memories WHERE tenant = %s AND lex IS NOT NULL",
            (new.tenant,))[0]) and rows == 120 + 30 - 3
        check(new, rng, 10)
    finally:
        new.close()


def test_a_whole_set_of_documents_is_merged_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower builds from every document batch by batch, then merges its segments once:
    merging after each batch would merge everything built so far again and again."""
    from engram.store.index import follow, lexicon

    monkeypatch.setattr(follow, "BATCH", 10)
    monkeypatch.setattr(lexicon, "BATCH", 10)
    merged: list[int] = []
    real = lexicon.Segment.merged
    monkeypatch.setattr(lexicon.Segment, "merged", staticmethod(
        lambda parts: (merged.append(sum(len(p.docs) for p in parts)), real(parts))[1]))
    rng = random.Random(8)
    docs = [follow.LexicalText(f"m{i}", sentence(rng), "", "o1") for i in range(200)]
    f = LexicalFollower()
    with f.lock:
        lex = f.apply(LexicalChanges(-1, 7, documents=iter(docs), whole=True))
        assert lex is not None and (lex.count, lex.version) == (200, 7)
        # 20 batches of one size: merged once, by eight (Lexicon.merge), none twice
        assert merged and sum(merged) <= sum(len(s.docs) for s in lex.segments)
        assert {m for m, _ in lex.search(["ramen"], [], 500, 0.5, set) or []} == {
            d.id for d in docs if "ramen" in d.body}
        f.drop()

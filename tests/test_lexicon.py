"""The SQLite store's in-memory lexical index (store/index/lexicon.py) against FTS5 itself:
the same memories with the same BM25 scores, for many queries, and still after deletes,
updates, erasures and writes by another process."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from contextlib import closing
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from engram.filters import parse_filters
from engram.model import Kind, MemoryRecord, Scope, new_id
from engram.pipeline.text import content_hash, terms
from engram.store import Key, Lexical, Query
from engram.store.bm25 import Tokenizer
from engram.store.index.lexicon import FANOUT, Lexicon, Segment, size_class
from engram.store.sqlite import SQLiteStore, lexlog
from engram.store.sqlite import sql as sqlite_sql

NOW = datetime(2025, 6, 1, 12, tzinfo=UTC)
ROOT = Path(__file__).resolve().parent.parent
# Some words in most rows (their IDF is FTS5's floor), names in few, possessives (the phrase
# `carolin s`), numbers split by punctuation (`3 30`), diacritics folded.
COMMON = ["we", "talked", "about", "today", "really", "went"]
WORDS = """hiking ramen lisbon kyoto guitar painting adoption counseling pottery museum
sunrise beach camping violin marathon café résumé co-op 3:30 o'clock festival""".split()
NAMES = ["Caroline's", "Melanie", "Jon's", "Gina", "Deborah's", "Maria"]
SCOPES = [Scope("u1"), Scope("u1", session_id="s2"), Scope("u2"), Scope("u1", agent_id="a"),
          Scope("u0")]  # u0's scope token ends in "e", which the stemmer drops (`...dce`)


def sentence(rng: random.Random) -> str:
    words = rng.sample(COMMON, rng.randint(2, 5)) + rng.choices(WORDS, k=rng.randint(1, 6))
    words.insert(rng.randrange(len(words) + 1), rng.choice(NAMES))
    rng.shuffle(words)
    return " ".join(words) + "."


def record(text: str, scope: Scope, rng: random.Random, **fields: object) -> MemoryRecord:
    at = NOW - timedelta(minutes=rng.randint(1, 10_000))
    base: dict[str, object] = dict(
        id=new_id(), scope=scope, kind=Kind.EPISODIC, text=text, metadata={"n": rng.randint(0, 3)},
        importance=0.5, created_at=at, updated_at=at, valid_from=at, content_hash=content_hash(text))
    base.update(fields)
    return MemoryRecord(**base)  # type: ignore[arg-type]


def fill(store: SQLiteStore, n: int, rng: random.Random) -> list[MemoryRecord]:
    recs = []
    prev = ""
    with store.write() as tx:
        for i in range(n):
            r = record(sentence(rng), SCOPES[i % len(SCOPES)], rng)
            v = np.asarray([rng.random() for _ in range(4)], dtype=np.float32)
            tx.insert(r, [Key("text", v / np.linalg.norm(v))], Lexical(r.text, prev))
            prev = r.text if i % 7 else ""
            recs.append(r)
    return recs


def fts5(store: SQLiteStore, q: Query, words: list[str], k: int, w: float) -> list[tuple[str, float]]:
    """The statement's path: FTS5 finds the rows and counts the statistics, bm25.py scores."""
    with closing(Tokenizer()) as tokenizer:
        return sqlite_sql.lexical_hits(store._read(*sqlite_sql.lexical(q, words)), tokenizer,
                                       words, k, w)


def queries(rng: random.Random, n: int) -> list[list[str]]:
    out = []
    vocab = COMMON + WORDS + NAMES + ["absent", "o'neil's"]
    for _ in range(n):
        out.append(terms(" ".join(rng.sample(vocab, rng.randint(1, 4)))) or ["ramen"])
    return out


def same(a: list[tuple[str, float]], b: list[tuple[str, float]], k: int) -> None:
    """Equal scores, position by position, and the same memories except where a tie at the
    cut leaves FTS5's choice among equals open."""
    assert len(a) == len(b)
    assert [s for _, s in a] == pytest.approx([s for _, s in b], abs=1e-9, rel=0)
    if not a:
        return
    cut = b[-1][1] if len(b) == k else -1.0
    assert {m for m, s in a if s > cut + 1e-9} == {m for m, s in b if s > cut + 1e-9}
    got, want = dict(a), dict(b)
    for mid in set(got) & set(want):
        assert got[mid] == pytest.approx(want[mid], abs=1e-9, rel=0)


def check(store: SQLiteStore, rng: random.Random, n: int = 60) -> int:
    """Compare both paths over `n` queries in every scope; the number of hits compared."""
    compared = 0
    for words in queries(rng, n):
        for scope in [*SCOPES, Scope()]:
            for k, w in ((5, 0.5), (40, 0.3), (10_000, 0.5)):
                q = Query(scope=scope, now=NOW)
                ours = store.lexical(q, words, k, w)
                theirs = fts5(store, q, words, k, w)
                same(ours, theirs, k)
                compared += len(ours)
    store.wait_for_saves()  # the index's file is saved off the searching thread
    return compared


@pytest.fixture
def store(tmp_path: Path) -> SQLiteStore:
    s = SQLiteStore(tmp_path / "lex.db", lexicon_threshold=0)
    yield s
    s.close()


def test_scores_equal_fts5_bm25(store: SQLiteStore) -> None:
    rng = random.Random(1)
    fill(store, 600, rng)
    assert check(store, rng) > 10_000
    lex = store._follower.lexicon
    assert lex is not None and lex.count == 600  # the in-memory path answered
    # FTS5's own N and token total (its averages record) are what the index counts
    (block,), = store._read("SELECT block FROM memory_fts_data WHERE id = 1")
    assert sqlite_sql.fts_row_count(block) == lex.count


def test_idf_floor_for_terms_in_most_rows(store: SQLiteStore) -> None:
    rng = random.Random(2)
    fill(store, 200, rng)
    with store.write() as tx:  # "went" in nearly every row: FTS5's IDF is then 1e-6
        for i in range(300):
            r = record(f"we went {i}", SCOPES[0], rng)
            tx.insert(r, [Key("text", np.ones(4, dtype=np.float32) / 2)], Lexical(r.text))
    q = Query(scope=SCOPES[0], now=NOW)
    ours, theirs = store.lexical(q, ["went"], 50, 0.5), fts5(store, q, ["went"], 50, 0.5)
    same(ours, theirs, 50)
    assert 0 < ours[0][1] < 1e-5


def test_equal_after_deletes_updates_and_erasures(store: SQLiteStore) -> None:
    rng = random.Random(3)
    recs = fill(store, 500, rng)
    check(store, rng, 10)  # builds the index
    with store.write() as tx:
        tx.soft_delete([r.id for r in recs[:60]], NOW)
        tx.erase([r.id for r in recs[60:90]])
        for r in recs[90:150]:
            new = sentence(rng)
            tx.update(replace(r, text=new), None, Lexical(new, "ramen ramen"))
    assert store._follower.lexicon is None  # an erasure drops it (its vocabulary may hold erased words)
    check(store, rng, 5)
    with store.write() as tx:  # followed through the log
        tx.soft_delete([r.id for r in recs[150:170]], NOW)
        for r in recs[170:200]:
            new = sentence(rng)
            tx.update(replace(r, text=new), None, Lexical(new, "ramen ramen"))
    fill(store, 100, rng)
    check(store, rng, 40)
    lex = store._follower.lexicon
    assert lex is not None
    (block,), = store._read("SELECT block FROM memory_fts_data WHERE id = 1")
    assert lex.count == sqlite_sql.fts_row_count(block) == 500 - 110 + 100


def test_other_writers_are_followed(store: SQLiteStore, tmp_path: Path) -> None:
    rng = random.Random(4)
    recs = fill(store, 300, rng)
    check(store, rng, 5)
    other = SQLiteStore(tmp_path / "lex.db", lexicon_threshold=0)
    try:
        fill(other, 200, rng)
        with other.write() as tx:
            tx.soft_delete([r.id for r in recs[:100]], NOW)
    finally:
        other.close()
    # another process too: it indexes rows the way any writer does
    script = textwrap.dedent(f"""
        import random, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_lexicon import fill
        from engram.store.sqlite import SQLiteStore
        s = SQLiteStore({str(tmp_path / 'lex.db')!r})
        recs = fill(s, 150, random.Random(5))
        with s.write() as tx:
            tx.erase([r.id for r in recs[:20]])
        s.close()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT)
    check(store, rng, 40)
    lex = store._follower.lexicon
    assert lex is not None and lex.count == 300 - 100 + 200 + 150 - 20


def test_many_small_writes_merge_their_segments(store: SQLiteStore) -> None:
    rng = random.Random(12)
    fill(store, 400, rng)
    for i in range(30):  # a search after every small write: a segment each, merged as they pile up
        recs = fill(store, 3 + i, rng)
        if i % 4 == 0:
            with store.write() as tx:
                tx.soft_delete([recs[0].id], NOW)
        check(store, rng, 1)
        lex = store._follower.lexicon
        assert lex is not None
        classes = Counter(size_class(len(seg.docs)) for seg in lex.segments)
        assert max(classes.values()) < FANOUT  # a size class of FANOUT segments is merged
    check(store, rng, 30)


def test_a_small_write_merges_only_segments_as_small_as_its_own() -> None:
    """Merged by size class: the segments of a build stay as they are while small writes add
    their own, each posting is rewritten about log8(postings) times, and the merged index
    scores as one built at once."""
    rng = random.Random(15)

    def doc(i: int) -> tuple[int, str, list[str], list[str], list[str]]:
        body = [rng.choice(WORDS).lower() for _ in range(rng.randint(3, 12))]
        return i, f"m{i}", body, body[:2], ["o1"]

    merges: list[int] = []
    lex = Lexicon()
    merged = Segment.merged
    try:
        Segment.merged = staticmethod(  # type: ignore[method-assign]
            lambda parts: (merges.append(sum(len(p.docs) for p in parts)), merged(parts))[1])
        build = [doc(i) for i in range(5000)]
        for i in range(0, len(build), 1000):  # a build's batches, merged once
            lex.add_tokens(build[i:i + 1000], merge=False)
        lex.merge()
        large = list(lex.segments)
        assert len(large) == 5 and not merges
        written = [doc(5000 + i) for i in range(300)]
        for d in written:  # a write of one document at a time
            lex.add_tokens([d])
            assert max(Counter(size_class(len(s.docs)) for s in lex.segments).values()) < FANOUT
        assert all(any(s is seg for s in lex.segments) for seg in large)  # never merged
        postings = sum(len(s.docs) for s in lex.segments)
        assert sum(merges) < 4 * postings  # each posting merged a few times, not per write
        assert max(merges) < sum(len(s.docs) for s in large)
    finally:
        Segment.merged = merged  # type: ignore[method-assign]
    once = Lexicon()
    once.add_tokens(build + written)
    try:
        for words in queries(random.Random(16), 40):
            for size in (5, 100):
                a, b = lex.top(words, ["o1"], size, 0.5), once.top(words, ["o1"], size, 0.5)
                assert a[1].tolist() == b[1].tolist()
    finally:
        lex.close()
        once.close()


def test_the_top_skips_scoring_what_cannot_enter_it(
        store: SQLiteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Lexicon.top` scores a common word's postings only for the documents a rarer word
    already found (MaxScore), and returns what scoring every match gives: the same scores,
    float for float, and the same documents wherever the cut is not a tie."""
    rng = random.Random(13)
    fill(store, 1500, rng)
    q = Query(scope=Scope(), now=NOW)
    store.lexical(q, ["ramen"], 10, 0.5)
    lex = store._follower.lexicon
    assert lex is not None
    scored: list[int] = []
    accumulate = lex._accumulate
    monkeypatch.setattr(lex, "_accumulate", lambda score, docs, *a: (
        scored.append(len(docs)), accumulate(score, docs, *a))[1])

    def everything(words: list[str], owners: list[str]) -> dict[int, float]:
        """Each matching document's score, every posting scored (the order of the terms)."""
        ranked = lex.top(words, owners, lex.n, 0.5)  # a cut below every match prunes nothing
        assert ranked is not None
        return dict(zip(ranked[0].tolist(), ranked[1].tolist(), strict=True))

    # "went" is in nearly every row (IDF 1e-6): its postings are looked up, not scored
    words = terms("went lisbon kyoto")
    full = everything(words, [])
    postings = sum(len(lex._postings(lex._phrase_key(lex.query_tokens.phrase(w))) [0])
                   for w in words)
    scored.clear()
    docs, got = lex.top(words, [], 20, 0.5)
    assert sum(scored) < postings // 2
    assert got.tolist() == sorted(full.values(), reverse=True)[:20]
    assert all(full[d] == s for d, s in zip(docs.tolist(), got.tolist(), strict=True))
    # a cut that asks for more phrases scores only the documents they bring, each once
    rounds: list[np.ndarray] = []
    monkeypatch.setattr(lex, "_accumulate", lambda score, docs, *a: (
        rounds.append(docs.copy()), accumulate(score, docs, *a))[1])
    again = 0
    for words in queries(rng, 60):
        for owners in ([], sqlite_sql.owner_tokens(SCOPES[0])):
            full = everything(words, owners)
            for size in (1, 7, 40):
                rounds.clear()
                docs, got = lex.top(words, owners, size, 0.5)
                want = sorted(full.values(), reverse=True)[:size]
                assert got.tolist() == want
                assert all(full[d] == s for d, s in zip(docs.tolist(), got.tolist(), strict=True))
                n = len([w for w in words if lex.query_tokens.phrase(w)])  # a call each a round
                assert len(rounds) % n == 0
                for j in range(n):
                    each = np.concatenate(rounds[j::n])
                    assert len(np.unique(each)) == len(each)
                again += len(rounds) > n
    assert again  # some cuts took more than one round


def test_visibility_kinds_and_filters_as_in_sql(store: SQLiteStore) -> None:
    rng = random.Random(6)
    recs = fill(store, 400, rng)
    with store.write() as tx:
        for r in recs[:80]:  # expired, or not valid yet: invisible to a search now
            tx.update(replace(r, expires_at=NOW - timedelta(days=1)))
    for words in queries(rng, 30):
        for q in (Query(scope=SCOPES[0], now=NOW, kinds=(Kind.EPISODIC,)),
                  Query(scope=SCOPES[0], now=NOW, conditions=parse_filters({"n": {"gte": 2}})),
                  Query(scope=Scope("u1"), now=NOW, as_of=NOW - timedelta(days=3))):
            same(store.lexical(q, words, 20, 0.5), fts5(store, q, words, 20, 0.5), 20)


def test_falls_back_to_fts5_inside_a_write(store: SQLiteStore) -> None:
    rng = random.Random(7)
    fill(store, 100, rng)
    q = Query(scope=SCOPES[0], now=NOW)
    store.lexical(q, ["ramen"], 10, 0.5)
    assert store._follower.lexicon is not None
    r = record("zebra crossing", SCOPES[0], rng)
    with store.write() as tx:
        tx.insert(r, [Key("text", np.ones(4, dtype=np.float32) / 2)], Lexical(r.text))
        # the write's own row, uncommitted: FTS5 sees it
        assert [m for m, _ in store.lexical(q, ["zebra"], 10, 0.5)] == [r.id]
    same(store.lexical(q, ["a-b-c", "zebra"], 10, 0.5), fts5(store, q, ["a-b-c", "zebra"], 10, 0.5), 10)


def test_phrases_of_three_tokens_or_more_are_counted_as_fts5_counts_them(
        store: SQLiteStore, tmp_path: Path) -> None:
    """`o'neil's` is the phrase `o neil s`: the lexicon finds it in the documents holding
    each of its pairs and counts it in their tokens, so it scores as FTS5's statement does
    (overlapping occurrences too: `s's's` twice in `s s s s`), never a document holding the
    pairs apart, after deletes and updates, and from its saved file."""
    rng = random.Random(14)
    fill(store, 300, rng)
    said = [("we met o'neil's friend at o'neil's place", ""), ("o neil went, neil s later", "o'neil's"),
            ("neil's o'neil, kyoto", ""), ("s s s s", "s s"), ("rock'n'roll'n'roll rock'n'roll", ""),
            ("O'Neil's, then o'neil's and O’NEIL’S", "rock'n'roll"), ("the o'neil's", "o'neil's o'neil's"),
            ("ramen at o'neil's place today", "we went to o'neil's")]
    recs = []
    with store.write() as tx:
        for i, (text, prev) in enumerate(said * 3):
            r = record(text, SCOPES[i % 2], rng)
            tx.insert(r, [Key("text", np.ones(4, dtype=np.float32) / 2)], Lexical(text, prev))
            recs.append(r)
    asked = [["o'neil's"], ["o'neil's", "went"], ["s's's"], ["s's's's's"], ["rock'n'roll'n'roll"],
             ["o'neil's place", "ramen"], ["neil's o'neil"], ["x'y'z"], ["ramen", "o'neil's", "today"],
             ["rock'n'roll", "o'neil's", "s's's"]]

    def compare(s: SQLiteStore) -> None:
        s.lexical(Query(scope=Scope(), now=NOW), ["ramen"], 1, 0.5)  # brought up to date
        lex = s._follower.lexicon
        assert lex is not None
        for words in asked:
            for scope in (SCOPES[0], SCOPES[1], Scope()):
                q = Query(scope=scope, now=NOW)
                for k, w in ((3, 0.5), (40, 0.3), (1000, 0.0)):
                    theirs = fts5(s, q, words, k, w)
                    ranked = lex.ranked(words, sqlite_sql.owner_tokens(scope), k, w)  # the lexicon's own
                    same(list(zip(ranked.ids, ranked.scores, strict=True)), theirs, k)
                    same(s.lexical(q, words, k, w), theirs, k)
        assert fts5(s, Query(scope=Scope(), now=NOW), ["o'neil's"], 1000, 0.5)  # found at all

    compare(store)
    with store.write() as tx:  # followed through the log
        tx.soft_delete([recs[0].id, recs[7].id], NOW)
        tx.update(replace(recs[2], text="o'neil's o'neil's"), None,
                  Lexical("o'neil's o'neil's", "s s s"))
    fill(store, 20, rng)
    compare(store)
    store.wait_for_saves()
    again = SQLiteStore(tmp_path / "lex.db", lexicon_threshold=0)
    try:
        compare(again)  # from its file, caught up
    finally:
        again.close()


def test_a_search_pool_runs_its_lexical_side_beside_the_dense_one(
        store: SQLiteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a large scope `pool` hands the lexical ranking to the store's helper thread while
    its own thread searches the dense keys (then checks what the query may see of it), and
    answers what one thread doing both answers. It keeps both on its own thread for a small
    scope, when the helper is taken (searches never queue for it) and inside a write, whose
    uncommitted rows only its own connection sees."""
    from engram.store.base import StoreBase

    rng = random.Random(11)
    fill(store, 300, rng)
    q = Query(scope=SCOPES[0], now=NOW)
    vector = np.ones(4, dtype=np.float32) / 2
    where: list[str] = []

    def traced(name: str) -> None:
        original = getattr(store, name)

        def call(*a: object, **kw: object) -> object:
            where.append(threading.current_thread().name)
            return original(*a, **kw)
        monkeypatch.setattr(store, name, call)

    traced("lexical")  # the whole lexical side on the caller's thread
    traced("_lexical_ranked")  # the helper's half

    def pool(words: list[str]) -> dict[str, list[tuple[str, float]]]:
        return store.pool(q, 20, vector=vector, keys=["text"], terms=words, previous_weight=0.5)

    pool(["ramen"])
    assert where == ["MainThread"]  # 300 keys: below the ANN threshold, nothing to gain
    where.clear()
    monkeypatch.setattr(store, "_large", lambda query: True)
    for words in queries(rng, 20):
        alone = StoreBase.pool(store, q, 20, vector=vector, keys=["text"], terms=words)
        assert pool(words) == alone and alone["lexical"] and alone["text"]
    assert where[0::2] == ["MainThread"] * 20  # StoreBase.pool: the caller's thread
    assert {w.split("_")[0] for w in where[1::2]} == {"engram-search"}
    where.clear()
    assert store._helper_free.acquire(blocking=False)  # another search holds the helper
    pool(["ramen"])
    store._helper_free.release()
    r = record("zebra crossing", SCOPES[0], rng)
    with store.write() as tx:
        tx.insert(r, [Key("text", vector)], Lexical(r.text))
        assert [m for m, _ in pool(["zebra"])["lexical"]] == [r.id]  # the write's own row
    assert where == ["MainThread", "MainThread"]
    monkeypatch.setattr(store, "_lexical_ranked", lambda *a, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # the helper's error is the search's
        pool(["ramen"])
    assert store._helper_free.acquire(blocking=False)  # and the helper is free again
    store._helper_free.release()


def test_a_lexical_ranking_the_query_cannot_see_enough_of_is_searched_again(
        store: SQLiteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper ranks a first pool of k + k/8 + 32; when the query may see fewer than k of
    them (expired memories rank first here), the searching thread searches again in growing
    pools, as a search on one thread does, and finds the visible ones."""
    from engram.store.base import StoreBase

    rng = random.Random(12)
    fill(store, 100, rng)
    gone = NOW - timedelta(days=1)
    expired = [record("zebra", SCOPES[0], rng, expires_at=gone) for _ in range(60)]
    kept = [record(f"a zebra crossing near the old {w} station", SCOPES[0], rng)
            for w in ("north", "south", "east")]
    vector = np.ones(4, dtype=np.float32) / 2
    with store.write() as tx:
        for r in expired + kept:
            tx.insert(r, [Key("text", vector)], Lexical(r.text))
    monkeypatch.setattr(store, "_large", lambda query: True)
    q = Query(scope=SCOPES[0], now=NOW)
    ranked = store._lexical_ranked(q, ["zebra"], 2, 0.5)
    assert ranked is not None and not ranked.whole and len(ranked.ids) == 34
    assert not {r.id for r in kept} & set(ranked.ids)  # the first pool: expired ones only
    found = store.pool(q, 2, vector=vector, keys=["text"], terms=["zebra"], previous_weight=0.5)
    assert {m for m, _ in found["lexical"]} <= {r.id for r in kept}
    assert len(found["lexical"]) == 2
    assert found == StoreBase.pool(store, q, 2, vector=vector, keys=["text"], terms=["zebra"])


def test_small_databases_stay_on_fts5(tmp_path: Path) -> None:
    s = SQLiteStore(tmp_path / "small.db", lexicon_threshold=1000)
    try:
        fill(s, 200, random.Random(8))
        assert s.lexical(Query(scope=SCOPES[0], now=NOW), ["ramen"], 10, 0.5)
        assert s._follower.lexicon is None
        fill(s, 900, random.Random(9))
        s.lexical(Query(scope=SCOPES[0], now=NOW), ["ramen"], 10, 0.5)
        assert s._follower.lexicon is not None and s._follower.lexicon.count == 1100
    finally:
        s.close()


def test_insert_many_writes_what_insert_writes(tmp_path: Path) -> None:
    rng = random.Random(10)
    rows = []
    for i in range(50):
        r = record(sentence(rng), SCOPES[i % len(SCOPES)], rng)
        v = np.asarray([rng.random() for _ in range(4)], dtype=np.float32)
        rows.append((r, [Key("text", v), Key("window", v[::-1].copy())], Lexical(r.text, f"prev {i}")))
    one, many = SQLiteStore(tmp_path / "one.db"), SQLiteStore(tmp_path / "many.db")
    try:
        for s in (one, many):
            fill(s, 5, random.Random(11))  # rows before: the rids continue after them
        with one.write() as tx:
            for row in rows:
                tx.insert(*row)
        with many.write() as tx:
            tx.insert_many(rows)
        tables = ["SELECT rid, * FROM memories WHERE rid > 5 ORDER BY rid",
                  "SELECT rowid, body, context, owner FROM memory_fts WHERE rowid > 5 ORDER BY rowid",
                  "SELECT seq, memory_id, kind, vector FROM memory_keys WHERE seq > 5 ORDER BY seq",
                  "SELECT * FROM lex_log WHERE id > 5 ORDER BY id", "SELECT * FROM meta ORDER BY name"]
        for q in tables:
            got, want = many._read(q), one._read(q)
            assert got == want and got, q
        q = Query(scope=SCOPES[0], now=NOW)
        got, want = (s.lexical(q, ["ramen", "lisbon"], 20, 0.5) for s in (many, one))
        assert [s for _, s in got] == [s for _, s in want] and got
    finally:
        one.close()
        many.close()


# -- the log's horizon and the saved index --------------------------------------------------

def log_rows(store: SQLiteStore) -> int:
    return int(store._read("SELECT count(*) FROM lex_log")[0][0])


def loaded(caplog: pytest.LogCaptureFixture) -> bool:
    return any("loaded the lexical index" in r.getMessage() for r in caplog.records)


def test_the_log_stays_bounded_and_an_index_past_its_horizon_rebuilds(tmp_path: Path) -> None:
    rng = random.Random(13)
    path = tmp_path / "lex.db"
    writer = SQLiteStore(path, lexicon_threshold=0, lexicon_log=50)
    other = SQLiteStore(path, lexicon_threshold=0, lexicon_log=50)  # another process's index
    try:
        recs = fill(writer, 200, rng)
        check(other, rng, 3)
        behind = other._follower.lexicon
        assert behind is not None
        for i in range(60):  # small writes, the way an agent writes: each logs its rows
            fill(writer, 7, rng)
            if i % 5 == 0:
                with writer.write() as tx:
                    tx.soft_delete([recs[i].id], NOW)
                    tx.update(replace(recs[i + 100], text="ramen kyoto"), None,
                              Lexical("ramen kyoto", "hiking"))
            assert log_rows(writer) <= 50 + 7
        (horizon,), = writer._read("SELECT value FROM meta WHERE name = 'lex_horizon'")
        assert horizon > behind.version  # the other index cannot replay what it missed
        writer._forget_lexicon_files()     # ... nor load a file: it is built again
        check(other, rng, 30)
        assert other._follower.lexicon is not None and other._follower.lexicon is not behind
        (block,), = other._read("SELECT block FROM memory_fts_data WHERE id = 1")
        assert other._follower.lexicon.count == sqlite_sql.fts_row_count(block) == 200 + 420 - 12
        # the position survives a log pruned to nothing (every entry at or below the horizon)
        with writer.write() as tx:
            tx.conn.execute("DELETE FROM lex_log")
        (last, *_), = writer._read(lexlog.STATE)
        assert last == writer._read("SELECT value FROM meta WHERE name = 'lex_horizon'")[0][0]
        fill(writer, 5, rng)
        check(other, rng, 5)
        assert other._follower.lexicon.count == 200 + 420 - 12 + 5
    finally:
        writer.close()
        other.close()


def test_a_saved_index_is_loaded_and_caught_up_by_a_new_store(
        store: SQLiteStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="engram.store")
    rng = random.Random(14)
    recs = fill(store, 600, rng)
    check(store, rng, 3)  # builds it, and saves it
    file = tmp_path / "lex.db.lexicon"
    assert file.exists() and store._read("SELECT value FROM meta WHERE name = 'lex_file'")[0][0]
    assert not list(tmp_path.glob("lex.db.lexicon.tmp*"))
    new = SQLiteStore(tmp_path / "lex.db", lexicon_threshold=0)
    try:
        check(new, rng, 30)
        assert loaded(caplog)
        assert new._follower.lexicon is not None and new._follower.lexicon.count == 600
    finally:
        new.close()
    # stale: written to since it was saved; the new store loads it and follows the log
    with store.write() as tx:
        tx.soft_delete([r.id for r in recs[:40]], NOW)
        for r in recs[40:60]:
            tx.update(replace(r, text="lisbon ramen"), None, Lexical("lisbon ramen", "ramen"))
    fill(store, 50, rng)
    caplog.clear()
    new = SQLiteStore(tmp_path / "lex.db", lexicon_threshold=0)
    try:
        check(new, rng, 30)
        assert loaded(caplog) and new._follower.lexicon is not None and new._follower.lexicon.count == 610
    finally:
        new.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "foreign", "older"])
def test_a_corrupt_or_foreign_file_is_rebuilt_never_trusted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    caplog.set_level("INFO", logger="engram.store")
    rng = random.Random(15)
    path, file = tmp_path / "lex.db", tmp_path / "lex.db.lexicon"
    s = SQLiteStore(path, lexicon_threshold=0)
    try:
        recs = fill(s, 300, rng)
        check(s, rng, 2)
        data = file.read_bytes()
        if damage == "flip":  # one bit in the postings
            file.write_bytes(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1])
                             + data[len(data) // 2 + 1:])
        elif damage == "truncate":
            file.write_bytes(data[:len(data) - 100])
        elif damage == "garbage":
            file.write_bytes(b"not an index at all" * 50)
        elif damage == "foreign":  # another database's index, with other rows
            other = SQLiteStore(tmp_path / "other.db", lexicon_threshold=0)
            fill(other, 350, random.Random(99))
            check(other, rng, 1)
            other.close()
            (tmp_path / "other.db.lexicon").replace(file)
        else:  # an older save of this database (a restored copy of the file)
            with s.write() as tx:
                tx.soft_delete([r.id for r in recs[:30]], NOW)
            s._save_lexicon(s._follower.lexicon)  # type: ignore[arg-type]
            s.wait_for_saves()
            file.write_bytes(data)
        caplog.clear()
        new = SQLiteStore(path, lexicon_threshold=0)
        try:
            check(new, rng, 20)
            assert not loaded(caplog)
            assert any("built the lexical index" in r.getMessage() for r in caplog.records)
            assert new._follower.lexicon is not None
            assert new._follower.lexicon.count == (270 if damage == "older" else 300)
        finally:
            new.close()
        # ... and saved again: the next store loads the rebuilt one
        caplog.clear()
        again = SQLiteStore(path, lexicon_threshold=0)
        try:
            check(again, rng, 3)
            assert loaded(caplog)
        finally:
            again.close()
    finally:
        s.close()


def side_files(tmp_path: Path) -> list[Path]:
    return [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(
        (".db", ".db-wal", ".db-shm"))]


def test_an_erasure_leaves_no_word_in_a_side_file(tmp_path: Path) -> None:
    rng = random.Random(16)
    path, canary = tmp_path / "lex.db", "zqxcanaryword"
    s = SQLiteStore(path, lexicon_threshold=0)
    other = SQLiteStore(path, lexicon_threshold=0)  # another process, its index built before
    try:
        fill(s, 200, rng)
        secret = record(f"my {canary} is here", SCOPES[0], rng)
        with s.write() as tx:
            tx.insert(secret, [Key("text", np.ones(4, dtype=np.float32) / 2)],
                      Lexical(secret.text))
        q = Query(scope=SCOPES[0], now=NOW)
        assert [m for m, _ in s.lexical(q, [canary], 5, 0.5)] == [secret.id]
        assert [m for m, _ in other.lexical(q, [canary], 5, 0.5)] == [secret.id]
        s.wait_for_saves()
        other.wait_for_saves()
        assert any(canary.encode() in p.read_bytes() for p in side_files(tmp_path))  # it can fail
        stale = other._follower.lexicon
        assert stale is not None
        with s.write() as tx:
            tx.erase([secret.id])
        assert not any(canary.encode() in p.read_bytes() for p in side_files(tmp_path))
        # the other process's index predates the erasure: it never names a file again...
        other._save_lexicon(stale)
        other.wait_for_saves()
        assert not any(canary.encode() in p.read_bytes() for p in side_files(tmp_path))
        assert s._read("SELECT value FROM meta WHERE name = 'lex_file'")[0][0] == 0
        # ... and its next search drops it, and builds (and saves) one without the word
        assert other.lexical(q, [canary], 5, 0.5) == []
        assert other._follower.lexicon is not stale and other._follower.lexicon is not None
        assert canary not in other._follower.lexicon.vocab
        other.wait_for_saves()
        assert (tmp_path / "lex.db.lexicon").exists()
        assert not any(canary.encode() in p.read_bytes() for p in side_files(tmp_path))
    finally:
        s.close()
        other.close()


def test_a_file_the_database_no_longer_names_goes_when_a_store_opens(tmp_path: Path) -> None:
    rng = random.Random(17)
    path, file = tmp_path / "lex.db", tmp_path / "lex.db.lexicon"
    s = SQLiteStore(path, lexicon_threshold=0)
    recs = fill(s, 100, rng)
    check(s, rng, 1)
    assert file.exists()
    # an erasure whose process died between its commit and removing the file
    s._read("SELECT 1")
    with s.connections.transaction() as conn:
        conn.execute("DELETE FROM memories WHERE id = ?", (recs[0].id,))
    s.close()
    assert file.exists()
    SQLiteStore(path, lexicon_threshold=0).close()
    assert not file.exists()


def test_no_saved_index_beside_an_encrypted_database(tmp_path: Path) -> None:
    pytest.importorskip("sqlcipher3")
    rng = random.Random(18)
    path, file = tmp_path / "enc.db", tmp_path / "enc.db.lexicon"
    file.write_bytes(b"left from when it was plain")
    s = SQLiteStore(path, key="a passphrase", lexicon_threshold=0)
    try:
        assert not file.exists()  # removed at open
        fill(s, 150, rng)
        check(s, rng, 10)  # the index is in memory, and answers as FTS5 does
        assert s._follower.lexicon is not None and s._follower.lexicon.count == 150
        assert not list(tmp_path.glob("enc.db.lexicon*"))
    finally:
        s.close()

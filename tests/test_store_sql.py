"""The SQL both stores build, checked without a database: every statement binds exactly its
parameters in either dialect, PostgreSQL's always start with the tenant, and the visibility
rule's time bounds are what `Query` documents."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engram.filters import parse_filters
from engram.model import Job, JobStatus, Kind, MemoryRecord, Scope, Session
from engram.store import Query, Seen, Select, bm25
from engram.store import records as r
from engram.store.postgres import sql as pg
from engram.store.sqlite import schema as lite_schema
from engram.store.sqlite import sql as lite

NOW = datetime(2025, 6, 1, tzinfo=UTC)
DIALECTS = [lite.DIALECT, pg.DIALECT]


def placeholders(d: r.Dialect, sql: str) -> int:
    return len(re.findall(re.escape(d.mark), sql))


names = st.none() | st.sampled_from(["a", "b'c", "ü"])
scopes = st.builds(Scope, names, names, names)
times = st.none() | st.just(NOW) | st.just(NOW - timedelta(days=3))
filters = st.sampled_from([{}, {"topic": "x"}, {"score": {"gte": 3, "lt": 9}},
                           {"topic": {"nin": ["a", None]}}, {"kind": "semantic"},
                           {"created_at": {"gt": NOW}}, {"role": {"in": ["user", "x"]}}])
selects = st.builds(
    Select, scope=scopes, exact=st.booleans(), seen=st.sampled_from(list(Seen)),
    now=st.just(NOW), as_of=times,
    kinds=st.none() | st.lists(st.sampled_from(list(Kind)), min_size=1, max_size=3).map(tuple),
    conditions=filters.map(parse_filters),
    ids=st.none() | st.lists(st.text(min_size=1, max_size=5), max_size=4).map(tuple),
    content_hash=st.none() | st.just("h"), after_id=st.none() | st.just("x"),
    before=st.none() | st.just("e1"), after=st.none() | st.just("e2"),
    order=st.sampled_from([None, "id", "newest", "oldest"]), limit=st.none() | st.integers(0, 9))


@given(sel=selects)
def test_every_memory_read_binds_exactly_its_parameters(sel: Select) -> None:
    for d in DIALECTS:
        for names_ in (r.MEMORY_COLUMNS, ("id",), r.CANDIDATE_COLUMNS):
            sql, params = r.select_memories(d, sel, "tenant-1", names_)
            assert placeholders(d, sql) == len(params), (d.name, sql)
            if d.tenant:
                assert sql.count("m.tenant = %s") == 1 and params[0] == "tenant-1"
                if sel.before or sel.after:  # the anchor's subquery is the tenant's too
                    assert "a.tenant = %s" in sql
            else:
                assert "tenant" not in sql


@given(scope=scopes)
def test_the_other_statements_bind_exactly_their_parameters(scope: Scope) -> None:
    job = Job(id="j", task="add", scope=scope, payload={"x": 1}, status=JobStatus.QUEUED,
              created_at=NOW, updated_at=NOW, run_at=NOW)
    sess = Session(scope=scope, policy={}, created_at=NOW, updated_at=NOW)
    for d in DIALECTS:
        stmts = [r.upsert_job(d, "t", job), r.upsert_session(d, "t", sess),
                 r.select_sessions(d, "t", scope, exact=True, limit=1),
                 r.select_sessions(d, "t", scope, exact=False, limit=5),
                 r.select_jobs(d, "t", scope=scope, status="queued", limit=3),
                 r.select_jobs(d, "t", key="k"), r.select_events(d, "t", "m1"),
                 r.delete_session(d, "t", scope), *r.erase_scope(d, "t", scope),
                 *r.stats_statements(d, "t", scope, NOW).values()]
        for sql, params in stmts:
            assert placeholders(d, sql) == len(params), (d.name, sql)
            assert ("tenant" in sql) is d.tenant, sql
    sql, params = pg.claim_job("t", NOW, NOW)
    assert placeholders(pg.DIALECT, sql) == len(params)


def test_upserts_replace_within_the_tenant() -> None:
    job = Job(id="j", task="add", scope=Scope("u"), payload={}, status=JobStatus.QUEUED,
              created_at=NOW, updated_at=NOW, run_at=NOW)
    assert "ON CONFLICT (tenant, id) DO UPDATE" in r.upsert_job(pg.DIALECT, "t", job)[0]
    assert "ON CONFLICT (id) DO UPDATE" in r.upsert_job(lite.DIALECT, "", job)[0]


@pytest.mark.parametrize(("seen", "as_of", "expected"), [
    (Seen.ALL, None, []),
    (Seen.LIVE, None, []),
    (Seen.UNEXPIRED, None, [("expires_at", ">", NOW)]),
    (Seen.VISIBLE, None, [("expires_at", ">", NOW), ("valid_to", ">", NOW)]),
    (Seen.VISIBLE, NOW - timedelta(days=1),
     [("expires_at", ">", NOW), ("valid_from", "<=", NOW - timedelta(days=1)),
      ("valid_to", ">", NOW - timedelta(days=1))]),
])
def test_time_bounds_of_each_level(seen: Seen, as_of: datetime | None,
                                   expected: list[tuple[str, str, datetime]]) -> None:
    assert [(b.column, b.op, b.at) for b in r.time_bounds(seen, NOW, as_of)] == expected


def test_the_visibility_rule_as_sqlite_renders_it() -> None:
    where, params = r.compile_query(lite.DIALECT, Query(Scope("u"), NOW, kinds=(Kind.SEMANTIC,)), "")
    assert where == ("m.deleted_at IS NULL AND (m.expires_at IS NULL OR m.expires_at > ?) AND "
                     "(m.valid_to IS NULL OR m.valid_to > ?) AND m.user_id = ? AND m.kind IN (?)")
    assert params == [NOW.timestamp(), NOW.timestamp(), "u", "semantic"]
    where, params = r.compile_query(pg.DIALECT, Query(Scope(), NOW, as_of=NOW), "t")
    assert where == ("m.tenant = %s AND m.deleted_at IS NULL AND "
                     "(m.expires_at IS NULL OR m.expires_at > %s) AND "
                     "(m.valid_from IS NULL OR m.valid_from <= %s) AND "
                     "(m.valid_to IS NULL OR m.valid_to > %s)")
    assert params == ["t", NOW, NOW, NOW]


def test_a_read_with_time_bounds_needs_now() -> None:
    with pytest.raises(ValueError, match="needs `now`"):
        r.select_memories(lite.DIALECT, Select(seen=Seen.VISIBLE), "")


# -- the PostgreSQL lexical index (store/bm25.py) ------------------------------------

tokens = st.sampled_from(["marta", "s", "dog", "o'x", "a\\b", "ü"])
phrase_lists = st.lists(st.lists(tokens, min_size=1, max_size=3).map(tuple), min_size=1, max_size=6)


@given(scope=scopes, phrases=phrase_lists, weight=st.sampled_from([0.0, 0.5, 2.0]))
def test_the_bm25_search_binds_exactly_its_parameters(scope: Scope, phrases: list[tuple[str, ...]],
                                                      weight: float) -> None:
    sql, params = pg.lexical("tenant-1", Query(scope, NOW), phrases, 7, weight)
    assert placeholders(pg.DIALECT, sql) == len(params)
    # every table it reads is read within the tenant
    reads = len(re.findall(r"FROM (memories|lex_stats) \w+", sql))
    assert sql.count("tenant = %s") == params.count("tenant-1") == reads
    assert params[-1] == 7 and weight in params


def test_the_lexical_index_statements_bind_exactly_their_parameters() -> None:
    tokenizer = bm25.Tokenizer()
    try:
        doc = bm25.document(tokenizer, "Marta's dog", "Did it run?", Scope("u", None, "s"))
    finally:
        tokenizer.close()
    rec = MemoryRecord(id="m", scope=Scope("u"), kind=Kind.EPISODIC, text="x", metadata={},
                       importance=0.5, created_at=NOW, updated_at=NOW, content_hash="h")
    for sql, params in (pg.insert_memory("t", rec, doc), pg.update_memory("t", rec, doc),
                        pg.update_memory("t", rec, None), pg.count_in("t", doc),
                        pg.count_out("t", ["m", "n"])):
        assert placeholders(pg.DIALECT, sql) == len(params), sql
        assert "t" in params


def test_the_tokens_are_the_sqlite_index_tokens() -> None:
    """The PostgreSQL store tokenises with the SQLite index's own tokenizer, configured alike."""
    ddl = " ".join(s for _, stmts in lite_schema.MIGRATIONS for s in stmts
                   if isinstance(s, str) and "memory_fts" in s)
    assert f"tokenize='{bm25.TOKENIZE}'" in ddl
    tokenizer = bm25.Tokenizer()
    try:
        # possessives and hyphens are phrases; numbers split at punctuation; diacritics and
        # case fold; Porter stems
        assert [tokenizer.phrase(t) for t in ("caroline's", "co-worker", "3:30", "CAFÉ", "running")] \
            == [("carolin", "s"), ("co", "worker"), ("3", "30"), ("cafe",), ("run",)]
        assert tokenizer.phrase("...") == ()
        doc = bm25.document(tokenizer, "Ana: Marta's dog, the dog", "Yes?", Scope("u", None, "s"))
        # stop words stay (they count in the length), as do the two scope tokens SQLite adds
        assert doc.body == "<ana><marta><s><dog><the><dog>" and doc.context == "<ye>"
        assert doc.length == 6 + 1 + 2
        assert doc.terms == sorted({"ana", "marta", "s", "dog", "the", "ye", "ana marta",
                                    "marta s", "s dog", "dog the", "the dog"})
    finally:
        tokenizer.close()


def test_phrases_that_overlap_themselves() -> None:
    assert bm25.overlaps_itself(("s", "s")) and bm25.overlaps_itself(("a", "b", "a"))
    assert not bm25.overlaps_itself(("marta", "s")) and not bm25.overlaps_itself(("s",))
    assert bm25.keys(("o", "neil", "s")) == ["o neil", "neil s"] and bm25.keys(("dog",)) == ["dog"]
    assert bm25.idf(10, 9) == bm25.MIN_IDF and bm25.idf(10, 1) > 1

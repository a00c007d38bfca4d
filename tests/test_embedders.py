"""The local embedder under concurrency: callers share forward passes and get their own rows."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from engram.providers.embedders import MiniLM


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

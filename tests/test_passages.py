"""pipeline/passages.py without a database: where a long text is cut, and how the dense
retriever's best key is chosen. The tokens come from the real MiniLM tokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.model import Kind, MemoryRecord, Scope, utcnow
from engram.pipeline import passages
from engram.providers.embedders import MiniLM
from engram.store import Key

SIZE = 254  # MiniLM's 256 tokens less [CLS] and [SEP]


def record(text: str, name: str | None = None) -> MemoryRecord:
    now = utcnow()
    return MemoryRecord(id=f"m{abs(hash(text))}", scope=Scope("u"), kind=Kind.EPISODIC,
                        text=text, metadata={}, importance=0.5, created_at=now, updated_at=now,
                        name=name)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=3000), st.integers(8, 300),
       st.integers(0, 64))
@settings(max_examples=300, deadline=None)
def test_windows_cover_every_token_within_the_size(strength: list[int], size: int,
                                                   overlap: int) -> None:
    found = passages.windows(strength, size, overlap, limit=10_000)
    assert found[0][0] == 0 and found[-1][1] == len(strength)
    for (a, b), (c, d) in zip(found, found[1:], strict=False):
        assert a < c <= b < d  # forward, no gap, overlapping at most ...
        assert b - c <= overlap  # ... `overlap` tokens
    assert all(0 < b - a <= size for a, b in found)
    assert all(b - a >= size // 2 for a, b in found[:-1])  # no window wastefully short


def test_windows_end_at_the_strongest_break_and_restart_at_a_sentence() -> None:
    # sentences of 30 tokens (2 at each start), a paragraph after the fifth
    strength = [1] * 400
    for i in range(0, 400, 30):
        strength[i] = 2
    strength[150] = 3
    found = passages.windows(strength, 200, overlap=48)
    assert found[0] == (0, 150)  # the paragraph, not the last sentence before 200
    assert found[1][0] == 150  # a paragraph needs no overlap
    second_end = found[1][1]
    assert strength[second_end] == 2 and second_end == 330  # the last sentence start in reach
    assert found[2][0] == 300  # the cut sentence read again from its start


def test_the_cap_keeps_the_first_passages() -> None:
    found = passages.windows([1] * 100_000, 254, limit=passages.MAX_PASSAGES + 1)
    assert len(found) == passages.MAX_PASSAGES + 1


@pytest.fixture(scope="module")
def tokens(embedder: MiniLM) -> MiniLM:
    return embedder


def test_a_short_text_has_no_passages(tokens: MiniLM) -> None:
    text = "Ana moved to Lisbon in May."
    assert passages.cut(text, tokens.token_spans([text])[0], SIZE) == []
    assert passages.of(tokens, [record(text), record("x " * 200)]) == {}  # 200 tokens fit


def test_a_long_text_is_cut_past_its_first_window_at_sentences(tokens: MiniLM) -> None:
    sentences = [f"Sentence number {i} talks about topic {i} in a few more words." for i in range(80)]
    text = " ".join(sentences)
    spans = tokens.token_spans([text])[0]
    found = passages.cut(text, spans, SIZE)
    assert len(found) >= 3
    assert all(p.startswith("Sentence number") for p in found)  # each starts a sentence ...
    assert all(p.endswith(".") for p in found)  # ... and ends one
    # each fits the window, and together with the first window they hold every sentence
    assert max(len(s) for s in tokens.token_spans(found)) <= SIZE
    first = text[:spans[SIZE - 1][1]]
    assert all(any(s in part for part in [first, *found]) for s in sentences)


def test_code_is_cut_between_blocks_and_lines(tokens: MiniLM) -> None:
    prose = " ".join(f"We discussed option {i} of the deployment in some detail." for i in range(20))
    code = "\n".join(f"    result_{i} = compute(value_{i}, factor={i})" for i in range(60))
    text = f"{prose}\n\n```python\n{code}\n```\n\nThat is all for the script."
    found = passages.cut(text, tokens.token_spans([text])[0], SIZE)
    assert found
    for p in found:
        assert p.startswith(("```", "result_", "That is")), p[:40]  # a line (its indent aside)


def test_a_speakers_name_starts_every_passage(tokens: MiniLM) -> None:
    rec = record(" ".join(f"Part {i} of a long story about the garden." for i in range(100)),
                 name="Ana")
    found = passages.of(tokens, [rec])[rec.id]
    assert found and all(p.startswith("Ana: Part ") for p in found)
    assert max(len(s) for s in tokens.token_spans(found)) <= SIZE


def test_an_embedder_that_does_not_tell_its_tokens_makes_no_passages() -> None:
    class Remote:
        name, dim = "remote", 3

        def embed_batch(self, texts: Any) -> np.ndarray:
            raise AssertionError("not called")

    assert passages.of(Remote(), [record("word " * 5000)]) == {}


def test_a_wrapped_embedder_tells_the_tokens_of_the_one_it_wraps(tokens: MiniLM) -> None:
    class Wrapper:
        name, dim = "wrapper", 384

        def __init__(self, inner: MiniLM) -> None:
            self.inner = inner

    rec = record("word " * 1000)
    assert passages.of(Wrapper(tokens), [rec]) == passages.of(tokens, [rec])


@given(st.dictionaries(st.sampled_from("abcdefgh"), st.floats(-1, 1), max_size=8),
       st.dictionaries(st.sampled_from("abcdefgh"), st.floats(-1, 1), max_size=8),
       st.integers(1, 8))
def test_closest_is_the_best_k_by_the_best_key(text: dict[str, float],
                                              passage: dict[str, float], k: int) -> None:
    def top(scores: dict[str, float]) -> list[tuple[str, float]]:
        return sorted(scores.items(), key=lambda hit: -hit[1])[:k]

    lowered = {m: s - passages.MARGIN for m, s in passage.items()}
    best = {m: max(s for s in (text.get(m), lowered.get(m)) if s is not None)
            for m in {*text, *passage}}
    found, won = passages.closest(top(text), top(passage), k)
    assert sorted(s for _, s in found) == sorted(s for _, s in top(best))  # the same scores
    assert all(best[m] == s for m, s in found)
    assert set(won) <= dict(found).keys()
    assert all(s == lowered[m] == best[m] and s > text.get(m, -2.0) for m, s in won.items())
    assert all(m in won for m, s in found if m not in text)  # found by a passage alone


def test_index_gives_long_texts_passage_keys_after_the_text_key(tokens: MiniLM,
                                                                tmp_path: Any) -> None:
    from engram import Memory
    from engram.pipeline.index import index

    mem = Memory(tmp_path / "m.db", embedder=tokens)
    try:
        long = record(" ".join(f"Chapter {i} of the manual explains the valve." for i in range(80)))
        keys, _ = index(mem._engine, [long])[long.id]
        names = [k.name for k in keys]
        assert names[:2] == ["text", "window"] and set(names[2:]) == {passages.KEY}
        texts = passages.of(tokens, [long])[long.id]
        assert len(names) == 2 + len(texts)
        want = tokens.embed_batch(texts)
        assert np.stack([k.vector for k in keys[2:]]) == pytest.approx(want, abs=1e-5)
        assert all(isinstance(k, Key) for k in keys)
    finally:
        mem.close()

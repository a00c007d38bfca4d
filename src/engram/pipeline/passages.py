"""Passages: a text longer than the embedder's window, cut into overlapping windows of the
embedder's own tokens, each a `passage` key of its memory, so the whole text is found.

An embedder reads a fixed number of tokens (MiniLM: 256) and a longer text's `text` key holds
its start only. The windows after the first become `passage` keys; the dense retriever scores a
memory by its best key among `text` and `passage` (`closest`), a passage less `MARGIN`: a
memory is as close as its best passage, once that passage stands out by more than chance. The
lexical index always holds the whole text. Cuts fall where the text breaks: a paragraph or code
block before a line, a line before a sentence, a sentence before a word.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..model import MemoryRecord
from ..providers import embedders
from ..store import Store
from .text import key_text

KEY = "passage"  # the key name of a passage
OVERLAP = 48     # tokens a passage may repeat of the one before: the sentence a cut fell in
# At most this many passages per memory: the text size limit (Config.max_text_chars, 32,000
# characters by default: about 8,000 tokens of English, 40 passages) stays inside it; a text
# longer still is found by its first passages and, whole, by the lexical index.
MAX_PASSAGES = 64
SPECIALS = 2     # the tokens a window spends on [CLS] and [SEP]
# What a passage's cosine gives up against a text key's. A long message has many windows, and
# the best of n draws beats one by about sigma * sqrt(2 ln n) by chance alone: with MiniLM's
# spread of cosines over a conversation (sigma 0.10-0.13 on BEAM's chats) and the 2-10
# windows of a long message, 0.15-0.25. Counted at face value, the best windows of long,
# on-topic answers crowd out the messages a question is about (BEAM dev, ten chats, dense
# alone: R@10 0.359 -> 0.297); less 0.2 they do not (0.359), and a passage that holds what its
# text does not (a sentence deep in a long note) still stands well clear of the rest.
MARGIN = 0.2

Span = tuple[int, int]  # a token's first and past-the-last character


def breaks(text: str, spans: Sequence[Span]) -> list[int]:
    """How good a cut is just before each token: 3 a blank line or a code fence, 2 a line or
    a sentence's end, 1 a space, 0 inside a word (a word cut into pieces)."""
    out = [3]
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        gap = text[end:start]
        if "\n\n" in gap or ("\n" in gap and text.startswith("```", start)):
            out.append(3)
        elif "\n" in gap or (gap and text[end - 1] in ".!?:;"):
            out.append(2)
        else:
            out.append(1 if gap else 0)
    return out


def windows(strength: Sequence[int], size: int, overlap: int = OVERLAP,
            limit: int = MAX_PASSAGES + 1) -> list[tuple[int, int]]:
    """Token ranges [start, end) of at most `size` tokens covering all `len(strength)` tokens
    (at most `limit` ranges), given each cut's `strength` (`breaks`). A window ends at the
    latest of its strongest cuts in its second half; the next starts at the earliest of the
    strongest cuts in the `overlap` tokens before that end (or at the end itself), so a
    sentence cut by the end is read whole by the next window."""
    n = len(strength)
    overlap = min(overlap, size // 2)  # so each window reaches past the one before
    out: list[tuple[int, int]] = []
    start = done = 0  # `done`: the tokens the windows so far cover
    while len(out) < limit:
        end = min(start + size, n)
        if end < n:
            lo = max(start + max(1, size // 2), done + 1)
            end = max(range(lo, end + 1), key=lambda i: (strength[i], i))
        out.append((start, end))
        if end >= n:
            break
        done = end
        start = max(range(max(start + 1, end - overlap), end + 1),
                    key=lambda i: (strength[i], -i))
    return out


def cut(text: str, spans: Sequence[Span], size: int, prefix: int = 0) -> list[str]:
    """The passages of `text` past its first window of `size` tokens (which its `text` key
    holds): each the text of one window. `spans` are the tokens of the whole text; the first
    `prefix` characters (a speaker's "name: ") are the start of every passage, their tokens
    outside the windows."""
    body = [s for s in spans if s[0] >= prefix]
    head = len(spans) - len(body)
    width = size - head
    if len(body) <= width or width < 1:
        return []
    found = windows(breaks(text, body), width)[1:]
    return [text[:prefix] + text[body[a][0]:body[b - 1][1]] for a, b in found]


def of(embedder: Any, records: Sequence[MemoryRecord]) -> dict[str, list[str]]:
    """The passage texts of each record whose text is longer than the embedder's window (only
    those are named); none when the embedder does not tell its window and tokens
    (`embedders.tokens`)."""
    reader = embedders.tokens(embedder)
    if reader is None:
        return {}
    size = reader.max_tokens - SPECIALS
    # A token covers at least one character: a text of at most `size` characters fits.
    long = [r for r in records if len(r.text) > size]
    if not long:
        return {}
    keyed = [key_text(r) for r in long]
    said = [head + body for head, body in keyed]
    out = {}
    for rec, (head, _), text, spans in zip(long, keyed, said, reader.token_spans(said),
                                           strict=True):
        found = cut(text, spans, size, len(head))
        if found:
            out[rec.id] = found
    return out


def explain(store: Store, hits: Sequence[tuple[str, float, dict[str, float]]],
            won: Mapping[str, float], vector: np.ndarray) -> None:
    """In the explanation of each hit whose dense score is a passage's (`won`), that
    contribution under the passage's name instead of "dense": "passage 3" is the third window
    after the one the `text` key holds. The entries still add up to the fused score."""
    shown = [mid for mid, _, explain in hits if mid in won and "dense" in explain]
    if not shown:
        return
    found = store.key_vectors(shown, KEY)
    for mid, _, explain in hits:
        if mid in found:
            explain[name(int(np.argmax(found[mid] @ vector)) + 1)] = explain.pop("dense")


def name(n: int) -> str:
    """The explanation's name of a hit's dense contribution made by its `n`th passage."""
    return f"{KEY} {n}"


def closest(text: Sequence[tuple[str, float]], passage: Sequence[tuple[str, float]],
            k: int) -> tuple[list[tuple[str, float]], dict[str, float]]:
    """The dense retriever's best `k` over the `text` and `passage` keys: each memory scored by
    its best key, a passage's cosine less `MARGIN`. Exact from each key's own best `k`: a
    memory among the best `k` by its best key is among the best `k` of that key. Also those of
    them a passage scored, with its score, where it beat their text."""
    best = dict(text)
    won = set()
    for mid, cosine in passage:
        sim = cosine - MARGIN
        if sim > best.get(mid, -2.0):
            best[mid] = sim
            won.add(mid)
    ranked = sorted(best.items(), key=lambda hit: -hit[1])[:k]
    return ranked, {mid: sim for mid, sim in ranked if mid in won}

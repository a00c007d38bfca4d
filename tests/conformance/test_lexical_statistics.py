"""What the lexical score counts, on every store (store/bm25.py): a phrase's IDF comes from the
memories' texts, not from the previous turns kept beside them; a repeated word weighs by the
log of its count."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from conformance.test_store import q, rec, vec
from engram.model import Scope
from engram.store import Key, Lexical, Store
from engram.store.bm25 import K1

ANA = Scope("ana", None, "trip")
FLIGHT = "I am flying to Tokyo on May 3rd."


def _scores(store: Store, docs: list[tuple[str, str]], words: list[str],
            previous_weight: float = 0.5) -> dict[str, float]:
    """The scores of `words` over `docs` (text, previous turn), by text."""
    with store.write() as tx:
        for i, (body, previous) in enumerate(docs):
            tx.insert(rec(body, scope=ANA), [Key("text", vec(1.0, 0.1 * i))], Lexical(body, previous))
    texts = {r.id: r.text for r in store.select(q(ANA), limit=100)}
    return {texts[mid]: s for mid, s in store.lexical(q(ANA), words, 10, previous_weight)}


def test_a_word_in_a_previous_turn_is_not_counted_in_its_idf(store: Store) -> None:
    """The reply after "I am flying to Tokyo" keeps that turn as its context: "Tokyo" is still
    said once in three memories, not in two rows of three (where its IDF is the floor, and the
    turn saying it scores nothing)."""
    reply = ("Have a good flight!", FLIGHT)
    got = _scores(store, [(FLIGHT, ""), reply, ("Ana is vegetarian", "")], ["tokyo"])
    idf = math.log((3 - 1 + 0.5) / (1 + 0.5))
    assert got[FLIGHT] > 0.5 * idf  # f = 1, and a row of about the mean length: ~idf
    assert got[FLIGHT] > got["Have a good flight!"] > 0  # the reply: through its context


def test_the_previous_turn_does_not_change_another_rows_idf(
        store_factory: Callable[[Path], Store], tmp_path: Path) -> None:
    """The same corpus but for one reply's previous turn (a word of the same length): the
    score of the row that says "Tokyo" does not move."""
    got = []
    for i, context in enumerate([FLIGHT, FLIGHT.replace("Tokyo", "Paris")]):
        s = store_factory(tmp_path / str(i))
        try:
            got.append(_scores(s, [(FLIGHT, ""), ("Have a good flight!", context),
                                   ("Ana is vegetarian", "")], ["tokyo"])[FLIGHT])
        finally:
            s.close()
    assert got[0] == pytest.approx(got[1], rel=1e-12)


def test_repeats_weigh_by_their_log(store: Store) -> None:
    """Ten messages of one length (so one length normalisation): four name "zebra" 1, 2, 4 and
    20 times. Each scores idf * f * (k1 + 1) / (f + k1) with f = 1 + ln(mentions): relative to
    the message naming it once, twenty mentions weigh 1 + ln 20 (about 4), not 20."""
    length = 20
    counts = [1, 2, 4, 20]
    docs = [(" ".join(["zebra"] * n + [f"w{n}x{i}" for i in range(length - n)]), "")
            for n in counts]
    docs += [(" ".join(f"f{j}x{i}" for i in range(length)), "") for j in range(6)]
    got = _scores(store, docs, ["zebra"])
    once = got[docs[0][0]]
    assert once > 0
    for n, (body, _) in zip(counts, docs, strict=False):
        f = 1.0 + math.log(n)
        assert got[body] / once == pytest.approx(f / (f + K1) * (1 + K1), rel=1e-9), n

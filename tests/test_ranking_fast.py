"""The fast ranking path (columns through C-level maps, derived fields on `Candidate`) gives
exactly what the reference gave: the same hits in the same order, the same scores and the same
explanations, float for float (tests/ranking_reference.py is the code as it was before).

Pools are drawn at random (seeded) with what every adjustment reads: several speakers and facts
without one (some naming a speaker), several sessions, times before and after `now` and equal
ones, time words, revisions of one topic (newest-wins), candidates the store no longer holds,
texts that are not ASCII. The large pools (many sessions, scores tied on purpose) are where the
fast path reads the texts of only the candidates that may reach the page (`_settle`): the
ties at the cut, the sessions holding the lowest and the highest best, negative weights."""

from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

import ranking_reference as ref
from engram.model import Scope
from engram.pipeline import retrieve
from engram.pipeline.retrieve import (
    PRESETS,
    RetrievalConfig,
    _names,
    _naming,
    _speakers,
    fuse_arrays,
    mention_times,
    mentions_time,
    named_speakers,
    rank_arrays,
)
from engram.pipeline.revisions import _counts, topic_words
from engram.store.base import Candidate

NOW = datetime(2024, 6, 1, 12, 0, tzinfo=UTC)
SPEAKERS = ["Tom", "Ana Lopez", "Caroline", None, None]
TOPICS = ["Spanish", "guitar", "Leeds", "pottery", "marathon", "wedding", "dog"]
PHRASES = [
    "I am learning {t}", "we moved to {t} last May", "I dropped {t} instead", "{t} is great",
    "no longer doing {t}", "Tom loves {t}", "Ana started {t} yesterday", "{t} since 2019",
    "actually the {t} was cancelled", "thinking about {t} and {u}", "Caroline said {t} is fun",
    "I’m into {t} now", "Ana’s {t} café opened in ２０１９", "ſince {t}, tom is happy",
]
QUERIES = [
    "Where does Ana live now?", "When did Tom start the guitar?", "What does Caroline like?",
    "What did Tom do before the marathon?", "How long has Ana been learning Spanish?",
    "What is the dog called?", "Is the wedding still on?", "What year did they move to Leeds?",
    "Tom and Ana both like pottery?", "what happened?",
]


def pool(rng: random.Random, n: int, sessions: int = 3,
         ) -> tuple[dict[str, list[tuple[str, float]]], dict[str, Candidate]]:
    cands: dict[str, Candidate] = {}
    times = [NOW - timedelta(days=rng.randrange(0, 400), hours=rng.randrange(24))
             for _ in range(6)] + [NOW + timedelta(days=3)]  # one after now (clock skew)
    for i in range(n):
        mid = f"m{rng.randrange(10**6):06d}{i}"
        session = rng.choice([*(f"s{k}" for k in range(sessions)), None])
        text = rng.choice(PHRASES).format(t=rng.choice(TOPICS), u=rng.choice(TOPICS))
        observed = rng.choice([*times, None])
        cands[mid] = Candidate(mid, Scope(rng.choice(["u", "v"]), None, session),
                               rng.choice(SPEAKERS), text, observed, rng.choice(times),
                               rng.choice([0.0, 0.5, 0.9, rng.random()]))
    ids = list(cands)
    found: dict[str, list[tuple[str, float]]] = {}
    for label in ("dense", "window", "fact", "lexical"):
        picked = rng.sample(ids, rng.randrange(1, n + 1))
        # ties on purpose: equal scores are ordered by id
        found[label] = sorted(((m, round(rng.uniform(0.2, 0.9), rng.choice([1, 2]))) for m in picked),
                              key=lambda h: -h[1])
    found["graph"] = []  # a retriever with nothing found takes no part
    for mid in rng.sample(ids, n // 10):  # deleted since the pool was read
        del cands[mid]
    return found, cands


CONFIGS: list[RetrievalConfig] = [
    *PRESETS.values(),
    replace(PRESETS["hybrid"], fusion="rrf"),
    replace(PRESETS["hybrid"], dense_weight=0.0, newer_page=20),
    replace(PRESETS["fast"], lexical_weight=0.0, speaker_boost=0.0, session_weight=0.0),
    replace(PRESETS["hybrid"], min_session_range=0.0, when_boost=0.6),
    # weights that could reverse the order of the bounds: everything is read
    replace(PRESETS["hybrid"], speaker_boost=-0.2, when_boost=-0.15),
    replace(PRESETS["hybrid"], session_weight=-0.3),
]


def same_as_reference(found: dict[str, list[tuple[str, float]]], cands: dict[str, Candidate],
                      queries: list[str], limits: tuple[int | None, ...]) -> None:
    for cfg in CONFIGS:
        weights = {"dense": cfg.dense_weight, "window": cfg.window_weight,
                   "fact": cfg.fact_weight, "lexical": cfg.lexical_weight, "graph": 1.0}
        fused = fuse_arrays(found, weights, cfg)
        expected_fused = ref.fuse_arrays(found, weights, cfg)
        assert fused.ids == expected_fused.ids
        assert fused.as_dicts() == expected_fused.as_dicts()
        for query in queries:
            for limit in limits:
                got = rank_arrays(fused, cands, query, cfg, NOW, limit)
                assert got == ref.rank_arrays(expected_fused, cands, query, cfg, NOW, limit)
                # with the statements' vectors, newest-wins links a revision by meaning
                qv = unit(query)
                got = rank_arrays(fused, cands, query, cfg, NOW, limit, vectors, qv)
                assert got == ref.rank_arrays(expected_fused, cands, query, cfg, NOW, limit,
                                              vectors, qv)


def unit(key: str) -> np.ndarray:
    """A vector of its own for each key (a few dimensions: pairs are often close)."""
    v = np.random.default_rng(zlib.crc32(key.encode())).normal(size=4)
    out: np.ndarray = v / np.linalg.norm(v)
    return out


def vectors(ids: list[str]) -> dict[str, np.ndarray]:
    return {mid: unit(mid) for mid in ids if not mid.endswith("7")}  # some have none


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_path_ranks_and_explains_exactly_as_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    found, cands = pool(rng, rng.choice([3, 12, 60, 300]))
    same_as_reference(found, cands, rng.sample(QUERIES, 3), (None, 10))


@pytest.mark.parametrize("seed", range(12))
def test_a_large_pool_of_many_sessions_ranks_exactly_as_the_reference(seed: int) -> None:
    """Where the fast path reads the texts of only a part of the pool: its first page must
    still be the reference's, score for score (a page of 1, of 10, of 0)."""
    rng = random.Random(1000 + seed)
    found, cands = pool(rng, rng.choice([400, 1200]), sessions=rng.choice([5, 60, 400]))
    same_as_reference(found, cands, [q for q in QUERIES if retrieve.asks_when(q)]
                      + rng.sample(QUERIES, 2), (1, 10, 0))


def test_a_tie_at_the_cut_is_broken_by_id_as_in_the_reference() -> None:
    """Every candidate scores the same before its text is read: which ones reach the page
    is decided by the time words alone, and among equals by id."""
    rng = random.Random(7)
    found, cands = pool(rng, 500, sessions=50)
    found = {label: [(mid, 0.5) for mid, _ in hits] for label, hits in found.items()}
    same_as_reference(found, cands, ["When did Tom start the guitar?", "what happened?"],
                      (1, 3, 10))


@pytest.mark.parametrize("seed", [172, 176, 179, 183, 195])
def test_a_negative_session_weight_still_ranks_exactly_as_the_reference(seed: int) -> None:
    """A session weight below 0 turns a session's best into a penalty, reversing what the
    bounds of the fast path rely on: it reads every text then (these pools differed when
    it did not)."""
    found, cands = pool(random.Random(seed), 60, sessions=200)
    cfg = replace(PRESETS["hybrid"], session_weight=-1.0)
    weights = {"dense": 0.5, "window": 0.3, "fact": 0.3, "lexical": 0.5}
    query = "When is the wedding?"
    assert rank_arrays(fuse_arrays(found, weights, cfg), cands, query, cfg, NOW, 10) == (
        ref.rank_arrays(ref.fuse_arrays(found, weights, cfg), cands, query, cfg, NOW, 10))


def test_only_the_candidates_that_may_reach_the_page_are_read(monkeypatch: pytest.MonkeyPatch,
                                                              ) -> None:
    read: list[int] = []

    def counted(texts: list[str]) -> list[bool]:
        read.append(len(texts))
        return mention_times(texts)

    monkeypatch.setattr(retrieve, "mention_times", counted)
    rng = random.Random(3)
    found, cands = pool(rng, 1200, sessions=400)
    cfg = PRESETS["hybrid"]
    fused = fuse_arrays(found, {"dense": 0.5, "window": 0.3, "fact": 0.3, "lexical": 0.5}, cfg)
    query = "When did Tom start the guitar?"
    assert rank_arrays(fused, cands, query, cfg, NOW, 10) == ref.rank_arrays(
        ref.fuse_arrays(found, {"dense": 0.5, "window": 0.3, "fact": 0.3, "lexical": 0.5}, cfg),
        cands, query, cfg, NOW, 10)
    assert 10 <= sum(read) < len(cands) / 2, read
    read.clear()
    rank_arrays(fused, cands, query, cfg, NOW)  # every one is explained: every one is read
    assert sum(read) == len(cands.keys() & set(fused.ids))


TRICKY = [
    "", "today", "Today's plan", "TODAY", "to day", "_today", "today_", "today2", "2today",
    "in 2019.", "in 2019s", "x2019", "20199", "1899", "2099!", "1900-2000", "since\nMay",
    "weekends", "weekend's", "WeEkS ago", "mayday", "May", "ſince", "K", "１９９９", "in ２０２０",
    "I’m late", "yesterday’s", "nächste Woche", "tom\x00yesterday", "o'clock next", "lately,",
    "Ana met Tom", "ANA", "anabel", "ana_b", "Ana's", "d'ana", "Ana-Lucia", "Åna", "ana2",
    "O'Brien said", "o'brien", "Jean-Luc", "jean luc", "a lone \ud800 surrogate today",
]


def test_word_lookups_match_the_regexes_they_replace() -> None:
    rng = random.Random(5)
    texts = TRICKY + [" ".join(rng.choices(TRICKY, k=3)) for _ in range(300)]
    assert mention_times(texts) == [mentions_time(t) for t in texts]
    for first in ("Ana", "ana", "Tom", "O'Brien", "Jean-Luc", "Åna", "ana_b", "K", "2019"):
        assert _naming(first)(texts) == [_names(first, t) for t in texts], first
    names = {"Ana Lopez", "Tom", "O'Brien", "Jean-Luc Picard", "Åna", "ana_b", "K", "2019", " ",
             "Caroline"}
    for query in [*texts[:80], "Where does Ana live?", "what did åna say?", "Did Jean-Luc go?"]:
        assert _speakers(query, names) == named_speakers(query, names), query


def test_word_counts_read_only_what_they_need_and_count_exactly() -> None:
    rng = random.Random(9)
    words = ["spanish", "liv", "day", "caf", "i'm", "ana", "tom", "leed", "café", "run", "x"]
    texts = TRICKY + [rng.choice(PHRASES).format(t=rng.choice(TOPICS), u=rng.choice(TOPICS))
                      for _ in range(200)] + ["I live in Leeds", "she lives there", "olive oil",
                                              "running late", "I ran", "Café Ana", "birthday",
                                              "a day off", "days", "Spanish!"]
    rng.shuffle(texts)
    got = _counts(words, texts)
    assert got == {w: min(3, sum(w in topic_words(t) for t in texts)) for w in words}
    assert _counts(words, texts, cap=1000) == {w: sum(w in topic_words(t) for t in texts)
                                                for w in words}


def test_the_random_pools_exercise_every_adjustment() -> None:
    """The comparison above means something only if every adjustment fires in it."""
    seen: Counter[str] = Counter()
    for seed in range(40):
        rng = random.Random(seed)
        found, cands = pool(rng, rng.choice([3, 12, 60, 300]))
        cfg = PRESETS["hybrid"]
        fused = fuse_arrays(found, {"dense": 0.5, "window": 0.3, "fact": 0.3, "lexical": 0.5}, cfg)
        for query in QUERIES:
            for _, _, explain in rank_arrays(fused, cands, query, cfg, NOW):
                seen.update(k for k, v in explain.items() if v)
    for label in ("dense", "window", "fact", "lexical", "speaker", "when", "recency",
                  "importance", "session", "newer"):
        assert seen[label] > 0, label


def test_a_candidate_derives_its_time_and_session_unit() -> None:
    at = datetime(2024, 5, 3, 9, 0, tzinfo=UTC)
    turn = Candidate("a", Scope("u", "bot", "s1"), "Tom", "hi", None, at, 0.5)
    fact = Candidate("b", Scope("u", None, None), None, "Tom likes tea", at - timedelta(days=1),
                     at, 0.5)
    assert (turn.at, turn.unit) == (at.timestamp(), ("u", "bot", "s1"))
    assert (fact.at, fact.unit) == ((at - timedelta(days=1)).timestamp(), "b")
    # derived again by `replace`: never stale
    assert replace(turn, id="c", scope=Scope("u", None, None)).unit == "c"

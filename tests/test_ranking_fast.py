"""The fast ranking path (columns through C-level maps, derived fields on `Candidate`) gives
exactly what the reference gave: the same hits in the same order, the same scores and the same
explanations, float for float (tests/ranking_reference.py is the code as it was before).

Pools are drawn at random (seeded) with what every adjustment reads: several speakers and facts
without one (some naming a speaker), several sessions, times before and after `now` and equal
ones, time words, revisions of one topic (newest-wins), candidates the store no longer holds."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

import ranking_reference as ref
from engram.model import Scope
from engram.pipeline.retrieve import PRESETS, RetrievalConfig, fuse_arrays, rank_arrays
from engram.store.base import Candidate

NOW = datetime(2024, 6, 1, 12, 0, tzinfo=UTC)
SPEAKERS = ["Tom", "Ana Lopez", "Caroline", None, None]
TOPICS = ["Spanish", "guitar", "Leeds", "pottery", "marathon", "wedding", "dog"]
PHRASES = [
    "I am learning {t}", "we moved to {t} last May", "I dropped {t} instead", "{t} is great",
    "no longer doing {t}", "Tom loves {t}", "Ana started {t} yesterday", "{t} since 2019",
    "actually the {t} was cancelled", "thinking about {t} and {u}", "Caroline said {t} is fun",
]
QUERIES = [
    "Where does Ana live now?", "When did Tom start the guitar?", "What does Caroline like?",
    "What did Tom do before the marathon?", "How long has Ana been learning Spanish?",
    "What is the dog called?", "Is the wedding still on?", "What year did they move to Leeds?",
    "Tom and Ana both like pottery?", "what happened?",
]


def pool(rng: random.Random, n: int) -> tuple[dict[str, list[tuple[str, float]]], dict[str, Candidate]]:
    cands: dict[str, Candidate] = {}
    times = [NOW - timedelta(days=rng.randrange(0, 400), hours=rng.randrange(24))
             for _ in range(6)] + [NOW + timedelta(days=3)]  # one after now (clock skew)
    for i in range(n):
        mid = f"m{rng.randrange(10**6):06d}{i}"
        session = rng.choice(["s1", "s2", "s3", None])
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
        found[label] = sorted(((m, round(rng.uniform(0.2, 0.9), 2)) for m in picked),
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
]


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_path_ranks_and_explains_exactly_as_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    found, cands = pool(rng, rng.choice([3, 12, 60, 300]))
    for cfg in CONFIGS:
        weights = {"dense": cfg.dense_weight, "window": cfg.window_weight,
                   "fact": cfg.fact_weight, "lexical": cfg.lexical_weight, "graph": 1.0}
        fused = fuse_arrays(found, weights, cfg)
        expected_fused = ref.fuse_arrays(found, weights, cfg)
        assert fused.ids == expected_fused.ids
        assert fused.as_dicts() == expected_fused.as_dicts()
        for query in rng.sample(QUERIES, 3):
            for limit in (None, 10):
                got = rank_arrays(fused, cands, query, cfg, NOW, limit)
                assert got == ref.rank_arrays(expected_fused, cands, query, cfg, NOW, limit)


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

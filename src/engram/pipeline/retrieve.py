"""Retrieval as data: a frozen `RetrievalConfig` (with named presets) and pure ranking functions.

The read path: candidates from the store (dense over the text, window and fact keys, lexical BM25) -> `fuse`
(score-normalised, weighted) -> `rank` (speaker, time-question, session, recency, importance
adjustments) -> hits. Each stage's contribution is kept in `Hit.explain`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, TypeVar

from ..errors import InvalidInput
from ..model import Scope
from ..store.base import Candidate


@dataclass(frozen=True)
class RetrievalConfig:
    """A retrieval strategy, as a value you can print, compare and benchmark."""

    name: str
    dense_weight: float = 0.5      # cosine of the query to the memory's own text
    window_weight: float = 0.0     # cosine to the episode's window (itself + 2 turns before)
    fact_weight: float = 0.0       # cosine to the facts extracted from the episode (with an LLM)
    lexical_weight: float = 0.5    # BM25 over text (+ previous turn at `previous_weight`)
    previous_weight: float = 0.5
    fusion: Literal["weighted", "rrf"] = "weighted"
    rrf_k: int = 60
    candidates: int = 100          # per retriever, before fusion
    speaker_boost: float = 0.0     # added when the query names the memory's speaker
    when_boost: float = 0.0        # for "when ..." questions, memories that mention a time
    session_weight: float = 0.0    # share of the memory's session's best score
    recency_weight: float = 0.0    # weight of time decay (half-life below)
    half_life_days: float = 30.0
    importance_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.fusion not in ("weighted", "rrf"):
            raise InvalidInput(f"unknown fusion {self.fusion!r}")
        if self.candidates < 1:
            raise InvalidInput("candidates must be positive")


PRESETS: dict[str, RetrievalConfig] = {
    p.name: p
    for p in (
        # The default, tuned on the LoCoMo dev split (see bench/locomo.py and README).
        RetrievalConfig("hybrid", candidates=1000, window_weight=0.3, fact_weight=0.3,
                        speaker_boost=0.2, when_boost=0.15,
                        session_weight=0.3, recency_weight=0.01, importance_weight=0.01),
        # The same signals over a tenth of the candidate pool: faster, a little less recall.
        RetrievalConfig("fast", candidates=100, window_weight=0.3, fact_weight=0.3, speaker_boost=0.2,
                        when_boost=0.15, session_weight=0.3, recency_weight=0.01,
                        importance_weight=0.01),
        # Plain baselines, for comparison.
        RetrievalConfig("rrf", fusion="rrf", previous_weight=0.0),
        RetrievalConfig("dense", dense_weight=1.0, lexical_weight=0.0),
        RetrievalConfig("lexical", dense_weight=0.0, lexical_weight=1.0, previous_weight=0.0),
    )
}


def get_preset(name: str) -> RetrievalConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidInput(f"unknown retrieval preset {name!r}; presets: {sorted(PRESETS)}") from None


K = TypeVar("K")


def _minmax(scores: Mapping[K, float], floor: float | None = None) -> dict[K, float]:
    if not scores:
        return {}
    lo = min(scores.values()) if floor is None else floor
    hi = max(scores.values())
    if hi - lo < 1e-12:
        return {k: 1.0 for k in scores}
    return {k: max(0.0, (v - lo) / (hi - lo)) for k, v in scores.items()}


def fuse(ranked: Mapping[str, Sequence[tuple[str, float]]], weights: Mapping[str, float],
         cfg: RetrievalConfig) -> dict[str, dict[str, float]]:
    """Per candidate id: each retriever's weighted, normalised contribution, summed as `fused`.

    Scores are min-max normalised per retriever; BM25 uses 0 as its floor (a memory with none
    of the words scores 0), which keeps one weak lexical match from looking like a perfect one.
    """
    out: dict[str, dict[str, float]] = {}
    for label, hits in ranked.items():
        w = weights.get(label, 0.0)
        if not w:
            continue
        if cfg.fusion == "rrf":
            norm = {mid: 1.0 / (cfg.rrf_k + r + 1) for r, (mid, _) in enumerate(hits)}
        else:
            norm = _minmax(dict(hits), floor=0.0 if label == "lexical" else None)
        for mid, s in norm.items():
            out.setdefault(mid, {})[label] = w * s
    for parts in out.values():
        parts["fused"] = sum(parts.values())
    return out


_WHEN_QUESTION = re.compile(
    r"^\s*(when|how long|what (year|month|date|day|time))\b|\bwhen\b", re.IGNORECASE)
_TIME_WORDS = re.compile(
    r"\b(yesterday|today|tonight|tomorrow|ago|last|next|recently|lately|earlier|weekends?|"
    r"weeks?|months?|years?|since|monday|tuesday|wednesday|thursday|friday|saturday|sunday|"
    r"january|february|march|april|may|june|july|august|september|october|november|december|"
    r"(19|20)\d\d)\b", re.IGNORECASE)


def asks_when(query: str) -> bool:
    """Does the question ask for a time ("When did...", "How long...", "What year...")?"""
    return bool(_WHEN_QUESTION.search(query))


def mentions_time(text: str) -> bool:
    return bool(_TIME_WORDS.search(text))


def named_speakers(query: str, names: set[str]) -> set[str]:
    """The speakers a query names, matched by first name as a whole word."""
    return {n for n in names
            if n.split() and re.search(rf"\b{re.escape(n.split()[0])}\b", query, re.IGNORECASE)}


def decay(when: datetime, now: datetime, half_life_days: float) -> float:
    """Time decay in ranking: 1 for a memory of today, 0.5 one half-life ago (world time)."""
    days = max(0.0, (now - when).total_seconds() / 86400)
    return float(0.5 ** (days / half_life_days))


Ranked = tuple[str, float, dict[str, float]]  # memory id, score, explanation


def rank(fused: Mapping[str, dict[str, float]], candidates: Mapping[str, Candidate], query: str,
         cfg: RetrievalConfig, now: datetime) -> list[Ranked]:
    """Final scores: fused score plus the adjustments the preset turns on, best first."""
    recs = {mid: candidates[mid] for mid in fused if mid in candidates}
    explain = {mid: dict(fused[mid]) for mid in recs}
    score = {mid: fused[mid]["fused"] for mid in recs}

    def add(mid: str, label: str, value: float) -> None:
        if value:
            explain[mid][label] = value
            score[mid] += value

    # A question naming exactly one speaker is about what that speaker said (or, for a fact
    # with no speaker, about what the fact says of them).
    named = named_speakers(query, {r.name for r in recs.values() if r.name})
    first = next(iter(named)).split()[0] if len(named) == 1 else None
    when = asks_when(query)
    for mid, rec in recs.items():
        if cfg.speaker_boost and first and (
                rec.name in named or (rec.name is None and _names(first, rec.text))):
            add(mid, "speaker", cfg.speaker_boost)
        if cfg.when_boost and when and mentions_time(rec.text):
            add(mid, "when", cfg.when_boost)
        if cfg.recency_weight:
            add(mid, "recency", cfg.recency_weight * decay(rec.observed_at or rec.created_at,
                                                           now, cfg.half_life_days))
        if cfg.importance_weight:
            add(mid, "importance", cfg.importance_weight * rec.importance)

    # Session-level evidence: a turn in the session that best matches the query gains.
    # A memory outside any session (a fact) is a session of its own.
    if cfg.session_weight:
        def unit(mid: str) -> Scope | str:
            rec = recs[mid]
            return rec.scope if rec.scope.session_id is not None else mid

        best: dict[Scope | str, float] = defaultdict(float)
        for mid in recs:
            best[unit(mid)] = max(best[unit(mid)], score[mid])
        norm = _minmax(best)
        for mid in recs:
            add(mid, "session", cfg.session_weight * norm[unit(mid)])

    out = [(mid, score[mid], {**explain[mid], "score": score[mid]}) for mid in recs]
    out.sort(key=lambda r: (-r[1], r[0]))
    return out


def _names(first_name: str, text: str) -> bool:
    return bool(re.search(rf"\b{re.escape(first_name)}\b", text, re.IGNORECASE))

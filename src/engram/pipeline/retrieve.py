"""Retrieval as data: a frozen `RetrievalConfig` (with named presets) and pure ranking functions.

The read path: candidates from the store (dense and lexical) -> `fuse` (score-normalised,
weighted) -> `rank` (adjust by context, speaker, recency, importance) -> hits. Each stage's
contribution is kept in `Hit.explain`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from ..errors import InvalidInput
from ..model import Hit, MemoryRecord
from .text import words


@dataclass(frozen=True)
class RetrievalConfig:
    name: str
    dense_weight: float = 0.5
    lexical_weight: float = 0.5
    fusion: Literal["weighted", "rrf"] = "weighted"
    rrf_k: int = 60
    candidates: int = 100          # per retriever, before fusion
    name_boost: float = 0.0        # added when the query names the memory's speaker
    neighbor_weight: float = 0.0   # share of the adjacent episodes' fused score
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
        RetrievalConfig("hybrid", name_boost=0.1, neighbor_weight=0.0,
                        recency_weight=0.02, importance_weight=0.02),
        RetrievalConfig("rrf", fusion="rrf"),
        RetrievalConfig("dense", dense_weight=1.0, lexical_weight=0.0),
        RetrievalConfig("lexical", dense_weight=0.0, lexical_weight=1.0),
    )
}


def get_preset(name: str) -> RetrievalConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidInput(f"unknown retrieval preset {name!r}; presets: {sorted(PRESETS)}") from None


def _minmax(scores: Mapping[str, float]) -> dict[str, float]:
    if not scores:
        return {}
    lo, hi = min(scores.values()), max(scores.values())
    if hi - lo < 1e-12:
        return {k: 1.0 for k in scores}
    return {k: (v - lo) / (hi - lo) for k, v in scores.items()}


def decay(record: MemoryRecord, now: datetime, half_life_days: float) -> float:
    """Time decay in ranking: 1 for a memory of today, 0.5 one half-life ago (world time)."""
    when = record.observed_at or record.created_at
    days = max(0.0, (now - when).total_seconds() / 86400)
    return float(0.5 ** (days / half_life_days))


def fuse(dense: Sequence[tuple[str, float]], lexical: Sequence[tuple[str, float]],
         cfg: RetrievalConfig) -> dict[str, dict[str, float]]:
    """Per candidate id: the contributions of each retriever, and their sum under `fused`."""
    out: dict[str, dict[str, float]] = {}
    if cfg.fusion == "rrf":
        for label, ranked, w in (("dense", dense, cfg.dense_weight),
                                 ("lexical", lexical, cfg.lexical_weight)):
            for rank, (mid, _) in enumerate(ranked):
                out.setdefault(mid, {})[label] = w / (cfg.rrf_k + rank + 1)
    else:
        for label, ranked, w in (("dense", dense, cfg.dense_weight),
                                 ("lexical", lexical, cfg.lexical_weight)):
            if w == 0:
                continue
            for mid, s in _minmax(dict(ranked)).items():
                out.setdefault(mid, {})[label] = w * s
    for parts in out.values():
        parts["fused"] = sum(parts.values())
    return out


def rank(fused: Mapping[str, dict[str, float]], records: Mapping[str, MemoryRecord], query: str,
         cfg: RetrievalConfig, now: datetime,
         neighbors: Mapping[str, Sequence[str]] | None = None) -> list[Hit]:
    """Final scores: fused score plus the adjustments the preset turns on, best first."""
    qwords = set(words(query))
    hits: list[Hit] = []
    for mid, parts in fused.items():
        rec = records.get(mid)
        if rec is None:
            continue
        explain = dict(parts)
        score = parts["fused"]
        if cfg.neighbor_weight and neighbors:
            near = [fused[n]["fused"] for n in neighbors.get(mid, ()) if n in fused]
            if near:
                explain["neighbors"] = cfg.neighbor_weight * max(near)
                score += explain["neighbors"]
        if cfg.name_boost and rec.name and set(words(rec.name)) & qwords:
            explain["speaker"] = cfg.name_boost
            score += cfg.name_boost
        if cfg.recency_weight:
            explain["recency"] = cfg.recency_weight * decay(rec, now, cfg.half_life_days)
            score += explain["recency"]
        if cfg.importance_weight:
            explain["importance"] = cfg.importance_weight * rec.importance
            score += explain["importance"]
        explain["score"] = score
        hits.append(Hit(rec, score if math.isfinite(score) else 0.0, explain))
    hits.sort(key=lambda h: (-h.score, h.memory.id))
    return hits

"""Consolidation without an LLM: episodes are kept as events; facts are deduplicated.

An episode (something said at a time) is never merged: the same sentence said twice is two
episodes. A semantic or procedural memory that repeats an existing one of the same scope and
kind adds nothing (exact match on normalised text) or is merged into it (near-duplicate:
cosine >= threshold *and* word overlap >= min_overlap *and* one text's content words contain
the other's). So "likes tea" / "likes coffee" or "room 101" / "room 102", close in embedding
space, stay two facts: a swapped word may be a correction, and merging would lose one side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Literal

from ..model import Kind, MemoryRecord
from .text import overlap, terms


@dataclass(frozen=True)
class Decision:
    action: Literal["ADD", "NOOP", "MERGE"]
    target: MemoryRecord | None = None   # the existing memory for NOOP / MERGE
    similarity: float = 0.0
    reason: str = ""


def decide(candidate: MemoryRecord, neighbours: Sequence[tuple[MemoryRecord, float]], *,
           threshold: float, min_overlap: float) -> Decision:
    """What to do with `candidate`, given existing memories and their cosine to it."""
    if candidate.kind is Kind.EPISODIC:
        return Decision("ADD", reason="episodes are events, never merged")
    best: Decision | None = None
    for existing, sim in neighbours:
        if existing.kind is not candidate.kind or existing.scope != candidate.scope:
            continue
        if existing.content_hash == candidate.content_hash:
            return Decision("NOOP", existing, 1.0, "exact duplicate")
        if sim >= threshold and (best is None or sim > best.similarity):
            ov = overlap(candidate.text, existing.text)
            if ov >= min_overlap and _one_contains_the_other(candidate.text, existing.text):
                best = Decision("MERGE", existing, sim,
                                f"near-duplicate: cosine {sim:.3f}, word overlap {ov:.2f}")
    return best or Decision("ADD", reason="new")


def _one_contains_the_other(a: str, b: str) -> bool:
    wa, wb = set(terms(a)), set(terms(b))
    return wa <= wb or wb <= wa


def merge(existing: MemoryRecord, new: MemoryRecord, now: datetime) -> MemoryRecord:
    """One memory holding both: the more informative text, both provenances, the max importance.

    The longer text wins (it usually says more); metadata of the newer overrides on conflict.
    Provenance lists the sources of both: their episode ids, or their own ids when they have none.
    """
    text = new.text if len(new.text) > len(existing.text) else existing.text
    provenance = tuple(dict.fromkeys((*(existing.provenance or (existing.id,)),
                                      *new.provenance, new.id)))
    observed = [t for t in (existing.observed_at, new.observed_at) if t is not None]
    return replace(
        existing,
        text=text,
        content_hash=new.content_hash if text is new.text else existing.content_hash,
        metadata={**existing.metadata, **new.metadata},
        importance=max(existing.importance, new.importance),
        provenance=provenance,
        observed_at=max(observed) if observed else None,
        updated_at=now,
        expires_at=None if existing.expires_at is None or new.expires_at is None
        else max(existing.expires_at, new.expires_at),
    )

"""Forgetting: the retention score that decides which memories a full scope evicts first.

    retention = 0.5 * importance + 0.3 * recency + 0.2 * use
    recency   = 0.5 ** (days since last access, or since creation / half_life_days)
    use       = 1 - 1 / (1 + access_count)

Every term is in [0, 1]. The lowest retention is evicted first; ties go to the oldest.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from ..model import MemoryRecord

HALF_LIFE_DAYS = 30.0


def recency(record: MemoryRecord, now: datetime, half_life_days: float = HALF_LIFE_DAYS) -> float:
    last = record.last_accessed_at or record.created_at
    days = max(0.0, (now - last).total_seconds() / 86400)
    return float(0.5 ** (days / half_life_days))


def retention(record: MemoryRecord, now: datetime) -> float:
    use = 1 - 1 / (1 + record.access_count)
    return 0.5 * record.importance + 0.3 * recency(record, now) + 0.2 * use


def to_evict(pool: Sequence[MemoryRecord], capacity: int, now: datetime) -> list[MemoryRecord]:
    """The memories to drop so that at most `capacity` remain."""
    excess = len(pool) - capacity
    if excess <= 0:
        return []
    ranked = sorted(pool, key=lambda r: (retention(r, now), r.created_at, r.id))
    return ranked[:excess]

"""The `graph` retriever: memories reached through the entities a query names.

Entities named in the query are found through the name/alias index (its word n-grams, the same
lookup that links mentions on write); their neighbours within `graph_depth` hops join them at a
lower weight. An episode scores by the entities it mentions, each weighted by how close it is to
the query (named 1, one hop 1/2, two hops 1/4) and by how rare it is (an entity every turn
mentions, such as a conversation's speaker, tells little). The sources of the relations between
them count too. Scores are scaled to [0, 1] (the best gets 1) and fused like every retriever.
"""

from __future__ import annotations

from collections import defaultdict

from ..model import Scope
from ..pipeline.engine import Engine
from ..store import Query, RelationSelect, Select
from . import rules as g

HOP_DECAY = 0.5
MENTIONS_READ = 5000  # mentions read per search at most (most recent first)


def candidates(engine: Engine, text: str, q: Query, n: int, depth: int = 1) -> list[tuple[str, float]]:
    """Up to `n` (memory id, score) that the query's entities lead to, best first; [] when the
    query names no known entity."""
    store = engine.store
    owner = Scope(q.scope.user_id, q.scope.agent_id)
    named = {eid for _, eid in store.match_names(owner, g.ngrams(text))}
    if not named:
        return []
    at = q.as_of or q.now
    hops = store.neighbours(owner, sorted(named), depth, at, as_of=q.as_of is not None) \
        if depth > 0 else dict.fromkeys(named, 0)
    near = {eid: HOP_DECAY ** d for eid, d in hops.items()}
    counts = store.mention_counts(owner, sorted(near))
    most = max(counts.values(), default=0)
    weight = {eid: w * g.rarity(counts.get(eid, 0), most) for eid, w in near.items()}
    score: dict[str, float] = defaultdict(float)
    for m in store.read_mentions(q.scope if q.scope.session_id else owner,
                                 entity_ids=sorted(e for e, w in weight.items() if w > 0),
                                 limit=MENTIONS_READ):
        score[m.episode_id] += weight[m.entity_id]
    if len(named) + len(hops) > 1:
        for r in store.read_relations(RelationSelect(owner, touching=tuple(sorted(named)),
                                                     seen="as_of" if q.as_of else "current",
                                                     at=at)):
            for source in r.provenance:
                score[source] += max(weight.get(r.subject, 0.0), weight.get(r.object or "", 0.0))
    if not score:
        return []
    best = sorted(score.items(), key=lambda s: (-s[1], s[0]))[: 4 * n]
    seen = set(store.read_ids(Select.of(q, ids=tuple(mid for mid, _ in best), order=None)))
    best = [(mid, s) for mid, s in best if mid in seen][:n]
    top = best[0][1] if best else 0.0
    return [(mid, s / top) for mid, s in best] if top > 0 else []

"""The knowledge graph of the reference MCP memory server (entities, observations, relations),
stored as ordinary engram memories so the same `Memory` API searches, lists, audits and erases it.

Mapping (every graph record is a `semantic` memory of the caller's scope; metadata tells them apart):

    entity       "Ana (person)"            {"kg": "entity", "entity": "Ana", "entity_type": "person"}
    observation  "Ana: speaks Portuguese"  {"kg": "observation", "entity": "Ana", "entity_type": "person"}
    relation     "Ana works at Clinic"     {"kg": "relation", "from": "Ana", "to": "Clinic",
                                            "relation_type": "works_at"}

Metadata keys are flat because engram's filters address top-level keys: `{"kg": "relation",
"from": "Ana"}` finds Ana's outgoing relations. Texts carry the entity name, so two entities'
identical observations stay two memories and hybrid search finds facts by whom they are about.
Deletions are soft deletes (a DELETE event each; `Memory.history` keeps them). Graph writes go
through `Memory.add`, so they are consolidated like any fact: an exact repeat adds nothing, a
near-duplicate merges into what is stored (a MERGE event says so).
"""

from __future__ import annotations

import contextlib
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import Memory
from ..errors import InvalidInput, NotFound
from ..model import MemoryRecord, Scope

KG = "kg"  # the metadata key marking a graph record
ENTITY, OBSERVATION, RELATION = "entity", "observation", "relation"
MAX_BATCH = 1000     # items per call: a tool call is one request, not a bulk import
MAX_NAME_CHARS = 256  # entity names and types, relation types
PAGE = 1000          # Memory.list's largest page
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Entity:
    name: str
    entity_type: str
    observations: tuple[str, ...] = ()


@dataclass(frozen=True)
class Relation:
    source: str          # "from" on the wire (a Python keyword here)
    target: str          # "to"
    relation_type: str


@dataclass(frozen=True)
class Graph:
    entities: list[Entity] = field(default_factory=list)
    relations: list[Relation] = field(default_factory=list)


# -- writes -------------------------------------------------------------------------------------

def create_entities(mem: Memory, entities: Sequence[Entity], scope: Scope) -> tuple[list[Entity], list[str]]:
    """Create the entities whose names are new; returns (created, skipped names).

    Like the reference server, an existing name (or one repeated in the batch) is skipped with
    its observations: `add_observations` is how facts are added to an existing entity.
    """
    _batch(entities, "entities")
    for e in entities:
        _name(e.name, "entity name")
        _name(e.entity_type, "entity type")
        _observations(e.observations)
    existing = set(_entities(mem, scope, [e.name for e in entities]))
    created: list[Entity] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for e in entities:
        if e.name in existing or e.name in seen:
            skipped.append(e.name)
            continue
        seen.add(e.name)
        created.append(Entity(e.name, e.entity_type, tuple(_unique(e.observations))))
    messages = []
    for e in created:
        meta = {KG: ENTITY, "entity": e.name, "entity_type": e.entity_type}
        messages.append({"content": entity_text(e.name, e.entity_type), "metadata": meta})
        messages += [_observation_message(e.name, e.entity_type, o) for o in e.observations]
    _write(mem, messages, scope)
    return created, skipped


def create_relations(mem: Memory, relations: Sequence[Relation], scope: Scope) -> list[Relation]:
    """Create the relations not stored yet; both ends must be existing entities (else NotFound,
    and nothing is written)."""
    _batch(relations, "relations")
    for r in relations:
        _name(r.source, "relation 'from'")
        _name(r.target, "relation 'to'")
        _name(r.relation_type, "relation type")
    known = _entities(mem, scope, [n for r in relations for n in (r.source, r.target)])
    for r in relations:
        for end in (r.source, r.target):
            if end not in known:
                raise NotFound(f"entity with name {end!r} not found")
    stored = {_relation(rec) for rec in _relation_records(mem, scope, "from", [r.source for r in relations])}
    new = [r for r in dict.fromkeys(relations) if r not in stored]
    _write(mem, [{"content": relation_text(r), "metadata": {
        KG: RELATION, "from": r.source, "to": r.target, "relation_type": r.relation_type}}
        for r in new], scope)
    return new


def add_observations(mem: Memory, additions: Sequence[tuple[str, Sequence[str]]],
                     scope: Scope) -> list[tuple[str, list[str]]]:
    """Add observations to existing entities; returns, per entity, the observations that were
    new to it. An unknown entity is NotFound and nothing is written."""
    _batch(additions, "observations")
    for name, contents in additions:
        _name(name, "entity name")
        _observations(contents)
    types = _entities(mem, scope, [name for name, _ in additions])
    for name, _ in additions:
        if name not in types:
            raise NotFound(f"entity with name {name!r} not found")
    have: dict[str, set[str]] = {}
    for rec in _records(mem, scope, {KG: OBSERVATION, "entity": {"in": sorted(types)}}):
        have.setdefault(rec.metadata["entity"], set()).add(normalize(observation_of(rec)))
    results: list[tuple[str, list[str]]] = []
    messages = []
    for name, contents in additions:
        known = have.setdefault(name, set())
        added = [o for o in _unique(contents) if normalize(o) not in known]
        known.update(normalize(o) for o in added)
        messages += [_observation_message(name, types[name], o) for o in added]
        results.append((name, added))
    _write(mem, messages, scope)
    return results


def delete_entities(mem: Memory, names: Sequence[str], scope: Scope) -> tuple[list[str], list[str]]:
    """Soft-delete entities with their observations and every relation touching them.

    Returns (deleted names, names not found); unknown names are not an error.
    """
    _batch(names, "entityNames")
    for n in names:
        _name(n, "entity name")
    wanted = sorted(set(names))
    records = _records(mem, scope, {KG: {"in": [ENTITY, OBSERVATION]}, "entity": {"in": wanted}})
    present = {r.metadata["entity"] for r in records if r.metadata.get(KG) == ENTITY}
    records += _relation_records(mem, scope, "from", wanted)
    records += _relation_records(mem, scope, "to", wanted)
    _delete(mem, records, scope)
    asked = list(dict.fromkeys(names))
    return [n for n in asked if n in present], [n for n in asked if n not in present]


def delete_observations(mem: Memory, deletions: Sequence[tuple[str, Sequence[str]]],
                        scope: Scope) -> tuple[int, list[str]]:
    """Soft-delete the given observations; returns (how many were deleted, entities not found)."""
    _batch(deletions, "deletions")
    for name, contents in deletions:
        _name(name, "entity name")
        _observations(contents)
    names = sorted({name for name, _ in deletions})
    present = set(_entities(mem, scope, names))
    drop = {(name, normalize(o)) for name, contents in deletions for o in contents}
    records = [rec for rec in _records(mem, scope, {KG: OBSERVATION, "entity": {"in": names}})
               if (rec.metadata["entity"], normalize(observation_of(rec))) in drop]
    _delete(mem, records, scope)
    return len(records), [name for name in dict.fromkeys(n for n, _ in deletions) if name not in present]


def delete_relations(mem: Memory, relations: Sequence[Relation], scope: Scope) -> int:
    """Soft-delete the given relations; returns how many were deleted."""
    _batch(relations, "relations")
    for r in relations:
        _name(r.source, "relation 'from'")
        _name(r.target, "relation 'to'")
        _name(r.relation_type, "relation type")
    drop = set(relations)
    records = [rec for rec in _relation_records(mem, scope, "from", [r.source for r in relations])
               if _relation(rec) in drop]
    _delete(mem, records, scope)
    return len(records)


# -- reads --------------------------------------------------------------------------------------

def read_graph(mem: Memory, scope: Scope) -> Graph:
    """The whole graph of the scope, entities and relations in the order they were created."""
    return _assemble(_records(mem, scope, {KG: {"in": [ENTITY, OBSERVATION, RELATION]}}))


def open_nodes(mem: Memory, names: Sequence[str], scope: Scope) -> Graph:
    """The named entities (unknown names are skipped) and every relation touching one of them."""
    _batch(names, "names")
    for n in names:
        _name(n, "entity name")
    wanted = sorted(set(names))
    if not wanted:
        return Graph()
    records = _records(mem, scope, {KG: {"in": [ENTITY, OBSERVATION]}, "entity": {"in": wanted}})
    graph = _assemble(records)
    present = [e.name for e in graph.entities]
    seen: dict[str, MemoryRecord] = {}
    for end in ("from", "to"):
        for rec in _relation_records(mem, scope, end, present):
            seen.setdefault(rec.id, rec)
    return Graph(graph.entities, [_relation(r) for r in sorted(seen.values(), key=lambda r: r.id)])


def search_nodes(mem: Memory, query: str, scope: Scope, *, limit: int = 10,
                 min_relative: float = 0.5) -> Graph:
    """Entities found by engram's hybrid search over entity and observation texts, best first,
    with every relation touching them.

    Hybrid scores have no absolute scale, so relevance is relative: a hit is kept when its fused
    retrieval score (dense + lexical, before recency and importance) is at least `min_relative`
    of the best hit's. The best match is always returned, as the nearest node.
    """
    hits = mem.search(query, **_owner(scope), kinds=["semantic"], limit=limit,
                      filters={KG: {"in": [ENTITY, OBSERVATION]}})
    if not hits:
        return Graph()
    best = max(h.explain.get("fused", h.score) for h in hits)
    order = list(dict.fromkeys(h.memory.metadata["entity"] for h in hits
                               if h.explain.get("fused", h.score) >= min_relative * best))
    graph = open_nodes(mem, order, scope)
    rank = {name: i for i, name in enumerate(order)}
    return Graph(sorted(graph.entities, key=lambda e: rank[e.name]), graph.relations)


# -- the mapping ----------------------------------------------------------------------------------

def entity_text(name: str, entity_type: str) -> str:
    return f"{name} ({entity_type})"


def observation_text(entity: str, observation: str) -> str:
    return f"{entity}: {observation}"


def relation_text(r: Relation) -> str:
    # "works_at" reads (and embeds) better as "works at"; the metadata keeps the exact type.
    return f"{r.source} {r.relation_type.replace('_', ' ')} {r.target}"


def observation_of(rec: MemoryRecord) -> str:
    """The observation an observation memory holds. A merge may have replaced its text with a
    longer one without the "<entity>: " prefix; then the whole text is the observation."""
    return rec.text.removeprefix(f"{rec.metadata['entity']}: ")


def normalize(text: str) -> str:
    """The form two observations share when they are the same observation: the form engram
    gives a text to find exact duplicates (`Memory.add` stores one of them). A test keeps the
    two in step; the graph has its own copy because it sees engram only through `Memory`."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = _SPACE.sub(" ", text).strip()
    return text.rstrip(".!?;: ")


def _observation_message(entity: str, entity_type: str, observation: str) -> dict[str, Any]:
    return {"content": observation_text(entity, observation),
            "metadata": {KG: OBSERVATION, "entity": entity, "entity_type": entity_type}}


def _relation(rec: MemoryRecord) -> Relation:
    m = rec.metadata
    return Relation(m["from"], m["to"], m["relation_type"])


def _assemble(records: Iterable[MemoryRecord]) -> Graph:
    types: dict[str, str] = {}
    observations: dict[str, list[str]] = {}
    relations: list[Relation] = []
    for rec in records:  # creation order: an entity's record comes before its observations
        kind = rec.metadata.get(KG)
        if kind == ENTITY:
            types.setdefault(rec.metadata["entity"], rec.metadata["entity_type"])
        elif kind == OBSERVATION:
            observations.setdefault(rec.metadata["entity"], []).append(observation_of(rec))
        elif kind == RELATION:
            relations.append(_relation(rec))
    entities = [Entity(name, t, tuple(observations.get(name, ()))) for name, t in types.items()]
    return Graph(entities, list(dict.fromkeys(relations)))


# -- access through the Memory API ----------------------------------------------------------------

def _records(mem: Memory, scope: Scope, filters: dict[str, Any]) -> list[MemoryRecord]:
    """Every visible memory matching `filters`, in creation order (all pages)."""
    out: list[MemoryRecord] = []
    cursor: str | None = None
    while True:
        page = mem.list(**_owner(scope), kinds=["semantic"], filters=filters, cursor=cursor, limit=PAGE)
        out += page.items
        if page.next_cursor is None:
            return out
        cursor = page.next_cursor


def _entities(mem: Memory, scope: Scope, names: Iterable[str]) -> dict[str, str]:
    """The existing entities among `names`: name -> entity type."""
    wanted = sorted(set(names))
    if not wanted:
        return {}
    found: dict[str, str] = {}
    for rec in _records(mem, scope, {KG: ENTITY, "entity": {"in": wanted}}):
        found.setdefault(rec.metadata["entity"], rec.metadata["entity_type"])
    return found


def _relation_records(mem: Memory, scope: Scope, end: str, names: Iterable[str]) -> list[MemoryRecord]:
    wanted = sorted(set(names))
    return _records(mem, scope, {KG: RELATION, end: {"in": wanted}}) if wanted else []


def _owner(scope: Scope) -> dict[str, Any]:
    # A graph belongs to a user (and agent), not to one conversation: session_id is not used.
    return {"user_id": scope.user_id, "agent_id": scope.agent_id}


def _write(mem: Memory, messages: list[dict[str, Any]], scope: Scope) -> None:
    # One `add` call: one transaction for the whole batch, embedded before it. Given facts are
    # stored as they are (no LLM extraction).
    if messages:
        mem.add(messages, **_owner(scope), kind="semantic", infer=False)


def _delete(mem: Memory, records: Iterable[MemoryRecord], scope: Scope) -> None:
    for rec_id in dict.fromkeys(r.id for r in records):
        with contextlib.suppress(NotFound):  # deleted meanwhile by another caller: same outcome
            mem.delete(rec_id, **_owner(scope))


# -- validation (before anything is read or written) ----------------------------------------------

def _batch(items: Sequence[Any], what: str) -> None:
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise InvalidInput(f"{what} must be a list")
    if len(items) > MAX_BATCH:
        raise InvalidInput(f"{what} has {len(items)} items; at most {MAX_BATCH} per call")


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(f"{what} must be a non-empty string")
    if len(value) > MAX_NAME_CHARS:
        raise InvalidInput(f"{what} has {len(value)} characters; at most {MAX_NAME_CHARS}")
    return value


def _observations(contents: Sequence[Any]) -> None:
    _batch(contents, "observations of an entity")
    for o in contents:
        if not isinstance(o, str) or not o.strip():
            raise InvalidInput("an observation must be a non-empty string")


def _unique(contents: Iterable[str]) -> list[str]:
    """The observations without repeats (compared as engram compares facts: normalised)."""
    seen: dict[str, str] = {}
    for o in contents:
        seen.setdefault(normalize(o), o)
    return list(seen.values())

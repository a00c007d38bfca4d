"""The knowledge graph of the reference MCP memory server (entities, observations, relations),
stored as ordinary engram memories so the same `Memory` API searches, lists, audits and erases it.

Mapping (every graph record is a `semantic` memory of the caller's scope; metadata tells them apart
and holds the exact values, which is what the graph is read back from):

    entity       "Ana (person)"            {"kg": "entity", "entity": "Ana", "entity_type": "person"}
    observation  "Ana: speaks Portuguese"  {"kg": "observation", "entity": "Ana", "entity_type": "person",
                                            "observation": "speaks Portuguese"}
    relation     "Ana works at Clinic"     {"kg": "relation", "from": "Ana", "to": "Clinic",
                                            "relation_type": "works_at"}

Metadata keys are flat because engram's filters address top-level keys: `{"kg": "relation",
"from": "Ana"}` finds Ana's outgoing relations. Texts carry the entity name, so two entities'
identical observations stay two memories and hybrid search finds facts by whom they are about.

The semantics are the reference server's: names, types and observations are compared exactly
(`ana` and `Ana` are two entities, `likes coffee` and `Likes coffee.` two observations), and a
relation may name entities that do not exist (yet). engram's consolidation never joins two graph
records: their metadata differ (facts whose metadata disagree are never merged), and a text that
engram would take for an exact repeat of a stored one (the same words up to case, spacing and
final punctuation) is stored with a ` #2`, ` #3`, ... suffix; the metadata keeps the exact value.
Deletions are soft deletes (a DELETE event each; `Memory.history` keeps them).

The same writes also go to engram's real knowledge graph (`Memory.relate`, `upsert_entity`;
docs/graph.md), so `entity`, `relations` and `neighbours` — and the graph retriever — see what
the reference tools wrote: a created entity is upserted with its type, a created relation is
related, a deleted relation is retracted, a deleted entity is deleted there too (with its
relations and mentions; `unmirror`). Observations have no counterpart in the real graph:
deleting one touches only its memory. `migrate` mirrors a graph written before that.
The reference tools keep reading the records above: they compare names exactly, while the real
graph resolves them (`ana` and `Ana` are one entity there).
"""

from __future__ import annotations

import contextlib
import json
import re
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from .. import EntityProfile, Memory, Subgraph
from .. import Relation as RealRelation
from ..errors import Conflict, InvalidImport, InvalidInput, NotFound
from ..model import MemoryRecord, Scope

KG = "kg"  # the metadata key marking a graph record
ENTITY, OBSERVATION, RELATION = "entity", "observation", "relation"
MAX_BATCH = 1000     # items per call: a tool call is one request, not a bulk import
MAX_NAME_CHARS = 256  # entity names and types, relation types
PAGE = 1000          # Memory.list's largest page
IN_CHUNK = 500       # names in one `in` filter
MAX_TRIES = 5        # writes of a record that engram took for a repeat of a memory outside the graph
MIN_SIMILARITY = 0.4  # search_nodes: the cosine a meaning-only match needs (MiniLM: unrelated < 0.3)
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

    As in the reference server, names are compared exactly (`ana` is not `Ana`) and an existing
    name is skipped with its observations: `add_observations` adds facts to an existing entity.
    A name repeated within the batch is skipped too, and exact repeats among an entity's
    observations are dropped (the reference would store both).
    """
    _batch(entities, "entities")
    for e in entities:
        _name(e.name, "entity name")
        _name(e.entity_type, "entity type")
        _observations(e.observations)
    created, skipped = _new_entities(entities, set(_entities(mem, scope, [e.name for e in entities])))
    _write(mem, _entity_messages(created), scope)
    mirror(mem, Graph(created, []), scope)
    return created, skipped


def create_relations(mem: Memory, relations: Sequence[Relation], scope: Scope) -> list[Relation]:
    """Create the relations not stored yet (compared exactly). As in the reference server, an end
    need not be an existing entity: the relation is stored, `read_graph` shows it, and it touches
    the entity once that is created."""
    _batch(relations, "relations")
    for r in relations:
        _name(r.source, "relation 'from'")
        _name(r.target, "relation 'to'")
        _name(r.relation_type, "relation type")
    new = _new_relations(relations, _relation_records(mem, scope, "from", [r.source for r in relations]))
    _write(mem, [_relation_message(r) for r in new], scope)
    mirror(mem, Graph([], new), scope)
    return new


def add_observations(mem: Memory, additions: Sequence[tuple[str, Sequence[str]]],
                     scope: Scope) -> list[tuple[str, list[str]]]:
    """Add observations to existing entities; returns, per entity, the observations that were
    new to it (compared exactly, as the reference server does: `Likes coffee.` is not
    `likes coffee`). An unknown entity is NotFound and nothing is written."""
    _batch(additions, "observations")
    for name, contents in additions:
        _name(name, "entity name")
        _observations(contents)
    types = _entities(mem, scope, [name for name, _ in additions])
    for name, _ in additions:
        if name not in types:
            raise NotFound(f"Entity with name {name} not found")
    have: dict[str, set[str]] = {}
    for rec in _records(mem, scope, {KG: OBSERVATION, "entity": {"in": sorted(types)}}):
        have.setdefault(rec.metadata["entity"], set()).add(observation_of(rec))
    results: list[tuple[str, list[str]]] = []
    messages = []
    for name, contents in additions:
        known = have.setdefault(name, set())
        added = [o for o in dict.fromkeys(contents) if o not in known]
        known.update(added)
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
    deleted = [n for n in asked if n in present]
    unmirror(mem, deleted, scope)
    return deleted, [n for n in asked if n not in present]


def delete_observations(mem: Memory, deletions: Sequence[tuple[str, Sequence[str]]],
                        scope: Scope) -> tuple[int, list[str]]:
    """Soft-delete the given observations (exact texts); returns (how many were deleted,
    entities not found)."""
    _batch(deletions, "deletions")
    for name, contents in deletions:
        _name(name, "entity name")
        _observations(contents)
    names = sorted({name for name, _ in deletions})
    present = set(_entities(mem, scope, names))
    drop = {(name, o) for name, contents in deletions for o in contents}
    records = [rec for rec in _records(mem, scope, {KG: OBSERVATION, "entity": {"in": names}})
               if (rec.metadata["entity"], observation_of(rec)) in drop]
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
    for r in {_relation(rec) for rec in records}:
        with contextlib.suppress(NotFound):  # the real graph never had it (written before)
            mem.unrelate(r.source, r.relation_type, r.target, retract=True, **_owner(scope))
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
                 min_similarity: float = MIN_SIMILARITY) -> Graph:
    """The entities the reference server finds, then those engram finds by meaning, with every
    relation touching one of them.

    First, as the reference does, every entity whose name, type or one of whose observations
    contains `query` (case-insensitive), in graph order. Then the entities of engram's hybrid
    search hits (best first) whose text is close in meaning: cosine of the embeddings at least
    `min_similarity`, an absolute floor, so a query that matches nothing returns nothing.
    """
    if not isinstance(query, str):
        raise InvalidInput("query must be a string")
    graph = read_graph(mem, scope)
    needle = query.lower()
    found = [e.name for e in graph.entities
             if needle in e.name.lower() or needle in e.entity_type.lower()
             or any(needle in o.lower() for o in e.observations)]
    if query.strip():
        found += _by_meaning(mem, query, scope, limit, min_similarity)
    names = set(found)
    by_name = {e.name: e for e in graph.entities}
    return Graph([by_name[n] for n in dict.fromkeys(found) if n in by_name],
                 [r for r in graph.relations if r.source in names or r.target in names])


def _by_meaning(mem: Memory, query: str, scope: Scope, limit: int, floor: float) -> list[str]:
    hits = mem.search(query, **_owner(scope), kinds=["semantic"], limit=limit,
                      filters={KG: {"in": [ENTITY, OBSERVATION]}})
    if not hits:
        return []
    # Hybrid scores are relative to the candidates; the floor needs an absolute measure.
    vectors = np.asarray(mem.embedder.embed_batch([query, *(h.memory.text for h in hits)]), dtype=float)
    norms = np.linalg.norm(vectors, axis=1)
    norms[norms == 0] = 1.0
    cosines = (vectors[1:] @ vectors[0]) / (norms[1:] * norms[0])
    return [h.memory.metadata["entity"] for h, cos in zip(hits, cosines, strict=True) if cos >= floor]


# -- migration from the reference server ----------------------------------------------------------

@dataclass(frozen=True)
class Imported:
    entities: list[Entity]     # created
    skipped: list[str]         # entity names that already existed (or repeated in the file)
    relations: list[Relation]  # created (repeats of stored relations are skipped)

    @property
    def observations(self) -> int:
        return sum(len(e.observations) for e in self.entities)


def read_reference_file(path: Path) -> Graph:
    """The graph in a reference server memory file (`memory.jsonl`: one JSON object a line,
    `{"type": "entity", "name", "entityType", "observations"}` or `{"type": "relation", "from",
    "to", "relationType"}`). The whole file is checked first: InvalidImport names the bad line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidImport(f"cannot read {path}: {exc}") from None
    entities: list[Entity] = []
    relations: list[Relation] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict):
                raise InvalidInput("not a JSON object")
            if item.get("type") == "entity":
                observations = item.get("observations", [])
                if not isinstance(observations, list):
                    raise InvalidInput("observations must be a list")
                entities.append(Entity(_name(item.get("name"), "name"),
                                       _name(item.get("entityType"), "entityType"), tuple(observations)))
                _observations(observations)
            elif item.get("type") == "relation":
                relations.append(Relation(_name(item.get("from"), "from"), _name(item.get("to"), "to"),
                                          _name(item.get("relationType"), "relationType")))
            else:
                raise InvalidInput('"type" must be "entity" or "relation"')
        except (json.JSONDecodeError, InvalidInput) as exc:
            raise InvalidImport(f"{path}, line {n}: {exc}") from None
    return Graph(entities, relations)


def import_graph(mem: Memory, graph: Graph, scope: Scope) -> Imported:
    """Store a reference server's graph (see `read_reference_file`) in one write: entities whose
    name exists are skipped, as `create_entities` skips them; relations already stored too."""
    existing = set(_entities(mem, scope, [e.name for e in graph.entities]))
    created, skipped = _new_entities(graph.entities, existing)
    new = _new_relations(graph.relations,
                         _relation_records(mem, scope, "from", [r.source for r in graph.relations]))
    _write(mem, _entity_messages(created) + [_relation_message(r) for r in new], scope)
    mirror(mem, Graph(created, new), scope)
    return Imported(created, skipped, new)


# -- the real knowledge graph ---------------------------------------------------------------------

def mirror(mem: Memory, graph: Graph, scope: Scope) -> tuple[int, int]:
    """Write entities (with their type) and relations into engram's knowledge graph; returns
    how many of each. Relations hold from now on and are many-valued (the reference server has
    no notion of one current value)."""
    for e in graph.entities:
        mem.upsert_entity(e.name, type=e.entity_type, **_owner(scope))
    for r in graph.relations:
        mem.relate(r.source, r.relation_type, r.target, single=False, **_owner(scope))
    return len(graph.entities), len(graph.relations)


def unmirror(mem: Memory, names: Sequence[str], scope: Scope) -> list[str]:
    """Delete from the real graph the entities that these deleted names resolve to (with
    their relations and mentions: `Memory.delete_entity`); returns their ids. One stays when
    a reference entity that is still there resolves to it too: the real graph resolves names
    (`ana` and `Ana` are one entity there, two here), so deleting `ana` must not take `Ana`."""
    targets: dict[str, set[str]] = {}
    for name in names:
        with contextlib.suppress(NotFound):  # the real graph never had it (written before)
            e = mem.entity(name, **_owner(scope), mentions=1).entity
            targets[e.id] = _words(e.name, *e.aliases)
    if targets:
        for rec in _records(mem, scope, {KG: ENTITY}):
            other = rec.metadata["entity"]
            near = [eid for eid, words in targets.items() if words & _words(other)]
            if near:  # shares a word with a target's names: ask the real graph which it is
                with contextlib.suppress(NotFound):
                    targets.pop(mem.entity(other, **_owner(scope), mentions=1).entity.id, None)
    gone = []
    for eid in targets:
        with contextlib.suppress(NotFound):  # deleted meanwhile by another caller
            mem.delete_entity(eid, **_owner(scope))
            gone.append(eid)
    return gone


def _words(*names: str) -> set[str]:
    """The words of names as the real graph compares them, roughly (case, accents and dots
    dropped): a cheap filter before asking it."""
    out: set[str] = set()
    for name in names:
        text = unicodedata.normalize("NFKD", name.replace(".", ""))
        text = "".join(c for c in text if not unicodedata.combining(c)).casefold()
        out |= set(re.findall(r"\w+", text))
    return out


def migrate(mem: Memory, scope: Scope) -> tuple[int, int]:
    """Migrate the `kg` records of a scope (written by these tools before engram had a real
    graph) into entities and relations. Idempotent: an entity resolves to itself and a
    relation that holds already is returned as it is."""
    return mirror(mem, read_graph(mem, scope), scope)


# -- the mapping ----------------------------------------------------------------------------------

def entity_text(name: str, entity_type: str) -> str:
    return f"{name} ({entity_type})"


def observation_text(entity: str, observation: str) -> str:
    return f"{entity}: {observation}"


def relation_text(r: Relation) -> str:
    # "works_at" reads (and embeds) better as "works at"; the metadata keeps the exact type.
    return f"{r.source} {r.relation_type.replace('_', ' ')} {r.target}"


def observation_of(rec: MemoryRecord) -> str:
    """The observation an observation memory holds: its metadata's exact value (records written
    before it was kept there: the text after "<entity>: ")."""
    exact = rec.metadata.get("observation")
    if isinstance(exact, str):
        return exact
    return rec.text.removeprefix(f"{rec.metadata['entity']}: ")


def normalize(text: str) -> str:
    """The form two texts share when engram takes them for exact duplicates (`Memory.add`
    stores one of them). A test keeps the two in step; the graph has its own copy because it
    sees engram only through `Memory`. The graph uses it to keep its records apart."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = _SPACE.sub(" ", text).strip()
    return text.rstrip(".!?;: ")


def _new_entities(entities: Sequence[Entity], existing: set[str]) -> tuple[list[Entity], list[str]]:
    created: list[Entity] = []
    skipped: list[str] = []
    seen: set[str] = set(existing)
    for e in entities:
        if e.name in seen:
            skipped.append(e.name)
            continue
        seen.add(e.name)
        created.append(Entity(e.name, e.entity_type, tuple(dict.fromkeys(e.observations))))
    return created, skipped


def _new_relations(relations: Sequence[Relation], stored: Iterable[MemoryRecord]) -> list[Relation]:
    have = {_relation(rec) for rec in stored}
    return [r for r in dict.fromkeys(relations) if r not in have]


def _entity_messages(created: Iterable[Entity]) -> list[dict[str, Any]]:
    messages = []
    for e in created:
        meta = {KG: ENTITY, "entity": e.name, "entity_type": e.entity_type}
        messages.append({"content": entity_text(e.name, e.entity_type), "metadata": meta})
        messages += [_observation_message(e.name, e.entity_type, o) for o in e.observations]
    return messages


def _observation_message(entity: str, entity_type: str, observation: str) -> dict[str, Any]:
    return {"content": observation_text(entity, observation),
            "metadata": {KG: OBSERVATION, "entity": entity, "entity_type": entity_type,
                         "observation": observation}}


def _relation_message(r: Relation) -> dict[str, Any]:
    return {"content": relation_text(r), "metadata": {
        KG: RELATION, "from": r.source, "to": r.target, "relation_type": r.relation_type}}


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
    for chunk in _chunks(wanted):
        for rec in _records(mem, scope, {KG: ENTITY, "entity": {"in": chunk}}):
            found.setdefault(rec.metadata["entity"], rec.metadata["entity_type"])
    return found


def _relation_records(mem: Memory, scope: Scope, end: str, names: Iterable[str]) -> list[MemoryRecord]:
    wanted = sorted(set(names))
    out: list[MemoryRecord] = []
    for chunk in _chunks(wanted):
        out += _records(mem, scope, {KG: RELATION, end: {"in": chunk}})
    return sorted(out, key=lambda r: r.id) if len(wanted) > IN_CHUNK else out


def _chunks(names: list[str]) -> Iterator[list[str]]:
    """Names in groups small enough for one `in` filter (a bulk import names thousands)."""
    for i in range(0, len(names), IN_CHUNK):
        yield names[i:i + IN_CHUNK]


def _owner(scope: Scope) -> dict[str, Any]:
    # A graph belongs to a user (and agent), not to one conversation: session_id is not used.
    return {"user_id": scope.user_id, "agent_id": scope.agent_id}


def _write(mem: Memory, messages: list[dict[str, Any]], scope: Scope) -> None:
    """Store graph records, each as a memory of its own.

    One `add` call: one transaction for the whole batch, embedded before it; given facts are
    stored as they are (no LLM extraction). Consolidation would take a record for an exact
    repeat of a stored memory whose text is the same up to case, spacing and final punctuation
    (`ana (person)` and `Ana (person)`): such a text gets a ` #2`-style suffix first. A record
    that engram took for a repeat of a memory outside the graph (which the graph does not read)
    adopts that memory: it gets the record's metadata, and keeps its own text."""
    if not messages:
        return
    used = {normalize(r.text) for r in _records(mem, scope, {KG: {"in": [ENTITY, OBSERVATION, RELATION]}})}
    pending = messages
    for _ in range(MAX_TRIES):
        batch = [_distinct(m, used) for m in pending]
        result = mem.add(batch, **_owner(scope), kind="semantic", infer=False)
        pending = []
        for m in batch:
            if any(_holds(rec, m["metadata"]) for rec in result.memories):
                continue
            twin = next((r for r in result.memories
                         if KG not in r.metadata and normalize(r.text) == normalize(m["content"])), None)
            if twin is None:
                pending.append(m)  # another writer's graph record: again, with the next suffix
            else:
                mem.update(twin.id, metadata={**twin.metadata, **m["metadata"]}, **_owner(scope))
        if not pending:
            return
    raise Conflict(f"could not store {len(pending)} graph records apart from existing memories")


def _distinct(message: dict[str, Any], used: set[str]) -> dict[str, Any]:
    text = base = message["content"]
    n = 1
    while normalize(text) in used:
        n += 1
        text = f"{base} #{n}"
    used.add(normalize(text))
    return {**message, "content": text}


def _holds(rec: MemoryRecord, metadata: dict[str, Any]) -> bool:
    """Does this stored memory hold the graph record with this metadata?"""
    return all(rec.metadata.get(k) == v for k, v in metadata.items())


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


# -- the real graph's tools: entity, relations, neighbours (wire shapes) --------------------------

class GraphEntity(BaseModel):
    id: str
    name: str
    type: str
    aliases: list[str]
    summary: str


class GraphRelation(BaseModel):
    id: str
    subject: str
    predicate: str
    object: str
    fact: str
    valid_from: str | None
    valid_to: str | None


class GraphMention(BaseModel):
    id: str
    text: str
    name: str | None
    observed_at: str | None


class EntityResult(GraphEntity):
    relations: list[GraphRelation]
    mentions: list[GraphMention]


class RelationsResult(BaseModel):
    relations: list[GraphRelation]


class NeighboursResult(BaseModel):
    entities: list[GraphEntity]
    relations: list[GraphRelation]


def entity_result(profile: EntityProfile) -> EntityResult:
    return EntityResult.model_validate(profile.to_dict())


def relations_result(relations: Sequence[RealRelation]) -> RelationsResult:
    return RelationsResult(relations=[GraphRelation.model_validate(r.to_dict()) for r in relations])


def neighbours_result(sub: Subgraph) -> NeighboursResult:
    return NeighboursResult.model_validate(sub.to_dict())

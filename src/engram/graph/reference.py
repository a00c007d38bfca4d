"""The knowledge graph of the reference MCP memory server (entities with observations, relations
between names), kept in engram's one knowledge graph: the reference's shapes on top of the real
entities and relations, not a second copy.

The reference compares names exactly (`ana` and `Ana` are two entities there) where the real
graph resolves them (one entity); so each real entity keeps, in its attributes, the reference
names that resolved to it, with their exact type, observations and creation order:

    entity "Ana" (person), "ana" (person)  ->  the real entity Ana, attributes
        {"mcp": {"Ana": {"type": "person", "observations": ["speaks Portuguese"], "seq": <id>},
                 "ana": {"type": "person", "observations": [], "seq": <id>}}}
    relation Ana -works_at-> Clinic        ->  the real relation Ana -works_at-> Clinic, metadata
        {"mcp": [["Ana", "Clinic", "works_at", <id>]]}

A relation of the reference may name an entity that does not exist (yet): the real relation
ends at a real entity without reference names, which `read_graph` does not list until a
reference entity of that name is created. Deleting a reference relation retracts the real one
once no reference relation is left on it; deleting a reference entity deletes the real entity
(with its relations and mentions) once no reference name is left on it. So `entity`,
`relations`, `neighbours`, graph retrieval, export and erasure see the reference's graph, and
erasing a user erases it in one place.

Graphs written by older versions as tagged memories (`{"kg": "entity" | "observation" |
"relation", ...}` metadata) are converted on first use (`upgrade`): written into the real graph,
then the tagged memories are deleted (a DELETE event each).
"""

from __future__ import annotations

import contextlib
import json
import logging
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import Conflict, InvalidImport, InvalidInput, NotFound
from ..model import Entity as RealEntity
from ..model import Event, EventType, MemoryRecord, Scope, new_id, utcnow
from ..model import Relation as RealRelation
from ..redact import redact
from ..store.base import EntitySelect, RelationSelect, Tx
from . import entities
from . import rules as g

if TYPE_CHECKING:
    from ..memory import Memory

log = logging.getLogger("engram.graph")

REF = "mcp"           # the attribute (entities) and metadata key (relations) of the reference
MAX_BATCH = 1000      # items per call: a tool call is one request, not a bulk import
MAX_NAME_CHARS = 256  # entity names and types, relation types
MAX_REAL_TYPE = 64    # the real graph's longest type: a longer reference type stays reference-only
MIN_SIMILARITY = 0.4  # search_nodes: the cosine a meaning-only match needs (MiniLM: unrelated < 0.3)
RETRACTED = "deleted by the reference graph tools"


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


# -- what the real graph holds of the reference's ------------------------------------------------

@dataclass
class _View:
    """The reference graph of an owner as read from the real one: each reference name with its
    real entity, each reference relation with its real relation."""

    names: dict[str, tuple[RealEntity, dict[str, Any]]]   # name -> (entity, its record)
    relations: dict[Relation, tuple[RealRelation, str]]    # relation -> (real relation, seq)

    def graph(self) -> Graph:
        named = sorted(self.names.items(), key=lambda kv: (str(kv[1][1].get("seq", "")), kv[0]))
        entities = [Entity(name, str(rec.get("type", "")), tuple(rec.get("observations", ())))
                    for name, (_, rec) in named]
        rels = sorted(self.relations.items(), key=lambda kv: kv[1][1])
        return Graph(entities, [r for r, _ in rels])


def _view(mem: Memory, owner: Scope) -> _View:
    """Read inside or outside a write: the store's reads see the write's own changes."""
    store = mem.store
    names: dict[str, tuple[RealEntity, dict[str, Any]]] = {}
    for e in store.read_entities(EntitySelect(owner, exact=True)):
        for name, rec in _records(e).items():
            names.setdefault(name, (e, rec))
    relations: dict[Relation, tuple[RealRelation, str]] = {}
    for r in store.read_relations(RelationSelect(owner, seen="current", at=utcnow())):
        if r.scope != owner:
            continue
        for source, target, rtype, seq in _triples(r):
            relations.setdefault(Relation(source, target, rtype), (r, seq))
    return _View(names, relations)


def _records(e: RealEntity) -> dict[str, dict[str, Any]]:
    found = e.attributes.get(REF)
    return {k: v for k, v in found.items() if isinstance(v, dict)} if isinstance(found, dict) else {}


def _triples(r: RealRelation) -> list[tuple[str, str, str, str]]:
    found = r.metadata.get(REF)
    if not isinstance(found, list):
        return []
    return [(t[0], t[1], t[2], t[3]) for t in found
            if isinstance(t, list) and len(t) == 4 and all(isinstance(x, str) for x in t)]


def _put_records(tx: Tx, e: RealEntity, records: dict[str, dict[str, Any]]) -> RealEntity:
    attributes = {k: v for k, v in e.attributes.items() if k != REF}
    if records:
        attributes[REF] = records
    e = replace(e, attributes=attributes, updated_at=utcnow())
    tx.put_entity(e, g.name_keys(e.name, e.aliases))
    return e


def _owner(scope: Scope) -> Scope:
    # A graph belongs to a user (and agent), not to one conversation: session_id is not used.
    return Scope(scope.user_id, scope.agent_id)


def _args(scope: Scope) -> dict[str, Any]:
    return {"user_id": scope.user_id, "agent_id": scope.agent_id}


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
        _observations(e.observations, mem.config.max_text_chars)
    owner = upgrade(mem, scope)
    entities = [replace(e, observations=_redacted(mem, e.observations)) for e in entities]
    fresh, _ = _new_entities(entities, set(_view(mem, owner).names))
    # The real entities first (resolved or created, each in its own write), then, in one write,
    # the reference's records on them: a name another caller created meanwhile is skipped.
    real = {e.name: _real_entity(mem, e, owner) for e in fresh}
    with mem.store.write() as tx:
        created, skipped = _new_entities(entities, set(_view(mem, owner).names))
        for e in created:
            target = _current(mem, real[e.name])
            records = _records(target)
            records[e.name] = {"type": e.entity_type, "observations": list(e.observations),
                               "seq": new_id()}
            _put_records(tx, target, records)
    return created, skipped


def _redacted(mem: Memory, observations: Sequence[str]) -> tuple[str, ...]:
    """Observations as they are stored: with the secrets ENGRAM_REDACT finds replaced, as in
    every text engram keeps (the same observation given twice compares equal again)."""
    return tuple(redact(o, mem.config.redact).text for o in observations)


def _real_entity(mem: Memory, e: Entity, owner: Scope) -> str:
    typ = e.entity_type if len(e.entity_type) <= MAX_REAL_TYPE else None
    return mem.upsert_entity(e.name, type=typ, **_args(owner)).id


def _current(mem: Memory, entity_id: str) -> RealEntity:
    found = mem.store.read_entities(EntitySelect(ids=(entity_id,)))
    if not found:  # deleted by another caller between the two writes
        raise Conflict("an entity was deleted while it was being written; try again")
    return found[0]


def create_relations(mem: Memory, relations: Sequence[Relation], scope: Scope) -> list[Relation]:
    """Create the relations not stored yet (compared exactly). As in the reference server, an end
    need not be an existing entity: the relation is stored, `read_graph` shows it, and it touches
    the entity once that is created."""
    _batch(relations, "relations")
    for r in relations:
        _name(r.source, "relation 'from'")
        _name(r.target, "relation 'to'")
        _name(r.relation_type, "relation type")
        if not g.predicate_key(r.relation_type):
            raise InvalidInput("relation type must have a word in it")
    owner = upgrade(mem, scope)
    have = _view(mem, owner).relations
    fresh = [r for r in dict.fromkeys(relations) if r not in have]
    real = {r: mem.relate(r.source, r.relation_type, r.target, single=False, **_args(owner)).id
            for r in fresh}
    with mem.store.write() as tx:
        have = _view(mem, owner).relations
        new = [r for r in fresh if r not in have]
        for r in new:
            found = mem.store.read_relations(RelationSelect(ids=(real[r],), seen="all"))
            if not found:
                raise Conflict("a relation was deleted while it was being written; try again")
            rel = found[0]
            triples = [list(t) for t in _triples(rel)]
            triples.append([r.source, r.target, r.relation_type, new_id()])
            tx.put_relation(replace(rel, metadata={**rel.metadata, REF: triples}))
    return new


def add_observations(mem: Memory, additions: Sequence[tuple[str, Sequence[str]]],
                     scope: Scope) -> list[tuple[str, list[str]]]:
    """Add observations to existing entities; returns, per entity, the observations that were
    new to it (compared exactly, as the reference server does: `Likes coffee.` is not
    `likes coffee`). An unknown entity is NotFound and nothing is written."""
    _batch(additions, "observations")
    for name, contents in additions:
        _name(name, "entity name")
        _observations(contents, mem.config.max_text_chars)
    owner = upgrade(mem, scope)
    additions = [(name, _redacted(mem, contents)) for name, contents in additions]
    with mem.store.write() as tx:
        view = _view(mem, owner)
        for name, _ in additions:
            if name not in view.names:
                raise NotFound(f"Entity with name {name} not found")
        changed: dict[str, dict[str, dict[str, Any]]] = {}  # entity id -> its records
        results: list[tuple[str, list[str]]] = []
        for name, contents in additions:
            e = view.names[name][0]
            records = changed.setdefault(e.id, _records(e))
            known = records[name].setdefault("observations", [])
            added = [o for o in dict.fromkeys(contents) if o not in known]
            known += added
            results.append((name, added))
        for eid, records in changed.items():
            _put_records(tx, _current(mem, eid), records)
    return results


def delete_entities(mem: Memory, names: Sequence[str], scope: Scope) -> tuple[list[str], list[str]]:
    """Delete entities with their observations and every relation touching them (the real
    entity goes too, with its relations and mentions, once no reference name is left on it).

    Returns (deleted names, names not found); unknown names are not an error.
    """
    _batch(names, "entityNames")
    for n in names:
        _name(n, "entity name")
    owner = upgrade(mem, scope)
    asked = list(dict.fromkeys(names))
    emptied: list[str] = []
    with mem.store.write() as tx:
        view = _view(mem, owner)
        present = [n for n in asked if n in view.names]
        # as the reference does, relations naming an asked name go even if it is no entity
        drop = [r for r in view.relations if r.source in asked or r.target in asked]
        _drop_relations(mem, tx, view, drop)
        # a real entity that ends a reference relation still there stays (its name resolved to
        # it without being a reference entity: `X -knows-> ana` when only `Ana` was created)
        dropped = set(drop)
        ends = {x for r, (real, _) in view.relations.items() if r not in dropped
                for x in (real.subject, real.object)}
        changed: dict[str, dict[str, dict[str, Any]]] = {}
        for n in present:
            e = view.names[n][0]
            changed.setdefault(e.id, _records(e)).pop(n, None)
        for eid, records in changed.items():
            if records or eid in ends:
                _put_records(tx, _current(mem, eid), records)
            else:
                emptied.append(eid)
    for eid in emptied:
        with contextlib.suppress(NotFound):  # deleted meanwhile by another caller
            mem.delete_entity(eid, **_args(owner))
    return present, [n for n in asked if n not in present]


def delete_observations(mem: Memory, deletions: Sequence[tuple[str, Sequence[str]]],
                        scope: Scope) -> tuple[int, list[str]]:
    """Delete the given observations (exact texts); returns (how many were deleted, entities
    not found)."""
    _batch(deletions, "deletions")
    for name, contents in deletions:
        _name(name, "entity name")
        _observations(contents)
    owner = upgrade(mem, scope)
    count = 0
    with mem.store.write() as tx:
        view = _view(mem, owner)
        changed: dict[str, dict[str, dict[str, Any]]] = {}
        for name, contents in deletions:
            if name not in view.names:
                continue
            e = view.names[name][0]
            record = changed.setdefault(e.id, _records(e))[name]
            drop = set(contents) | set(_redacted(mem, contents))  # as stored
            kept = [o for o in record.get("observations", []) if o not in drop]
            count += len(record.get("observations", [])) - len(kept)
            record["observations"] = kept
        for eid, records in changed.items():
            _put_records(tx, _current(mem, eid), records)
    missing = [n for n in dict.fromkeys(n for n, _ in deletions) if n not in view.names]
    return count, missing


def delete_relations(mem: Memory, relations: Sequence[Relation], scope: Scope) -> int:
    """Delete the given relations; returns how many were deleted."""
    _batch(relations, "relations")
    for r in relations:
        _name(r.source, "relation 'from'")
        _name(r.target, "relation 'to'")
        _name(r.relation_type, "relation type")
    owner = upgrade(mem, scope)
    with mem.store.write() as tx:
        view = _view(mem, owner)
        drop = [r for r in dict.fromkeys(relations) if r in view.relations]
        _drop_relations(mem, tx, view, drop)
    return len(drop)


def _drop_relations(mem: Memory, tx: Tx, view: _View, drop: Iterable[Relation]) -> None:
    """Inside a write: take these reference relations off their real relations; a real relation
    left with none is retracted (it never held: `unrelate(retract=True)`), a DELETE event kept."""
    by_real: dict[str, set[Relation]] = {}
    for r in drop:
        by_real.setdefault(view.relations[r][0].id, set()).add(r)
    now = utcnow()
    retired: set[str] = set()
    for rid, rels in by_real.items():
        found = mem.store.read_relations(RelationSelect(ids=(rid,), seen="all"))
        if not found:
            continue
        real = found[0]
        left = [list(t) for t in _triples(real) if Relation(t[0], t[1], t[2]) not in rels]
        if left:
            tx.put_relation(replace(real, metadata={**real.metadata, REF: left}))
            continue
        done = replace(real, expired_at=now, metadata={k: v for k, v in real.metadata.items()
                                                       if k != REF})
        tx.put_relation(done)
        tx.append(Event(id=new_id(), memory_id=done.id, type=EventType.DELETE, at=now,
                        scope=done.scope, before=real.to_dict(), after=done.to_dict(),
                        reason=RETRACTED))
        retired.update(x for x in (real.subject, real.object) if x)
    # the ends' summaries are rewritten without what went, as `unrelate` leaves them
    entities.refresh(mem.store, tx, retired, now, forget=True)


# -- reads --------------------------------------------------------------------------------------

def read_graph(mem: Memory, scope: Scope) -> Graph:
    """The whole graph of the scope, entities and relations in the order they were created."""
    return _view(mem, upgrade(mem, scope)).graph()


def open_nodes(mem: Memory, names: Sequence[str], scope: Scope) -> Graph:
    """The named entities (unknown names are skipped) and every relation touching one of them."""
    _batch(names, "names")
    for n in names:
        _name(n, "entity name")
    graph = read_graph(mem, scope)
    wanted = set(names)
    entities = [e for e in graph.entities if e.name in wanted]
    present = {e.name for e in entities}
    return Graph(entities, [r for r in graph.relations if r.source in present or r.target in present])


def search_nodes(mem: Memory, query: str, scope: Scope, *, limit: int = 10,
                 min_similarity: float = MIN_SIMILARITY) -> Graph:
    """The entities the reference server finds, then those engram finds by meaning, with every
    relation touching one of them.

    First, as the reference does, every entity whose name, type or one of whose observations
    contains `query` (case-insensitive), in graph order. Then, best first, at most `limit`
    entities whose name and type or one of whose observations is close in meaning: the cosine
    of the embeddings at least `min_similarity`, an absolute floor, so a query that matches
    nothing returns nothing.
    """
    if not isinstance(query, str):
        raise InvalidInput("query must be a string")
    graph = read_graph(mem, scope)
    needle = query.lower()
    found = [e.name for e in graph.entities
             if needle in e.name.lower() or needle in e.entity_type.lower()
             or any(needle in o.lower() for o in e.observations)]
    if query.strip():
        found += _by_meaning(mem, query, graph.entities, limit, min_similarity)
    names = set(found)
    by_name = {e.name: e for e in graph.entities}
    return Graph([by_name[n] for n in dict.fromkeys(found)],
                 [r for r in graph.relations if r.source in names or r.target in names])


def _by_meaning(mem: Memory, query: str, entities: Sequence[Entity], limit: int,
                floor: float) -> list[str]:
    texts: list[str] = []
    owners: list[str] = []
    for e in entities:
        for text in (entity_text(e.name, e.entity_type),
                     *(observation_text(e.name, o) for o in e.observations)):
            texts.append(text)
            owners.append(e.name)
    if not texts:
        return []
    vectors = np.vstack([_embedded(mem, [query])[0], _embedded(mem, texts)]).astype(float)
    norms = np.linalg.norm(vectors, axis=1)
    norms[norms == 0] = 1.0
    cosines = (vectors[1:] @ vectors[0]) / (norms[1:] * norms[0])
    best: dict[str, float] = {}
    for name, cos in zip(owners, cosines, strict=True):
        best[name] = max(best.get(name, -1.0), float(cos))
    ranked = sorted((n for n, c in best.items() if c >= floor), key=lambda n: -best[n])
    return ranked[:limit]


MAX_CACHED = 100_000  # vectors of graph texts kept per Memory (about 150 MB of float32 at most)
_vectors: weakref.WeakKeyDictionary[Any, dict[str, np.ndarray]] = weakref.WeakKeyDictionary()


def _embedded(mem: Memory, texts: Sequence[str]) -> np.ndarray:
    """The embeddings of `texts`, those of texts seen before from a cache kept with `mem`: a
    search embeds only what is new since the last one (a text's vector never changes)."""
    cache = _vectors.setdefault(mem, {})
    missing = list(dict.fromkeys(t for t in texts if t not in cache))
    if missing:
        if len(cache) + len(missing) > MAX_CACHED:
            cache.clear()
        for i in range(0, len(missing), 256):
            batch = missing[i:i + 256]
            cache.update(zip(batch, np.asarray(mem.embedder.embed_batch(batch), dtype=np.float32),
                             strict=True))
    return np.asarray([cache[t] for t in texts])


def entity_text(name: str, entity_type: str) -> str:
    return f"{name} ({entity_type})"


def observation_text(entity: str, observation: str) -> str:
    return f"{entity}: {observation}"


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
    """Store a reference server's graph (see `read_reference_file`): entities whose name exists
    are skipped, as `create_entities` skips them; relations already stored too. Written in
    batches of `MAX_BATCH`, entities first."""
    created: list[Entity] = []
    skipped: list[str] = []
    new: list[Relation] = []
    for i in range(0, len(graph.entities), MAX_BATCH):
        done, passed = create_entities(mem, graph.entities[i:i + MAX_BATCH], scope)
        created += done
        skipped += passed
    relations = list(dict.fromkeys(graph.relations))
    for i in range(0, len(relations), MAX_BATCH):
        new += create_relations(mem, relations[i:i + MAX_BATCH], scope)
    return Imported(created, skipped, new)


# -- graphs written as tagged memories by older versions ------------------------------------------

KG = "kg"  # the metadata key that marked a graph record
_upgraded: weakref.WeakKeyDictionary[Any, set[Scope]] = weakref.WeakKeyDictionary()


def upgrade(mem: Memory, scope: Scope) -> Scope:
    """The owner of `scope`, its graph converted from tagged memories first if an older version
    wrote it so (once per Memory and owner: later calls only look the owner up here)."""
    owner = _owner(scope)
    done = _upgraded.setdefault(mem, set())
    if owner not in done:
        migrate(mem, owner)
        done.add(owner)
    return owner


def migrate(mem: Memory, scope: Scope) -> tuple[int, int]:
    """Convert the `kg` memories of a scope (the graph as older versions kept it) into the real
    graph, then delete them (a DELETE event each: the history keeps what they were). Returns
    how many entities and relations were converted; (0, 0) once done."""
    owner = _owner(scope)
    records = _tagged(mem, owner)
    if not records:
        return 0, 0
    old = _assemble(records)
    done_owners = _upgraded.setdefault(mem, set())
    done_owners.add(owner)  # the writes below must not come back here
    try:
        done = import_graph(mem, old, owner)
    except BaseException:
        done_owners.discard(owner)  # the next call tries again
        raise
    for rec in records:
        with contextlib.suppress(NotFound):  # deleted meanwhile by another caller
            mem.delete(rec.id, **_args(owner))
    log.info("converted %d graph memories of %s into %d entities and %d relations",
             len(records), owner, len(done.entities), len(done.relations))
    return len(old.entities), len(old.relations)


def _tagged(mem: Memory, owner: Scope) -> list[MemoryRecord]:
    out: list[MemoryRecord] = []
    cursor: str | None = None
    while True:
        page = mem.list(**_args(owner), kinds=["semantic"], cursor=cursor, limit=1000,
                        filters={KG: {"in": ["entity", "observation", "relation"]}})
        out += page.items
        if page.next_cursor is None:
            return out
        cursor = page.next_cursor


def _assemble(records: Iterable[MemoryRecord]) -> Graph:
    types: dict[str, str] = {}
    observations: dict[str, list[str]] = {}
    relations: list[Relation] = []
    for rec in records:  # creation order: an entity's record comes before its observations
        m = rec.metadata
        with contextlib.suppress(KeyError, TypeError):
            if m.get(KG) == "entity":
                types.setdefault(m["entity"], m["entity_type"])
            elif m.get(KG) == "observation":
                exact = m.get("observation")
                text = exact if isinstance(exact, str) else rec.text.removeprefix(f"{m['entity']}: ")
                observations.setdefault(m["entity"], []).append(text)
            elif m.get(KG) == "relation":
                relations.append(Relation(m["from"], m["to"], m["relation_type"]))
    entities = [Entity(name, t, tuple(dict.fromkeys(observations.get(name, ()))))
                for name, t in types.items()]
    return Graph(entities, list(dict.fromkeys(relations)))


# -- validation (before anything is read or written) ----------------------------------------------

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


def _batch(items: Sequence[Any], what: str) -> None:
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise InvalidInput(f"{what} must be a list")
    if len(items) > MAX_BATCH:
        raise InvalidInput(f"{what} has {len(items)} items; at most {MAX_BATCH} per call")


def _name(value: Any, what: str) -> str:
    return entities.checked_name(value, what, max_chars=MAX_NAME_CHARS)  # exact: not stripped


def _observations(contents: Sequence[Any], max_chars: int | None = None) -> None:
    _batch(contents, "observations of an entity")
    for o in contents:
        if not isinstance(o, str) or not o.strip():
            raise InvalidInput("an observation must be a non-empty string")
        if max_chars is not None and len(o) > max_chars:
            raise InvalidInput(f"an observation has {len(o)} characters; the limit is {max_chars} "
                               "(ENGRAM_MAX_TEXT_CHARS)")
        if "\x00" in o:
            raise InvalidInput("an observation contains a NUL character")

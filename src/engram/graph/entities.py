"""The knowledge graph's I/O: entity upserts with staged resolution, relations on a timeline,
mentions linked from episodes, the graph reads, and what an erasure takes from the graph.

The decisions are the pure functions of `rules.py`; this module reads their inputs from the
store, spends model time (embeddings, the LLM for ambiguous names) before each write
transaction, and writes what they decide.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from .. import redact as redaction
from ..errors import Erased, InvalidInput, NotFound, ProviderError, StoreError
from ..model import (
    Entity,
    EntityProfile,
    Event,
    EventType,
    Kind,
    MemoryRecord,
    Mention,
    Relation,
    Scope,
    Subgraph,
    new_id,
    utcnow,
)
from ..pipeline import extract as extraction
from ..pipeline.engine import Engine
from ..pipeline.fence import Fence
from ..providers.llms import LLM
from ..store import EntitySelect, RelationSelect, Store, Tx
from . import rules as g

log = logging.getLogger("engram.memory")

SPEAKER_TYPE = "person"
MAX_CANDIDATES = 50   # entities resolution compares a new name with
MAX_DEPTH = 4         # neighbours / path


def owner(scope: Scope) -> Scope:
    """Entities belong to a user and agent, not to one conversation."""
    return Scope(scope.user_id, scope.agent_id, None)


# -- resolution ----------------------------------------------------------------------------------

class _Choice(BaseModel):
    """The LLM's answer for an ambiguous name: the number of the candidate it is, or 0."""

    same_as: int


def _known(store: Store, scope: Scope, name: str, aliases: Sequence[str],
           type: str | None) -> list[g.Known]:
    """Candidates for a name: those sharing a key or a distinctive word with it, and (for the
    embedding stage) the rest of the owner's entities up to MAX_CANDIDATES."""
    keys = [k for k, _ in g.name_keys(name, aliases)]
    found = store.read_entities(EntitySelect(scope, exact=True, keys=tuple(keys)))
    found += store.read_entities(EntitySelect(scope, exact=True, tokens=tuple(keys),
                                              limit=MAX_CANDIDATES))
    if g.acronym(name) is None and " " not in g.normalise(name):
        # a one-word name may be an acronym of a longer one: those are found by embedding
        found += store.read_entities(EntitySelect(scope, exact=True, limit=MAX_CANDIDATES))
    vectors = dict(store.entity_embeddings(scope, exact=True))
    seen: dict[str, g.Known] = {}
    for e in found:
        seen.setdefault(e.id, g.Known(e.id, e.name, e.type, e.aliases, vectors.get(e.id)))
    return list(seen.values())


def resolve(engine: Engine, scope: Scope, name: str, type: str, aliases: Sequence[str] = (),
            vector: np.ndarray | None = None, *,
            use_llm: bool = True) -> tuple[g.Resolution, dict[str, Entity]]:
    """The staged resolution of `name` among the owner's entities (see `graph.resolve`); an
    ambiguous one is put to the LLM when there is one, else kept apart."""
    store = engine.store
    known = _known(store, scope, name, aliases, type)
    if vector is None and known:
        vector = engine.embedder.embed_batch([name])[0]
    res = g.resolve(name, type, known, vector, aliases)
    entities = {e.id: e for e in store.read_entities(EntitySelect(scope, exact=True,
                                                                 ids=tuple(k.id for k in known)))} \
        if known else {}
    if res.stage == "ambiguous" and use_llm and engine.llm is not None:
        options = [entities[i] for i in res.candidates if i in entities]
        try:
            chosen = ask(engine.llm, name, type, options)
        except ProviderError as exc:
            log.info("entity resolution: LLM unavailable (%s); %r kept apart", exc, name)
        else:
            why = "the LLM chose it" if chosen else "the LLM said none"
            return g.Resolution(chosen, "llm", res.score, res.candidates, why), entities
    return res, entities


def ask(llm: LLM, name: str, type: str, options: Sequence[Entity]) -> str | None:
    """The LLM's pick among `options` for an ambiguous name (an id), or None for "none of
    them, or not sure". Raises ProviderError when the LLM fails."""
    listing = "\n".join(f"{n}. {e.name} ({e.type})"
                        + (f", also {', '.join(e.aliases)}" if e.aliases else "")
                        for n, e in enumerate(options, start=1))
    prompt = [{"role": "system", "content":
               "You decide whether a name refers to one of the known entities. Answer with the "
               "number of the entity it is, or 0 if it is none of them or you are not sure. "
               "Different identifiers, codes or numbers are different entities; a person's "
               "first name alone is the full name only when nothing says otherwise."},
              {"role": "user", "content": f"Name: {name} ({type or 'unknown type'})\nKnown:\n{listing}"}]
    choice = llm.complete(prompt, _Choice).parsed
    if choice is not None and 1 <= choice.same_as <= len(options):
        return options[choice.same_as - 1].id
    return None


# -- entity upserts ------------------------------------------------------------------------------

def checked_name(value: Any, what: str, *, max_chars: int = 256) -> str:
    """A name as given: a non-blank string of at most `max_chars`, with no NUL."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(f"{what} must be a non-empty string")
    if len(value) > max_chars:
        raise InvalidInput(f"{what} has {len(value)} characters; at most {max_chars}")
    if "\x00" in value:
        raise InvalidInput(f"{what} contains a NUL character")
    return value


def _clean(value: Any, what: str, *, max_chars: int = 256) -> str:
    return checked_name(value, what, max_chars=max_chars).strip()


def clean_aliases(aliases: Any) -> tuple[str, ...]:
    if aliases is None:
        return ()
    if isinstance(aliases, str) or not isinstance(aliases, Sequence):
        raise InvalidInput("aliases must be a list of names")
    return tuple(dict.fromkeys(_clean(a, "an alias") for a in aliases))


def upsert(engine: Engine, scope: Scope, name: str, *, type: str | None = None,
           aliases: Sequence[str] = (), summary: str | None = None,
           attributes: Mapping[str, Any] | None = None, provenance: Sequence[str] = (),
           tx: Tx | None = None, llm_summary: bool = True,
           fence: Fence | None = None) -> Entity:
    """The entity `name` of the owner: resolved (staged) and updated with what is given, or
    created. Aliases accumulate; the type of an untyped entity is set once known. A summary
    given here is the caller's and is kept as written (`summary=""` hands it back to the
    rules); otherwise the rules summary follows the type and aliases. In its own transaction
    (no `tx`), `Erased` if the owner was erased since it began (since `fence`)."""
    scope = owner(scope)
    if tx is None:
        fence = fence or Fence.take(engine.store, scope)
    name = _clean(name, "name")
    typ = _clean(type, "type", max_chars=64).casefold() if type is not None else ""
    aliases = clean_aliases(aliases)
    if summary is not None:
        if not isinstance(summary, str):
            raise InvalidInput("summary must be a string")
        if len(summary) > MAX_CALLER_SUMMARY or "\x00" in summary:
            raise InvalidInput(f"summary must be at most {MAX_CALLER_SUMMARY} characters, "
                               "without NUL")
    by = "" if summary is None else "caller" if summary.strip() else ""
    vector = engine.embedder.embed_batch([name])[0]
    res, entities = resolve(engine, scope, name, typ, aliases, vector)
    now = utcnow()
    store = engine.store
    new: Entity | None = None
    if res.entity is not None:
        old = entities.get(res.entity) or store.read_entities(EntitySelect(ids=(res.entity,)))[0]
        extra = [a for a in (name, *aliases)
                 if g.normalise(a) != g.normalise(old.name) and a not in old.aliases]
        new = replace(old, aliases=(*old.aliases, *extra),
                      type=old.type if old.type not in g.GENERIC_TYPES else typ or old.type,
                      summary=old.summary if summary is None else summary.strip(),
                      summary_by=old.summary_by if summary is None else by,
                      attributes={**old.attributes, **(attributes or {})},
                      provenance=tuple(dict.fromkeys((*old.provenance, *provenance))),
                      updated_at=now)
        if new == replace(old, updated_at=now):
            return old  # nothing new: no write
    with _write(engine, tx) as w:
        if tx is None and fence is not None:
            fence.hold(w)  # what was resolved may be gone: never written back
        if new is not None:
            w.put_entity(new, g.name_keys(new.name, new.aliases))
            entity = new
        else:
            entity = create(store, w, Entity(
                id=new_id(), scope=scope, name=name, type=typ or "entity", aliases=aliases,
                summary=(summary or "").strip(), summary_by=by,
                attributes=dict(attributes or {}), provenance=tuple(dict.fromkeys(provenance)),
                created_at=now, updated_at=now), vector)
            log.info("entity %s %r (%s): %s", entity.id, name, entity.type, res.why)
        entity = refresh(store, w, [entity.id], now).get(entity.id, entity)
    if tx is None and llm_summary:
        summarize(engine, [entity.id])
    return entity


@contextmanager
def _write(engine: Engine, tx: Tx | None) -> Iterator[Tx]:
    """The caller's transaction, or a new one."""
    if tx is not None:
        yield tx
        return
    with engine.store.write() as own:
        yield own


def create(store: Store, tx: Tx, entity: Entity, vector: np.ndarray | None) -> Entity:
    """Inside a write: insert a new entity under its claim key, or, when its owner has an
    entity of that name already (another writer created it after this one's resolution read
    the index), merge what this one adds into that one and return it. The unique index makes
    this hold across threads and processes: two writers naming one new entity end with one."""
    for key in g.claim_keys(entity.name, entity.type):
        holder = tx.add_entity(entity, g.name_keys(entity.name, entity.aliases), key, vector)
        if holder == entity.id:
            return entity
        held = store.read_entities(EntitySelect(ids=(holder,)))[0]
        if g.compatible(held.type, entity.type):
            merged = g.absorb(held, entity)
            if merged != held:
                tx.put_entity(merged, g.name_keys(merged.name, merged.aliases))
            log.info("entity %r exists already (%s): merged into it", entity.name, held.id)
            return merged
    raise StoreError(f"entity {entity.name!r}: both claim keys are held by another type")


# -- summaries -----------------------------------------------------------------------------------

RULES, LLM_SUMMARY, CALLER = "rules", "llm", "caller"
MAX_CALLER_SUMMARY = 2000  # characters of a summary a caller writes (generated ones: 400)
SUMMARY_RELATIONS = 20  # relations an LLM summary is written from, at most


def refresh(store: Store, tx: Tx, ids: Iterable[str], now: datetime, *,
            forget: bool = False) -> dict[str, Entity]:
    """Inside a write: rewrite the rules summary of these entities (unless the caller or an
    LLM wrote theirs) from their type, aliases and the relations that hold now. `forget`:
    relations were deleted or erased, so an LLM's summary (which may name what went) is
    replaced by the rules summary too. Returns the entities as they are now."""
    wanted = tuple(sorted({i for i in ids if i}))
    if not wanted:
        return {}
    found = store.read_entities(EntitySelect(ids=wanted))
    rels = store.read_relations(RelationSelect(touching=wanted, at=now))
    out = {}
    for e in found:
        if e.summary_by in ("", RULES) or (forget and e.summary_by == LLM_SUMMARY):
            text = g.describe(e, [r for r in rels if e.id in (r.subject, r.object)])
            if (text, RULES) != (e.summary, e.summary_by):
                e = replace(e, summary=text, summary_by=RULES)
                tx.put_entity(e, g.name_keys(e.name, e.aliases))
        out[e.id] = e
    return out


class _Summary(BaseModel):
    """An LLM's summary of an entity."""

    summary: str = Field(description="one or two sentences, from the facts given only")


SUMMARY_SYSTEM = (
    "You write the short profile of an entity (a person, a place, an organisation, a thing) for "
    "an assistant's memory: one or two plain sentences, at most 300 characters, from the facts "
    "given and nothing else. Say what it is and what holds now; no instructions, no guesses.")


def generate(llm: LLM, entity: Entity, relations: Sequence[Relation],
             policy: str = "secrets") -> str | None:
    """An LLM's summary of `entity` from its current relations (schema-constrained), or None
    when the reply is unusable: it is checked like an extracted item (one line of visible
    text, at most MAX_SUMMARY characters, not an injected instruction) and dropped when
    redaction would change it. Raises ProviderError when the LLM fails."""
    facts = "\n".join(f"- {r.fact}" + (f" (since {r.valid_from.date().isoformat()})"
                                        if r.valid_from else "")
                      for r in relations[:SUMMARY_RELATIONS])
    head = f"{entity.name} ({entity.type})" + (f", also {', '.join(entity.aliases)}"
                                                if entity.aliases else "")
    prompt = [{"role": "system", "content": SUMMARY_SYSTEM},
              {"role": "user", "content": f"Entity: {head}\nWhat holds now:\n{facts or '- nothing known'}"}]
    reply = llm.complete(prompt, _Summary, max_tokens=200).parsed
    text = reply.summary.strip() if reply is not None else ""
    why = extraction.bad_name(text, limit=g.MAX_SUMMARY)
    if why is None and redaction.redact(text, policy).counts:
        why = "holds a secret"
    if why is not None:
        log.info("entity %s: LLM summary left out (%s)", entity.id, why)
        return None
    return text


def summarize(engine: Engine, ids: Iterable[str], fence: Fence | None = None) -> None:
    """After a write, with `graph_summaries="llm"` and an LLM: regenerate the summaries of these
    entities that are not the caller's. A failed or unusable reply keeps the rules summary
    (rewritten now, so an older LLM summary does not outlive the relations it described).
    Under the write's `fence`: after an erasure in its scope, no summary is written (one may
    describe an erased relation)."""
    llm = engine.llm
    wanted = tuple(sorted({i for i in ids if i}))
    if llm is None or engine.config.graph_summaries != LLM_SUMMARY or not wanted:
        return
    store = engine.store
    now = utcnow()
    for e in store.read_entities(EntitySelect(ids=wanted)):
        if e.summary_by == CALLER:
            continue
        rels = store.read_relations(RelationSelect(touching=(e.id,), at=now))
        try:
            text = generate(llm, e, rels, engine.config.redact)
        except ProviderError as exc:
            log.info("entity %s: LLM summary unavailable (%s)", e.id, exc)
            text = None
        try:
            with store.write() as tx:
                if fence is not None:
                    fence.hold(tx)
                current = store.read_entities(EntitySelect(ids=(e.id,)))
                if not current or current[0].summary_by == CALLER:
                    continue  # deleted, or the caller wrote one meanwhile
                if text is None:
                    fallback = replace(current[0], summary_by=RULES)
                    tx.put_entity(fallback, g.name_keys(fallback.name, fallback.aliases))
                    refresh(store, tx, [e.id], now)
                else:
                    done = replace(current[0], summary=text, summary_by=LLM_SUMMARY)
                    tx.put_entity(done, g.name_keys(done.name, done.aliases))
        except Erased as exc:  # the write it follows is done: only the summaries are left out
            log.info("entity summaries left out: %s", exc)
            return


def ends(relations: Iterable[Relation]) -> set[str]:
    """The entities at either end of these relations."""
    return {x for r in relations for x in (r.subject, r.object) if x}


def shown(e: Entity, relations: Sequence[Relation], *, dates: bool = False) -> str:
    """The summary to show: the caller's or the LLM's as written, else the rules summary of
    the relations that hold now (exact at read time: a relation may have ended since)."""
    if e.summary_by in (CALLER, LLM_SUMMARY):
        return e.summary
    return g.describe(e, [r for r in relations if e.id in (r.subject, r.object)], dates=dates)


# -- delete --------------------------------------------------------------------------------------

DELETED = "entity deleted"  # the reason of a deleted entity's DELETE event


def delete(engine: Engine, scope: Scope, name: str) -> Subgraph:
    """Remove the entity a name, alias or id names, with its index rows, every relation
    touching it (both directions, with their history) and its mentions; a DELETE event keeps
    that it was deleted and what went (ids and counts, never its name: an erasure needs
    nothing from it). Returns what was removed: the entity and its relations. NotFound if the
    owner has no such entity. The entity is not a tombstone: a later message, relation or
    extraction that names it again creates it anew."""
    scope = owner(scope)
    store = engine.store
    now = utcnow()
    with store.write() as tx:
        e = find(store, scope, name)
        rels = store.read_relations(RelationSelect(scope, touching=(e.id,), seen="all"))
        mentioned = store.mention_counts(scope, [e.id]).get(e.id, 0)
        tx.erase_graph([e.id], [])
        others = {x for r in rels for x in (r.subject, r.object) if x and x != e.id}
        refresh(store, tx, others, now, forget=True)
        tx.append(Event(id=new_id(), memory_id=e.id, type=EventType.DELETE, at=now, scope=e.scope,
                        before={"id": e.id, "type": e.type, "relations": [r.id for r in rels],
                                "mentions": mentioned},
                        reason=DELETED))
    log.info("entity %s deleted: %d relations, %d mentions", e.id, len(rels), mentioned)
    summarize(engine, others)
    return Subgraph([e], rels)


def find(store: Store, scope: Scope, name: str) -> Entity:
    """The entity a name or alias (or id) names in the scope; NotFound otherwise."""
    name = _clean(name, "name")
    by_id = store.read_entities(EntitySelect(owner(scope), ids=(name,)))
    if by_id:
        return by_id[0]
    keys = {g.normalise(name), g.core(name)} - {""}
    found = store.read_entities(EntitySelect(owner(scope), keys=tuple(keys)))
    if not found:
        raise NotFound(f"no entity named {name!r}")
    exact = [e for e in found if g.normalise(e.name) == g.normalise(name)]
    return (exact or found)[0]


# -- relations -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """A relation's object: an entity (by name, resolved like the subject) or a literal."""

    name: str | None = None
    type: str | None = None
    value: str | None = None


def target(obj: Any, literal: bool = False, type: str | None = None) -> Target:
    if isinstance(obj, bool) or obj is None:
        raise InvalidInput("object must be a name or a value")
    if isinstance(obj, int | float):
        return Target(value=str(obj))
    if isinstance(obj, datetime):
        return Target(value=obj.isoformat())
    if not isinstance(obj, str):
        raise InvalidInput("object must be a name or a value")
    if literal:
        return Target(value=_clean(obj, "object", max_chars=1024))
    return Target(name=_clean(obj, "object"), type=type)


def fact_text(subject: str, predicate: str, obj: str) -> str:
    return f"{subject} {predicate.replace('_', ' ')} {obj}"


def relate(engine: Engine, scope: Scope, subject: str, predicate: str, obj: Target, *,
           valid_from: datetime | None = None, valid_to: datetime | None = None,
           metadata: Mapping[str, Any] | None = None, single: bool | None = None,
           subject_type: str | None = None, fact: str | None = None,
           provenance: Sequence[str] = (), confidence: float = 1.0,
           observed_at: datetime | None = None) -> Relation:
    """Record `subject -[predicate]-> object` from `valid_from` (default: `observed_at`, else
    now). The ends are resolved (or created). A single-valued predicate's edges that hold at
    that time are closed (valid_to, a SUPERSEDE event), never deleted; a late fact, older than
    a value already known, lands before it. The same value already holding is returned as it
    is (its provenance extended)."""
    scope = owner(scope)
    pred = g.predicate_key(_clean(predicate, "predicate", max_chars=128))
    if not pred:
        raise InvalidInput("predicate must have a word in it")
    if valid_from is not None and valid_to is not None and valid_to <= valid_from:
        raise InvalidInput("valid_to must be after valid_from")
    if not 0.0 <= confidence <= 1.0:
        raise InvalidInput("confidence must be in [0, 1]")
    now = utcnow()
    start = valid_from or observed_at or now
    cfg = engine.config
    one = g.single_valued(pred, single=cfg.graph_single, multi=cfg.graph_multi, flag=single)
    fence = Fence.take(engine.store, scope)  # the ends are written first, each on its own
    subj = upsert(engine, scope, subject, type=subject_type, provenance=provenance,
                  llm_summary=False, fence=fence)
    other = upsert(engine, scope, obj.name, type=obj.type, provenance=provenance,
                   llm_summary=False, fence=fence) if obj.name is not None else None
    value = obj.value
    store = engine.store
    with store.write() as tx:
        fence.hold(tx)  # an erasure since the ends were written took them
        existing = store.read_relations(RelationSelect(scope, subjects=(subj.id,),
                                                       predicate=pred, seen="all"))
        existing = [r for r in existing if r.expired_at is None]

        def same(r: Relation) -> bool:
            return r.object == other.id if other is not None else \
                r.object is None and g.normalise(r.value or "") == g.normalise(value or "")

        spot = g.place(same, start, existing, one)
        if spot.duplicate is not None:
            dup = spot.duplicate
            more = tuple(dict.fromkeys((*dup.provenance, *provenance)))
            if more != dup.provenance:
                dup = replace(dup, provenance=more)
                tx.put_relation(dup)
            return dup
        rel = Relation(
            id=new_id(), scope=scope, subject=subj.id, predicate=pred,
            object=other.id if other else None, value=value,
            fact=fact or fact_text(subj.name, pred, other.name if other else value or ""),
            created_at=now, valid_from=start,
            valid_to=valid_to if valid_to is not None else spot.valid_to,
            provenance=tuple(dict.fromkeys(provenance)), confidence=confidence,
            metadata=dict(metadata or {}), subject_name=subj.name,
            object_name=other.name if other else value or "")
        for old, end in spot.closes:
            closed = replace(old, valid_to=end)
            tx.put_relation(closed)
            tx.append(_event(EventType.SUPERSEDE, closed, now, before=old,
                             reason=f"{pred} is single-valued: superseded by {rel.id}"))
        tx.put_relation(rel)
        tx.append(_event(EventType.ADD, rel, now, reason="related"))
        touched = {subj.id, rel.object or "", *(old.object or "" for old, _ in spot.closes)}
        refresh(store, tx, touched, now)
    log.info("relation %s: %s", rel.id, rel.fact)
    summarize(engine, touched)
    return rel


def unrelate(engine: Engine, scope: Scope, subject: str, predicate: str,
             obj: Target | None = None, *, at: datetime | None = None,
             retract: bool = False) -> list[Relation]:
    """End the current edges `subject -[predicate]-> object` (any object if None): they stop
    holding at `at` (default now; `valid_to`), and stay as history. `retract=True` says they
    never held (a mistake): they are retired (`expired_at`) and leave as-of reads too."""
    scope = owner(scope)
    fence = Fence.take(engine.store, scope)
    subj = find(engine.store, scope, subject)
    pred = g.predicate_key(_clean(predicate, "predicate", max_chars=128))
    now = utcnow()
    end = at or now
    found = engine.store.read_relations(RelationSelect(scope, subjects=(subj.id,),
                                                       predicate=pred, seen="as_of", at=end)) \
        if not retract else engine.store.read_relations(
            RelationSelect(scope, subjects=(subj.id,), predicate=pred, seen="current", at=now))
    if obj is not None:
        if obj.name is not None:
            other = find(engine.store, scope, obj.name)
            found = [r for r in found if r.object == other.id]
        else:
            found = [r for r in found if r.object is None
                     and g.normalise(r.value or "") == g.normalise(obj.value or "")]
    out = []
    with engine.store.write() as tx:
        fence.hold(tx)  # an erased relation is never written back
        for r in found:
            done = replace(r, expired_at=now) if retract else replace(r, valid_to=end)
            tx.put_relation(done)
            tx.append(_event(EventType.DELETE if retract else EventType.UPDATE, done, now,
                             before=r, reason="retracted" if retract else "ended by unrelate"))
            out.append(done)
        touched = {subj.id, *(r.object or "" for r in out)}
        refresh(engine.store, tx, touched, now)
    summarize(engine, touched)
    return out


def _event(type: EventType, rel: Relation, at: datetime, *, before: Relation | None = None,
           reason: str) -> Event:
    return Event(id=new_id(), memory_id=rel.id, type=type, at=at, scope=rel.scope,
                 before=before.to_dict() if before else None, after=rel.to_dict(), reason=reason)


# -- reads ---------------------------------------------------------------------------------------

def relations(store: Store, scope: Scope, *, subject: str | None = None,
              predicate: str | None = None, obj: str | None = None,
              as_of: datetime | None = None, history: bool = False,
              limit: int = 100) -> list[Relation]:
    """The s/p/o query: relations matching every end given (names, aliases or ids; an unknown
    name matches nothing), current by default, valid at `as_of` when given, or every stored
    edge with `history=True`."""
    scope = owner(scope)
    subjects = objects = None
    value = None
    try:
        if subject is not None:
            subjects = (find(store, scope, subject).id,)
        if obj is not None:
            try:
                objects = (find(store, scope, obj).id,)
            except NotFound:
                value = obj  # a literal value
    except NotFound:
        return []
    found = store.read_relations(RelationSelect(
        scope, subjects=subjects, objects=objects, value=value,
        predicate=g.predicate_key(predicate) if predicate else None,
        seen="all" if history else "as_of" if as_of is not None else "current",
        at=as_of or utcnow()))
    if value is not None:
        found = [r for r in found if r.object is None]
    return found[:limit]


def neighbours(store: Store, scope: Scope, name: str, depth: int = 1,
               as_of: datetime | None = None) -> Subgraph:
    """The entity `name` and every entity within `depth` hops, with the relations between
    them (current, or valid at `as_of`)."""
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= MAX_DEPTH:
        raise InvalidInput(f"depth must be an integer from 1 to {MAX_DEPTH}")
    scope = owner(scope)
    start = find(store, scope, name)
    at = as_of or utcnow()
    hops = store.neighbours(scope, [start.id], depth, at, as_of=as_of is not None)
    ids = tuple(sorted(hops, key=lambda i: (hops[i], i)))
    entities = {e.id: e for e in store.read_entities(EntitySelect(scope, ids=ids))}
    rels = store.read_relations(RelationSelect(scope, touching=ids, seen="as_of" if as_of else "current",
                                               at=at))
    inside = [r for r in rels if r.subject in entities and (r.object is None or r.object in entities)]
    literal = [r for r in inside if r.object is None and r.subject == start.id]
    edges = [r for r in inside if r.object is not None]
    return Subgraph([entities[i] for i in ids if i in entities], [*edges, *literal])


def path(store: Store, scope: Scope, a: str, b: str, max_depth: int = MAX_DEPTH,
         as_of: datetime | None = None) -> Subgraph:
    """A shortest chain of relations between two entities (either direction), its entities in
    order; empty when they are not connected within `max_depth` hops."""
    if not isinstance(max_depth, int) or isinstance(max_depth, bool) or not 1 <= max_depth <= 6:
        raise InvalidInput("max_depth must be an integer from 1 to 6")
    scope = owner(scope)
    x, y = find(store, scope, a), find(store, scope, b)
    at = as_of or utcnow()
    ids = store.find_path(scope, x.id, y.id, max_depth, at, as_of=as_of is not None)
    if ids is None:
        return Subgraph([], [])
    if not ids:
        return Subgraph([x], [])
    by_id = {r.id: r for r in store.read_relations(RelationSelect(scope, ids=tuple(ids), seen="all"))}
    rels = [by_id[i] for i in ids]
    order = [x.id]
    for r in rels:
        order.append(r.object if r.subject == order[-1] else r.subject)  # type: ignore[arg-type]
    entities = {e.id: e for e in store.read_entities(EntitySelect(scope, ids=tuple(order)))}
    return Subgraph([entities[i] for i in order], rels)


def profile(store: Store, scope: Scope, name: str, mentions: int = 5) -> EntityProfile:
    """What is known about one entity: it, its current relations (both directions) and the
    episodes that mention it most recently."""
    scope_owner = owner(scope)
    e = find(store, scope_owner, name)
    rels = store.read_relations(RelationSelect(scope_owner, touching=(e.id,), at=utcnow()))
    found = store.read_mentions(scope_owner if scope.session_id is None else scope,
                                entity_ids=[e.id], limit=mentions)
    records = store.get([m.episode_id for m in found])
    recent = [records[m.episode_id] for m in found if m.episode_id in records
              and records[m.episode_id].deleted_at is None]
    if e.summary_by not in (CALLER, LLM_SUMMARY):  # the rules summary, exact now
        e = replace(e, summary=shown(e, rels), summary_by=RULES)
    return EntityProfile(e, rels, recent)


def entities(engine: Engine, scope: Scope, query: str | None = None, *, type: str | None = None,
             limit: int = 50, after_id: str | None = None) -> list[Entity]:
    """The owner's entities in creation order, or with `query` the best matches: exact names
    and aliases first, then by embedding cosine of the names."""
    scope = owner(scope)
    store = engine.store
    typ = type.casefold() if type else None
    if query is None or not query.strip():
        return store.read_entities(EntitySelect(scope, type=typ, after_id=after_id, limit=limit))
    keys = tuple({g.normalise(query), g.core(query)} - {""})
    exact = store.read_entities(EntitySelect(scope, keys=keys, type=typ))
    vectors = store.entity_embeddings(scope, type=typ)
    ranked: list[str] = [e.id for e in exact]
    if vectors:
        v = engine.embedder.embed_batch([query])[0]
        mat = np.stack([vec for _, vec in vectors])
        sims = mat @ v / (np.linalg.norm(mat, axis=1) * (np.linalg.norm(v) or 1.0) + 1e-12)
        for i in np.argsort(-sims)[: limit * 2]:
            if sims[i] >= 0.35 and vectors[i][0] not in ranked:
                ranked.append(vectors[i][0])
    words = {w for w, kind in g.name_keys(query) if kind == "token"}
    if words:
        for e in store.read_entities(EntitySelect(scope, tokens=tuple(words), type=typ,
                                                  limit=limit)):
            if e.id not in ranked:
                ranked.append(e.id)
    ranked = ranked[:limit]
    by_id = {e.id: e for e in store.read_entities(EntitySelect(scope, ids=tuple(ranked)))} \
        if ranked else {}
    return [by_id[i] for i in ranked if i in by_id]


# -- mentions from episodes (no LLM needed) ------------------------------------------------------

@dataclass(frozen=True)
class Speakers:
    """The speakers of a batch of episodes not yet known as entities, with their name
    embeddings: computed before the write transaction."""

    vectors: dict[tuple[Scope, str], np.ndarray]


def prepare(engine: Engine, records: Iterable[MemoryRecord]) -> Speakers:
    """Model time for `link`: embed the names of speakers who are not entities yet."""
    todo: dict[tuple[Scope, str], None] = {}
    for r in records:
        if r.kind is Kind.EPISODIC and r.name and r.name.strip():
            todo[(owner(r.scope), r.name.strip())] = None
    unknown = []
    for scope, name in todo:
        if not engine.store.match_names(scope, [g.normalise(name)]):
            unknown.append((scope, name))
    if not unknown:
        return Speakers({})
    vecs = engine.embedder.embed_batch([n for _, n in unknown])
    return Speakers({k: np.asarray(v) for k, v in zip(unknown, vecs, strict=True)})


def link(engine: Engine, tx: Tx, records: Sequence[MemoryRecord], speakers: Speakers) -> int:
    """Inside the add's transaction: speakers become entities (persons, by exact name), and
    each episode is linked to its speaker and to the known entities whose name or alias it
    mentions (word n-grams looked up in the name index). Returns the mentions written."""
    store = engine.store
    episodes = [r for r in records if r.kind is Kind.EPISODIC]
    if not episodes:
        return 0
    now = utcnow()
    made: dict[tuple[Scope, str], str] = {}
    for (scope, name), vec in speakers.vectors.items():
        hit = store.match_names(scope, [g.normalise(name)])
        if hit:
            made[(scope, g.normalise(name))] = hit[0][1]
            continue
        e = Entity(id=new_id(), scope=scope, name=name, type=SPEAKER_TYPE, created_at=now,
                   updated_at=now, provenance=tuple(r.id for r in episodes
                                                    if r.name and r.name.strip() == name)[:1])
        e = create(store, tx, e, vec)
        refresh(store, tx, [e.id], now)
        made[(scope, g.normalise(name))] = e.id
    mentions: list[Mention] = []
    by_owner: dict[Scope, list[MemoryRecord]] = {}
    for r in episodes:
        by_owner.setdefault(owner(r.scope), []).append(r)
    for scope, group in by_owner.items():
        grams = {r.id: g.ngrams(r.text) for r in group}
        every = sorted({k for ks in grams.values() for k in ks}
                       | {g.normalise(r.name) for r in group if r.name})
        index: dict[str, set[str]] = {}
        for key, eid in store.match_names(scope, every):
            index.setdefault(key, set()).add(eid)
        for (s, key), eid in made.items():
            if s == scope:
                index.setdefault(key, set()).add(eid)
        for r in group:
            found: set[str] = set()
            for key in grams[r.id]:
                found |= index.get(key, set())
            if r.name:
                found |= index.get(g.normalise(r.name), set())
            mentions += [Mention(r.id, eid, r.scope, r.observed_at or r.valid_from)
                         for eid in sorted(found)]
    tx.put_mentions(mentions)
    return len(mentions)


# -- erasure -------------------------------------------------------------------------------------

def erase(store: Store, tx: Tx, erased: Sequence[str], scope: Scope, *, whole: bool) -> None:
    """Inside an erasure's transaction: the graph derived from the erased memories goes.
    Mentions in them; relations whose every source is erased; entities whose every source is
    erased and that no remaining episode mentions (one still mentioned keeps its other
    evidence). `whole`: a whole owner scope is erased (no session named), so is its graph,
    explicit or not; the erasure of a session takes only what its messages gave the graph."""
    gone = set(erased)
    if whole and scope.session_id is None:
        own = owner(scope)
        ents = [e.id for e in store.read_entities(EntitySelect(own))]
        rels = [r.id for r in store.read_relations(RelationSelect(own, seen="all"))]
        deleted = [e.memory_id for e in store.events_of(EventType.DELETE.value, own, limit=100_000)
                   if e.reason == DELETED and e.memory_id]  # their events hold the owner's ids
        tx.drop_mentions(list(erased))
        tx.erase_graph([*ents, *deleted], rels)
        return
    if not gone:
        return
    own = owner(scope)
    touched = store.read_mentions(Scope(own.user_id, own.agent_id), episode_ids=sorted(gone))
    tx.drop_mentions(sorted(gone))
    drop_rels: list[str] = []
    affected: set[str] = set()  # entities whose relations change: their summaries follow
    for r in store.read_relations(RelationSelect(own, seen="all")):
        if r.provenance and gone.intersection(r.provenance):
            left = tuple(p for p in r.provenance if p not in gone)
            if left:
                tx.put_relation(replace(r, provenance=left))
            else:
                drop_rels.append(r.id)
                affected |= {r.subject, r.object or ""}
    candidates = {m.entity_id for m in touched}
    drop_ents: list[str] = []
    for e in store.read_entities(EntitySelect(own)):
        if not (gone.intersection(e.provenance) or e.id in candidates):
            continue
        left = tuple(p for p in e.provenance if p not in gone)
        if e.provenance and not left:
            others = [m for m in store.read_mentions(own, entity_ids=[e.id], limit=2)
                      if m.episode_id not in gone]
            if not others:
                drop_ents.append(e.id)
                continue
            left = (others[0].episode_id,)  # its remaining evidence
        if left != e.provenance:
            tx.put_entity(replace(e, provenance=left), g.name_keys(e.name, e.aliases))
    if drop_ents:  # their relations go with them: the other ends' summaries follow
        for r in store.read_relations(RelationSelect(own, touching=tuple(drop_ents), seen="all")):
            affected |= {r.subject, r.object or ""}
    tx.erase_graph(drop_ents, drop_rels)
    refresh(store, tx, affected - set(drop_ents), utcnow(), forget=True)


# -- context -------------------------------------------------------------------------------------

def in_play(engine: Engine, text: str, scope: Scope, limit: int) -> list[tuple[str, str, str]]:
    """(entity id, label, what is known) for each entity `text` names (through the name/alias
    index), for the context's entity block: type, other names, summary and what holds now."""
    store = engine.store
    own = owner(scope)
    named = list(dict.fromkeys(eid for _, eid in sorted(store.match_names(own, g.ngrams(text)))))
    if not named:
        return []
    found = {e.id: e for e in store.read_entities(EntitySelect(own, ids=tuple(named[:limit])))}
    rels = store.read_relations(RelationSelect(own, touching=tuple(found), at=utcnow()))
    out = []
    for eid in named[:limit]:
        e = found.get(eid)
        if e is None:
            continue
        head = f"{e.name} ({e.type}" + (f"; also {', '.join(e.aliases)}" if e.aliases else "") + ")"
        if e.summary_by in (CALLER, LLM_SUMMARY):  # a written summary, then what holds now
            facts = [r.fact + (f" (since {r.valid_from.date().isoformat()})" if r.valid_from else "")
                     for r in rels if eid in (r.subject, r.object)][:8]
            out.append((eid, head, "; ".join(([e.summary] if e.summary else []) + facts)))
        else:  # the rules summary says what holds now, with dates
            out.append((eid, head, shown(e, rels, dates=True)))
    return out


# -- the graph of an extraction (with an LLM) ----------------------------------------------------

@dataclass(frozen=True)
class Edge:
    """One extracted relation with its ends resolved to entity ids (before the write)."""

    subject: str
    predicate: str
    object: str | None
    value: str | None
    valid_from: datetime | None
    valid_to: datetime | None
    fact: str


@dataclass(frozen=True)
class Staged:
    """The entities and relations of one extraction, resolved before the write transaction
    (embeddings, the LLM for ambiguous names): `entities` to put (new, or known ones with more
    aliases and provenance) with the name vectors of the new ones, and the edges to place."""

    scope: Scope
    entities: dict[str, Entity]
    vectors: dict[str, np.ndarray]
    edges: tuple[Edge, ...]
    provenance: tuple[str, ...]
    metadata: dict[str, Any]
    observed_at: datetime          # when an edge with no valid_from starts
    mentions: tuple[Mention, ...]  # the source episodes that name the entities


def stage(engine: Engine, scope: Scope, names: Sequence[tuple[str, str, Sequence[str]]],
          edges: Sequence[tuple[str, str, str | None, str | None, datetime | None, datetime | None]],
          episodes: Sequence[MemoryRecord], metadata: Mapping[str, Any]) -> Staged:
    """Resolve an extraction's entities (name, type, aliases) and the ends of its relations
    (subject, predicate, object name or None, literal value, valid_from, valid_to), staged
    like `upsert`: exact keys, rules, then the LLM for what stays ambiguous. Names of the batch
    that share a key are one entity. `episodes` are the sources (provenance, and mentions
    where their text names an entity). Runs outside any transaction; `commit` writes the
    result. Names must be valid already (extraction validates them)."""
    scope = owner(scope)
    now = utcnow()
    provenance = tuple(e.id for e in episodes)
    out: dict[str, Entity] = {}
    vectors: dict[str, np.ndarray] = {}
    by_key: dict[str, str] = {}
    todo = list(names) + [(s, "", ()) for s, *_ in edges] \
        + [(o, "", ()) for _, _, o, *_ in edges if o is not None]
    wanted = list(dict.fromkeys(n for n, _, _ in todo))  # embedded as `upsert` embeds a name
    embedded = dict(zip(wanted, engine.embedder.embed_batch(wanted), strict=True)) if wanted else {}
    for name, typ, aliases in todo:
        keys = [g.normalise(a) for a in (name, *aliases)]
        known = next((by_key[k] for k in keys if k in by_key), None)
        if known is None:
            res, found = resolve(engine, scope, name, typ.casefold(), aliases,
                                 np.asarray(embedded[name]))
            if res.entity is not None:
                known = res.entity
                if known not in out:
                    out[known] = found.get(known) or engine.store.read_entities(
                        EntitySelect(ids=(known,)))[0]
        if known is None:  # new to the owner and to the batch
            fresh = Entity(id=new_id(), scope=scope, name=name, type=typ.casefold() or "entity",
                           aliases=tuple(aliases), provenance=provenance, created_at=now,
                           updated_at=now)
            out[fresh.id] = fresh
            vectors[fresh.id] = np.asarray(embedded[name])
            known = fresh.id
        else:
            old = out[known]
            extra = [a for a in (name, *aliases)
                     if g.normalise(a) != g.normalise(old.name)
                     and g.normalise(a) not in {g.normalise(x) for x in old.aliases}]
            out[known] = replace(
                old, aliases=(*old.aliases, *extra),
                type=typ.casefold() if old.type in g.GENERIC_TYPES and typ else old.type,
                provenance=tuple(dict.fromkeys((*old.provenance, *provenance))), updated_at=now)
        for k in [*keys, *(g.normalise(a) for a in out[known].aliases),
                  g.normalise(out[known].name)]:
            by_key.setdefault(k, known)
    placed = []
    for s, pred, o, value, start, end in edges:
        subj = out[by_key[g.normalise(s)]]
        obj = out[by_key[g.normalise(o)]] if o is not None else None
        placed.append(Edge(subj.id, pred, obj.id if obj else None, value, start, end,
                           fact_text(subj.name, pred, obj.name if obj else value or "")))
    mentions = []
    for ep in episodes:
        named = {by_key[k] for k in g.ngrams(ep.text) if k in by_key}
        mentions += [Mention(ep.id, eid, ep.scope, ep.observed_at or ep.valid_from)
                     for eid in sorted(named)]
    observed = max((e.observed_at or e.created_at) for e in episodes)
    return Staged(scope, out, vectors, tuple(placed), provenance, dict(metadata), observed,
                  tuple(mentions))


def commit(engine: Engine, tx: Tx, staged: Staged) -> list[Relation]:
    """Inside the facts' transaction: write the staged entities, then place each edge on its
    subject's timeline exactly as `relate` does (a single-valued predicate's current edge is
    closed, a late value lands before a later one, the same value extends its provenance).
    Edges of the batch see each other (a reply may say where someone worked, then moved)."""
    store = engine.store
    now = utcnow()
    cfg = engine.config
    ids: dict[str, str] = {}  # a new entity another writer created meanwhile: that one's id
    entities: dict[str, Entity] = {}
    for e in staged.entities.values():
        if e.id in staged.vectors:  # new when staged
            made = create(store, tx, e, staged.vectors[e.id])
            ids[e.id] = made.id
            entities[made.id] = made
        else:
            tx.put_entity(e, g.name_keys(e.name, e.aliases))
            entities[e.id] = e
    if any(old != new for old, new in ids.items()):
        staged = replace(
            staged, entities=entities,
            edges=tuple(replace(x, subject=ids.get(x.subject, x.subject),
                                object=ids.get(x.object, x.object) if x.object else None)
                        for x in staged.edges),
            mentions=tuple(dict.fromkeys(replace(m, entity_id=ids.get(m.entity_id, m.entity_id))
                                         for m in staged.mentions)))
    tx.put_mentions(list(staged.mentions))
    written: dict[str, Relation] = {}
    out = []
    for edge in staged.edges:
        existing = {r.id: r for r in store.read_relations(RelationSelect(
            staged.scope, subjects=(edge.subject,), predicate=edge.predicate, seen="all"))}
        existing.update({i: r for i, r in written.items()
                         if r.subject == edge.subject and r.predicate == edge.predicate})
        live = [r for r in existing.values() if r.expired_at is None]

        def same(r: Relation, edge: Edge = edge) -> bool:
            return r.object == edge.object if edge.object is not None else \
                r.object is None and g.normalise(r.value or "") == g.normalise(edge.value or "")

        start = edge.valid_from or staged.observed_at
        one = g.single_valued(edge.predicate, single=cfg.graph_single, multi=cfg.graph_multi)
        spot = g.place(same, start, live, one)
        if spot.duplicate is not None:
            dup = spot.duplicate
            more = tuple(dict.fromkeys((*dup.provenance, *staged.provenance)))
            if more != dup.provenance:
                dup = replace(dup, provenance=more)
                tx.put_relation(dup)
                written[dup.id] = dup
            out.append(dup)
            continue
        subj = staged.entities[edge.subject]
        obj = staged.entities.get(edge.object) if edge.object else None
        rel = Relation(
            id=new_id(), scope=staged.scope, subject=edge.subject, predicate=edge.predicate,
            object=edge.object, value=edge.value, fact=edge.fact, created_at=now,
            valid_from=start, valid_to=edge.valid_to if edge.valid_to is not None else spot.valid_to,
            provenance=staged.provenance, metadata=dict(staged.metadata),
            subject_name=subj.name, object_name=obj.name if obj else edge.value or "")
        for old, end in spot.closes:
            closed = replace(old, valid_to=end)
            tx.put_relation(closed)
            written[closed.id] = closed
            tx.append(_event(EventType.SUPERSEDE, closed, now, before=old,
                             reason=f"{edge.predicate} is single-valued: superseded by {rel.id}"))
        tx.put_relation(rel)
        written[rel.id] = rel
        tx.append(_event(EventType.ADD, rel, now, reason="extracted"))
        out.append(rel)
    refresh(store, tx, {*staged.entities, *(r.object or "" for r in written.values())}, now)
    return out

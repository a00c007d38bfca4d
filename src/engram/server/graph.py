"""The knowledge graph's /v1 routes: entities (and their deletion), relations (the s/p/o query,
as of a time), neighbours, and relate / unrelate. Each handler makes one `Memory` call for the key's tenant,
as every route does (routes.py); the wire shapes are the `to_dict()` of the model's values."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from .routes import Context, MemoryId, ScopeQ, _errors
from .schemas import MAX_ID, MAX_PAGE, Flag, Id, Int, Number, QueryFlag, ScopeOut, Time, When, _In

router = APIRouter(prefix="/v1", tags=["graph"])
Name = Annotated[str, Query(min_length=1, max_length=256)]
OptName = Annotated[str | None, Query(min_length=1, max_length=256)]


class EntityOut(BaseModel):
    id: str
    scope: ScopeOut
    name: str
    type: str
    aliases: list[str]
    summary: str
    summary_by: str = Field(description='who wrote the summary: "caller", "rules" (from type, '
                            'aliases and relations), "llm", or "" (none)')
    attributes: dict[str, Any]
    provenance: list[str]
    created_at: Time
    updated_at: Time


class RelationOut(BaseModel):
    id: str
    scope: ScopeOut
    subject: str = Field(description="the subject entity's name")
    subject_id: str
    predicate: str
    object: str = Field(description="the object entity's name, or the literal value")
    object_id: str | None = Field(description="None when the object is a literal value")
    value: str | None
    fact: str
    valid_from: Time | None
    valid_to: Time | None = Field(description="None while it holds")
    created_at: Time
    expired_at: Time | None = Field(description="set when retracted (it never held)")
    provenance: list[str]
    confidence: float
    metadata: dict[str, Any]


class MentionOut(BaseModel):
    id: str
    text: str
    name: str | None
    observed_at: Time | None


class EntityProfileOut(EntityOut):
    relations: list[RelationOut] = Field(description="what holds now, both directions")
    mentions: list[MentionOut] = Field(description="the episodes mentioning it, newest first")


class EntitiesOut(BaseModel):
    items: list[EntityOut]


class RelationsOut(BaseModel):
    items: list[RelationOut]


class SubgraphOut(BaseModel):
    entities: list[EntityOut]
    relations: list[RelationOut]


class RelateIn(_In):
    subject: Annotated[str, Field(min_length=1, max_length=256)]
    predicate: Annotated[str, Field(min_length=1, max_length=128)]
    object: Annotated[str, Field(min_length=1, max_length=1024)] | Int | Number
    valid_from: When | None = None
    valid_to: When | None = None
    user_id: Id | None = None
    agent_id: Id | None = None
    metadata: dict[str, Any] | None = None
    single: Flag | None = Field(None, description="one current value per subject; default: "
                                "declared / configured (docs/graph.md)")
    literal: Flag = Field(False, description="the object is a value, not an entity")
    subject_type: Annotated[str, Field(max_length=64)] | None = None
    object_type: Annotated[str, Field(max_length=64)] | None = None


class UnrelateIn(_In):
    subject: Annotated[str, Field(min_length=1, max_length=256)]
    predicate: Annotated[str, Field(min_length=1, max_length=128)]
    object: Annotated[str, Field(min_length=1, max_length=1024)] | Int | Number | None = None
    at: When | None = None
    retract: Flag = False
    literal: Flag = False
    user_id: Id | None = None
    agent_id: Id | None = None


@router.get("/entities", response_model=EntitiesOut)
def list_entities(ctx: Context, user_id: ScopeQ = None, agent_id: ScopeQ = None,
                  query: Annotated[str | None, Query(min_length=1, max_length=1000)] = None,
                  type: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
                  cursor: Annotated[str | None, Query(max_length=MAX_ID)] = None,
                  limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50) -> Any:
    """The owner's entities in creation order, or the best matches of `query`."""
    found = ctx.mem.entities(query, type=type, limit=limit, cursor=cursor, user_id=user_id,
                             agent_id=agent_id)
    return {"items": [e.to_dict() for e in found]}


@router.get("/entities/{id}", response_model=EntityProfileOut, responses=_errors(404))
def get_entity(id: MemoryId, ctx: Context, user_id: ScopeQ = None, agent_id: ScopeQ = None,
               mentions: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 5) -> Any:
    """An entity's profile, by id, name or alias."""
    return ctx.mem.entity(id, user_id=user_id, agent_id=agent_id, mentions=mentions).to_dict()


@router.delete("/entities/{id}", response_model=SubgraphOut, responses=_errors(403, 404))
def delete_entity(id: MemoryId, ctx: Context, user_id: ScopeQ = None,
                  agent_id: ScopeQ = None) -> Any:
    """Remove an entity (by id, name or alias) with its names, every relation touching it and
    its mentions; answers what was removed. Naming it again later creates a new entity."""
    return ctx.mem.delete_entity(id, user_id=user_id, agent_id=agent_id).to_dict()


@router.get("/relations", response_model=RelationsOut)
def list_relations(ctx: Context, subject: OptName = None, predicate: OptName = None,
                   object: OptName = None, as_of: When | None = None, history: QueryFlag = False,
                   user_id: ScopeQ = None, agent_id: ScopeQ = None,
                   limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> Any:
    """The s/p/o query: what holds now, what held at `as_of`, or every edge with `history`."""
    found = ctx.mem.relations(subject, predicate, object, as_of=as_of, history=history,
                              limit=limit, user_id=user_id, agent_id=agent_id)
    return {"items": [r.to_dict() for r in found]}


@router.post("/relations", status_code=201, response_model=RelationOut)
def relate(body: RelateIn, ctx: Context) -> Any:
    """Record a relation; a single-valued predicate's current edge is closed, not deleted."""
    return ctx.mem.relate(body.subject, body.predicate, body.object, valid_from=body.valid_from,
                          valid_to=body.valid_to, user_id=body.user_id, agent_id=body.agent_id,
                          metadata=body.metadata, single=body.single, literal=body.literal,
                          subject_type=body.subject_type, object_type=body.object_type).to_dict()


@router.post("/relations/end", response_model=RelationsOut, responses=_errors(404))
def unrelate(body: UnrelateIn, ctx: Context) -> Any:
    """End (or with `retract`, retire) the edges of a subject and predicate."""
    done = ctx.mem.unrelate(body.subject, body.predicate, body.object, at=body.at,
                            retract=body.retract, literal=body.literal, user_id=body.user_id,
                            agent_id=body.agent_id)
    return {"items": [r.to_dict() for r in done]}


@router.get("/graph/neighbours", response_model=SubgraphOut, responses=_errors(404))
def neighbours(ctx: Context, name: Name, depth: Annotated[int, Query(ge=1, le=4)] = 1,
               as_of: When | None = None, user_id: ScopeQ = None,
               agent_id: ScopeQ = None) -> Any:
    """The entity and those within `depth` hops, with the relations between them."""
    return ctx.mem.neighbours(name, depth=depth, as_of=as_of, user_id=user_id,
                              agent_id=agent_id).to_dict()


@router.get("/graph/path", response_model=SubgraphOut, responses=_errors(404))
def path(ctx: Context, a: Name, b: Name, max_depth: Annotated[int, Query(ge=1, le=6)] = 4,
         as_of: When | None = None, user_id: ScopeQ = None, agent_id: ScopeQ = None) -> Any:
    """A shortest chain of relations between two entities (empty if none)."""
    return ctx.mem.path(a, b, max_depth=max_depth, as_of=as_of, user_id=user_id,
                        agent_id=agent_id).to_dict()

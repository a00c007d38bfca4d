"""What engram's MCP tools send and receive: engram's own result shapes, and the knowledge graph
exactly as the reference memory server names it (camelCase), with the translations to them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from ..graph import reference as graph
from ..model import EntityProfile, Hit, MemoryRecord, Subgraph
from ..model import Relation as RealRelation

Kind = Literal["semantic", "episodic", "procedural"]


# -- wire shapes: the knowledge graph, exactly as the reference memory server names them ----------

class _Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, serialize_by_alias=True)


class EntityModel(_Camel):
    name: str = Field(description="The name of the entity")
    entity_type: str = Field(description="The type of the entity")
    observations: list[str] = Field(description="Observation contents associated with the entity")


class RelationModel(_Camel):
    source: str = Field(alias="from", description="The name of the entity where the relation starts")
    to: str = Field(description="The name of the entity where the relation ends")
    relation_type: str = Field(description="The type of the relation, in active voice (works_at)")


class ObservationAddition(_Camel):
    entity_name: str = Field(description="The name of the entity to add the observations to")
    contents: list[str] = Field(description="Observation contents to add")


class ObservationDeletion(_Camel):
    entity_name: str = Field(description="The name of the entity holding the observations")
    observations: list[str] = Field(description="Observations to delete")


class CreateEntitiesResult(_Camel):
    entities: list[EntityModel]
    skipped: list[str]


class CreateRelationsResult(_Camel):
    relations: list[RelationModel]


class AddedObservations(_Camel):
    entity_name: str
    added_observations: list[str]


class AddObservationsResult(_Camel):
    results: list[AddedObservations]


class DeleteResult(_Camel):
    success: bool
    message: str


class GraphResult(_Camel):
    entities: list[EntityModel]
    relations: list[RelationModel]


# -- wire shapes: engram's own tools --------------------------------------------------------------

class MemoryOut(BaseModel):
    id: str
    kind: str
    text: str
    created_at: str = Field(description="when engram learned it (ISO-8601)")
    observed_at: str | None = Field(description="when it happened in the world, if known")
    importance: float
    metadata: dict[str, Any]
    session_id: str | None


class HitOut(MemoryOut):
    score: float
    explain: dict[str, float] = Field(description="each ranking stage's contribution to the score")


class RememberResult(BaseModel):
    memories: list[MemoryOut]
    events: list[str] = Field(description="what the write did: ADD, MERGE (near-duplicate), ...")


class RecallResult(BaseModel):
    hits: list[HitOut]


class ForgetResult(BaseModel):
    deleted: str
    message: str


class ListResult(BaseModel):
    memories: list[MemoryOut]
    next_cursor: str | None = Field(description="pass back as `cursor` for the next page; null at the end")


class ContextResult(BaseModel):
    text: str = Field(description="the context as one text")
    messages: list[dict[str, Any]] = Field(description="the same as chat messages")
    total_tokens: int
    usage: dict[str, int] = Field(description="tokens used per block")
    memory_ids: list[str] = Field(description="the memories it holds")


# -- wire shapes: the real knowledge graph's tools (entity, relations, neighbours) -----------------

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


# -- translation ----------------------------------------------------------------------------------

def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def memory_out(rec: MemoryRecord) -> MemoryOut:
    return MemoryOut(id=rec.id, kind=rec.kind.value, text=rec.text, created_at=rec.created_at.isoformat(),
                     observed_at=_iso(rec.observed_at), importance=rec.importance,
                     metadata=rec.metadata, session_id=rec.scope.session_id)


def hit_out(hit: Hit) -> HitOut:
    return HitOut(**memory_out(hit.memory).model_dump(), score=round(hit.score, 4),
                  explain={k: round(v, 4) for k, v in hit.explain.items()})


def entity_out(e: graph.Entity) -> EntityModel:
    return EntityModel(name=e.name, entity_type=e.entity_type, observations=list(e.observations))


def relation_out(r: graph.Relation) -> RelationModel:
    return RelationModel.model_validate({"from": r.source, "to": r.target, "relationType": r.relation_type})


def relation_in(r: RelationModel) -> graph.Relation:
    return graph.Relation(r.source, r.to, r.relation_type)


def dump(value: BaseModel | list[Any]) -> Any:
    """A wire value as plain JSON data (camelCase keys), as the reference server writes it."""
    if isinstance(value, list):
        return [dump(v) for v in value]
    return value.model_dump(mode="json", by_alias=True)


def graph_out(g: graph.Graph) -> GraphResult:
    return GraphResult(entities=[entity_out(e) for e in g.entities],
                       relations=[relation_out(r) for r in g.relations])


def entity_result(profile: EntityProfile) -> EntityResult:
    return EntityResult.model_validate(profile.to_dict())


def relations_result(relations: list[RealRelation]) -> RelationsResult:
    return RelationsResult(relations=[GraphRelation.model_validate(r.to_dict()) for r in relations])


def neighbours_result(sub: Subgraph) -> NeighboursResult:
    return NeighboursResult.model_validate(sub.to_dict())

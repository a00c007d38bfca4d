"""The knowledge graph's rows, for both SQL backends: entities (with their name/alias index),
relations, mentions; codecs and statements built without I/O for either dialect.

Neighbours and paths are recursive CTEs (`WITH RECURSIVE`), which SQLite and PostgreSQL both
run: the walk stays in the database, one statement per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import numpy as np

from ..model import Entity, Mention, Relation, Scope
from .base import EntitySelect, NameKind, RelationSelect
from .records import Dialect, Stmt, Where, columns

ENTITY_COLUMNS = ("id", "user_id", "agent_id", "name", "type", "aliases", "summary",
                  "attributes", "provenance", "created_at", "updated_at", "summary_by")
RELATION_COLUMNS = ("id", "user_id", "agent_id", "subject_id", "predicate", "object_id", "value",
                    "fact", "valid_from", "valid_to", "created_at", "expired_at", "provenance",
                    "confidence", "metadata")
MENTION_COLUMNS = ("episode_id", "entity_id", "user_id", "agent_id", "session_id", "at")

def owner(w: Where, scope: Scope, exact: bool = False) -> Where:
    """The owner part of a scope (graph rows have no session): None matches anything, unless
    `exact` (then NULL)."""
    for col, value in (("user_id", scope.user_id), ("agent_id", scope.agent_id)):
        if value is not None:
            w.add(f"{w.alias}.{col} = {w.d.mark}", value)
        elif exact:
            w.add(f"{w.alias}.{col} IS NULL")
    return w


def _holds(w: Where, seen: str, at: datetime | None) -> Where:
    if seen == "all":
        return w
    if at is None:
        raise ValueError("a current or as_of read of relations needs a time")
    a, mark, t = w.alias, w.d.mark, w.d.time(at)
    w.add(f"{a}.expired_at IS NULL")
    w.add(f"({a}.valid_to IS NULL OR {a}.valid_to > {mark})", t)
    if seen == "as_of":
        w.add(f"({a}.valid_from IS NULL OR {a}.valid_from <= {mark})", t)
    return w


# -- entities ------------------------------------------------------------------------------------

def select_entities(d: Dialect, tenant: str, sel: EntitySelect) -> Stmt:
    w = owner(Where(d, tenant, "e"), sel.scope, sel.exact)
    if sel.ids is not None:
        w.one_of("e.id", sel.ids)
    if sel.type is not None:
        w.add(f"e.type = {d.mark}", sel.type)
    if sel.after_id is not None:
        w.add(f"e.id > {d.mark}", sel.after_id)
    for values, kinds in ((sel.keys, ("name", "alias")), (sel.tokens, ("token",))):
        if values is not None:
            n = Where(d, tenant, "n").add("n.entity_id = e.id")
            n.one_of("n.key", values).one_of("n.kind", kinds)
            w.add(f"EXISTS (SELECT 1 FROM entity_names n WHERE {n.sql})", *n.params)
    sql = f"SELECT {columns('e', ENTITY_COLUMNS)} FROM entities e WHERE {w.sql} ORDER BY e.id"
    if sel.limit is not None:
        return f"{sql} LIMIT {d.mark}", [*w.params, sel.limit]
    return sql, w.params


def match_names(d: Dialect, tenant: str, scope: Scope, keys: Sequence[str]) -> Stmt:
    """(key, entity id) for each of `keys` that is an entity's normalised name or alias."""
    w = owner(Where(d, tenant, "n"), scope).one_of("n.key", keys).one_of("n.kind", ("name", "alias"))
    return f"SELECT DISTINCT n.key, n.entity_id FROM entity_names n WHERE {w.sql}", w.params


def select_embeddings(d: Dialect, tenant: str, scope: Scope, exact: bool,
                      type: str | None) -> Stmt:
    w = owner(Where(d, tenant, "e"), scope, exact).add("e.embedding IS NOT NULL")
    if type is not None:
        w.add(f"e.type = {d.mark}", type)
    return f"SELECT e.id, e.embedding FROM entities e WHERE {w.sql} ORDER BY e.id", w.params


def entity_values(d: Dialect, e: Entity) -> list[Any]:
    s = e.scope
    return [e.id, s.user_id, s.agent_id, e.name, e.type, d.json(list(e.aliases)), e.summary,
            d.json(e.attributes), d.json(list(e.provenance)), d.time(e.created_at),
            d.time(e.updated_at), e.summary_by]


def read_entity(d: Dialect, row: Sequence[Any]) -> Entity:
    eid, uid, aid, name, typ, aliases, summary, attributes, provenance, created, updated, by = row
    return Entity(id=eid, scope=Scope(uid, aid), name=name, type=typ,
                  aliases=tuple(d.read_json(aliases)), summary=summary, summary_by=by,
                  attributes=d.read_json(attributes), provenance=tuple(d.read_json(provenance)),
                  created_at=d.read_time(created), updated_at=d.read_time(updated))


def upsert_entity(d: Dialect, tenant: str, e: Entity, embedding: np.ndarray | None) -> Stmt:
    names = [*ENTITY_COLUMNS, "embedding"]
    blob = None if embedding is None else np.asarray(embedding, dtype=np.float32).tobytes()
    values = [*entity_values(d, e), blob]
    if d.tenant:
        names, values = ["tenant", *names], [tenant, *values]
    target = "tenant, id" if d.tenant else "id"
    # An upsert without a new embedding keeps the stored one.
    sets = ", ".join(f"{c} = excluded.{c}" for c in ENTITY_COLUMNS if c != "id")
    sets += ", embedding = coalesce(excluded.embedding, entities.embedding)"
    return (f"INSERT INTO entities ({', '.join(names)}) VALUES ({d.marks(len(names))}) "
            f"ON CONFLICT ({target}) DO UPDATE SET {sets}", values)


def insert_entity(d: Dialect, tenant: str, e: Entity, embedding: np.ndarray | None,
                  key: str) -> Stmt:
    """Insert a new entity under its claim `key`, unless an entity of its owner holds that key
    already (the unique index `entities_key`): then nothing is written (see `key_holder`)."""
    names = [*ENTITY_COLUMNS, "embedding", "key"]
    blob = None if embedding is None else np.asarray(embedding, dtype=np.float32).tobytes()
    values = [*entity_values(d, e), blob, key]
    if d.tenant:
        names, values = ["tenant", *names], [tenant, *values]
    return (f"INSERT INTO entities ({', '.join(names)}) VALUES ({d.marks(len(names))}) "
            f"ON CONFLICT DO NOTHING", values)


def key_holder(d: Dialect, tenant: str, scope: Scope, key: str) -> Stmt:
    """The id of the entity of the owner `scope` (exactly) that holds the claim `key`."""
    w = Where(d, tenant, "e").add(f"coalesce(e.user_id, '') = {d.mark}", scope.user_id or "")
    w.add(f"coalesce(e.agent_id, '') = {d.mark}", scope.agent_id or "").add(f"e.key = {d.mark}", key)
    return f"SELECT e.id FROM entities e WHERE {w.sql}", w.params


def put_names(d: Dialect, tenant: str, e: Entity,
              keys: Sequence[tuple[str, NameKind]]) -> list[Stmt]:
    """Replace the index rows of an entity."""
    w = Where(d, tenant, "n").add(f"n.entity_id = {d.mark}", e.id)
    out: list[Stmt] = [(f"DELETE FROM entity_names AS n WHERE {w.sql}", w.params)]
    cols = ["entity_id", "user_id", "agent_id", "key", "kind"]
    if d.tenant:
        cols = ["tenant", *cols]
    for key, kind in keys:
        values: list[Any] = [e.id, e.scope.user_id, e.scope.agent_id, key, kind]
        out.append((f"INSERT INTO entity_names ({', '.join(cols)}) VALUES ({d.marks(len(cols))})",
                    [tenant, *values] if d.tenant else values))
    return out


# -- relations -----------------------------------------------------------------------------------

def select_relations(d: Dialect, tenant: str, sel: RelationSelect) -> Stmt:
    """Relations with their ends' names, in creation order."""
    w = _holds(owner(Where(d, tenant, "r"), sel.scope), sel.seen, sel.at)
    if sel.ids is not None:
        w.one_of("r.id", sel.ids)
    if sel.subjects is not None:
        w.one_of("r.subject_id", sel.subjects)
    if sel.objects is not None:
        w.one_of("r.object_id", sel.objects)
    if sel.predicate is not None:
        w.add(f"r.predicate = {d.mark}", sel.predicate)
    if sel.value is not None:
        w.add(f"r.value = {d.mark}", sel.value)
    if sel.touching is not None:
        if d.arrays:
            w.add(f"(r.subject_id = ANY({d.mark}) OR r.object_id = ANY({d.mark}))",
                  list(sel.touching), list(sel.touching))
        else:
            marks = d.marks(len(sel.touching))
            w.add(f"(r.subject_id IN ({marks}) OR r.object_id IN ({marks}))",
                  *sel.touching, *sel.touching)
    t = "AND s.tenant = r.tenant" if d.tenant else ""
    o = "AND o.tenant = r.tenant" if d.tenant else ""
    sql = (f"SELECT {columns('r', RELATION_COLUMNS)}, s.name, o.name FROM relations r "
           f"JOIN entities s ON s.id = r.subject_id {t} "
           f"LEFT JOIN entities o ON o.id = r.object_id {o} WHERE {w.sql} ORDER BY r.id")
    if sel.limit is not None:
        return f"{sql} LIMIT {d.mark}", [*w.params, sel.limit]
    return sql, w.params


def relation_values(d: Dialect, r: Relation) -> list[Any]:
    t = d.opt_time
    s = r.scope
    return [r.id, s.user_id, s.agent_id, r.subject, r.predicate, r.object, r.value, r.fact,
            t(r.valid_from), t(r.valid_to), d.time(r.created_at), t(r.expired_at),
            d.json(list(r.provenance)), r.confidence, d.json(r.metadata)]


def read_relation(d: Dialect, row: Sequence[Any]) -> Relation:
    (rid, uid, aid, subject, predicate, obj, value, fact, valid_from, valid_to, created, expired,
     provenance, confidence, metadata, subject_name, object_name) = row
    t = d.opt_read_time
    return Relation(id=rid, scope=Scope(uid, aid), subject=subject, predicate=predicate,
                    object=obj, value=value, fact=fact, valid_from=t(valid_from),
                    valid_to=t(valid_to), created_at=d.read_time(created), expired_at=t(expired),
                    provenance=tuple(d.read_json(provenance)), confidence=float(confidence),
                    metadata=d.read_json(metadata), subject_name=subject_name or "",
                    object_name=object_name or value or "")


def upsert_relation(d: Dialect, tenant: str, r: Relation) -> Stmt:
    names, values = list(RELATION_COLUMNS), relation_values(d, r)
    if d.tenant:
        names, values = ["tenant", *names], [tenant, *values]
    target = "tenant, id" if d.tenant else "id"
    sets = ", ".join(f"{c} = excluded.{c}" for c in RELATION_COLUMNS if c != "id")
    return (f"INSERT INTO relations ({', '.join(names)}) VALUES ({d.marks(len(names))}) "
            f"ON CONFLICT ({target}) DO UPDATE SET {sets}", values)


# -- mentions ------------------------------------------------------------------------------------

def insert_mention(d: Dialect, tenant: str, m: Mention) -> Stmt:
    names = list(MENTION_COLUMNS)
    values: list[Any] = [m.episode_id, m.entity_id, m.scope.user_id, m.scope.agent_id,
                         m.scope.session_id, d.opt_time(m.at)]
    if d.tenant:
        names, values = ["tenant", *names], [tenant, *values]
    target = "tenant, episode_id, entity_id" if d.tenant else "episode_id, entity_id"
    return (f"INSERT INTO mentions ({', '.join(names)}) VALUES ({d.marks(len(names))}) "
            f"ON CONFLICT ({target}) DO NOTHING", values)


def select_mentions(d: Dialect, tenant: str, scope: Scope, *,
                    entity_ids: Sequence[str] | None = None,
                    episode_ids: Sequence[str] | None = None, limit: int | None = None) -> Stmt:
    """Mentions, the most recent first."""
    w = owner(Where(d, tenant, "m"), scope)
    if scope.session_id is not None:
        w.add(f"m.session_id = {d.mark}", scope.session_id)
    if entity_ids is not None:
        w.one_of("m.entity_id", entity_ids)
    if episode_ids is not None:
        w.one_of("m.episode_id", episode_ids)
    sql = (f"SELECT {columns('m', MENTION_COLUMNS)} FROM mentions m WHERE {w.sql} "
           f"ORDER BY m.at DESC{d.nulls_last}, m.episode_id DESC")
    if limit is not None:
        return f"{sql} LIMIT {d.mark}", [*w.params, limit]
    return sql, w.params


def read_mention(d: Dialect, row: Sequence[Any]) -> Mention:
    episode, entity, uid, aid, sid, at = row
    return Mention(episode_id=episode, entity_id=entity, scope=Scope(uid, aid, sid),
                   at=d.opt_read_time(at))


def mention_counts(d: Dialect, tenant: str, scope: Scope, entity_ids: Sequence[str]) -> Stmt:
    """How many episodes mention each entity (for weighting rare entities over common ones)."""
    w = owner(Where(d, tenant, "m"), scope).one_of("m.entity_id", entity_ids)
    return (f"SELECT m.entity_id, count(*) FROM mentions m WHERE {w.sql} GROUP BY m.entity_id",
            w.params)


# -- walks (recursive CTEs) ----------------------------------------------------------------------

def _edges(d: Dialect, tenant: str, scope: Scope, seen: str, at: datetime | None) -> Stmt:
    """The graph's edges between entities as an undirected list (a, b, relation id)."""
    w = _holds(owner(Where(d, tenant, "r"), scope), seen, at).add("r.object_id IS NOT NULL")
    sql = (f"SELECT r.subject_id AS a, r.object_id AS b, r.id AS rel FROM relations r "
           f"WHERE {w.sql} UNION ALL SELECT r.object_id, r.subject_id, r.id FROM relations r "
           f"WHERE {w.sql}")
    return sql, [*w.params, *w.params]


def neighbours(d: Dialect, tenant: str, scope: Scope, start: Sequence[str], depth: int,
               seen: str, at: datetime | None) -> Stmt:
    """(entity id, its shortest distance) of every entity within `depth` hops of `start`."""
    edges, eparams = _edges(d, tenant, scope, seen, at)
    if d.arrays:  # ids compare byte-wise ("C"), as the id columns do
        seeds = f'SELECT x COLLATE "C" AS id FROM unnest({d.mark}::text[]) AS t(x)'
        sparams: list[Any] = [list(start)]
    else:
        seeds = " UNION ALL ".join(f"SELECT {d.mark} AS id" for _ in start)
        sparams = list(start)
    sql = (f"WITH RECURSIVE edges AS ({edges}), seeds AS ({seeds}), "
           f"walk(id, depth) AS (SELECT id, 0 FROM seeds UNION "
           f"SELECT e.b, w.depth + 1 FROM walk w JOIN edges e ON e.a = w.id "
           f"WHERE w.depth < {d.mark}) "
           f"SELECT id, min(depth) FROM walk GROUP BY id")
    return sql, [*eparams, *sparams, depth]


def path(d: Dialect, tenant: str, scope: Scope, a: str, b: str, max_depth: int,
         seen: str, at: datetime | None) -> Stmt:
    """The relation ids of one shortest path from entity `a` to `b` (at most `max_depth`
    hops), as one string of ids separated by ',' (none if unreachable). Entities already on the
    path are not entered again, so the walk ends on a cyclic graph."""
    edges, eparams = _edges(d, tenant, scope, seen, at)
    cat = "||"
    seed = f'CAST({d.mark} AS text) COLLATE "C"' if d.tenant else d.mark
    text = 'text) COLLATE "C"' if d.tenant else "TEXT)"
    sql = (f"WITH RECURSIVE edges AS ({edges}), "
           f"walk(id, depth, nodes, rels) AS ("
           f"SELECT {seed}, 0, CAST(',' {cat} {d.mark} {cat} ',' AS {text}, CAST('' AS {text} "
           f"UNION ALL SELECT e.b, w.depth + 1, CAST(w.nodes {cat} e.b {cat} ',' AS {text}, "
           f"CAST(w.rels {cat} e.rel {cat} ',' AS {text} FROM walk w JOIN edges e ON e.a = w.id "
           f"WHERE w.depth < {d.mark} AND w.id <> {d.mark} "
           f"AND position(',' {cat} e.b {cat} ',' IN w.nodes) = 0) "
           f"SELECT rels FROM walk WHERE id = {d.mark} ORDER BY depth, rels LIMIT 1")
    if not d.tenant:  # SQLite has instr(haystack, needle), not position(needle IN haystack)
        sql = sql.replace(f"position(',' {cat} e.b {cat} ',' IN w.nodes) = 0",
                          f"instr(w.nodes, ',' {cat} e.b {cat} ',') = 0")
    return sql, [*eparams, a, a, max_depth, b, b]


# -- erasure -------------------------------------------------------------------------------------

def erase_statements(d: Dialect, tenant: str, entity_ids: Sequence[str],
                     relation_ids: Sequence[str]) -> list[Stmt]:
    """Remove entities (with their index rows, mentions and every relation touching them) and
    relations (with their history events)."""
    out: list[Stmt] = []
    if entity_ids:
        touching = Where(d, tenant, "r")
        if d.arrays:
            touching.add(f"(r.subject_id = ANY({d.mark}) OR r.object_id = ANY({d.mark}))",
                         list(entity_ids), list(entity_ids))
        else:
            marks = d.marks(len(entity_ids))
            touching.add(f"(r.subject_id IN ({marks}) OR r.object_id IN ({marks}))",
                         *entity_ids, *entity_ids)
        out.append((f"DELETE FROM events AS e WHERE {_tenant(d, 'e')}e.memory_id IN "
                    f"(SELECT r.id FROM relations r WHERE {touching.sql})",
                    [*([tenant] if d.tenant else []), *touching.params]))
        out.append((f"DELETE FROM relations AS r WHERE {touching.sql}", touching.params))
        w = Where(d, tenant, "x").one_of("x.memory_id", entity_ids)  # a deleted entity's event
        out.append((f"DELETE FROM events AS x WHERE {w.sql}", w.params))
        for table, col in (("mentions", "entity_id"), ("entity_names", "entity_id"),
                           ("entities", "id")):
            w = Where(d, tenant, "x").one_of(f"x.{col}", entity_ids)
            out.append((f"DELETE FROM {table} AS x WHERE {w.sql}", w.params))
    if relation_ids:
        w = Where(d, tenant, "x").one_of("x.memory_id", relation_ids)
        out.append((f"DELETE FROM events AS x WHERE {w.sql}", w.params))
        w = Where(d, tenant, "x").one_of("x.id", relation_ids)
        out.append((f"DELETE FROM relations AS x WHERE {w.sql}", w.params))
    return out


def drop_mentions(d: Dialect, tenant: str, episode_ids: Sequence[str]) -> Stmt:
    w = Where(d, tenant, "x").one_of("x.episode_id", episode_ids)
    return f"DELETE FROM mentions AS x WHERE {w.sql}", w.params


def _tenant(d: Dialect, alias: str) -> str:
    return f"{alias}.tenant = {d.mark} AND " if d.tenant else ""


# -- the migration that makes an owner's entities unique by name -----------------------------------

def merge_duplicates(d: Dialect, conn: Any) -> None:
    """Migration step (`conn`: the migration's connection, every tenant's rows in view): merge
    the entities an older version created twice (two writers naming one new entity at once;
    `graph.rules.dedupe` decides which are one), move their relations and mentions to the
    survivor, and give every entity its claim key, so `entities_key` can be created unique."""
    from ..graph import rules as pg  # the decision is the graph's; this only applies it

    lead = "tenant, " if d.tenant else ""
    rows = conn.execute(f"SELECT {lead}{', '.join(ENTITY_COLUMNS)} FROM entities "
                        f"ORDER BY {lead}id").fetchall()
    by_tenant: dict[str, list[Entity]] = {}
    for row in rows:
        tenant, rest = (row[0], row[1:]) if d.tenant else ("", row)
        by_tenant.setdefault(tenant, []).append(read_entity(d, rest))
    for tenant, found in by_tenant.items():
        before = {e.id: e for e in found}
        kept, merged, keys = pg.dedupe(found)
        for dup, into in merged.items():
            for stmt in _merge(d, tenant, dup, into):
                conn.execute(*stmt)
        for eid, e in kept.items():
            if e != before[eid]:
                conn.execute(*upsert_entity(d, tenant, e, None))
                for stmt in put_names(d, tenant, e, pg.name_keys(e.name, e.aliases)):
                    conn.execute(*stmt)
            w = Where(d, tenant, "x").add(f"x.id = {d.mark}", eid)
            conn.execute(f"UPDATE entities AS x SET key = {d.mark} WHERE {w.sql}",
                         [keys[eid], *w.params])


def _merge(d: Dialect, tenant: str, dup: str, into: str) -> list[Stmt]:
    """Move a duplicate entity's edges and mentions to the entity it is, then remove it."""
    out: list[Stmt] = []
    for col in ("subject_id", "object_id"):
        w = Where(d, tenant, "x").add(f"x.{col} = {d.mark}", dup)
        out.append((f"UPDATE relations AS x SET {col} = {d.mark} WHERE {w.sql}", [into, *w.params]))
    cols = [c for c in MENTION_COLUMNS if c != "entity_id"]
    lead = ["tenant"] if d.tenant else []
    w = Where(d, tenant, "x").add(f"x.entity_id = {d.mark}", dup)
    out.append((f"INSERT INTO mentions ({', '.join([*lead, 'entity_id', *cols])}) "
                f"SELECT {', '.join([*(f'x.{c}' for c in lead), d.mark, *(f'x.{c}' for c in cols)])} "
                f"FROM mentions x WHERE {w.sql} ON CONFLICT DO NOTHING", [into, *w.params]))
    for table, col in (("mentions", "entity_id"), ("entity_names", "entity_id"), ("entities", "id")):
        w = Where(d, tenant, "x").add(f"x.{col} = {d.mark}", dup)
        out.append((f"DELETE FROM {table} AS x WHERE {w.sql}", w.params))
    return out

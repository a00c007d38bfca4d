"""The knowledge graph's part of the `Store` contract, on every backend (a fresh database per
test): entities and their name index, relations with world time (current, as of, history),
mentions, neighbours and paths (recursive CTEs), erasure, and owner scoping."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from engram.model import Entity, Event, EventType, Mention, Relation, Scope, new_id
from engram.store import EntitySelect, RelationSelect, Store

T0 = datetime(2024, 1, 1, tzinfo=UTC)
U, V = Scope("u"), Scope("v")


def ent(name: str, scope: Scope = U, type: str = "person", **kw: object) -> Entity:
    return Entity(id=new_id(), scope=scope, name=name, type=type, created_at=T0, updated_at=T0,
                  **kw)  # type: ignore[arg-type]


def rel(s: Entity, p: str, o: Entity | None, *, value: str | None = None,
        start: datetime | None = T0, end: datetime | None = None, **kw: object) -> Relation:
    return Relation(id=new_id(), scope=s.scope, subject=s.id, predicate=p,
                    object=o.id if o else None, value=value,
                    fact=f"{s.name} {p} {o.name if o else value}", created_at=T0,
                    valid_from=start, valid_to=end, **kw)  # type: ignore[arg-type]


def put(store: Store, *entities: Entity, relations: tuple[Relation, ...] = ()) -> None:
    with store.write() as tx:
        for e in entities:
            keys = [(e.name.lower(), "name"), *((a.lower(), "alias") for a in e.aliases)]
            tx.put_entity(e, keys, np.ones(4, dtype=np.float32) * (len(e.name) % 3 + 1))  # type: ignore[arg-type]
        for r in relations:
            tx.put_relation(r)


def test_entity_round_trip_with_every_field(store: Store) -> None:
    e = ent("Ana Silva", aliases=("Ana", "A. Silva"), summary="a nurse",
            attributes={"born": 1990, "tags": ["é", None]}, provenance=("ep-1", "ep-2"))
    put(store, e)
    assert store.read_entities(EntitySelect(ids=(e.id,))) == [e]
    e2 = Entity(**{**e.__dict__, "summary": "a doctor", "updated_at": T0 + timedelta(days=1)})
    with store.write() as tx:
        tx.put_entity(e2, [("ana silva", "name")])  # no embedding given: the stored one stays
    assert store.read_entities(EntitySelect(ids=(e.id,))) == [e2]
    assert [i for i, _ in store.entity_embeddings(U)] == [e.id]


def test_name_index_finds_names_and_aliases_of_the_owner_only(store: Store) -> None:
    a, b = ent("Ana", aliases=("Annie",)), ent("Ana", scope=V)
    put(store, a, b)
    assert sorted(store.match_names(U, ["annie", "ana", "bob"])) == [("ana", a.id), ("annie", a.id)]
    assert [e.id for e in store.read_entities(EntitySelect(V, keys=("ana",)))] == [b.id]
    assert store.read_entities(EntitySelect(U, keys=("nobody",))) == []
    # exact: NULL agent means no agent
    c = ent("Cleo", scope=Scope("u", "agent"))
    put(store, c)
    assert [e.id for e in store.read_entities(EntitySelect(U, exact=True))] == [a.id]
    assert {e.id for e in store.read_entities(EntitySelect(U))} == {a.id, c.id}


def test_relations_current_as_of_and_history(store: Store) -> None:
    ana, acme, globex = ent("Ana"), ent("Acme", type="org"), ent("Globex", type="org")
    old = rel(ana, "works_at", acme, start=T0, end=T0 + timedelta(days=365))
    new = rel(ana, "works_at", globex, start=T0 + timedelta(days=365))
    age = rel(ana, "age", None, value="34")
    put(store, ana, acme, globex, relations=(old, new, age))
    now = T0 + timedelta(days=400)
    current = store.read_relations(RelationSelect(U, subjects=(ana.id,), predicate="works_at", at=now))
    assert [(r.id, r.subject_name, r.object_name) for r in current] == [(new.id, "Ana", "Globex")]
    then = store.read_relations(RelationSelect(U, subjects=(ana.id,), seen="as_of",
                                               at=T0 + timedelta(days=10)))
    assert {r.id for r in then} == {old.id, age.id}
    everything = store.read_relations(RelationSelect(U, seen="all"))
    assert {r.id for r in everything} == {old.id, new.id, age.id}
    assert [r.object_name for r in store.read_relations(RelationSelect(U, value="34", at=now))] == ["34"]
    assert [r.id for r in store.read_relations(RelationSelect(U, objects=(acme.id,), seen="all"))] == [old.id]
    assert {r.id for r in store.read_relations(RelationSelect(U, touching=(globex.id,), at=now))} == {new.id}
    assert store.read_relations(RelationSelect(V, seen="all")) == []
    # a retired edge leaves current and as-of reads, and stays in the history
    with store.write() as tx:
        tx.put_relation(Relation(**{**age.__dict__, "expired_at": now}))
    assert age.id not in {r.id for r in store.read_relations(RelationSelect(U, at=now))}
    assert age.id in {r.id for r in store.read_relations(RelationSelect(U, seen="all"))}
    got = store.read_relations(RelationSelect(ids=(old.id,), seen="all"))[0]
    assert got == Relation(**{**old.__dict__, "subject_name": "Ana", "object_name": "Acme"})


def test_neighbours_by_depth_over_current_edges(store: Store) -> None:
    a, b, c, d, x = ent("A"), ent("B"), ent("C"), ent("D"), ent("X")
    ended = T0 + timedelta(days=1)
    rels = (rel(a, "knows", b), rel(c, "knows", b), rel(c, "knows", d),  # direction ignored
            rel(a, "knows", x, end=ended), rel(a, "knows", a))             # ended; a loop
    put(store, a, b, c, d, x, relations=rels)
    now = T0 + timedelta(days=2)
    assert store.neighbours(U, [a.id], 1, now) == {a.id: 0, b.id: 1}
    assert store.neighbours(U, [a.id], 3, now) == {a.id: 0, b.id: 1, c.id: 2, d.id: 3}
    assert store.neighbours(U, [a.id], 1, T0, as_of=True) == {a.id: 0, b.id: 1, x.id: 1}
    assert store.neighbours(V, [a.id], 2, now) == {a.id: 0}  # another owner's edges: none
    assert store.neighbours(U, [], 2, now) == {}


def test_shortest_path_either_direction_and_cycles(store: Store) -> None:
    a, b, c, d = ent("A"), ent("B"), ent("C"), ent("D")
    ab, bc, cd, ca = rel(a, "r", b), rel(b, "r", c), rel(c, "r", d), rel(c, "r", a)
    put(store, a, b, c, d, relations=(ab, bc, cd, ca))
    now = T0 + timedelta(days=1)
    assert store.find_path(U, a.id, d.id, 4, now) == [ca.id, cd.id]  # a<-c->d: 2 hops
    assert store.find_path(U, d.id, b.id, 4, now) == [cd.id, bc.id]
    assert store.find_path(U, a.id, d.id, 1, now) is None
    assert store.find_path(U, a.id, a.id, 3, now) == []
    lone = ent("Lone")
    put(store, lone)
    assert store.find_path(U, a.id, lone.id, 4, now) is None


def test_mentions_most_recent_first_and_counted(store: Store) -> None:
    ana, bob = ent("Ana"), ent("Bob")
    put(store, ana, bob)
    s = Scope("u", None, "s1")
    with store.write() as tx:
        tx.put_mentions([Mention("ep1", ana.id, s, T0), Mention("ep2", ana.id, s, T0 + timedelta(1)),
                         Mention("ep2", bob.id, s, T0 + timedelta(1))])
        tx.put_mentions([Mention("ep1", ana.id, s, T0)])  # a repeat is kept once
    assert [m.episode_id for m in store.read_mentions(U, entity_ids=[ana.id])] == ["ep2", "ep1"]
    assert store.read_mentions(U, entity_ids=[ana.id], limit=1)[0].scope == s
    assert store.mention_counts(U, [ana.id, bob.id]) == {ana.id: 2, bob.id: 1}
    assert {m.entity_id for m in store.read_mentions(U, episode_ids=["ep2"])} == {ana.id, bob.id}
    assert store.read_mentions(Scope("u", None, "other"), entity_ids=[ana.id]) == []
    with store.write() as tx:
        tx.drop_mentions(["ep2"])
    assert store.mention_counts(U, [ana.id, bob.id]) == {ana.id: 1}


def test_erase_graph_takes_entities_their_edges_names_mentions_and_events(store: Store) -> None:
    a, b, c = ent("Canary Person", aliases=("Canary",)), ent("B"), ent("C")
    ab, bc = rel(a, "knows", b), rel(b, "knows", c)
    put(store, a, b, c, relations=(ab, bc))
    with store.write() as tx:
        tx.put_mentions([Mention("ep1", a.id, U, T0)])
        for r in (ab, bc):
            tx.append(Event(id=new_id(), memory_id=r.id, type=EventType.ADD, at=T0, scope=U,
                            after=r.to_dict()))
    with store.write() as tx:
        tx.erase_graph([a.id], [bc.id])
    assert {e.id for e in store.read_entities(EntitySelect(U))} == {b.id, c.id}
    assert store.read_relations(RelationSelect(U, seen="all")) == []
    assert store.match_names(U, ["canary", "canary person"]) == []
    assert store.read_mentions(U, entity_ids=[a.id]) == []
    assert store.events(ab.id) == [] and store.events(bc.id) == []


def test_graph_migration_is_recorded(store: Store) -> None:
    assert "0003_graph" in store.migrations()


def test_a_database_made_before_the_graph_upgrades(tmp_path: Any, monkeypatch: Any) -> None:
    from engram.store.sqlite import SQLiteStore, schema

    path = tmp_path / "old.db"
    graph = ("0003_graph", "0005_entity_keys")
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", [x for x in schema.MIGRATIONS if x[0] not in graph])
        SQLiteStore(path).close()
    new = SQLiteStore(path)
    try:
        assert new.migrations() == [name for name, _ in schema.MIGRATIONS if name not in graph] \
            + list(graph)
        a = ent("Ana")
        put(new, a)
        assert new.read_entities(EntitySelect(U)) == [a]
    finally:
        new.close()


# -- 0005_entity_keys: one entity per name, duplicates an older version made merged -----------------

def _old_graph(d: Any, run: Any, tenant: str) -> dict[str, Any]:
    """Rows as a version before 0005 wrote them: one entity twice (two writers raced), a name
    shared by two types, and another owner's namesake."""
    from engram.graph import rules as pg
    from engram.store import graph as sg

    ana1 = ent("Ana", aliases=("Annie",), summary="a nurse", provenance=("ep1",))
    ana2 = ent("ana", type="entity", aliases=("Ana S.",), provenance=("ep2",))
    acme, place, person = ent("Acme", type="organization"), ent("Paris", type="place"), \
        ent("Paris", type="person")
    theirs = ent("Ana", scope=V)
    cols = ["tenant", *sg.ENTITY_COLUMNS[:-1]] if d.tenant else list(sg.ENTITY_COLUMNS[:-1])
    for e in (ana1, ana2, acme, place, person, theirs):
        values = sg.entity_values(d, e)[:-1]
        run(f"INSERT INTO entities ({', '.join(cols)}) VALUES ({d.marks(len(cols))})",
            [tenant, *values] if d.tenant else values)
        for stmt in sg.put_names(d, tenant, e, pg.name_keys(e.name, e.aliases)):
            run(*stmt)
    works, lives = rel(ana2, "works_at", acme), rel(ana1, "lives_in", place)
    for r in (works, lives):
        run(*sg.upsert_relation(d, tenant, r))
    for episode, e in (("ep1", ana1), ("ep1", ana2), ("ep2", ana2)):
        run(*sg.insert_mention(d, tenant, Mention(episode, e.id, U, T0)))
    return {"ana1": ana1, "ana2": ana2, "place": place, "person": person, "theirs": theirs,
            "works": works}


def _check_merged(store: Store, old: dict[str, Any]) -> None:
    ana1, ana2 = old["ana1"], old["ana2"]
    assert "0005_entity_keys" in store.migrations()
    mine = {e.id: e for e in store.read_entities(EntitySelect(U, exact=True))}
    assert ana2.id not in mine and sorted(e.name for e in mine.values()) == \
        ["Acme", "Ana", "Paris", "Paris"]
    ana = mine[ana1.id]
    assert ana.aliases == ("Annie", "Ana S.") and ana.provenance == ("ep1", "ep2")
    assert (ana.type, ana.summary, ana.summary_by) == ("person", "a nurse", "caller")
    assert {old["place"].id, old["person"].id} <= set(mine)  # two types: two entities
    assert [r.subject for r in store.read_relations(RelationSelect(U, ids=(old["works"].id,),
                                                                   seen="all"))] == [ana1.id]
    assert sorted(m.episode_id for m in store.read_mentions(U, entity_ids=[ana1.id])) == ["ep1", "ep2"]
    assert store.read_mentions(U, entity_ids=[ana2.id]) == []
    assert store.match_names(U, ["ana s"]) == [("ana s", ana1.id)]
    assert [e.id for e in store.read_entities(EntitySelect(V))] == [old["theirs"].id]
    with store.write() as tx:  # the key is unique now: a new "Ana" of U finds the old one
        fresh = ent("ANA")
        assert tx.add_entity(fresh, [("ana", "name")], "ana") == ana1.id
        assert tx.add_entity(ent("Paris", type="person"), [], "paris#person") == old["person"].id
        assert tx.add_entity(fresh, [("ana", "name")], "ana#robot") == fresh.id


def test_sqlite_merges_the_duplicates_of_an_older_version(tmp_path: Any, monkeypatch: Any) -> None:
    import sqlite3
    from contextlib import closing

    from engram.store.sqlite import SQLiteStore, schema
    from engram.store.sqlite import sql as lite

    path = tmp_path / "old.db"
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", [x for x in schema.MIGRATIONS if x[0] != "0005_entity_keys"])
        SQLiteStore(path).close()
    with closing(sqlite3.connect(path)) as conn, conn:
        old = _old_graph(lite.DIALECT, conn.execute, "")
    new = SQLiteStore(path)
    try:
        _check_merged(new, old)
    finally:
        new.close()


def test_postgres_merges_the_duplicates_of_an_older_version(tmp_path: Any, monkeypatch: Any,
                                                            pg_server: Any) -> None:
    import psycopg

    from engram.store.postgres import PostgresStore, schema
    from engram.store.postgres import sql as pgsql

    db = pg_server.database_for(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(schema, "MIGRATIONS", [x for x in schema.MIGRATIONS if x[0] != "0005_entity_keys"])
        PostgresStore(db).close()
    with psycopg.connect(db) as conn:
        olds = {}
        for tenant in ("", "b"):  # each tenant's entities are merged among themselves only
            conn.execute("SELECT set_config('engram.tenant', %s, false)", (tenant,))
            olds[tenant] = _old_graph(pgsql.DIALECT, conn.execute, tenant)
    new = PostgresStore(db)
    other = new.for_tenant("b")
    try:
        _check_merged(new, olds[""])
        _check_merged(other, olds["b"])
    finally:
        other.close()
        new.close()


def test_add_entity_is_unique_by_owner_and_key(store: Store) -> None:
    a = ent("Ana")
    with store.write() as tx:
        assert tx.add_entity(a, [("ana", "name")], "ana") == a.id
        assert tx.add_entity(ent("ANA"), [("ana", "name")], "ana") == a.id  # taken: nothing written
        for scope in (V, Scope("u", "bot"), Scope(None, "bot")):  # other owners: their own key
            other = ent("Ana", scope=scope)
            assert tx.add_entity(other, [("ana", "name")], "ana") == other.id
        typed = ent("Ana", type="robot")
        assert tx.add_entity(typed, [("ana", "name")], "ana#robot") == typed.id
    found = store.read_entities(EntitySelect(U, exact=True))
    assert sorted(e.id for e in found) == sorted([a.id, typed.id])
    assert len(store.match_names(V, ["ana"])) == 1  # the index rows of what was inserted only
    with store.write() as tx:  # an update by id keeps the key
        tx.put_entity(Entity(**{**a.__dict__, "aliases": ("Annie",)}),
                      [("ana", "name"), ("annie", "alias")])
        assert tx.add_entity(ent("Ana"), [], "ana") == a.id

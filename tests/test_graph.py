"""The knowledge graph through `Memory`: relations on a timeline (single- and many-valued
predicates, late facts, as-of reads), entity resolution, mentions without an LLM, graph reads,
erasure with the canary grep on both stores. The pure decisions are tested without a store."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from engram import Config, EventType, InvalidInput, Memory, NotFound, Relation, Scope
from engram.graph import rules as g
from engram.model import new_id
from engram.providers.llms import LLM, ScriptedLLM

T = datetime(2020, 1, 1, tzinfo=UTC)
CANARY = "Zqxcanary"


def year(n: int) -> datetime:
    return T.replace(year=n)


# -- relations on a timeline -----------------------------------------------------------------

def test_a_new_employer_closes_the_old_edge_and_keeps_it(gmem: Memory) -> None:
    old = gmem.relate("Ana", "works at", "Acme", valid_from=year(2019), user_id="u")
    new = gmem.relate("Ana", "works_at", "Globex", valid_from=year(2022), user_id="u")
    assert old.predicate == new.predicate == "works_at"
    assert [r.object_name for r in gmem.relations("Ana", "works_at", user_id="u")] == ["Globex"]
    assert [r.object_name for r in gmem.relations("Ana", "works_at", as_of=year(2020),
                                                   user_id="u")] == ["Acme"]
    history = gmem.relations("Ana", "works_at", history=True, user_id="u")
    closed = next(r for r in history if r.id == old.id)
    assert closed.valid_to == year(2022) and closed.expired_at is None
    events = gmem.history(old.id, user_id="u")  # a relation's history, like a memory's
    assert [e.type for e in events] == [EventType.ADD, EventType.SUPERSEDE]
    assert events[-1].before and events[-1].after and events[-1].after["valid_to"]
    assert new.id in (events[-1].reason or "")


def test_a_late_fact_lands_in_the_middle_of_the_timeline(gmem: Memory) -> None:
    gmem.relate("Ana", "lives_in", "Porto", valid_from=year(2015), user_id="u")
    gmem.relate("Ana", "lives_in", "Berlin", valid_from=year(2023), user_id="u")
    late = gmem.relate("Ana", "lives_in", "Lisbon", valid_from=year(2019), user_id="u")
    assert late.valid_to == year(2023)  # it held until the newer value began
    spans = {r.object_name: (r.valid_from, r.valid_to)
             for r in gmem.relations("Ana", "lives_in", history=True, user_id="u")}
    assert spans == {"Porto": (year(2015), year(2019)), "Lisbon": (year(2019), year(2023)),
                     "Berlin": (year(2023), None)}
    assert [r.object_name for r in gmem.relations("Ana", "lives_in", user_id="u")] == ["Berlin"]


def test_many_valued_predicates_keep_every_value_and_repeats_are_one(gmem: Memory) -> None:
    a = gmem.relate("Ana", "friend_of", "Bob", user_id="u")
    gmem.relate("Ana", "friend_of", "Carla", user_id="u")
    again = gmem.relate("Ana", "friend_of", "bob", user_id="u")
    assert again.id == a.id
    gmem.relate("Ana", "likes", "tea", user_id="u")
    gmem.relate("Ana", "likes", "jazz", user_id="u")
    assert {r.object_name for r in gmem.relations("Ana", user_id="u")} == {"Bob", "Carla", "tea", "jazz"}


def test_cardinality_comes_from_flag_then_configuration_then_defaults(tmp_path: Path,
                                                                      embedder: Any) -> None:
    assert g.single_valued("works at") and not g.single_valued("friend_of")
    assert not g.single_valued("plays_for")  # undeclared: many-valued
    assert g.single_valued("plays_for", single=["plays for"])
    assert not g.single_valued("works_at", multi=["works_at"])
    assert g.single_valued("friend_of", flag=True)
    cfg = Config(path=tmp_path / "m.db", graph_single=("plays_for",), graph_multi=("works_at",))
    with Memory(config=cfg, embedder=embedder, llm=None) as m:
        m.relate("Ana", "plays_for", "Benfica", valid_from=year(2019), user_id="u")
        m.relate("Ana", "plays_for", "Porto FC", valid_from=year(2021), user_id="u")
        m.relate("Ana", "works_at", "Acme", user_id="u")
        m.relate("Ana", "works_at", "Globex", user_id="u")
        m.relate("Ana", "has_role", "captain", literal=True, user_id="u")
        m.relate("Ana", "has_role", "coach", literal=True, single=True, user_id="u")
        assert [r.object_name for r in m.relations("Ana", "plays_for", user_id="u")] == ["Porto FC"]
        assert {r.object_name for r in m.relations("Ana", "works_at", user_id="u")} == {"Acme", "Globex"}
        assert [r.object_name for r in m.relations("Ana", "has_role", user_id="u")] == ["coach"]


def test_unrelate_ends_and_retract_retires(gmem: Memory) -> None:
    kept = gmem.relate("Ana", "member_of", "Chess Club", valid_from=year(2018), user_id="u")
    wrong = gmem.relate("Ana", "member_of", "Book Club", valid_from=year(2018), user_id="u")
    ended = gmem.unrelate("Ana", "member_of", "Chess Club", at=year(2021), user_id="u")
    assert [(r.id, r.valid_to) for r in ended] == [(kept.id, year(2021))]
    gone = gmem.unrelate("Ana", "member_of", "Book Club", retract=True, user_id="u")
    assert gone[0].id == wrong.id and gone[0].expired_at is not None
    assert gmem.relations("Ana", "member_of", user_id="u") == []
    assert [r.id for r in gmem.relations("Ana", "member_of", as_of=year(2019), user_id="u")] == [kept.id]
    assert {e.type for e in gmem.store.events(wrong.id)} == {EventType.ADD, EventType.DELETE}


def test_literals_and_bad_input(gmem: Memory) -> None:
    r = gmem.relate("Ana", "age", 34, user_id="u")
    assert (r.object, r.value, r.object_name) == (None, "34", "34")
    assert [x.id for x in gmem.relations(object="34", user_id="u")] == [r.id]
    with pytest.raises(InvalidInput):
        gmem.relate("", "knows", "Bob", user_id="u")
    with pytest.raises(InvalidInput):
        gmem.relate("Ana", "!!", "Bob", user_id="u")
    with pytest.raises(InvalidInput):
        gmem.relate("Ana", "knows", "Bob", valid_from=year(2020), valid_to=year(2019), user_id="u")
    with pytest.raises(InvalidInput):
        gmem.relate("Ana", "knows", None, user_id="u")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        gmem.neighbours("Ana", depth=9, user_id="u")
    with pytest.raises(NotFound):
        gmem.entity("Nobody", user_id="u")
    assert gmem.relations("Nobody", user_id="u") == []


# -- graph reads -------------------------------------------------------------------------------

def test_neighbours_path_and_profile(gmem: Memory) -> None:
    gmem.relate("Ana", "friend_of", "Bob", user_id="u")
    gmem.relate("Bob", "works_at", "Acme", user_id="u")
    gmem.relate("Acme", "located_in", "Lisbon", user_id="u")
    gmem.relate("Zed", "friend_of", "Ana", user_id="other")
    one = gmem.neighbours("Ana", depth=1, user_id="u")
    assert {e.name for e in one.entities} == {"Ana", "Bob"}
    two = gmem.neighbours("Ana", depth=2, user_id="u")
    assert {e.name for e in two.entities} == {"Ana", "Bob", "Acme"}
    assert {r.predicate for r in two.relations} == {"friend_of", "works_at"}
    p = gmem.path("Ana", "Lisbon", user_id="u")
    assert [e.name for e in p.entities] == ["Ana", "Bob", "Acme", "Lisbon"]
    assert [r.predicate for r in p.relations] == ["friend_of", "works_at", "located_in"]
    assert gmem.path("Ana", "Lisbon", max_depth=2, user_id="u").relations == []
    prof = gmem.entity("bob", user_id="u")
    assert prof.entity.name == "Bob" and {r.predicate for r in prof.relations} == {"friend_of", "works_at"}
    assert {e.name for e in gmem.neighbours("Ana", user_id="other").entities} == {"Ana", "Zed"}
    wire = two.to_dict()
    assert set(wire) == {"entities", "relations"}
    assert {"id", "subject", "predicate", "object", "valid_from", "valid_to"} <= set(wire["relations"][0])


def test_entities_are_listed_and_searched(gmem: Memory) -> None:
    gmem.upsert_entity("International Business Machines", type="organization",
                       aliases=["Big Blue"], user_id="u")
    gmem.upsert_entity("Lisbon", type="place", user_id="u")
    ibm = gmem.upsert_entity("IBM", type="organization", user_id="u")  # the acronym resolves
    assert ibm.name == "International Business Machines" and "IBM" in ibm.aliases
    assert [e.name for e in gmem.entities(user_id="u")] == ["International Business Machines", "Lisbon"]
    assert gmem.entities("big blue", user_id="u")[0].id == ibm.id
    assert [e.name for e in gmem.entities(type="place", user_id="u")] == ["Lisbon"]
    assert gmem.entity("IBM", user_id="u").entity.id == ibm.id
    assert gmem.entities(user_id="someone else") == []


def test_identifiers_and_types_never_merge(gmem: Memory) -> None:
    a = gmem.upsert_entity("SR-2023-052", type="ticket", user_id="u")
    b = gmem.upsert_entity("SR-2023-053", type="ticket", user_id="u")
    c = gmem.upsert_entity("Paris", type="place", user_id="u")
    d = gmem.upsert_entity("Paris", type="person", user_id="u")
    assert len({a.id, b.id}) == 2 and c.id != d.id
    assert gmem.upsert_entity("sr-2023-052", type="ticket", user_id="u").id == a.id  # exact key


def test_an_ambiguous_name_goes_to_the_llm(tmp_path: Path, embedder: Any) -> None:
    script = ScriptedLLM()
    with Memory(tmp_path / "m.db", embedder=embedder, llm=LLM(script, retries=0)) as m:
        silva = m.upsert_entity("Ana Silva", type="person", user_id="u")
        m.upsert_entity("Ana Costa", type="person", user_id="u")

        def pick_silva(messages: Any, schema: Any) -> dict[str, int]:
            listing = messages[-1]["content"].splitlines()
            return {"same_as": next(int(line.split(".")[0]) for line in listing
                                    if "Ana Silva" in line)}

        script.push(pick_silva)
        got = m.upsert_entity("Ana", type="person", user_id="u")  # two candidates: ask
        assert "Name: Ana (person)" in script.requests[-1].messages[-1]["content"]
        assert got.id == silva.id and "Ana" in got.aliases
    with Memory(tmp_path / "n.db", embedder=embedder, llm=None) as m:
        m.upsert_entity("Ana Silva", type="person", user_id="u")
        m.upsert_entity("Ana Costa", type="person", user_id="u")
        alone = m.upsert_entity("Ana", type="person", user_id="u")  # no LLM: kept apart
        assert alone.name == "Ana"


# -- mentions without an LLM -------------------------------------------------------------------

def test_speakers_become_entities_and_known_names_are_linked(gmem: Memory) -> None:
    gmem.upsert_entity("Lisbon", type="place", aliases=["Lisboa"], user_id="u")
    gmem.add([{"content": "I just got back from Lisboa!", "name": "Ana"},
              {"content": "How was it? Did you see Bob there?", "name": "Carla"},
              {"content": "No, Bob was in Porto", "name": "Ana"}], user_id="u", session_id="s1")
    people = {e.name for e in gmem.entities(type="person", user_id="u")}
    assert people == {"Ana", "Carla"}
    lisbon = gmem.entity("Lisbon", user_id="u")
    assert [m.text for m in lisbon.mentions] == ["I just got back from Lisboa!"]
    ana = gmem.entity("Ana", user_id="u")
    assert len(ana.mentions) == 2  # her own turns
    gmem.upsert_entity("Bob", type="person", user_id="u")
    gmem.add({"content": "Bob says hi", "name": "Carla"}, user_id="u", session_id="s2")
    assert [m.text for m in gmem.entity("Bob", user_id="u").mentions] == ["Bob says hi"]


# -- erasure -----------------------------------------------------------------------------------

def test_erase_takes_what_only_the_erased_episodes_gave_the_graph(gmem: Memory) -> None:
    first = gmem.add({"content": "hello there", "name": CANARY}, user_id="u",
                     session_id="s1").memories[0]
    gmem.add({"content": "I met Keeper today", "name": "Ana"}, user_id="u", session_id="s1")
    keeper = gmem.upsert_entity("Keeper", type="person", user_id="u")  # explicit: no provenance
    assert gmem.entity(CANARY, user_id="u")
    gmem.erase(id=first.id, user_id="u")
    with pytest.raises(NotFound):
        gmem.entity(CANARY, user_id="u")  # its only evidence is gone
    assert gmem.entity("Keeper", user_id="u").entity.id == keeper.id
    assert gmem.entity("Ana", user_id="u").mentions  # still mentioned elsewhere


def test_an_entity_mentioned_elsewhere_keeps_its_other_evidence(gmem: Memory) -> None:
    a = gmem.add({"content": "first words", "name": "Dora"}, user_id="u", session_id="s1").memories[0]
    b = gmem.add({"content": "second words", "name": "Dora"}, user_id="u", session_id="s2").memories[0]
    gmem.erase(id=a.id, user_id="u")
    prof = gmem.entity("Dora", user_id="u")
    assert [m.id for m in prof.mentions] == [b.id] and prof.entity.provenance == (b.id,)


def test_erasing_a_user_erases_their_graph(gmem: Memory) -> None:
    gmem.relate("Ana", "knows", CANARY, user_id="u")
    gmem.relate("Ana", "knows", "Bob", user_id="keep")
    gmem.add({"content": "hi", "name": "Ana"}, user_id="u", session_id="s")
    gmem.erase(user_id="u")
    assert gmem.entities(user_id="u") == [] and gmem.relations(user_id="u") == []
    assert [r.object_name for r in gmem.relations(user_id="keep")] == ["Bob"]


def test_canary_leaves_the_sqlite_file(tmp_path: Path, embedder: Any) -> None:
    db = tmp_path / "g.db"
    with Memory(db, embedder=embedder, llm=None) as m:
        ep = m.add({"content": "just saying hi", "name": CANARY}, user_id="u",
                   session_id="s").memories[0]
        m.relate(CANARY, "works_at", "Acme", user_id="u")
        assert _count(db, CANARY) > 0
        m.erase(user_id="u")
        assert ep.id
    assert _count(db, CANARY) == 0
    with closing(sqlite3.connect(db)) as conn:
        for table in ("entities", "entity_names", "relations", "mentions"):
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == 0


def test_canary_leaves_the_postgres_files(pg_server: Any, embedder: Any) -> None:
    from engram.store.postgres import PostgresStore

    db = pg_server.url(pg_server.create_database())
    name = db.split("/")[3].split("?")[0]
    needle = CANARY.encode()

    def occurrences() -> int:
        return sum(p.read_bytes().count(needle) for p in pg_server.files(name))

    m = Memory(store=PostgresStore(db, reclaim_mode="full"), embedder=embedder, llm=None)
    try:
        m.add({"content": "just saying hi", "name": CANARY}, user_id="u", session_id="s")
        m.relate(CANARY, "works_at", "Acme", user_id="u")
        pg_server.settle()
        assert occurrences() > 0
        m.erase(user_id="u")
        pg_server.settle()
        assert occurrences() == 0
    finally:
        m.close()


def _count(db: Path, needle: str) -> int:
    raw = needle.encode()
    return sum(p.read_bytes().count(raw) for p in (db, Path(f"{db}-wal")) if p.exists())


# -- the pure decisions ------------------------------------------------------------------------

def _rel(obj: str, start: datetime, end: datetime | None = None) -> Relation:
    return Relation(id=new_id(), scope=Scope("u"), subject="s", predicate="p", object=obj,
                    value=None, fact="", created_at=T, valid_from=start, valid_to=end)


def test_placement_within_one_subject_and_predicate() -> None:
    a, b = _rel("A", year(2015)), _rel("B", year(2023))
    a = replace(a, valid_to=year(2023))

    def is_(o: str) -> Any:
        return lambda r: r.object == o

    assert g.place(is_("A"), year(2016), [a, b], True).duplicate == a
    late = g.place(is_("C"), year(2019), [a, b], True)
    assert late.closes == ((a, year(2019)),) and late.valid_to == year(2023)
    newest = g.place(is_("D"), year(2024), [a, b], True)
    assert newest.closes == ((b, year(2024)),) and newest.valid_to is None
    assert g.place(is_("D"), year(2024), [a, b], False) == g.Placement()


def test_names_and_keys() -> None:
    assert g.normalise("  The  Acme, Inc. ") == "acme inc"
    assert g.core("Acme Inc.") == "acme" and g.acronym("Bank of America") == "ba"
    assert g.is_identifier("SR-2023-052") and not g.is_identifier("Ana")
    assert g.predicate_key("Works-At") == "works_at"
    assert "ana silva" in g.ngrams("I met Ana Silva.") and "the" not in g.ngrams("the end")


def test_context_has_an_entity_block_within_the_budget(mem: Memory) -> None:
    mem.relate("Ana", "works_at", "Globex", valid_from=year(2023), user_id="u")
    mem.upsert_entity("Ana", type="person", summary="a nurse from Porto", user_id="u")
    mem.add({"content": "I love my job", "name": "Ana"}, user_id="u", session_id="s")
    ctx = mem.context("Where does Ana work?", user_id="u", budget_tokens=400)
    block = ctx.blocks["entities"]
    assert block.ids and block.tokens > 0 and ctx.total_tokens <= 400
    system = ctx.messages[0]["content"]
    assert '"Ana (person)": "a nurse from Porto; Ana works at Globex (since 2023-01-01)"' in system
    assert mem.context("What is the weather?", user_id="u").blocks["entities"].ids == ()


def test_the_graph_retriever_reaches_episodes_through_neighbours(tmp_path: Path,
                                                                 embedder: Any) -> None:
    from engram import PRESETS

    cfg = replace(PRESETS["hybrid"], name="graph", graph_weight=0.5, graph_depth=1)
    with Memory(tmp_path / "m.db", embedder=embedder, llm=None, retrieval=cfg) as m:
        m.relate("Ana", "works_at", "Globex", user_id="u")
        m.add(["Globex announced record layoffs this morning", "I had pasta for lunch",
               "The weather is grey again"], user_id="u", session_id="s")
        hits = m.search("How is Ana's employer doing?", user_id="u", limit=3)
        top = hits[0]
        assert top.memory.text.startswith("Globex") and top.explain["graph"] == pytest.approx(0.5)
        assert all("graph" not in h.explain for h in hits[1:])
        plain = m.search("How is the weather?", user_id="u", limit=3)
        assert all("graph" not in h.explain for h in plain)  # no entity named: no graph part
    with pytest.raises(InvalidInput):
        replace(cfg, graph_depth=3)


def test_erasing_a_session_keeps_the_owners_graph(gmem: Memory) -> None:
    gmem.relate("Ana", "works_at", "Acme", user_id="u")
    gmem.add({"content": "hi", "name": "Visitor"}, user_id="u", session_id="s1")
    gmem.add({"content": "hello", "name": "Ana"}, user_id="u", session_id="s2")
    gmem.erase(user_id="u", session_id="s1")
    assert {e.name for e in gmem.entities(user_id="u")} == {"Ana", "Acme"}
    assert [r.object_name for r in gmem.relations("Ana", user_id="u")] == ["Acme"]

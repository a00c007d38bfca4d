"""The knowledge graph over MCP: the reference server's tools keep their graph in engram's real
graph (the only one), the `entity`, `relations` and `neighbours` tools read it, and a graph that
older versions kept as tagged memories converts into it once."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mcp import Client

from engram import Memory, Scope
from engram.graph import reference as kg
from engram.mcp import build_server
from engram.providers.embedders import MiniLM


def data(result: Any) -> Any:
    assert not result.is_error, result.content[0].text
    return result.structured_content


def test_reference_tools_write_the_real_graph_and_the_new_tools_read_it(
        tmp_path: Path, embedder: MiniLM) -> None:
    async def go(mem: Memory) -> None:
        async with Client(build_server(lambda: mem, user_id="u1")) as c:
            data(await c.call_tool("create_entities", {"entities": [
                {"name": "Ana", "entityType": "person", "observations": ["speaks Portuguese"]},
                {"name": "Clinic", "entityType": "organization", "observations": []},
                {"name": "Lisbon", "entityType": "place", "observations": []}]}))
            data(await c.call_tool("create_relations", {"relations": [
                {"from": "Ana", "to": "Clinic", "relationType": "works_at"},
                {"from": "Clinic", "to": "Lisbon", "relationType": "located_in"}]}))
            prof = data(await c.call_tool("entity", {"name": "ana"}))
            assert (prof["name"], prof["type"]) == ("Ana", "person")
            assert [r["object"] for r in prof["relations"]] == ["Clinic"]
            rels = data(await c.call_tool("relations", {"predicate": "located_in"}))["relations"]
            assert [(r["subject"], r["object"]) for r in rels] == [("Clinic", "Lisbon")]
            hood = data(await c.call_tool("neighbours", {"name": "Ana", "depth": 2}))
            assert {e["name"] for e in hood["entities"]} == {"Ana", "Clinic", "Lisbon"}
            data(await c.call_tool("delete_relations", {"relations": [
                {"from": "Ana", "to": "Clinic", "relationType": "works_at"}]}))
            assert data(await c.call_tool("relations", {"subject": "Ana"}))["relations"] == []
            missing = await c.call_tool("entity", {"name": "Nobody"})
            assert missing.is_error and "NotFound" in missing.content[0].text
            graph = data(await c.call_tool("read_graph", {}))  # the reference shapes as before
            assert {e["name"] for e in graph["entities"]} == {"Ana", "Clinic", "Lisbon"}

    with Memory(tmp_path / "m.db", embedder=embedder, llm=None) as mem:
        asyncio.run(go(mem))


OLD_GRAPH = [  # what the reference tools stored before the real graph: tagged memories only
    {"content": "Ana (person)", "metadata": {"kg": "entity", "entity": "Ana", "entity_type": "person"}},
    {"content": "Ana: speaks Portuguese", "metadata": {
        "kg": "observation", "entity": "Ana", "entity_type": "person", "observation": "speaks Portuguese"}},
    {"content": "ana (person) #2", "metadata": {"kg": "entity", "entity": "ana", "entity_type": "person"}},
    {"content": "Bob (person)", "metadata": {"kg": "entity", "entity": "Bob", "entity_type": "person"}},
    {"content": "Ana friend of Bob", "metadata": {
        "kg": "relation", "from": "Ana", "to": "Bob", "relation_type": "friend_of"}},
]


def test_a_graph_kept_as_tagged_memories_converts_once_into_the_real_graph(
        tmp_path: Path, embedder: MiniLM) -> None:
    with Memory(tmp_path / "m.db", embedder=embedder, llm=None) as mem:
        tagged = mem.add(OLD_GRAPH, user_id="u1", kind="semantic", infer=False).memories
        assert len(tagged) == 5 and mem.entities(user_id="u1") == []

    async def go(mem: Memory) -> Any:
        async with Client(build_server(lambda: mem, user_id="u1")) as c:
            return data(await c.call_tool("read_graph", {}))

    with Memory(tmp_path / "m.db", embedder=embedder, llm=None) as mem:  # a store opened again
        graph = asyncio.run(go(mem))
        assert graph == {"entities": [
            {"name": "Ana", "entityType": "person", "observations": ["speaks Portuguese"]},
            {"name": "ana", "entityType": "person", "observations": []},
            {"name": "Bob", "entityType": "person", "observations": []}],
            "relations": [{"from": "Ana", "to": "Bob", "relationType": "friend_of"}]}
        # one truth: the real graph holds it, the tagged memories are gone (their history kept)
        assert {e.name for e in mem.entities(user_id="u1")} == {"Ana", "Bob"}
        assert [(r.subject_name, r.predicate, r.object_name)
                for r in mem.relations(user_id="u1")] == [("Ana", "friend_of", "Bob")]
        assert mem.list(user_id="u1").items == []
        assert all([e.type.value for e in mem.history(m.id)] == ["ADD", "DELETE"] for m in tagged)
        assert kg.migrate(mem, Scope("u1")) == (0, 0)  # once: nothing left to convert
    with Memory(tmp_path / "m.db", embedder=embedder, llm=None) as mem:
        assert asyncio.run(go(mem)) == graph  # and not again on the next open


def test_the_reference_graph_is_the_real_graph_for_erasure_and_export(
        tmp_path: Path, embedder: MiniLM) -> None:
    async def go(mem: Memory) -> None:
        async with Client(build_server(lambda: mem, user_id="u1")) as c:
            data(await c.call_tool("create_entities", {"entities": [
                {"name": "Ana", "entityType": "person", "observations": ["speaks Portuguese"]},
                {"name": "ana", "entityType": "person", "observations": ["is five"]},
                {"name": "Clinic", "entityType": "organization", "observations": []}]}))
            data(await c.call_tool("create_relations", {"relations": [
                {"from": "Ana", "to": "Clinic", "relationType": "works_at"},
                {"from": "ana", "to": "Ghost", "relationType": "haunted_by"}]}))

    with Memory(tmp_path / "m.db", embedder=embedder, llm=None) as mem:
        asyncio.run(go(mem))
        graph = kg.read_graph(mem, Scope("u1"))
        assert mem.list(user_id="u1").items == []  # no second copy as memories
        mem.export(tmp_path / "u1.jsonl", user_id="u1")
        mem.erase(user_id="u1")
        assert kg.read_graph(mem, Scope("u1")) == kg.Graph()
        assert mem.entities(user_id="u1") == []
    with Memory(tmp_path / "moved.db", embedder=embedder, llm=None) as mem:
        mem.import_(tmp_path / "u1.jsonl")
        assert kg.read_graph(mem, Scope("u1")) == graph
        assert graph.entities[1] == kg.Entity("ana", "person", ("is five",))
        assert kg.Relation("ana", "Ghost", "haunted_by") in graph.relations


def test_delete_entities_deletes_the_real_entity_unless_a_namesake_remains(
        tmp_path: Path, embedder: MiniLM) -> None:
    async def go(mem: Memory) -> None:
        async with Client(build_server(lambda: mem, user_id="u1")) as c:
            data(await c.call_tool("create_entities", {"entities": [
                {"name": "Ana", "entityType": "person", "observations": []},
                {"name": "ana", "entityType": "person", "observations": []},  # two here, one there
                {"name": "Clinic", "entityType": "organization", "observations": []}]}))
            data(await c.call_tool("create_relations", {"relations": [
                {"from": "Ana", "to": "Clinic", "relationType": "works_at"}]}))
            ana = mem.entity("Ana", user_id="u1").entity
            data(await c.call_tool("delete_entities", {"entityNames": ["ana"]}))
            # `Ana` is still a reference entity, and the real graph's Ana is hers too
            assert mem.entity("Ana", user_id="u1").entity.id == ana.id
            data(await c.call_tool("delete_entities", {"entityNames": ["Clinic"]}))
            assert data(await c.call_tool("relations", {"subject": "Ana"}))["relations"] == []
            missing = await c.call_tool("entity", {"name": "Clinic"})
            assert missing.is_error and "NotFound" in missing.content[0].text
            data(await c.call_tool("delete_entities", {"entityNames": ["Ana"]}))
            assert mem.entities(user_id="u1") == []
            graph = data(await c.call_tool("read_graph", {}))
            assert graph["entities"] == [] and graph["relations"] == []

    with Memory(tmp_path / "m.db", embedder=embedder, llm=None) as mem:
        asyncio.run(go(mem))


def test_writers_at_once_keep_every_name_and_observation(gmem: Memory) -> None:
    # Names that the real graph resolves to one entity, written by threads at once: each
    # thread's records land on the one entity, none overwrites another's (both stores).
    owner = Scope("u1")
    names = ["Ana", "ana", "ANA", "Ana."]
    kg.create_entities(gmem, [kg.Entity("Ana", "person")], owner)

    def write(i: int) -> None:
        if 0 < i < len(names):
            kg.create_entities(gmem, [kg.Entity(names[i], "person", (f"fact {i}",))], owner)
        kg.add_observations(gmem, [("Ana", [f"seen by {i}"])], owner)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(16)))
    graph = kg.read_graph(gmem, owner)
    assert sorted(e.name for e in graph.entities) == sorted(names)
    by_name = {e.name: e for e in graph.entities}
    assert sorted(by_name["Ana"].observations) == sorted(f"seen by {i}" for i in range(16))
    assert all(by_name[n].observations == (f"fact {i}",) for i, n in enumerate(names) if i)
    assert len(gmem.entities(user_id="u1")) == 1  # one real entity holds them all


def test_observations_are_redacted_as_every_stored_text(tmp_path: Path, embedder: MiniLM) -> None:
    key = "sk-proj-Zq7RtY2uIo9pAs4dFg6hJk1lZx3cVb8nM0qW5eRt7yUi9oPa2sD4fG6hJ8kL0"
    with Memory(tmp_path / "m.db", embedder=embedder, llm=None) as mem:
        kg.create_entities(mem, [kg.Entity("Ana", "person", (f"her key is {key}",))], Scope("u"))
        kg.add_observations(mem, [("Ana", [f"old key {key}"])], Scope("u"))
        (ana,) = kg.read_graph(mem, Scope("u")).entities
        assert len(ana.observations) == 2 and not any(key in o for o in ana.observations)
        assert kg.delete_observations(mem, [("Ana", [f"old key {key}"])], Scope("u")) == (1, [])
    assert not any(key.encode() in p.read_bytes() for p in tmp_path.iterdir() if p.is_file())


def test_a_deleted_relation_leaves_the_entities_summaries(gmem: Memory) -> None:
    owner = Scope("u1")
    kg.create_entities(gmem, [kg.Entity("Ana", "person"), kg.Entity("Clinic", "organization")], owner)
    kg.create_relations(gmem, [kg.Relation("Ana", "Clinic", "works_at")], owner)

    def stored(name: str) -> str:  # the row's summary (`entity` recomputes a rules summary)
        return next(e.summary for e in gmem.entities(user_id="u1") if e.name == name)

    assert "Clinic" in stored("Ana") and "Ana" in stored("Clinic")
    assert kg.delete_relations(gmem, [kg.Relation("Ana", "Clinic", "works_at")], owner) == 1
    assert "Clinic" not in stored("Ana") and "Ana" not in stored("Clinic")
    assert gmem.relations("Ana", user_id="u1") == []


CONVERT = """
import sys
from engram import Memory, Scope
from engram.graph import reference as kg
from engram.providers.embedders import MiniLM
with Memory(sys.argv[1], embedder=MiniLM(threads=1, int8=True), llm=None) as mem:
    print(len(kg.read_graph(mem, Scope("u1")).entities))
"""


def test_processes_opening_an_old_graph_at_once_convert_it_once(tmp_path: Path,
                                                                 embedder: MiniLM) -> None:
    with Memory(tmp_path / "m.db", embedder=embedder, llm=None) as mem:
        mem.add(OLD_GRAPH, user_id="u1", kind="semantic", infer=False)
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT, str(tmp_path / "m.db")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["3", "3", "3"]
    with Memory(tmp_path / "m.db", embedder=embedder, llm=None) as mem:
        graph = kg.read_graph(mem, Scope("u1"))
        assert [e.name for e in graph.entities] == ["Ana", "ana", "Bob"]
        assert graph.entities[0].observations == ("speaks Portuguese",)  # not twice
        assert graph.relations == [kg.Relation("Ana", "Bob", "friend_of")]
        assert len(mem.relations(user_id="u1")) == 1 and mem.list(user_id="u1").items == []

"""The knowledge graph over MCP: the reference server's tools also write engram's real graph,
the `entity`, `relations` and `neighbours` tools read it, and `kg` records written before the
real graph existed migrate into it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from mcp import Client

from engram import Memory, Scope
from engram.mcp import build_server
from engram.mcp import graph as kg
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


def test_kg_records_written_before_migrate_into_entities_and_relations(
        tmp_path: Path, embedder: MiniLM) -> None:
    with Memory(tmp_path / "m.db", embedder=embedder, llm=None) as mem:
        owner = Scope("u1")
        # what the reference tools stored before the real graph: kg records only
        mem.add([{"content": "Ana (person)", "metadata": {"kg": "entity", "entity": "Ana",
                                                          "entity_type": "person"}},
                 {"content": "Bob (person)", "metadata": {"kg": "entity", "entity": "Bob",
                                                          "entity_type": "person"}},
                 {"content": "Ana friend of Bob", "metadata": {
                     "kg": "relation", "from": "Ana", "to": "Bob", "relation_type": "friend_of"}}],
                user_id="u1", kind="semantic", infer=False)
        assert mem.entities(user_id="u1") == []
        assert kg.migrate(mem, owner) == (2, 1)
        assert kg.migrate(mem, owner) == (2, 1)  # again: nothing new
        assert {e.name for e in mem.entities(user_id="u1")} == {"Ana", "Bob"}
        assert [(r.subject_name, r.predicate, r.object_name)
                for r in mem.relations(user_id="u1")] == [("Ana", "friend_of", "Bob")]


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

"""The MCP face, driven by the `mcp` SDK's own client: `engram mcp` as a subprocess over stdio and
over streamable HTTP, an in-process HTTP server whose `resolve` picks a Memory per request, and the
knowledge-graph mapping (`engram.graph.reference`) checked directly against a real Memory."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from typer.testing import CliRunner

from engram import InvalidImport, InvalidInput, Memory, NotFound, Scope
from engram.cli import app
from engram.graph import reference as kg
from engram.mcp import build_server, current_request
from engram.providers.embedders import MiniLM
from server_kit import serve_in_thread

TOOLS = {"remember", "recall", "forget", "list_memories", "get_context", "create_entities",
         "create_relations", "add_observations", "delete_entities", "delete_observations",
         "delete_relations", "read_graph", "search_nodes", "open_nodes",
         "entity", "relations", "neighbours"}
TIMEOUT = 180  # seconds for a subprocess to load torch and the model on a busy 2-core machine
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "OMP_NUM_THREADS": "1"}  # one thread: the machine is shared


def _same_engram() -> dict[str, str]:
    """The child imports the engram under test (a PYTHONPATH that puts a work tree first)."""
    return {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}


def data(result: Any) -> Any:
    assert not result.is_error, result.content[0].text
    return result.structured_content


def error(result: Any) -> str:
    assert result.is_error, result.structured_content
    text: str = result.content[0].text
    return text


# -- stdio: the engram CLI as a subprocess -------------------------------------------------------

@pytest.mark.slow
def test_stdio_memory_tools(tmp_path: Path, embedder: MiniLM) -> None:
    db = tmp_path / "stdio.db"
    params = StdioServerParameters(command=sys.executable, args=["-m", "engram.cli", "mcp"],
                                   env={**CHILD_ENV, **_same_engram(), "ENGRAM_DB": str(db)})
    stray: list[Exception] = []  # anything on stdout that is not a protocol message lands here

    async def on_message(message: Any) -> None:
        if isinstance(message, Exception):
            stray.append(message)

    async def session() -> tuple[str, str]:
        async with Client(params, message_handler=on_message, read_timeout_seconds=TIMEOUT) as c:
            tools = {t.name: t for t in (await c.list_tools()).tools}
            assert set(tools) == TOOLS
            assert set(tools["create_entities"].input_schema["$defs"]["EntityModel"]["properties"]) == {
                "name", "entityType", "observations"}
            assert tools["recall"].annotations.read_only_hint is True

            fact = data(await c.call_tool("remember", {"text": "Ana moved to Lisbon in May 2024",
                                                       "metadata": {"topic": "home"}}))
            assert fact["events"][0].startswith("ADD ")
            fid = fact["memories"][0]["id"]
            data(await c.call_tool("remember", {"text": "Ana is allergic to peanuts", "importance": 0.9}))
            data(await c.call_tool("remember", {"text": "I ordered a pizza", "kind": "episodic",
                                                "session_id": "s1"}))

            hits = data(await c.call_tool("recall", {"query": "Where does Ana live?", "limit": 2}))["hits"]
            assert hits[0]["id"] == fid and hits[0]["text"] == "Ana moved to Lisbon in May 2024"
            assert hits[0]["score"] > 0 and hits[0]["created_at"] and "dense" in hits[0]["explain"]
            only = data(await c.call_tool("recall", {"query": "Ana", "filters": {"topic": "home"}}))
            assert [h["id"] for h in only["hits"]] == [fid]

            page = data(await c.call_tool("list_memories", {"limit": 2}))
            assert len(page["memories"]) == 2 and page["next_cursor"]
            rest = data(await c.call_tool("list_memories", {"cursor": page["next_cursor"]}))
            assert [m["text"] for m in rest["memories"]] == ["I ordered a pizza"]

            context = data(await c.call_tool("get_context", {"query": "What is Ana allergic to?",
                                                             "session_id": "s1", "budget_tokens": 500}))
            assert "peanuts" in context["text"] and "pizza" in context["text"]
            assert 0 < context["total_tokens"] <= 500 and context["memory_ids"]

            assert data(await c.call_tool("forget", {"id": fid}))["deleted"] == fid
            hits = data(await c.call_tool("recall", {"query": "Where does Ana live?"}))["hits"]
            assert fid not in {h["id"] for h in hits}
            assert "NotFound" in error(await c.call_tool("forget", {"id": fid}))

            # Bad input is a tool error with engram's typed error named, never a crash.
            assert "InvalidInput: text is empty" in error(await c.call_tool("remember", {"text": "  "}))
            bad_filter = {"query": "x", "filters": {"a b": 1}}
            assert "InvalidFilter" in error(await c.call_tool("recall", bad_filter))
            # A schema refusal is one line in engram's words (not pydantic's, with its URL).
            refused = error(await c.call_tool("recall", {"query": "x", "limit": 0}))
            assert refused == ("Error executing tool recall: InvalidInput: limit: Input should be "
                               "greater than or equal to 1")
            assert "entityType" in error(await c.call_tool("create_entities", {"entities": [{"name": "A"}]}))
            # ... and the server is still serving.
            first = data(await c.call_tool("list_memories", {}))["memories"][0]["text"]
            return fid, first

    fid, first = asyncio.run(session())
    assert first == "Ana is allergic to peanuts"
    assert stray == []
    with Memory(db, embedder=embedder) as mem:  # the same file, through the library
        assert [e.type.value for e in mem.history(fid)] == ["ADD", "DELETE"]
        assert mem.stats(user_id="default").memories == 2


# -- streamable HTTP: `engram mcp --transport http` as a subprocess --------------------------------

@contextmanager
def http_server(db: Path) -> Iterator[str]:
    """`engram mcp -t http --port 0`; yields its URL, read from uvicorn's startup line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "engram.cli", "--db", str(db), "mcp", "-t", "http", "--port", "0"],
        env={**os.environ, **CHILD_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def pump() -> None:  # keep draining stderr so the server never blocks on a full pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=TIMEOUT)
            seen.append(line)
            assert line, f"engram mcp exited before serving:\n{''.join(seen)}"
            found = re.search(r"Uvicorn running on (http://\S+)", line)
            if found:
                break
        yield found.group(1) + "/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.mark.slow
def test_http_knowledge_graph(tmp_path: Path, embedder: MiniLM) -> None:
    db = tmp_path / "http.db"

    async def session(url: str) -> None:
        async with Client(url, read_timeout_seconds=TIMEOUT) as c:
            assert {t.name for t in (await c.list_tools()).tools} == TOOLS
            created = data(await c.call_tool("create_entities", {"entities": [
                {"name": "Ana", "entityType": "person",
                 "observations": ["speaks Portuguese", "likes strong coffee"]},
                {"name": "Clinic", "entityType": "organization", "observations": ["opened in 2019"]},
                {"name": "Bob", "entityType": "person", "observations": ["likes strong coffee"]},
            ]}))
            assert [e["name"] for e in created["entities"]] == ["Ana", "Clinic", "Bob"]
            again = data(await c.call_tool("create_entities", {"entities": [
                {"name": "Ana", "entityType": "person", "observations": ["new fact, ignored"]}]}))
            assert again == {"entities": [], "skipped": ["Ana"]}

            works = {"from": "Ana", "to": "Clinic", "relationType": "works_at"}
            knows = {"from": "Bob", "to": "Ana", "relationType": "knows"}
            new = data(await c.call_tool("create_relations", {"relations": [works, knows, works]}))
            assert new["relations"] == [works, knows]
            assert data(await c.call_tool("create_relations", {"relations": [works]}))["relations"] == []
            # As in the reference server, a relation may name an entity that does not exist.
            ghost = {"from": "Ana", "to": "Ghost", "relationType": "knows"}
            likes = knows | {"relationType": "likes"}
            assert data(await c.call_tool("create_relations", {"relations": [likes, ghost]}))[
                "relations"] == [likes, ghost]

            added = data(await c.call_tool("add_observations", {"observations": [
                {"entityName": "Ana", "contents": ["plays the cello", "likes strong coffee"]}]}))
            assert added == {"results": [{"entityName": "Ana", "addedObservations": ["plays the cello"]}]}
            assert "NotFound: Entity with name Ghost not found" in error(await c.call_tool(
                "add_observations", {"observations": [{"entityName": "Ghost", "contents": ["boo"]}]}))

            graph = data(await c.call_tool("read_graph", {}))
            assert graph == {
                "entities": [
                    {"name": "Ana", "entityType": "person",
                     "observations": ["speaks Portuguese", "likes strong coffee", "plays the cello"]},
                    {"name": "Clinic", "entityType": "organization", "observations": ["opened in 2019"]},
                    {"name": "Bob", "entityType": "person", "observations": ["likes strong coffee"]}],
                "relations": [works, knows, likes, ghost]}

            found = data(await c.call_tool("search_nodes", {"query": "who plays a musical instrument?"}))
            assert found["entities"][0]["name"] == "Ana"
            assert works in found["relations"] and knows in found["relations"]
            assert data(await c.call_tool("search_nodes", {"query": "qwertyuiop zxcv"})) == {
                "entities": [], "relations": []}  # nothing matches: nothing is returned
            opened = data(await c.call_tool("open_nodes", {"names": ["Clinic", "Nobody"]}))
            assert opened == {"entities": [graph["entities"][1]], "relations": [works]}

            # One graph: engram's knowledge graph holds it (not memories), its own tools read it.
            ana = data(await c.call_tool("entity", {"name": "Ana"}))
            assert ana["type"] == "person" and sorted(
                (r["subject"], r["predicate"], r["object"]) for r in ana["relations"]) == [
                ("Ana", "knows", "Ghost"), ("Ana", "works_at", "Clinic"), ("Bob", "knows", "Ana"),
                ("Bob", "likes", "Ana")]
            assert data(await c.call_tool("list_memories", {}))["memories"] == []

            msg = data(await c.call_tool("delete_observations", {"deletions": [
                {"entityName": "Ana", "observations": ["plays the cello"]}]}))
            assert msg == {"success": True, "message": "Observations deleted successfully"}
            assert data(await c.call_tool("delete_relations", {"relations": [knows]}))["success"]
            gone = data(await c.call_tool("delete_entities", {"entityNames": ["Clinic", "Ghost"]}))
            assert gone["message"] == "Deleted 1 of 2 entities. Not found: Ghost"

            after = data(await c.call_tool("read_graph", {}))
            assert after == {"entities": [
                {"name": "Ana", "entityType": "person",
                 "observations": ["speaks Portuguese", "likes strong coffee"]},
                {"name": "Bob", "entityType": "person", "observations": ["likes strong coffee"]}],
                "relations": [likes]}  # works_at went with Clinic, Ana knows Ghost with Ghost

    with http_server(db) as url:
        asyncio.run(session(url))
    with Memory(db, embedder=embedder) as mem:
        with pytest.raises(NotFound):  # the real entity went with the reference's
            mem.entity("Clinic", user_id="default")
        # a deleted relation is retracted: the history keeps it (works_at went with Clinic)
        retracted = [(r.subject_name, r.predicate, r.object_name)
                     for r in mem.relations(user_id="default", history=True) if r.expired_at]
        assert sorted(retracted) == [("Ana", "knows", "Ghost"), ("Bob", "knows", "Ana")]
        assert mem.stats(user_id="default").memories == 0


# -- in-process HTTP: one server, a Memory per request (how the REST service mounts it) ------------

def test_resolve_picks_the_memory_per_request(tmp_path: Path, embedder: MiniLM) -> None:
    mems = {name: Memory(tmp_path / f"{name}.db", embedder=embedder) for name in ("a", "b")}
    seen: list[str] = []

    def resolve() -> Memory:
        request = current_request()
        assert request is not None  # the HTTP request of the tool call, visible to the host
        seen.append(request.headers["x-tenant"])
        return mems[request.headers["x-tenant"]]

    async def call(url: str, tenant: str, tool: str, args: dict[str, Any]) -> Any:
        async with (httpx2.AsyncClient(headers={"x-tenant": tenant}, timeout=60) as http,
                    Client(streamable_http_client(url, http_client=http)) as c):
            return await c.call_tool(tool, args)

    async def scenario(url: str) -> None:
        fact = data(await call(url, "a", "remember", {"text": "The launch code is 1234"}))
        fid = fact["memories"][0]["id"]
        assert data(await call(url, "b", "recall", {"query": "launch code"}))["hits"] == []
        assert "NotFound" in error(await call(url, "b", "forget", {"id": fid}))
        assert data(await call(url, "b", "read_graph", {})) == {"entities": [], "relations": []}
        hits = data(await call(url, "a", "recall", {"query": "launch code"}))["hits"]
        assert [h["id"] for h in hits] == [fid]

    server = build_server(resolve, user_id="u1")
    try:
        with serve_in_thread(server.streamable_http_app()) as base:
            asyncio.run(scenario(base + "/mcp"))
    finally:
        for m in mems.values():
            m.close()
    assert seen == ["a", "b", "b", "b", "a"]


def test_build_server_refuses_an_empty_user() -> None:
    with pytest.raises(InvalidInput):
        build_server(lambda: None, user_id=" ")


# -- the graph mapping, directly on a Memory ------------------------------------------------------

OWNER = Scope(user_id="u")


def test_graph_observations_are_kept_exactly_per_entity(mem: Memory) -> None:
    kg.create_entities(mem, [kg.Entity("Ana", "person", ("likes coffee", "likes coffee", "Likes coffee.")),
                             kg.Entity("Bob", "person", ("likes coffee",))], OWNER)
    # Identical observations of two entities stay two; an exact repeat within one is one;
    # observations that differ in case or punctuation are two, as in the reference server.
    graph = kg.read_graph(mem, OWNER)
    assert graph.entities == [kg.Entity("Ana", "person", ("likes coffee", "Likes coffee.")),
                              kg.Entity("Bob", "person", ("likes coffee",))]
    # They live on the real entities, not in memories.
    assert mem.list(user_id="u").items == []
    assert mem.entity("Ana", user_id="u").entity.attributes["mcp"]["Ana"]["observations"] == [
        "likes coffee", "Likes coffee."]
    # A graph in another scope is another graph.
    assert kg.read_graph(mem, Scope(user_id="other")).entities == []


def test_graph_refusals_write_nothing(mem: Memory, snapshot: Any, tmp_path: Path) -> None:
    kg.create_entities(mem, [kg.Entity("Ana", "person")], OWNER)
    before = snapshot(tmp_path / "m.db")
    with pytest.raises(InvalidInput):
        kg.create_relations(mem, [kg.Relation("Ana", "Ana", "likes"), kg.Relation("Ana", "Zed", " ")],
                            OWNER)
    with pytest.raises(NotFound):
        kg.add_observations(mem, [("Ana", ["fine"]), ("Zed", ["missing"])], OWNER)
    with pytest.raises(InvalidInput):
        kg.create_entities(mem, [kg.Entity("Cid", "person"), kg.Entity("", "person")], OWNER)
    with pytest.raises(InvalidInput):
        kg.create_entities(mem, [kg.Entity("Cid", "person", ("ok", "  "))], OWNER)
    with pytest.raises(InvalidInput):
        kg.open_nodes(mem, [kg.Entity("x", "y")], OWNER)
    with pytest.raises(InvalidInput, match="ENGRAM_MAX_TEXT_CHARS"):
        kg.add_observations(mem, [("Ana", ["x" * (mem.config.max_text_chars + 1)])], OWNER)
    assert snapshot(tmp_path / "m.db") == before


def test_graph_deletes_retract_relations_and_delete_the_entity(mem: Memory) -> None:
    kg.create_entities(mem, [kg.Entity("Ana", "person", ("plays cello",)), kg.Entity("Bob", "person")], OWNER)
    kg.create_relations(mem, [kg.Relation("Bob", "Ana", "knows"), kg.Relation("Bob", "Cid", "knows")],
                        OWNER)
    assert kg.delete_relations(mem, [kg.Relation("Bob", "Cid", "knows")], OWNER) == 1
    (cid,) = [r for r in mem.relations("Bob", user_id="u", history=True) if r.object_name == "Cid"]
    assert cid.expired_at is not None  # retracted, kept as history
    assert [e.type.value for e in mem.history(cid.id)] == ["ADD", "DELETE"]
    assert kg.delete_entities(mem, ["Ana", "Ana", "Nope"], OWNER) == (["Ana"], ["Nope"])
    assert kg.read_graph(mem, OWNER) == kg.Graph([kg.Entity("Bob", "person")], [])
    with pytest.raises(NotFound):
        mem.entity("Ana", user_id="u")
    assert kg.delete_observations(mem, [("Ghost", ["x"])], OWNER) == (0, ["Ghost"])
    assert kg.delete_relations(mem, [kg.Relation("Bob", "Ana", "knows")], OWNER) == 0


def test_relations_that_differ_only_in_type_stay_two(mem: Memory) -> None:
    kg.create_entities(mem, [kg.Entity("Bob", "person"), kg.Entity("Ana", "person")], OWNER)
    both = [kg.Relation("Bob", "Ana", "knows"), kg.Relation("Bob", "Ana", "knows_well")]
    kg.create_relations(mem, both, OWNER)
    assert kg.read_graph(mem, OWNER).relations == both


def test_search_nodes_ranks_by_meaning(mem: Memory) -> None:
    kg.create_entities(mem, [kg.Entity("Ana", "person", ("is a cardiologist",)),
                             kg.Entity("Lisbon", "city", ("capital of Portugal",)),
                             kg.Entity("Rex", "dog", ("barks at the mailman",))], OWNER)
    kg.create_relations(mem, [kg.Relation("Ana", "Lisbon", "lives_in")], OWNER)
    found = kg.search_nodes(mem, "heart doctor", OWNER)
    assert found.entities[0].name == "Ana"
    assert kg.Relation("Ana", "Lisbon", "lives_in") in found.relations
    assert kg.search_nodes(mem, "which pet?", OWNER).entities[0].name == "Rex"


def test_names_that_differ_in_case_are_two_entities(mem: Memory) -> None:
    # Issue 15: `ana` after `Ana` was reported created and was nowhere, its observations attached
    # to no visible entity. The reference server compares names exactly: two entities.
    kg.create_entities(mem, [kg.Entity("Ana", "person", ("plays chess",))], OWNER)
    created, skipped = kg.create_entities(mem, [kg.Entity("ana", "person", ("plays chess", "is five"))],
                                          OWNER)
    assert [e.name for e in created] == ["ana"] and skipped == []
    assert kg.read_graph(mem, OWNER).entities == [kg.Entity("Ana", "person", ("plays chess",)),
                                                  kg.Entity("ana", "person", ("plays chess", "is five"))]
    assert kg.open_nodes(mem, ["ana"], OWNER).entities == [
        kg.Entity("ana", "person", ("plays chess", "is five"))]
    assert kg.delete_entities(mem, ["ana"], OWNER) == (["ana"], [])
    assert kg.read_graph(mem, OWNER).entities == [kg.Entity("Ana", "person", ("plays chess",))]


def test_observations_are_appended_unless_exactly_equal(mem: Memory) -> None:
    # Issue 15: a near-duplicate observation was merged by rewriting the stored text.
    kg.create_entities(mem, [kg.Entity("Ana", "person", ("likes coffee",))], OWNER)
    added = kg.add_observations(mem, [("Ana", ["likes coffee", "likes strong coffee", "Likes coffee."])],
                                OWNER)
    assert added == [("Ana", ["likes strong coffee", "Likes coffee."])]
    assert kg.read_graph(mem, OWNER).entities[0].observations == (
        "likes coffee", "likes strong coffee", "Likes coffee.")
    assert all(e.type.value == "ADD" for m in mem.list(user_id="u").items for e in mem.history(m.id))
    # Deletion matches exactly too.
    assert kg.delete_observations(mem, [("Ana", ["likes coffee"])], OWNER) == (1, [])
    assert kg.read_graph(mem, OWNER).entities[0].observations == ("likes strong coffee", "Likes coffee.")


def test_relations_may_name_unknown_entities(mem: Memory) -> None:
    # As in the reference server: stored, shown by read_graph, touching the entity once it exists.
    assert kg.create_relations(mem, [kg.Relation("Ana", "Zed", "knows")], OWNER) == [
        kg.Relation("Ana", "Zed", "knows")]
    assert kg.read_graph(mem, OWNER).relations == [kg.Relation("Ana", "Zed", "knows")]
    assert kg.open_nodes(mem, ["Zed"], OWNER) == kg.Graph()
    kg.create_entities(mem, [kg.Entity("Zed", "person")], OWNER)
    assert kg.open_nodes(mem, ["Zed"], OWNER).relations == [kg.Relation("Ana", "Zed", "knows")]
    # Relation types that read the same ("works_at" / "works at") are two relations.
    both = [kg.Relation("Ana", "Zed", "works_at"), kg.Relation("Ana", "Zed", "works at")]
    assert kg.create_relations(mem, both, OWNER) == both
    assert kg.read_graph(mem, OWNER).relations[1:] == both


def test_a_plain_fact_and_a_graph_record_stay_apart(mem: Memory) -> None:
    # A fact remembered outside the graph is a memory; the graph's observation is the entity's.
    fact = mem.add("ana: Likes tea.", user_id="u", kind="semantic").memories[0]
    kg.create_entities(mem, [kg.Entity("Ana", "person", ("likes tea",))], OWNER)
    assert kg.read_graph(mem, OWNER).entities == [kg.Entity("Ana", "person", ("likes tea",))]
    assert [m.text for m in mem.list(user_id="u").items] == ["ana: Likes tea."]
    assert mem.get(fact.id).metadata == {}


def test_search_nodes_matches_words_like_the_reference_and_meaning_above_a_floor(mem: Memory) -> None:
    kg.create_entities(mem, [kg.Entity("Ana", "person", ("is a cardiologist",)),
                             kg.Entity("Lisbon", "city", ("capital of Portugal",)),
                             kg.Entity("Rex", "dog", ("barks at the mailman",))], OWNER)
    kg.create_relations(mem, [kg.Relation("Ana", "Lisbon", "lives_in")], OWNER)
    # Substrings, case-insensitive, of names, types and observations: the reference's matches.
    assert [e.name for e in kg.search_nodes(mem, "CARDIO", OWNER).entities] == ["Ana"]
    assert [e.name for e in kg.search_nodes(mem, "dog", OWNER).entities][:1] == ["Rex"]
    assert [e.name for e in kg.search_nodes(mem, "a", OWNER).entities] == ["Ana", "Lisbon", "Rex"]
    # A query that matches nothing, by words or meaning, returns nothing (it used to return 3 of
    # 3 entities and every relation).
    for nonsense in ("xyzzy qwerty", "zzz nonsense query 123", "asdkjh"):
        assert kg.search_nodes(mem, nonsense, OWNER) == kg.Graph(), nonsense


def test_graph_tools_text_content_has_the_reference_shape(mem: Memory) -> None:
    # The reference server's text content: a bare JSON array for create_* and add_observations,
    # the graph object for reads, a plain message for deletions (indented as JSON.stringify(v, null, 2)).
    async def scenario() -> list[Any]:
        async with Client(build_server(lambda: mem)) as c:
            calls = [("create_entities", {"entities": [{"name": "Ana", "entityType": "person",
                                                         "observations": ["sings"]}]}),
                     ("create_relations", {"relations": [
                         {"from": "Ana", "to": "Bo", "relationType": "knows"}]}),
                     ("add_observations", {"observations": [{"entityName": "Ana", "contents": ["runs"]}]}),
                     ("read_graph", {}), ("search_nodes", {"query": "sings"}),
                     ("open_nodes", {"names": ["Ana"]}), ("delete_relations", {"relations": [
                         {"from": "Ana", "to": "Bo", "relationType": "knows"}]})]
            return [await c.call_tool(name, args) for name, args in calls]

    created, related, observed, read, found, opened, deleted = asyncio.run(scenario())
    ana = {"name": "Ana", "entityType": "person", "observations": ["sings"]}
    assert created.content[0].text == json.dumps([ana], indent=2)
    assert created.structured_content == {"entities": [ana], "skipped": []}
    assert json.loads(related.content[0].text) == [{"from": "Ana", "to": "Bo", "relationType": "knows"}]
    assert json.loads(observed.content[0].text) == [{"entityName": "Ana", "addedObservations": ["runs"]}]
    graph = {"entities": [ana | {"observations": ["sings", "runs"]}],
             "relations": [{"from": "Ana", "to": "Bo", "relationType": "knows"}]}
    for result in (read, found, opened):
        assert json.loads(result.content[0].text) == graph == result.structured_content
    assert deleted.content[0].text == "Relations deleted successfully"
    assert deleted.structured_content == {"success": True, "message": "Relations deleted successfully"}


def test_import_a_reference_memory_file(mem: Memory, tmp_path: Path) -> None:
    lines = [{"type": "entity", "name": "Ana", "entityType": "person", "observations": ["sings", "Sings"]},
             {"type": "entity", "name": "ana", "entityType": "person", "observations": []},
             {"type": "relation", "from": "Ana", "to": "Clinic", "relationType": "works_at"},
             {"type": "entity", "name": "Clinic", "entityType": "place", "observations": ["opened 2019"]},
             {"type": "relation", "from": "Ana", "to": "Clinic", "relationType": "works_at"}]
    path = tmp_path / "memory.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines), encoding="utf-8")
    kg.create_entities(mem, [kg.Entity("Clinic", "place", ("has a garden",))], OWNER)
    done = kg.import_graph(mem, kg.read_reference_file(path), OWNER)
    assert [e.name for e in done.entities] == ["Ana", "ana"]
    assert (done.skipped, done.observations) == (["Clinic"], 2)
    assert kg.read_graph(mem, OWNER) == kg.Graph(
        [kg.Entity("Clinic", "place", ("has a garden",)), kg.Entity("Ana", "person", ("sings", "Sings")),
         kg.Entity("ana", "person")], [kg.Relation("Ana", "Clinic", "works_at")])
    # Importing again adds nothing.
    again = kg.import_graph(mem, kg.read_reference_file(path), OWNER)
    assert (again.entities, again.relations) == ([], [])


@pytest.mark.parametrize(("text", "where"), [
    ('{"type": "entity", "name": "A", "entityType": "t", "observations": ["x"]}\n{not json', "line 2"),
    ('{"type": "node", "name": "A"}', "line 1"),
    ('{"type": "entity", "name": "A", "observations": []}', "entityType"),
    ('{"type": "relation", "from": "A", "to": "B"}', "relationType"),
    ('[1, 2]', "line 1")])
def test_import_refuses_a_bad_file_whole(mem: Memory, tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "memory.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InvalidImport, match=where):
        kg.read_reference_file(path)


def test_cli_imports_a_reference_memory_file(tmp_path: Path, embedder: MiniLM) -> None:
    path = tmp_path / "memory.jsonl"
    path.write_text(json.dumps({"type": "entity", "name": "Ana", "entityType": "person",
                                "observations": ["sings"]}) + "\n", encoding="utf-8")
    db = tmp_path / "cli.db"
    result = CliRunner().invoke(app, ["--db", str(db), "mcp", "import", str(path), "--user-id", "ana"])
    assert result.exit_code == 0, result.output
    assert "imported 1 entities (1 observations) and 0 relations" in result.output
    with Memory(db, embedder=embedder) as m:
        assert kg.read_graph(m, Scope(user_id="ana")).entities == [kg.Entity("Ana", "person", ("sings",))]
    result = CliRunner().invoke(app, ["--db", str(db), "--json", "mcp", "import", str(path),
                                      "--user-id", "ana"])
    assert result.exit_code == 0 and json.loads(result.stdout) == {
        "entities": 0, "observations": 0, "relations": 0, "skipped": ["Ana"]}
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops", encoding="utf-8")
    result = CliRunner().invoke(app, ["--db", str(db), "mcp", "import", str(bad)])
    assert result.exit_code == 2 and "line 1" in result.output


def test_get_context_budget_minimum_is_the_engines(mem: Memory) -> None:
    # One minimum everywhere: the engine's (a positive integer); a budget too small for the
    # query and the framing is the engine's InvalidInput, in words.
    async def scenario() -> tuple[Any, Any, Any]:
        async with Client(build_server(lambda: mem)) as c:
            schema = {t.name: t for t in (await c.list_tools()).tools}["get_context"].input_schema
            assert data(await c.call_tool("get_context", {"query": "hi", "budget_tokens": 64}))[
                "total_tokens"] <= 64  # refused by a minimum of 100 before
            small = await c.call_tool("get_context", {"query": "hi", "budget_tokens": 10})
            zero = await c.call_tool("get_context", {"query": "hi", "budget_tokens": 0})
            return schema, small, zero

    schema, small, zero = asyncio.run(scenario())
    assert schema["properties"]["budget_tokens"]["minimum"] == 1
    assert "InvalidInput: the new message and instructions alone take" in error(small)
    assert "https://" not in error(zero) and "InvalidInput: budget_tokens:" in error(zero)


# -- the command line -----------------------------------------------------------------------------

def test_cli_refuses_a_bad_transport(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["--db", str(tmp_path / "x.db"), "mcp", "--transport", "sse"])
    assert result.exit_code == 2
    assert "transport must be one of stdio, http" in result.output


@pytest.mark.slow
def test_docs_python_example_runs_without_the_venv_on_path(tmp_path: Path) -> None:
    # Issue 15: the example launched `engram`, found only when the venv's bin is on PATH.
    doc = (Path(__file__).parents[1] / "docs" / "mcp.md").read_text(encoding="utf-8")
    code = re.search(r"\*\*From Python\*\*.*?```python\n(.*?)```", doc, re.DOTALL)
    assert code is not None
    bin_dir = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != bin_dir)
    env = {**os.environ, **CHILD_ENV, "PATH": path}
    done = subprocess.run([sys.executable, "-c", code.group(1)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "Ana is vegetarian"

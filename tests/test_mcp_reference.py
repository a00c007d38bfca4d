"""engram as a drop-in for the reference MCP memory server: one sequence of knowledge-graph tool
calls sent to both, the reference (`@modelcontextprotocol/server-memory`, pinned in
tests/mcp_reference/) over stdio and engram in-process, both driven by the `mcp` SDK's client,
and their results compared. Where engram differs on purpose (docs/mcp.md lists it), the check
says how.

The reference server is installed with `npm ci` from the pinned lock file into the pytest cache,
once per lock file. Without node / npm, or without the npm registry, this test fails: it never
skips, since a skipped comparison would claim nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters

from engram import Memory, Scope
from engram.graph import reference as kg
from engram.mcp import build_server
from engram.providers.embedders import MiniLM

PINNED = Path(__file__).parent / "mcp_reference"  # package.json + package-lock.json
ENTRY = Path("node_modules", "@modelcontextprotocol", "server-memory", "dist", "index.js")
NPM_TIMEOUT = 600


@pytest.fixture(scope="session")
def reference_server(request: pytest.FixtureRequest) -> Path:
    """The reference server's entry point, installed from the pinned lock file."""
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        pytest.fail("the reference MCP memory server needs node and npm on PATH", pytrace=False)
    files = ("package.json", "package-lock.json")
    stamp = hashlib.sha256(b"".join((PINNED / f).read_bytes() for f in files)).hexdigest()[:16]
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    if cache is not None:
        target = Path(cache.mkdir(f"mcp-reference-{stamp}"))
    else:
        target = Path(tempfile.gettempdir()) / f"engram-mcp-reference-{stamp}"
        target.mkdir(exist_ok=True)
    if not (target / ENTRY).exists():
        for f in files:
            shutil.copyfile(PINNED / f, target / f)
        try:
            done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=target,
                                  capture_output=True, text=True, timeout=NPM_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"npm ci of the reference server took over {NPM_TIMEOUT}s", pytrace=False)
        if done.returncode != 0 or not (target / ENTRY).exists():
            pytest.fail(f"npm ci of the reference server failed (is the npm registry reachable?):\n"
                        f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}", pytrace=False)
    return target / ENTRY


ANA = {"name": "Ana", "entityType": "person", "observations": ["likes coffee", "speaks Portuguese"]}
LOWER_ANA = {"name": "ana", "entityType": "person", "observations": ["Likes coffee."]}
CLINIC = {"name": "Clinic", "entityType": "organization", "observations": ["opened in 2019"]}
WORKS = {"from": "Ana", "to": "Clinic", "relationType": "works_at"}
KNOWS = {"from": "ana", "to": "Ana", "relationType": "knows"}
GHOST = {"from": "Ana", "to": "Ghost", "relationType": "haunted_by"}

# (tool, arguments): the calls a client of the reference server makes, in order, covering what
# issue 15 found different (names differing in case, near-duplicate and case-variant
# observations, relations to an entity that does not exist, searches) and every tool.
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("read_graph", {}),
    ("create_entities", {"entities": [ANA, CLINIC]}),
    ("create_entities", {"entities": [LOWER_ANA, {**ANA, "observations": ["ignored"]}]}),
    ("create_relations", {"relations": [WORKS, KNOWS, GHOST]}),
    ("create_relations", {"relations": [WORKS]}),
    ("add_observations", {"observations": [
        {"entityName": "Ana", "contents": ["likes coffee", "likes strong coffee", "Likes coffee."]},
        {"entityName": "ana", "contents": ["plays the cello"]}]}),
    ("add_observations", {"observations": [{"entityName": "Nobody", "contents": ["boo"]}]}),
    ("read_graph", {}),
    ("search_nodes", {"query": "COFFEE"}),
    ("search_nodes", {"query": "organization"}),
    ("search_nodes", {"query": "Ghost"}),
    ("search_nodes", {"query": "qwertyuiop zxcvbnm"}),
    ("open_nodes", {"names": ["ana", "Nobody"]}),
    ("open_nodes", {"names": ["Clinic"]}),
    ("delete_observations", {"deletions": [{"entityName": "Ana", "observations": ["likes coffee"]}]}),
    ("delete_relations", {"relations": [KNOWS]}),
    ("read_graph", {}),
    ("delete_entities", {"entityNames": ["Clinic"]}),
    ("read_graph", {}),
]


async def _run(server: Any, calls: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], list[Any]]:
    async with Client(server, read_timeout_seconds=120) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        return tools, [await client.call_tool(name, args) for name, args in calls]


def _text(result: Any) -> str:
    assert len(result.content) == 1 and result.content[0].type == "text"
    text: str = result.content[0].text
    return text


def test_engram_answers_the_reference_servers_calls_as_it_does(reference_server: Path, tmp_path: Path,
                                                               embedder: MiniLM) -> None:
    memory_file = tmp_path / "memory.jsonl"
    params = StdioServerParameters(command=shutil.which("node") or "node", args=[str(reference_server)],
                                   env={"PATH": os.environ.get("PATH", ""),
                                        "MEMORY_FILE_PATH": str(memory_file)})
    ref_tools, expected = asyncio.run(_run(params, CALLS))
    with Memory(tmp_path / "engram.db", embedder=embedder) as mem:
        tools, got = asyncio.run(_run(build_server(lambda: mem, user_id="u"), CALLS))
        final = kg.read_graph(mem, Scope(user_id="u"))

    # The same tools, with the same argument names.
    for name, tool in ref_tools.items():
        assert name in tools, name
        assert set(tool.input_schema.get("properties", {})) == set(
            tools[name].input_schema.get("properties", {})), name

    for (name, args), ref, ours in zip(CALLS, expected, got, strict=True):
        where = f"{name}({json.dumps(args)})"
        assert ours.is_error == ref.is_error, (where, _text(ref), _text(ours))
        if ref.is_error:
            # The reference's message, after engram's error name: "NotFound: Entity with name ..."
            assert _text(ref) in _text(ours), (where, _text(ref), _text(ours))
            continue
        if name.startswith("delete_"):
            assert _text(ours) == _text(ref), where  # a plain message
            assert ours.structured_content == ref.structured_content, where
            continue
        want, have = json.loads(_text(ref)), json.loads(_text(ours))
        if name == "search_nodes":
            # engram returns the reference's entities first, in its order, then meaning matches.
            assert have["entities"][:len(want["entities"])] == want["entities"], where
            assert all(r in have["relations"] for r in want["relations"]), where
            if not want["entities"]:
                assert have == want, where  # a query that matches nothing returns nothing
            continue
        assert _text(ours) == _text(ref), where  # the same bare array or object, to the byte
        for key, value in ref.structured_content.items():
            assert ours.structured_content[key] == value, (where, key)

    # The reference's memory file, imported into engram, is the graph engram ended with.
    with Memory(tmp_path / "imported.db", embedder=embedder) as mem:
        kg.import_graph(mem, kg.read_reference_file(memory_file), Scope(user_id="u"))
        assert kg.read_graph(mem, Scope(user_id="u")) == final

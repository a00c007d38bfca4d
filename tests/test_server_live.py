"""The service on a real uvicorn over loopback: the MCP server at /mcp behind the bearer keys
(driven by the mcp SDK's own client), tenant isolation over MCP, and `engram serve` itself."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from engram.config import Config
from engram.providers.embedders import MiniLM
from engram.server import ServiceLimits, create_app
from engram.server.keys import SQLiteKeyStore
from server_kit import serve_in_thread

CANARY = "canary-51c9: the vault code is 4417"


@pytest.fixture
def live(tmp_path: Path, embedder: MiniLM) -> Iterator[tuple[str, dict[str, str]]]:
    cfg = Config(path=tmp_path / "engram.db")
    keys = SQLiteKeyStore(tmp_path / "keys.db")
    tokens = {t: keys.create(t, "admin")[1] for t in ("a", "b")}
    app = create_app(cfg, embedder=embedder, keys=keys, limits=ServiceLimits(rate=1000, burst=1000))
    try:
        with serve_in_thread(app) as url:
            yield url, tokens
    finally:
        keys.close()


def _data(result: Any) -> Any:
    assert not result.is_error, result.content[0].text
    return result.structured_content


async def _mcp(url: str, key: str | None, tool: str, args: dict[str, Any], user: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if user is not None:
        headers["X-Engram-User"] = user
    async with (httpx2.AsyncClient(headers=headers, timeout=60) as http,
                Client(streamable_http_client(f"{url}/mcp", http_client=http)) as c):
        return await c.call_tool(tool, args)


def test_mcp_is_mounted_behind_the_keys(live: tuple[str, dict[str, str]]) -> None:
    url, tokens = live
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "0"}}}
    with httpx2.Client(timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = http.post(f"{url}/mcp", json=init, headers={
                **headers, "Accept": "application/json, text/event-stream"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"

    async def scenario() -> None:
        fact = _data(await _mcp(url, tokens["a"], "remember", {"text": CANARY}))
        fid = fact["memories"][0]["id"]
        # Tenant b, every memory tool on a's canary: nothing comes back, nothing changes.
        outputs = [
            await _mcp(url, tokens["b"], "recall", {"query": "vault code"}),
            await _mcp(url, tokens["b"], "list_memories", {}),
            await _mcp(url, tokens["b"], "get_context", {"query": "what is the vault code?"}),
            await _mcp(url, tokens["b"], "read_graph", {}),
            await _mcp(url, tokens["b"], "search_nodes", {"query": "vault"}),
            await _mcp(url, tokens["b"], "forget", {"id": fid}),
        ]
        assert outputs[-1].is_error and "NotFound" in outputs[-1].content[0].text
        for out in outputs:
            text = " ".join(getattr(c, "text", "") for c in out.content) + str(out.structured_content)
            assert "canary-51c9" not in text and "4417" not in text
        hits = _data(await _mcp(url, tokens["a"], "recall", {"query": "vault code"}))["hits"]
        assert [h["id"] for h in hits] == [fid]

    asyncio.run(scenario())
    # The same memory through REST, for tenant a only.
    with httpx2.Client(timeout=30) as http:
        items = http.get(f"{url}/v1/memories", headers={"Authorization": f"Bearer {tokens['a']}"})
        assert [m["text"] for m in items.json()["items"]] == [CANARY]
        other = http.get(f"{url}/v1/memories", headers={"Authorization": f"Bearer {tokens['b']}"})
        assert other.json()["items"] == []
        metrics = http.get(f"{url}/metrics").text
        assert 'route="/mcp"' in metrics


def test_mcp_clients_act_for_the_user_their_header_names(live: tuple[str, dict[str, str]]) -> None:
    # Issue 15: /mcp always used the user "default", so what REST stored for ana was invisible.
    url, tokens = live
    with httpx2.Client(timeout=30) as http:
        r = http.post(f"{url}/v1/memories", headers={"Authorization": f"Bearer {tokens['a']}"},
                      json={"user_id": "ana", "messages": "Ana is allergic to peanuts", "kind": "semantic"})
        assert r.status_code == 201, r.text

    async def scenario() -> None:
        hits = _data(await _mcp(url, tokens["a"], "recall", {"query": "allergy"}, user="ana"))["hits"]
        assert [h["text"] for h in hits] == ["Ana is allergic to peanuts"]
        assert _data(await _mcp(url, tokens["a"], "recall", {"query": "allergy"}))["hits"] == []
        assert _data(await _mcp(url, tokens["a"], "recall", {"query": "allergy"}, user="bob"))["hits"] == []
        assert _data(await _mcp(url, tokens["b"], "recall", {"query": "allergy"}, user="ana"))["hits"] == []
        # What an MCP client remembers for ana, REST reads for ana.
        _data(await _mcp(url, tokens["a"], "remember", {"text": "Ana moved to Porto"}, user="ana"))
        refused = await _mcp(url, tokens["a"], "recall", {"query": "x"}, user="u" * 300)
        assert refused.is_error and "X-Engram-User" in refused.content[0].text

    asyncio.run(scenario())
    with httpx2.Client(timeout=30) as http:
        items = http.get(f"{url}/v1/memories", params={"user_id": "ana"},
                         headers={"Authorization": f"Bearer {tokens['a']}"}).json()["items"]
        assert [m["text"] for m in items] == ["Ana is allergic to peanuts", "Ana moved to Porto"]


def test_rest_over_loopback_with_concurrent_clients(live: tuple[str, dict[str, str]]) -> None:
    url, tokens = live

    async def scenario() -> list[int]:
        headers = {"Authorization": f"Bearer {tokens['a']}"}
        async with httpx2.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
            adds = [http.post("/v1/memories", json={"messages": f"note number {i}", "user_id": "u"})
                    for i in range(20)]
            codes = [r.status_code for r in await asyncio.gather(*adds)]
            found = await http.post("/v1/memories/search", json={"query": "note number 7", "limit": 20})
            assert len(found.json()["hits"]) == 20
            return codes

    assert asyncio.run(scenario()) == [201] * 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_engram_serve_no_auth_says_so_loudly(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "ENGRAM_DB": str(tmp_path / "engram.db"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "engram.cli", "serve", "--no-auth", "--port", str(port)]
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=env) as proc:
        try:
            banner = []
            assert proc.stderr is not None
            for line in proc.stderr:  # the URL line comes last, just before uvicorn starts
                banner.append(line)
                if "engram serving on" in line:
                    break
            text = "".join(banner)
            assert "NO AUTHENTICATION" in text, text
            assert f"http://127.0.0.1:{port}" in text
            for _ in range(600):  # uvicorn binds right after the banner; wait for it, bounded
                try:
                    r = httpx2.get(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except httpx2.TransportError:
                    threading.Event().wait(0.1)
            assert r.json() == {"status": "ok"}
            r = httpx2.get(f"http://127.0.0.1:{port}/v1/memories", timeout=10)  # no key needed
            assert r.status_code == 200 and r.json()["items"] == []
        finally:
            proc.terminate()
            proc.wait(timeout=30)

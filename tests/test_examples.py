"""The programs in examples/ run as a user would run them, each in its own process, and do
what their README says: the chat agent recalls an earlier session, the LangGraph agent's memory
is an engram memory, the LlamaIndex model is shown what engram recalls, the curl script talks
to a real `engram serve`, and the MCP client configs start or reach a working server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from docblocks import (
    ROOT,
    check_first_hits,
    expected_first_hits,
    free_port,
    run_shell,
    running_service,
    shell_env,
)

EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent


def _env(tmp_path: Path) -> dict[str, str]:
    return shell_env(tmp_path)


def _run(name: str, tmp_path: Path) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / name), "--db", str(tmp_path / "x.db")],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_example_is_listed_in_its_readme() -> None:
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    files = [p for p in EXAMPLES.rglob("*") if p.is_file() and p.name != "README.md"]
    assert len(files) >= 6
    for path in files:
        assert f"]({path.relative_to(EXAMPLES)})" in readme, path


def test_chat_agent_remembers_an_earlier_session(tmp_path: Path) -> None:
    out = _run("chat_agent.py", tmp_path)
    assert "[friday] assistant: You told me: My sister Zoe lives in Trondheim." in out


def test_langgraph_agent_stores_an_engram_memory(tmp_path: Path) -> None:
    out = _run("langgraph_agent.py", tmp_path).splitlines()
    assert out[2].startswith("tool: created memory ")
    found = json.loads(out[4].removeprefix("tool: "))
    assert found[0]["value"]["content"] == "The user's daughter Mia starts school in Ghent in September."
    assert out[-1] == "engram: The user's daughter Mia starts school in Ghent in September."


def test_llamaindex_agent_model_is_shown_the_memory(tmp_path: Path) -> None:
    out = _run("llamaindex_agent.py", tmp_path)
    shown = out[:out.index("  user: Can I have the satay?")]
    assert "<engram>" in shown and "I'm allergic to peanuts." in shown
    assert out.endswith("answer: Better not: the satay sauce is made of peanuts.\n")


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[str, str]]:
    env = _env(tmp_path)
    key = subprocess.run(["engram", "keys", "create", "--tenant", "acme", "--role", "admin"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    with running_service(env, free_port()) as url:
        yield url, key


def test_curl_script_against_the_service(service: tuple[str, str], tmp_path: Path) -> None:
    url, key = service
    code = (EXAMPLES / "service.sh").read_text(encoding="utf-8")
    outputs = run_shell(f"export ENGRAM_URL={url} ENGRAM_KEY={key}\n" + code, tmp_path)
    left = httpx.post(f"{url}/v1/memories/search", json={"query": "Tokyo", "user_id": "ana"},
                      headers={"Authorization": f"Bearer {key}"})
    assert left.status_code == 200 and left.json()["hits"] == []  # the script's erase took them all
    check_first_hits(expected_first_hits(code), outputs)


def _tools(config: dict[str, object]) -> list[str]:
    from mcp import Client, StdioServerParameters

    async def main() -> list[str]:
        if "url" in config:
            client = Client(str(config["url"]))
        else:
            client = Client(StdioServerParameters(command=str(config["command"]),
                                                  args=list(config["args"]),  # type: ignore[call-overload]
                                                  env=dict(config["env"])))  # type: ignore[call-overload]
        async with client:
            await client.call_tool("remember", {"text": "Ana is vegetarian"})
            hits = (await client.call_tool("recall", {"query": "what does Ana eat?"})).structured_content
            assert hits is not None and hits["hits"][0]["text"] == "Ana is vegetarian"
            return [t.name for t in (await client.list_tools()).tools]

    return asyncio.run(main())


def test_claude_desktop_config_starts_a_working_server(tmp_path: Path) -> None:
    text = (EXAMPLES / "mcp" / "claude_desktop_config.json").read_text(encoding="utf-8")
    text = text.replace("/path/to/.venv/bin/engram", str(BIN / "engram"))
    text = text.replace("/path/to/engram.db", str(tmp_path / "engram.db"))
    config = json.loads(text)["mcpServers"]["engram"]
    config["env"] = {**_env(tmp_path), **config["env"]}  # the client passes a bare environment
    assert "remember" in _tools(config) and "read_graph" in _tools(config)


def test_cursor_config_reaches_the_http_server(tmp_path: Path) -> None:
    config = json.loads((EXAMPLES / "mcp" / "cursor_mcp.json").read_text(encoding="utf-8"))
    url = config["mcpServers"]["engram"]["url"]
    assert url == "http://127.0.0.1:8765/mcp"
    port = free_port()
    server = subprocess.Popen(["engram", "mcp", "--transport", "http", "--port", str(port)],
                              env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/mcp")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.3)
        assert "recall" in _tools({"url": url.replace("8765", str(port))})
    finally:
        server.terminate()
        server.wait(timeout=30)

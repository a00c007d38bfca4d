"""The documentation site is tested: it builds with warnings as errors (broken links and anchors
included), its generated references cover the whole CLI, REST API and MCP tool list, and the code
blocks of its pages run (each page's ```python blocks in order, in one namespace; its ```bash
blocks in bash with `engram` on PATH), unless a block says why it cannot
(`<!-- not run: reason -->`, see docblocks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from docblocks import (
    ROOT,
    WrongFirstHit,
    blocks,
    check_first_hits,
    check_printed,
    expected_first_hits,
    free_port,
    printed_first_hits,
    run_python,
    run_shell,
    running_service,
    shell_env,
)

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
PYTHON_PAGES = [page for page in PAGES if blocks(page, "python")]
# Searches whose first hit is wrong today (the ranking is being fixed elsewhere; the examples stay
# as a user would write them). strict: the test fails once the ranking finds them.
WRONG_FIRST_HIT: dict[str, str] = {}
SHELL = [b for page in PAGES for b in blocks(page, "bash")]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return out


def _page(site: Path, uri: str) -> str:
    return (site / uri / "index.html").read_text(encoding="utf-8")


def test_site_builds_strict_with_every_page_in_the_nav(site: Path) -> None:
    for page in PAGES:
        name = "" if page.stem == "index" else page.stem
        assert (site / name / "index.html").exists(), f"{page.name} is not in the site"
    assert "Why engram" in _page(site, "")  # the home page is README.md


def test_cli_reference_covers_every_command(site: Path) -> None:
    import typer

    from engram.cli import app

    group: Any = typer.main.get_command(app)
    page = _page(site, "reference/cli")
    for name, command in group.commands.items():
        for sub in getattr(command, "commands", {None: None}):
            title = f"engram {name}" + (f" {sub}" if sub else "")
            assert f"<code>{title}</code>" in page, f"{title} is missing from the CLI reference"


def test_rest_reference_covers_every_route(site: Path, tmp_path: Path) -> None:
    from engram.config import Config
    from engram.server import create_app

    spec = create_app(Config(path=tmp_path / "engram.db"), auth=False, mcp=False).openapi()
    page = _page(site, "reference/rest")
    for path, operations in spec["paths"].items():
        for method in operations:
            assert f"<code>{method.upper()} {path}</code>" in page


def test_mcp_reference_covers_every_tool(site: Path) -> None:
    import asyncio

    from engram.mcp import build_server

    tools = asyncio.run(build_server(lambda: None).list_tools())  # type: ignore[arg-type, return-value]
    page = _page(site, "reference/mcp")
    assert len(tools) >= 14
    for tool in tools:
        assert f"<code>{tool.name}</code>" in page


def test_api_reference_documents_the_memory_methods(site: Path) -> None:
    page = _page(site, "reference/api")
    for method in ("add", "search", "update", "erase", "history", "context", "session"):
        assert f'id="engram.Memory.{method}"' in page


@pytest.mark.parametrize("page", [
    pytest.param(p, id=p.name, marks=pytest.mark.xfail(raises=WrongFirstHit, strict=True,
                                                       reason=WRONG_FIRST_HIT[p.name]))
    if p.name in WRONG_FIRST_HIT else pytest.param(p, id=p.name) for p in PYTHON_PAGES])
def test_page_python_blocks_run(page: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    found = blocks(page, "python")
    run_python(found, tmp_path)
    check_printed([hit for b in found for hit in printed_first_hits(b.code)], capfd.readouterr().out)


def test_page_shell_blocks_run(tmp_path: Path) -> None:
    assert len(SHELL) >= 3
    # Each block in a folder of its own (operations.md's backups, retention, encryption).
    for i, block in enumerate(SHELL):
        folder = tmp_path / str(i)
        folder.mkdir()
        check_first_hits(expected_first_hits(block.code), run_shell(block.code, folder))


def test_service_page_runs_against_a_service(tmp_path: Path) -> None:
    found = blocks(DOCS / "service.md", "bash", "service")
    assert len(found) >= 10
    port = free_port()
    script = "\n".join(b.code for b in found).replace("localhost:8000", f"localhost:{port}")
    # Every request of the page must succeed: curl fails on an HTTP error (and shows its body).
    (tmp_path / ".curlrc").write_text("fail-with-body\n", encoding="utf-8")
    env = shell_env(tmp_path, CURL_HOME=str(tmp_path))
    with running_service(env, port):
        outputs = run_shell(script, tmp_path, env)
    check_first_hits(expected_first_hits(script), outputs)

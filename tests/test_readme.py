"""README examples are part of the docs: every ```python and ```bash block runs as written (with
no LLM configured, as on a fresh machine), and every search in them finds the first hit it shows
(`# first hit: ...`, see docblocks.py). Python blocks check the rest with their own asserts."""

from __future__ import annotations

import json
import re
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
    printed_first_hits,
    run_python,
    run_shell,
)

README = ROOT / "README.md"
PYTHON = blocks(README, "python")
SHELL = blocks(README, "bash")

# Searches whose first hit is wrong today. The ranking is being fixed elsewhere and the examples
# stay as a user would write them; strict, so the test fails once the ranking finds them.
WRONG_FIRST_HIT: dict[str, str] = {}


def _params(found: list[Any]) -> list[Any]:
    return [pytest.param(b, id=b.id, marks=pytest.mark.xfail(
        raises=WrongFirstHit, strict=True, reason=WRONG_FIRST_HIT[b.id]))
        if b.id in WRONG_FIRST_HIT else pytest.param(b, id=b.id) for b in found]


def test_readme_has_examples_of_every_face() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(PYTHON) >= 2 and len(SHELL) >= 2, "README.md lost its quickstart"
    for face in ("### Library", "### CLI", "### Service", "### MCP", "### An adapter"):
        assert face in text
    assert len(text.splitlines()) <= 400, "README.md is the front door: at most 400 lines"


@pytest.mark.parametrize("block", _params(PYTHON))
def test_readme_python_block_runs(block: Any, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    run_python([block], tmp_path)
    check_printed(printed_first_hits(block.code), capsys.readouterr().out)


@pytest.mark.parametrize("block", _params(SHELL))
def test_readme_shell_block_runs_and_finds_its_first_hits(block: Any, tmp_path: Path) -> None:
    wanted = expected_first_hits(block.code)
    check_first_hits(wanted, run_shell(block.code, tmp_path))


def test_readme_mcp_config_starts_a_working_server(tmp_path: Path) -> None:
    from test_examples import BIN, _env, _tools

    (text,) = re.findall(r"```json\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    text = text.replace("/path/to/.venv/bin/engram", str(BIN / "engram"))
    config = json.loads(text.replace("/path/to/engram.db", str(tmp_path / "engram.db")))
    server = config["mcpServers"]["engram"]
    server["env"] = {**_env(tmp_path), **server["env"]}  # the client passes a bare environment
    assert "recall" in _tools(server)

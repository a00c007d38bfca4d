"""Configuration is one object: only `Config.from_env` reads the environment, and every
`ENGRAM_*` variable the code knows is documented in the configuration page's table
(docs/configuration.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engram.config import Config, default_db_path
from engram.errors import InvalidInput

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "engram"


def _configuration_table() -> str:
    return (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")


def test_every_engram_variable_is_documented() -> None:
    used = {v for f in SRC.rglob("*.py") for v in re.findall(r"ENGRAM_[A-Z0-9_]+", f.read_text())
            if not v.endswith("_")}  # `ENGRAM_PG_*` in a comment names a family, not a variable
    documented = set(re.findall(r"`(ENGRAM_[A-Z0-9_]+)`", _configuration_table()))
    assert used, "no ENGRAM_* variable found: the scan is broken"
    assert sorted(used - documented) == []
    assert sorted(documented - used) == [], "documented variables the code no longer reads"


def test_only_config_reads_the_environment() -> None:
    readers = []
    for f in SRC.rglob("*.py"):
        if f.name == "config.py" and f.parent == SRC:
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") \
                    and isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert readers == []


def test_engram_db_is_read_by_from_env_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ENGRAM_DB", str(tmp_path / "env.db"))
    assert Config().path == default_db_path()  # a plain Config never looks at the environment
    assert Config.from_env().path == tmp_path / "env.db"
    assert Config.from_env(path=tmp_path / "arg.db").path == tmp_path / "arg.db"  # an argument wins


def test_a_bad_value_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGRAM_JOB_RETRIES", "many")
    with pytest.raises(InvalidInput, match="ENGRAM_JOB_RETRIES"):
        Config.from_env()

"""The knowledge graph commands of the CLI (cli/graph.py), through typer's CliRunner."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engram.cli import app
from engram.providers import embedders


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, embedder: embedders.MiniLM) -> Iterator[None]:
    monkeypatch.setitem(embedders.EMBEDDERS, "minilm", lambda: embedder)
    yield


def run(db: Path, *args: str, code: int = 0) -> str:
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["--db", str(db), *args])
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    return result.stdout


def test_relate_then_entities_entity_and_relations(tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    run(db, "relate", "Ana", "works_at", "Acme", "--from", "2019-01-01", "-u", "ana")
    run(db, "relate", "Ana", "works_at", "Globex", "--from", "2023-01-01", "-u", "ana")
    out = json.loads(run(db, "relate", "Ana", "age", "34", "--literal", "-u", "ana", "--json"))
    assert out["object"] == "34" and out["object_id"] is None
    names = {e["name"] for e in json.loads(run(db, "entities", "-u", "ana", "--json"))}
    assert names == {"Ana", "Acme", "Globex"}
    prof = json.loads(run(db, "entity", "ana", "-u", "ana", "--json"))
    assert {r["object"] for r in prof["relations"]} == {"Globex", "34"}
    then = json.loads(run(db, "relations", "--subject", "Ana", "-p", "works_at", "--as-of",
                          "2020-06-01", "-u", "ana", "--json"))
    assert [r["object"] for r in then] == ["Acme"]
    table = run(db, "relations", "--subject", "Ana", "--history", "-u", "ana")
    assert "Acme" in table and "Globex" in table and "2023-01-01" in table
    assert "Globex" in run(db, "entity", "Ana", "-u", "ana")
    run(db, "entity", "Nobody", "-u", "ana", code=1)


def test_entity_delete_asks_first_then_removes(tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    run(db, "relate", "Ana", "works_at", "Acme", "-u", "ana")
    declined = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["--db", str(db), "entity", "Acme", "--delete", "-u", "ana"], input="n\n")
    assert declined.exit_code == 1 and "nothing was deleted" in declined.output
    assert json.loads(run(db, "entity", "Acme", "-u", "ana", "--json"))["name"] == "Acme"
    out = json.loads(run(db, "entity", "acme", "--delete", "--yes", "-u", "ana", "--json"))
    assert [e["name"] for e in out["entities"]] == ["Acme"] and len(out["relations"]) == 1
    run(db, "entity", "Acme", "-u", "ana", code=1)
    run(db, "entity", "Acme", "--delete", "-y", "-u", "ana", code=1)  # unknown: not found
    assert "deleted Ana" in run(db, "entity", "Ana", "--delete", "-y", "-u", "ana")

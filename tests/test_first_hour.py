"""What a new user hits in the first hour with the `engram` command and the library, each as
they would try it: flags in --help, a misspelt --db, the two meanings of "session", commands the
library has (update, supersedes, tenants), `stats`, the explain table in 80 columns, and an
explicit database file beside ENGRAM_DATABASE_URL."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner, Result

from engram import Config, Memory
from engram.cli import app
from engram.cli.base import database
from engram.providers import embedders


@pytest.fixture(scope="module")
def shared_embedder() -> embedders.MiniLM:
    return embedders.MiniLM(int8=True)


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, shared_embedder: embedders.MiniLM) -> None:
    monkeypatch.setitem(embedders.EMBEDDERS, "minilm-int8", lambda: shared_embedder)
    for var in ("ENGRAM_DB", "ENGRAM_EMBEDDER", "ENGRAM_DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)


def run(*args: str | Path, code: int = 0, columns: int = 200) -> Result:
    result = CliRunner(env={"COLUMNS": str(columns)}).invoke(app, [str(a) for a in args])
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def _commands(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found: list[tuple[str, ...]] = []
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group (typer's own click)
            found += _commands(command, (*prefix, name))
        else:
            found.append((*prefix, name))
    return found


def test_help_shows_no_type_for_a_flag() -> None:
    commands = _commands(typer.main.get_group(app))
    assert ("update",) in commands and ("sessions", "add") in commands
    for command in [(), *commands]:
        out = run(*command, "--help", columns=120).stdout
        assert "<bool>" not in out, command
    assert "<float>" in run("add", "--help", columns=120).stdout  # a value's type still shows


@pytest.mark.parametrize("command", [["list"], ["search", "tea"], ["stats"], ["show", "x"],
                                     ["history", "x"], ["relations"], ["entities"],
                                     ["sessions", "list"], ["export", "out.jsonl"],
                                     ["reindex", "--yes"], ["jobs"]])
def test_a_read_command_refuses_a_missing_database(tmp_path: Path, command: list[str]) -> None:
    typo = tmp_path / "dta" / "engram.db"
    result = run("--db", typo, *command, code=1)
    assert result.stderr.startswith(f"error: no database at {typo}")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its folder


def test_a_command_that_adds_creates_the_database(tmp_path: Path) -> None:
    fresh = tmp_path / "new" / "engram.db"
    run("--db", fresh, "add", "Ana likes green tea", "-u", "ana")
    assert fresh.exists()
    assert "Ana likes green tea" in run("--db", fresh, "list").stdout


def test_add_supersedes_and_update(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    first = run("--db", db, "--json", "add", "Ana is vegetarian", "-u", "ana", "-k", "semantic")
    old = json.loads(first.stdout)["memories"][0]["id"]
    plain = run("--db", db, "add", "Ana lives in Porto", "-u", "ana", "-k", "semantic")
    assert "--supersedes ID" in plain.stderr and "supersedes=..." not in plain.stderr
    second = run("--db", db, "--json", "add", "Ana is pescatarian", "-u", "ana", "-k", "semantic",
                 "--supersedes", old)
    new = json.loads(second.stdout)["memories"][0]["id"]
    with Memory(db) as mem:
        assert mem.get(old).superseded_by == new
    assert [e["type"] for e in json.loads(run("--db", db, "--json", "history", old).stdout)] == [
        "ADD", "SUPERSEDE"]

    done = run("--db", db, "update", new, "--text", "Ana is pescatarian since May",
               "--importance", "0.8")
    assert done.stdout.strip() == f"updated {new} (text, importance)"
    with Memory(db) as mem:
        rec = mem.get(new)
        assert rec.text == "Ana is pescatarian since May" and rec.importance == 0.8
    assert run("--db", db, "update", new, code=2).stderr.startswith("error: update needs")
    assert run("--db", db, "update", "no-such-id", "--text", "x", code=1).stderr.strip() == (
        "error: no memory with id 'no-such-id'")


def test_s_is_the_session_everywhere(tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    run("--db", db, "relate", "Ana", "works_at", "Clinic", "-u", "ana")
    assert "No such option: -s" in run("--db", db, "relations", "-s", "Ana", code=2).stderr
    assert "Clinic" in run("--db", db, "relations", "--subject", "Ana", "-u", "ana").stdout


def test_a_session_id_on_memories_is_not_a_conversation(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    run("--db", db, "add", "We land in Porto at 9", "-u", "ana", "-s", "trip")
    none = run("--db", db, "sessions", "list")
    assert "engram sessions add" in none.stderr and "engram list --session" in none.stderr
    started = run("--db", db, "sessions", "add", "trip", "Book a table for two", "-u", "ana")
    assert started.stdout.startswith("added ") and "to session trip" in started.stdout
    listed = json.loads(run("--db", db, "--json", "sessions", "list").stdout)
    assert [s["scope"]["session_id"] for s in listed] == ["trip"]
    shown = run("--db", db, "sessions", "show", "trip").stdout
    assert "Book a table for two" in shown


def test_tenant_reads_what_the_service_stored_for_it(tmp_path: Path,
                                                     shared_embedder: embedders.MiniLM) -> None:
    db = tmp_path / "svc.db"
    with Memory(db, tenant="acme", embedder=shared_embedder) as mem:
        mem.add("Acme's customer prefers email", user_id="u1")
    assert "prefers email" in run("--db", db, "--tenant", "acme", "list").stdout
    assert run("--db", db, "--tenant", "other", "list", code=1).stderr.startswith("error: no database")
    assert run("--db", db, "list", code=1)  # the default database was never written


def test_stats_reads_as_a_table_and_names_its_database(tmp_path: Path) -> None:
    db = tmp_path / "st.db"
    run("--db", db, "add", "Ana likes tea", "-u", "ana")
    out = run("--db", db, "stats", columns=80).stdout
    assert "{" not in out and "}" not in out
    assert re.search(r"queued\s+0", out) and re.search(r"episodes\s+no limit", out)
    assert re.search(r"size\s+\d+(\.\d)? KiB", out)
    assert str(db) in "".join(out.split())  # whole, folded over lines at 80 columns


def test_the_database_shown_for_postgresql_has_no_password(tmp_path: Path) -> None:
    url = "postgresql://engram:s3cret@db.example:5433/memory?sslmode=require"
    shown = database(Config(path=tmp_path / "unused.db", database_url=url))
    assert shown == "postgresql://engram:***@db.example:5433/memory?sslmode=require"
    assert database(Config(path=tmp_path / "x.db")) == str(tmp_path / "x.db")


def test_stats_on_postgresql_names_the_server_not_a_file(pg_server: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    url = pg_server.url(pg_server.create_database())
    monkeypatch.setenv("ENGRAM_DATABASE_URL", url)
    run("add", "Ana likes tea", "-u", "ana")
    out = run("stats").stdout
    assert url in " ".join(out.split()) or url[:40] in out
    assert "engram.db" not in out


def test_explain_keeps_whole_headers_in_80_columns(tmp_path: Path) -> None:
    db = tmp_path / "e.db"
    run("--db", db, "add", "Ana likes green tea", "-u", "ana")
    run("--db", db, "add", "Ana lives in Lisbon", "-u", "ana", "-k", "semantic")
    out = run("--db", db, "search", "what does Ana drink?", "-e", "-n", "2", columns=80).stdout
    assert "…" not in out
    for stage in ("dense", "lexical", "recency", "importance", "score"):
        assert re.search(rf"^\s*{stage}\s+\d", out, re.M), stage
    assert max(len(line) for line in out.splitlines()) <= 80


def test_an_explicit_file_wins_over_the_environments_postgresql(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_embedder: embedders.MiniLM) -> None:
    monkeypatch.setenv("ENGRAM_DATABASE_URL", "postgresql://nobody@/nowhere?host=/nonexistent")
    with Memory(tmp_path / "explicit.db", embedder=shared_embedder) as mem:
        assert mem.config.database_url is None
        mem.add("kept in the file", user_id="u")
    assert (tmp_path / "explicit.db").exists()
    assert Config.from_env().database_url is not None  # with no file named, the URL holds
    both = Config.from_env(path=tmp_path / "x.db", database_url="postgresql://a@/b")
    assert both.database_url == "postgresql://a@/b"  # both named: the URL, as before

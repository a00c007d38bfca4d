"""The `engram` CLI, driven for real through typer's CliRunner against SQLite files in tmp_path."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from engram import Memory
from engram.cli import app
from engram.providers import embedders

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shared_embedder() -> embedders.MiniLM:
    """One real MiniLM (the default's, int8) for the module: each CLI run builds a Memory, the
    model loads once."""
    return embedders.MiniLM(int8=True)


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, shared_embedder: embedders.MiniLM) -> None:
    monkeypatch.setitem(embedders.EMBEDDERS, "minilm-int8", lambda: shared_embedder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("ENGRAM_DB", "ENGRAM_EMBEDDER", "ENGRAM_RETRIEVAL", "ENGRAM_MAX_TEXT_CHARS"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "engram.db"


def run(db: Path, *args: str, input: str | None = None, code: int = 0) -> Result:
    # A wide terminal, so that rich tables are not cut (COLUMNS is what rich reads).
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["--db", str(db), *args], input=input)
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    # A clean exit: typer.Exit / SystemExit only, never an escaped exception or traceback.
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result


def run_json(db: Path, *args: str, input: str | None = None) -> object:
    return json.loads(run(db, *args, "--json", input=input).stdout)


def seed(db: Path, shared_embedder: embedders.MiniLM, texts: list[str], **scope: str) -> list[str]:
    """Memories written through the library, for tests about reading them through the CLI."""
    with Memory(db, embedder=shared_embedder) as mem:
        return [m.id for m in mem.add(texts, **scope).memories]


# -- add / search ------------------------------------------------------------------------------

def test_add_then_search_json(db: Path) -> None:
    added = run_json(db, "add", "I moved to Lisbon in May", "--user", "ana",
                     "--observed-at", "2024-05-01", "--metadata", '{"topic": "home"}')
    assert isinstance(added, dict)
    [memory] = added["memories"]
    assert memory["text"] == "I moved to Lisbon in May"
    assert memory["scope"]["user_id"] == "ana"
    assert memory["observed_at"].startswith("2024-05-01")
    assert [e["type"] for e in added["events"]] == ["ADD"]

    run(db, "add", "-", "-u", "ana", "-k", "semantic", "--importance", "0.9",
        input="Ana's dog is a shiba inu called Miso\n")
    run(db, "add", "I live in Porto", "-u", "bob")

    hits = run_json(db, "search", "which city did I move to?", "-u", "ana")
    assert isinstance(hits, list)
    assert hits[0]["memory"]["id"] == memory["id"]
    assert {h["memory"]["scope"]["user_id"] for h in hits} == {"ana"}  # bob is out of scope
    assert {"dense", "fused", "score"} <= set(hits[0]["explain"])
    assert hits[0]["score"] == pytest.approx(hits[0]["explain"]["score"])

    semantic = run_json(db, "search", "pet", "-u", "ana", "--kind", "SEMANTIC")
    assert [h["memory"]["text"] for h in semantic] == ["Ana's dog is a shiba inu called Miso"]
    assert semantic[0]["memory"]["importance"] == 0.9

    filtered = run_json(db, "search", "where", "--filter", '{"topic": "home"}', "-n", "5")
    assert [h["memory"]["id"] for h in filtered] == [memory["id"]]


def test_search_explain_prints_stage_table(db: Path, shared_embedder: embedders.MiniLM) -> None:
    seed(db, shared_embedder, ["Ana loves spicy food", "Ana hates cilantro"], user_id="ana")
    out = run(db, "search", "spicy food", "--explain").stdout
    assert "score breakdown" in out
    for stage in ("dense", "lexical", "fused", "recency", "importance", "score"):
        assert stage in out
    assert "Ana loves spicy food" in out


# -- list ----------------------------------------------------------------------------------------

def test_list_pages_with_cursor(db: Path, shared_embedder: embedders.MiniLM) -> None:
    ids = seed(db, shared_embedder, [f"note number {i}" for i in range(5)], user_id="ana")
    first = run(db, "list", "-u", "ana", "-n", "2").stdout
    assert "note number 0" in first and "note number 1" in first
    found = re.search(r"next cursor: (\S+)", first)
    assert found is not None
    cursor: str | None = found.group(1)
    seen = ids[:2]
    for _ in range(2):
        assert cursor is not None
        page = run_json(db, "list", "-u", "ana", "-n", "2", "--cursor", cursor)
        assert isinstance(page, dict)
        seen += [item["id"] for item in page["items"]]
        cursor = page["next_cursor"]
    assert cursor is None
    assert seen == ids  # creation order, nothing twice, nothing lost


# -- show / history / delete / erase --------------------------------------------------------------

def test_show_history_delete_erase(db: Path, shared_embedder: embedders.MiniLM) -> None:
    keep, gone, other = seed(db, shared_embedder, ["keep [bold]me[/bold]", "delete me",
                                                   "erase me"], user_id="ana")
    shown = run(db, "show", keep).stdout
    assert "keep [bold]me[/bold]" in shown  # user text is not rich markup
    assert "user=ana" in shown and "episodic" in shown

    assert "deleted" in run(db, "delete", gone).stdout
    run(db, "show", gone, code=1)
    events = run_json(db, "history", gone)
    assert isinstance(events, list)
    assert [e["type"] for e in events] == ["ADD", "DELETE"]
    table = run(db, "history", gone).stdout
    assert "ADD" in table and "DELETE" in table

    declined = run(db, "erase", "--id", other, input="n\n", code=1)
    assert "nothing was erased" in declined.stderr
    assert run_json(db, "erase", "--id", other, "--yes") == {"erased": 1}  # was still there

    confirmed = run(db, "erase", "--user", "ana", input="y\n")
    assert "erased 2 memories" in confirmed.stdout  # keep + the soft-deleted one
    stats = run_json(db, "stats")
    assert isinstance(stats, dict)
    assert stats["memories"] == 0 and stats["deleted"] == 0


@pytest.mark.parametrize("command", ["show", "delete", "history"])
def test_unknown_id_exits_1(db: Path, command: str, shared_embedder: embedders.MiniLM) -> None:
    Memory(db, embedder=shared_embedder).close()
    result = run(db, command, "no-such-id", code=1)
    assert result.stderr.strip() == "error: no memory with id 'no-such-id'"
    assert result.stdout == ""


def test_jobs_lists_a_background_add(db: Path) -> None:
    queued = run_json(db, "add", "Ana booked the 9:40 train", "-u", "ana", "--background")
    assert isinstance(queued, dict) and queued["job"] is not None
    job = queued["job"]["id"]
    listed = run(db, "jobs", "-u", "ana").stdout
    assert job in listed and " add " in listed  # the job's task, as the table shows it
    rows = run_json(db, "jobs", "-u", "ana")
    assert isinstance(rows, list)
    assert [(r["id"], r["task"]) for r in rows] == [(job, "add")]


# -- export / import -----------------------------------------------------------------------------

def test_export_then_import_restores_memories(tmp_path: Path,
                                              shared_embedder: embedders.MiniLM) -> None:
    src, dst, dump = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "ana.jsonl"
    ids = seed(src, shared_embedder, ["Ana lives in Lisbon", "Ana has a dog named Miso",
                                      "Ana is pescatarian"], user_id="ana")
    seed(src, shared_embedder, ["Bob lives in Porto"], user_id="bob")
    with Memory(src, embedder=shared_embedder) as mem:
        mem.delete(ids[2])

    assert run_json(src, "export", str(dump), "--user", "ana") == {"exported": 3,
                                                                    "path": str(dump)}
    out = run(dst, "import", str(dump))
    assert "imported 3 memories" in out.stdout

    before = run_json(src, "list", "-u", "ana")
    after = run_json(dst, "list")
    assert isinstance(before, dict) and isinstance(after, dict)
    assert after["items"] == before["items"]
    hits = run_json(dst, "search", "where does Ana live")  # embeddings were rebuilt
    assert isinstance(hits, list) and hits[0]["memory"]["id"] == ids[0]


@pytest.mark.parametrize("content", [None, "this is not an engram export\n"])
def test_unreadable_import_exits_2(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "dump.jsonl"
    if content is not None:
        path.write_text(content)
    result = run(tmp_path / "x.db", "import", str(path), code=2)
    assert result.stderr.startswith("error: ")
    assert str(path) in result.stderr


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    (["add", "   "], "text is empty"),
    (["add", "-"], "text is empty"),  # empty stdin
    (["add", "x", "--metadata", "{oops"], "--metadata is not valid JSON"),
    (["add", "x", "--observed-at", "yesterday"], "--observed-at must be an ISO-8601"),
    (["erase", "--yes"], "erase needs --id"),
    (["search", "x", "--filter", "{'topic': 1}"], "--filter is not valid JSON"),
    (["search", "x", "--kind", "dream"], "'dream' is not one of"),
    (["search", "x", "--limit", "0"], "limit must be an integer"),
])
def test_invalid_input_exits_2(db: Path, args: list[str], message: str,
                              shared_embedder: embedders.MiniLM) -> None:
    Memory(db, embedder=shared_embedder).close()  # a search needs a database to refuse it
    result = run(db, *args, input="", code=2)
    assert message in " ".join(result.stderr.split())  # rich panels wrap lines
    assert result.stdout == ""


def test_broken_database_exits_3(tmp_path: Path) -> None:
    path = tmp_path / "broken.db"
    path.write_bytes(b"this is not a sqlite database at all " * 20)
    result = run(path, "stats", code=3)
    assert result.stderr.startswith("error: ")


@pytest.mark.parametrize(("command", "module", "extra"), [
    (["serve"], "fastapi", "server"), (["mcp"], "mcp", "mcp"), (["mcp", "-t", "http"], "mcp", "mcp")])
def test_a_missing_extra_is_named(tmp_path: Path, command: list[str], module: str, extra: str) -> None:
    # A fresh interpreter in which the extra's module cannot be imported, as in a core install.
    code = f"import sys; sys.modules[{module!r}] = None; from engram.cli import app; app()"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    done = subprocess.run([sys.executable, "-c", code, "--db", str(tmp_path / "x.db"), *command],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip() == (f"error: this needs engram's {extra} extra (no module {module!r}): "
                                   f"pip install 'mnemotrace[{extra}]'")
    assert done.stdout == ""


# -- demo, help, docs ----------------------------------------------------------------------------

def test_demo_prints_hits(tmp_path: Path) -> None:
    out = run(tmp_path / "demo.db", "demo", "--limit", "2").stdout
    assert "remembered 36 messages from 3 sessions and 3 facts" in out
    assert "Where does Ana live?" in out
    assert "dense" in out and "lexical" in out
    assert "Lisbon" in out and "Miso" in out


def _commands() -> list[str]:
    group = typer.main.get_command(app)
    return sorted(group.commands)  # type: ignore[attr-defined]


def test_docs_cover_every_command() -> None:
    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`engram ([a-z][a-z_-]*)", doc))
    missing = set(_commands()) - documented
    assert not missing, f"docs/cli.md does not document: {sorted(missing)}"
    assert len(_commands()) >= 11


# -- issue 15: what a new user of the CLI hit ----------------------------------------------------

def test_add_with_a_speaker_name(db: Path, shared_embedder: embedders.MiniLM) -> None:
    out = run_json(db, "add", "I just moved to Lisbon", "-u", "ana", "--name", "Ana")
    assert isinstance(out, dict) and out["memories"][0]["name"] == "Ana"
    run(db, "add", "I love rainy days", "-u", "ana", "--name", "Bob")
    hits = run_json(db, "search", "Where does Ana live?", "-u", "ana", "--explain")
    assert isinstance(hits, list)
    assert hits[0]["memory"]["text"] == "I just moved to Lisbon" and "speaker" in hits[0]["explain"]


def test_jobs_with_none_says_so(db: Path) -> None:
    run(db, "add", "a first memory")  # a database, with no jobs
    assert run(db, "jobs", "--status", "failed").output.strip() == "no failed jobs"
    assert run(db, "jobs").output.strip() == "no jobs"
    assert run_json(db, "jobs", "--status", "failed") == []


def test_sessions_list_shows_the_summary_after_the_end(db: Path, shared_embedder: embedders.MiniLM) -> None:
    with Memory(db, embedder=shared_embedder) as mem:
        s = mem.session(session_id="trip", user_id="ana")
        s.add(["I fly to Tokyo on May 3rd.", "I will stay three weeks."])
        s.end()
    table = run(db, "sessions", "list").output
    assert "Tokyo" in table  # the summary column was empty
    listed = run_json(db, "sessions", "list")
    assert isinstance(listed, list) and "Tokyo" in listed[0]["end_summary"]
    shown = run(db, "sessions", "show", "trip").output
    assert "end-of-session summary" in shown

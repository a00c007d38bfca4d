"""The `engram` command line: a thin typer face over `Memory`, with rich tables and `--json`.

Exit codes: 0 ok, 1 not found (or a declined confirmation), 2 invalid input or usage,
3 any other engram error (store, provider, file system). Heavy imports happen inside commands.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from .errors import EngramError, InvalidFilter, InvalidInput, NotFound
from .model import EventType, Kind

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from .memory import Memory
    from .model import Event, Hit, MemoryRecord

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_INVALID = 2
EXIT_ERROR = 3

# The order stages are shown in; keys a future stage adds are appended after these.
STAGES = ("dense", "window", "fact", "lexical", "fused", "speaker", "when", "session", "recency",
          "importance", "score")

app = typer.Typer(
    name="engram",
    help="Long-term memory for LLM agents, from the shell.",
    epilog="Exit codes: 0 ok, 1 not found or declined, 2 invalid input or usage, 3 other errors.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# -- shared options ------------------------------------------------------------------------------

DbOpt = Annotated[Path | None, typer.Option(
    "--db", dir_okay=False, metavar="PATH",
    help="Database file (default: $ENGRAM_DB, else ~/.engram/engram.db).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
UserOpt = Annotated[str | None, typer.Option(
    "--user", "-u", metavar="ID", help="Scope: user id.")]
AgentOpt = Annotated[str | None, typer.Option(
    "--agent", "-a", metavar="ID", help="Scope: agent id.")]
SessionOpt = Annotated[str | None, typer.Option(
    "--session", "-s", metavar="ID", help="Scope: session id.")]
KindsOpt = Annotated[list[Kind] | None, typer.Option(
    "--kind", "-k", case_sensitive=False, metavar="KIND",
    help="Only this kind (repeatable).")]
FilterOpt = Annotated[str | None, typer.Option(
    "--filter", "-f", metavar="JSON", help='Metadata filter, e.g. \'{"topic": "food"}\'.')]
LimitOpt = Annotated[int, typer.Option(
    "--limit", "-n", metavar="N", help="How many results (1-1000).")]


@dataclass(frozen=True)
class _State:
    db: Path | None = None
    json: bool = False


def _state(ctx: typer.Context, db: Path | None, as_json: bool) -> _State:
    """Command-level --db / --json win over the global ones."""
    base = ctx.obj if isinstance(ctx.obj, _State) else _State()
    return _State(db or base.db, as_json or base.json)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"engram {__version__}")
        raise typer.Exit()


@app.callback()
def main(ctx: typer.Context, db: DbOpt = None, as_json: JsonOpt = False,
         version: Annotated[bool, typer.Option(
             "--version", callback=_version, is_eager=True,
             help="Print the version and exit.")] = False) -> None:
    """Long-term memory for LLM agents, from the shell."""
    ctx.obj = _State(db, as_json)


# -- errors, memory, output ----------------------------------------------------------------------

def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _exit_code(exc: EngramError) -> int:
    if isinstance(exc, NotFound):
        return EXIT_NOT_FOUND
    if isinstance(exc, InvalidInput):
        return EXIT_INVALID
    return EXIT_ERROR


@contextmanager
def _guard() -> Iterator[None]:
    """Turn engram errors into a one-line message and an exit code, never a traceback."""
    try:
        yield
    except EngramError as exc:
        _fail(str(exc), _exit_code(exc))
    except OSError as exc:  # e.g. an export path in a missing directory
        _fail(str(exc), EXIT_ERROR)


@contextmanager
def _memory(state: _State) -> Iterator[Memory]:
    from .config import Config
    from .memory import Memory

    with _guard():
        mem = Memory(config=Config.from_env(path=state.db))
        try:
            yield mem
        finally:
            mem.close()


def _console(stderr: bool = False) -> Console:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, ensure_ascii=False, indent=2))


def _when(value: str | None, option: str) -> datetime | None:
    if value is None:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise InvalidInput(f"{option} must be an ISO-8601 date or time such as 2024-05-10 or "
                           f"2024-05-10T14:30:00+00:00, not {value!r}") from None


def _json_option(value: str | None, option: str, error: type[InvalidInput] = InvalidInput) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise error(f"{option} is not valid JSON: {exc}") from None


def _hit_dict(hit: Hit) -> dict[str, Any]:
    return {"memory": hit.memory.to_dict(), "score": hit.score, "explain": hit.explain}


def _text(value: str) -> Text:
    """User text as-is: square brackets in a memory are not rich markup."""
    from rich.text import Text

    return Text(value)


def _date(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


def _scope_str(rec: MemoryRecord | Event) -> str:
    return " ".join(f"{k.removesuffix('_id')}={v}" for k, v in rec.scope.as_dict().items()
                    if v is not None) or "-"


def _memory_cell(rec: MemoryRecord, *, with_id: bool = True) -> Text:
    from rich.text import Text

    who = rec.name or (rec.role if rec.kind is Kind.EPISODIC else None)
    cell = Text(f"{who}: " if who else "", style="bold")
    cell.append(rec.text)
    tags = [rec.kind.value, *([rec.id] if with_id else [])]
    if rec.superseded_by:
        tags.append(f"superseded by {rec.superseded_by}")
    cell.append("\n" + " · ".join(tags), style="dim")
    return cell


def _records_table(records: Sequence[MemoryRecord], hits: Sequence[Hit] | None = None, *,
                   title: str | None = None, with_id: bool = True) -> Table:
    from rich.table import Table

    table = Table(title=title, show_lines=True, title_justify="left")
    if hits is not None:
        table.add_column("#", justify="right")
        table.add_column("score", justify="right")
    table.add_column("when", no_wrap=True)
    table.add_column("memory", ratio=1)
    for i, rec in enumerate(records):
        lead = [str(i + 1), f"{hits[i].score:.3f}"] if hits is not None else []
        table.add_row(*lead, _date(rec.observed_at or rec.created_at),
                      _memory_cell(rec, with_id=with_id))
    return table


def _explain_table(hits: Sequence[Hit], title: str = "score breakdown") -> Table:
    from rich import box
    from rich.table import Table

    present = {k for h in hits for k in h.explain}
    columns = [s for s in STAGES if s in present] + sorted(present - set(STAGES))
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("#", justify="right")
    for name in columns:
        table.add_column(name, justify="right", style="bold" if name == "score" else None)
    for i, h in enumerate(hits, start=1):
        table.add_row(str(i), *(f"{h.explain[c]:.3f}" if c in h.explain else "-"
                                for c in columns))
    return table


# -- commands ------------------------------------------------------------------------------------

@app.command()
def add(ctx: typer.Context,
        text: Annotated[str, typer.Argument(help="The text to remember, or - to read stdin.")],
        user: UserOpt = None, agent: AgentOpt = None, session: SessionOpt = None,
        kind: Annotated[Kind | None, typer.Option(
            "--kind", "-k", case_sensitive=False,
            help="episodic (default), semantic or procedural.")] = None,
        metadata: Annotated[str | None, typer.Option(
            "--metadata", "-m", metavar="JSON", help="A JSON object stored with it.")] = None,
        observed_at: Annotated[str | None, typer.Option(
            "--observed-at", metavar="ISO", help="When it happened (default: now).")] = None,
        importance: Annotated[float | None, typer.Option(
            "--importance", help="0 to 1 (default 0.5).")] = None,
        expires_at: Annotated[str | None, typer.Option(
            "--expires-at", metavar="ISO", help="Forget it after this time.")] = None,
        infer: Annotated[bool, typer.Option(
            "--infer/--no-infer", help="With an LLM: also extract facts (default on).")] = True,
        background: Annotated[bool, typer.Option(
            "--background", help="Queue it as a job and return at once (see engram jobs).")] = False,
        db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Remember a message (episode) or a fact."""
    state = _state(ctx, db, as_json)
    with _guard():
        if text == "-":
            try:
                text = sys.stdin.read().rstrip("\n")
            except UnicodeDecodeError as exc:
                raise InvalidInput(f"stdin is not valid UTF-8: {exc.reason}") from None
        kwargs = dict(metadata=_json_option(metadata, "--metadata"),
                      observed_at=_when(observed_at, "--observed-at"),
                      expires_at=_when(expires_at, "--expires-at"))
    with _memory(state) as mem:
        result = mem.add(text, user_id=user, agent_id=agent, session_id=session, kind=kind,
                         importance=importance, infer=infer, background=background, **kwargs)
    if state.json:
        _print_json({"memories": [m.to_dict() for m in result.memories],
                     "events": [e.to_dict() for e in result.events], "notes": list(result.notes),
                     "job": result.job.to_dict() if result.job else None})
        return
    if result.job:
        typer.echo(f"queued job {result.job.id}")
    for note in result.notes:
        typer.echo(note, err=True)
    touched = {e.memory_id for e in result.events}
    verbs = {EventType.ADD: "added", EventType.MERGE: "merged into", EventType.DELETE: "evicted"}
    for ev in result.events:
        note = f" ({ev.reason})" if ev.type is not EventType.ADD and ev.reason else ""
        typer.echo(f"{verbs.get(ev.type, ev.type.value)} {ev.memory_id}{note}")
    for rec in result.memories:
        if rec.id not in touched:
            typer.echo(f"already remembered as {rec.id}")


@app.command()
def search(ctx: typer.Context,
           query: Annotated[str, typer.Argument(help="What to look for, in plain words.")],
           user: UserOpt = None, agent: AgentOpt = None, session: SessionOpt = None,
           limit: LimitOpt = 10, kinds: KindsOpt = None, filter: FilterOpt = None,
           as_of: Annotated[str | None, typer.Option(
               "--as-of", metavar="ISO", help="Only facts valid at this time.")] = None,
           explain: Annotated[bool, typer.Option(
               "--explain", "-e", help="Show each hit's score breakdown by stage.")] = False,
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Hybrid search (dense + lexical + adjustments), best first."""
    state = _state(ctx, db, as_json)
    with _guard():
        filters = _json_option(filter, "--filter", InvalidFilter)
        when = _when(as_of, "--as-of")
    with _memory(state) as mem:
        hits = mem.search(query, user_id=user, agent_id=agent, session_id=session,
                          filters=filters, limit=limit, kinds=kinds or None, as_of=when)
    if state.json:
        _print_json([_hit_dict(h) for h in hits])
        return
    if not hits:
        typer.echo("no memories found", err=True)
        return
    console = _console()
    console.print(_records_table([h.memory for h in hits], hits))
    if explain:
        console.print(_explain_table(hits))


@app.command("list")
def list_cmd(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
             session: SessionOpt = None, filter: FilterOpt = None, kinds: KindsOpt = None,
             limit: LimitOpt = 20,
             cursor: Annotated[str | None, typer.Option(
                 "--cursor", "-c", help="Continue after this cursor (from the previous page).")]
             = None,
             db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Memories in the order they were learned, one page at a time."""
    state = _state(ctx, db, as_json)
    with _guard():
        filters = _json_option(filter, "--filter", InvalidFilter)
    with _memory(state) as mem:
        page = mem.list(user_id=user, agent_id=agent, session_id=session, filters=filters,
                        kinds=kinds or None, cursor=cursor, limit=limit)
    if state.json:
        _print_json({"items": [r.to_dict() for r in page.items],
                     "next_cursor": page.next_cursor})
        return
    if page.items:
        _console().print(_records_table(page.items))
    else:
        typer.echo("no memories", err=True)
    if page.next_cursor:
        typer.echo(f"next cursor: {page.next_cursor}  (engram list --cursor {page.next_cursor})")


@app.command()
def show(ctx: typer.Context, id: Annotated[str, typer.Argument(help="A memory id.")],
         db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Every field of one memory."""
    state = _state(ctx, db, as_json)
    with _memory(state) as mem:
        rec = mem.get(id)
    if state.json:
        _print_json(rec.to_dict())
        return
    from rich.table import Table

    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rec.to_dict().items():
        if key == "scope":
            value = _scope_str(rec)
        elif isinstance(value, dict | list):
            value = json.dumps(value, ensure_ascii=False) if value else "-"
        table.add_row(key, _text("-" if value in (None, "") else str(value)))
    _console().print(table)


def _changes(ev: Event) -> str:
    if not ev.before or not ev.after:
        return ""
    return ", ".join(k for k in ev.after if k != "updated_at" and ev.after[k] != ev.before.get(k))


@app.command()
def history(ctx: typer.Context, id: Annotated[str, typer.Argument(help="A memory id.")],
            db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """The audit trail of one memory, oldest first (deleted and erased ids too)."""
    state = _state(ctx, db, as_json)
    with _memory(state) as mem:
        events = mem.history(id)
    if state.json:
        _print_json([e.to_dict() for e in events])
        return
    from rich.table import Table

    table = Table(title=f"history of {id}", title_justify="left")
    for col in ("at", "event", "changed", "reason"):
        table.add_column(col, no_wrap=col in ("at", "event"))
    for ev in events:
        table.add_row(_date(ev.at), ev.type.value, _changes(ev), _text(ev.reason or ""))
    _console().print(table)


@app.command()
def delete(ctx: typer.Context, id: Annotated[str, typer.Argument(help="A memory id.")],
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Soft delete: hidden from every read, kept in the history."""
    state = _state(ctx, db, as_json)
    with _memory(state) as mem:
        mem.delete(id)
    if state.json:
        _print_json({"deleted": id})
    else:
        typer.echo(f"deleted {id} (still in its history; `engram erase --id` removes every trace)")


@app.command()
def erase(ctx: typer.Context,
          id: Annotated[str | None, typer.Option("--id", help="Erase this one memory.")] = None,
          user: UserOpt = None, agent: AgentOpt = None, session: SessionOpt = None,
          yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
          db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Hard delete of one memory or a whole scope, history included. Cannot be undone."""
    import click

    state = _state(ctx, db, as_json)
    scope = {"user_id": user, "agent_id": agent, "session_id": session}
    if id is None and not any(scope.values()):
        _fail("erase needs --id or at least one of --user, --agent, --session", EXIT_INVALID)
    with _memory(state) as mem:
        if not yes:
            if id is not None:
                what = f"memory {id}"
            else:
                st = mem.stats(**scope)
                named = " ".join(f"{k.removesuffix('_id')}={v}" for k, v in scope.items() if v)
                total = st.memories + st.superseded + st.deleted + st.expired
                what = f"{total} memories of {named}"
            try:
                ok = click.confirm(f"Erase {what} and their history? This cannot be undone",
                                   err=True)
            except click.Abort:
                typer.echo("", err=True)
                ok = False
            if not ok:
                _fail("not confirmed; nothing was erased", EXIT_NOT_FOUND)
        count = mem.erase(id=id, **scope)
    if state.json:
        _print_json({"erased": count})
    else:
        typer.echo(f"erased {count} {'memory' if count == 1 else 'memories'}")


@app.command()
def export(ctx: typer.Context,
           path: Annotated[Path, typer.Argument(dir_okay=False, help="Output file (JSON lines).")],
           user: UserOpt = None, agent: AgentOpt = None, session: SessionOpt = None,
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Write a scope (deleted and superseded memories too, with history) to a file."""
    state = _state(ctx, db, as_json)
    with _memory(state) as mem:
        count = mem.export(path, user_id=user, agent_id=agent, session_id=session)
    if state.json:
        _print_json({"exported": count, "path": str(path)})
    else:
        typer.echo(f"exported {count} memories to {path}")


@app.command("import")
def import_cmd(ctx: typer.Context,
               path: Annotated[Path, typer.Argument(help="A file written by `engram export`.")],
               db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Read an export back; all or nothing, ids already present are skipped."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    state = _state(ctx, db, as_json)
    # Started on the first report, so a file refused up front prints only the error.
    progress = Progress(TextColumn("importing"), BarColumn(), MofNCompleteColumn(),
                        console=_console(stderr=True), disable=state.json)
    task = progress.add_task("import", total=None, start=False)

    def advance(done: int, total: int) -> None:
        if not progress.live.is_started:
            progress.start()
            progress.start_task(task)
        progress.update(task, completed=done, total=total)

    try:
        with _memory(state) as mem:
            count = mem.import_(path, progress=advance)
    finally:
        progress.stop()
    if state.json:
        _print_json({"imported": count, "path": str(path)})
    else:
        typer.echo(f"imported {count} memories from {path}")


@app.command()
def stats(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
          session: SessionOpt = None, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Counts by kind and state, for the whole database or a scope."""
    state = _state(ctx, db, as_json)
    with _memory(state) as mem:
        st = mem.stats(user_id=user, agent_id=agent, session_id=session)
        path = mem.config.path
    if state.json:
        _print_json(st.to_dict())
        return
    from rich.table import Table

    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("database", _text(str(path)))
    for key, value in st.to_dict().items():
        if key == "by_kind":
            for k in Kind:
                table.add_row(f"  {k.value}", str(value.get(k.value, 0)))
        else:
            table.add_row(key, "-" if value is None else str(value))
    _console().print(table)


@app.command()
def worker(ctx: typer.Context,
           until_idle: Annotated[bool, typer.Option("--until-idle",
                                                    help="Stop when no job is runnable.")] = False,
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Run background jobs (adds, extraction, reflection) from the database's job table."""
    import threading

    state = _state(ctx, db, as_json)
    with _memory(state) as mem:
        stop = threading.Event()
        if not state.json:
            typer.echo(f"engram worker on {mem.config.path}: waiting for jobs (Ctrl-C stops)", err=True)
        try:
            ran = mem.work(until_idle=until_idle, stop=stop)
        except KeyboardInterrupt:
            stop.set()
            ran = -1
    if state.json:
        _print_json({"ran": ran})
    elif ran >= 0:
        typer.echo(f"ran {ran} jobs")


@app.command()
def jobs(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
         session: SessionOpt = None,
         status: Annotated[str | None, typer.Option("--status",
                                                    help="queued, running, done or failed.")] = None,
         limit: Annotated[int, typer.Option("--limit", "-n", help="How many, newest first.")] = 20,
         db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Background jobs, newest first."""
    state = _state(ctx, db, as_json)
    with _memory(state) as mem:
        found = mem.jobs(user_id=user, agent_id=agent, session_id=session, status=status, limit=limit)
    if state.json:
        _print_json([j.to_dict() for j in found])
        return
    for j in found:
        typer.echo(f"{j.id}  {j.task:8} {j.status.value:8} attempts={j.attempts}"
                   + (f"  error: {j.error}" if j.error else ""))


@app.command()
def reflect(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
            session: SessionOpt = None,
            limit: Annotated[int, typer.Option("--limit", "-n", help="Recent episodes to read.")] = 50,
            db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Learn lessons (procedural) and insights (semantic) from recent episodes; needs an LLM."""
    state = _state(ctx, db, as_json)
    with _memory(state) as mem:
        result = mem.reflect(user_id=user, agent_id=agent, session_id=session, limit=limit)
    if state.json:
        _print_json({"memories": [m.to_dict() for m in result.memories], "notes": list(result.notes)})
        return
    for note in result.notes:
        typer.echo(note, err=True)
    if result.memories:
        _console().print(_records_table(result.memories))


@app.command("mcp")
def mcp_cmd(ctx: typer.Context,
            transport: Annotated[str, typer.Option(
                "--transport", "-t", metavar="stdio|http",
                help="stdio (for a local MCP client) or http (streamable HTTP at /mcp).")] = "stdio",
            host: Annotated[str, typer.Option("--host", help="HTTP: address to listen on.")] = "127.0.0.1",
            port: Annotated[int, typer.Option("--port", help="HTTP: port (0 picks a free one).")] = 8000,
            user_id: Annotated[str, typer.Option(
                "--user-id", metavar="ID", help="Scope of every tool call: user id.")] = "default",
            db: DbOpt = None) -> None:
    """Serve engram's memory and knowledge-graph tools over MCP (stdio or streamable HTTP)."""
    from .config import Config
    from .mcp import serve

    state = _state(ctx, db, False)
    with _guard():
        serve(transport=transport, host=host, port=port, user_id=user_id,
              config=Config.from_env(path=state.db))


@app.command()
def demo(ctx: typer.Context,
         limit: Annotated[int, typer.Option("--limit", "-n", help="Hits per question.")] = 3,
         db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Remember a sample conversation (3 sessions with Ana) and ask it questions.

    Uses a temporary database unless --db is given.
    """
    import tempfile

    state = _state(ctx, db, as_json)
    with tempfile.TemporaryDirectory(prefix="engram-demo-") as tmp:
        if state.db is None:
            state = _State(Path(tmp) / "demo.db", state.json)
            keep = False
        else:
            keep = True
        _run_demo(state, limit, keep)


def _sample() -> dict[str, Any]:
    from importlib.resources import files

    data: dict[str, Any] = json.loads(
        files("engram").joinpath("data/sample_conversation.json").read_text(encoding="utf-8"))
    return data


def _run_demo(state: _State, limit: int, keep: bool) -> None:
    import time

    data = _sample()
    scope = {"user_id": data["user_id"], "agent_id": data["agent_id"]}
    console = _console()
    t0 = time.perf_counter()
    results: list[tuple[str, list[Hit]]] = []
    with _memory(state) as mem:
        if not state.json:
            console.print(f"[bold]engram demo[/] - database: {state.db}"
                          + ("" if keep else " (temporary)"))
            console.print("loading the embedder and remembering the sample conversation...")
        n_messages = 0
        for s in data["sessions"]:
            start = datetime.fromisoformat(s["date"])
            messages = [{**m, "observed_at": start + timedelta(minutes=2 * i)}
                        for i, m in enumerate(s["messages"])]
            mem.add(messages, session_id=s["session_id"], **scope)
            n_messages += len(messages)
        for fact in data["facts"]:
            mem.add(fact["text"], kind=Kind.SEMANTIC, importance=fact.get("importance"),
                    observed_at=_when(fact["observed_at"], "observed_at"), **scope)
        for query in data["queries"]:
            results.append((query, mem.search(query, user_id=data["user_id"], limit=limit)))
    took = time.perf_counter() - t0
    ingested = {"sessions": len(data["sessions"]), "messages": n_messages,
                "facts": len(data["facts"])}
    if state.json:
        _print_json({"db": str(state.db) if keep else None, "ingested": ingested,
                     "queries": [{"query": q, "hits": [_hit_dict(h) for h in hits]}
                                 for q, hits in results],
                     "seconds": round(took, 2)})
        return
    console.print(f"remembered {n_messages} messages from {ingested['sessions']} sessions and "
                  f"{ingested['facts']} facts for user {data['user_id']!r} in {took:.1f}s\n")
    for query, hits in results:
        console.rule(_text(query), align="left")
        console.print(_demo_table(hits))
    if keep:
        console.print(f"try: engram --db {state.db} search \"Ana's trip\" --user "
                      f"{data['user_id']} --explain", markup=False)


def _demo_table(hits: Sequence[Hit]) -> Table:
    """Hits with their score breakdown; ids left out, they mean nothing here."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_lines=True)
    table.add_column("#", justify="right")
    table.add_column("score", justify="right", style="bold")
    table.add_column("memory, and how its score was made", ratio=1)
    for i, h in enumerate(hits, start=1):
        cell = _memory_cell(h.memory, with_id=False)
        cell.append(f" · {_date(h.memory.observed_at or h.memory.created_at)}", style="dim")
        cell.append("\n" + _breakdown(h), style="cyan")
        table.add_row(str(i), f"{h.score:.3f}", cell)
    return table


def _breakdown(hit: Hit) -> str:
    """`dense 0.41 + lexical 0.50 + recency 0.00 = 0.91`: the stages that add up to the score."""
    parts = [s for s in STAGES if s in hit.explain and s not in ("fused", "score")]
    parts += sorted(set(hit.explain) - set(STAGES))
    return " + ".join(f"{s} {hit.explain[s]:.3f}" for s in parts) + f" = {hit.score:.3f}"


# -- the REST service and its API keys (engram/server) ------------------------------------------

keys_app = typer.Typer(help="Manage the REST service's API keys (stored hashed, shown once).",
                       no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@contextmanager
def _key_store(state: _State) -> Iterator[Any]:
    from .config import Config
    from .store.keys import open_key_store

    with _guard():
        keys = open_key_store(Config.from_env(path=state.db))
        try:
            yield keys
        finally:
            keys.close()


@keys_app.command("create")
def keys_create(ctx: typer.Context,
                tenant: Annotated[str, typer.Option("--tenant", "-t", help="The tenant the key acts for.")],
                role: Annotated[str, typer.Option(
                    "--role", "-r", help="member (read and write) or admin (also erase, export, import).")]
                = "member",
                name: Annotated[str, typer.Option("--name", help="A label, e.g. who holds it.")] = "",
                db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Create an API key; the key is printed once and only its hash is stored."""
    state = _state(ctx, db, as_json)
    with _key_store(state) as keys, _guard():
        key, secret = keys.create(tenant, role, name)
    if state.json:
        _print_json({**key.to_dict(), "key": secret})
        return
    typer.echo(secret)
    typer.echo(f"created {key.role.value} key {key.id} for tenant {key.tenant!r}; store it now, "
               "it is not shown again", err=True)


@keys_app.command("list")
def keys_list(ctx: typer.Context,
              tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="Only this tenant.")]
              = None,
              db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """API keys (ids, tenants, roles; never the keys themselves)."""
    state = _state(ctx, db, as_json)
    with _key_store(state) as keys, _guard():
        found = keys.list(tenant)
    if state.json:
        _print_json([k.to_dict() for k in found])
        return
    if not found:
        typer.echo("no API keys", err=True)
        return
    from rich.table import Table

    table = Table()
    for col in ("id", "tenant", "role", "name", "created", "revoked"):
        table.add_column(col)
    for k in found:
        table.add_row(k.id, _text(k.tenant), k.role.value, _text(k.name), _date(k.created_at),
                      _date(k.revoked_at) if k.revoked_at else "")
    _console().print(table)


@keys_app.command("revoke")
def keys_revoke(ctx: typer.Context, id: Annotated[str, typer.Argument(help="A key id (from keys list).")],
                db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Revoke an API key: requests with it answer 401 from now on."""
    state = _state(ctx, db, as_json)
    with _key_store(state) as keys, _guard():
        key = keys.revoke(id)
    if state.json:
        _print_json(key.to_dict())
    else:
        typer.echo(f"revoked key {key.id} of tenant {key.tenant!r}")


@app.command()
def serve(ctx: typer.Context,
          host: Annotated[str, typer.Option("--host", help="Interface to bind.")] = "127.0.0.1",
          port: Annotated[int, typer.Option("--port", "-p", help="TCP port.")] = 8000,
          no_auth: Annotated[bool, typer.Option(
              "--no-auth", help="No API keys: anyone who reaches the port is the admin of the "
                                "single-user database. For local use only.")] = False,
          rate: Annotated[float, typer.Option("--rate", help="Requests per second per tenant.")] = 50.0,
          burst: Annotated[int, typer.Option("--burst", help="Requests a tenant may make at once.")] = 100,
          max_body: Annotated[int, typer.Option("--max-body", help="Largest request body, bytes.")]
          = 1_048_576,
          db: DbOpt = None) -> None:
    """Run the REST service (OpenAPI at /openapi.json, docs at /docs)."""
    import uvicorn

    from .config import Config
    from .server import ServiceLimits, create_app

    state = _state(ctx, db, False)
    with _guard():
        config = Config.from_env(path=state.db)
        try:
            limits = ServiceLimits(max_body_bytes=max_body, rate=rate, burst=burst)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        if no_auth:
            warn = _console(stderr=True)
            warn.print("[bold red]" + "!" * 78)
            warn.print("[bold red]!! engram serve --no-auth: NO AUTHENTICATION. Anyone who can reach "
                       f"{host}:{port} can read,\n!! change and erase every memory in "
                       f"{config.database_url and 'the PostgreSQL database' or config.path}.")
            if host not in ("127.0.0.1", "localhost", "::1"):
                warn.print(f"[bold red]!! and {host} is not a loopback address.")
            warn.print("[bold red]" + "!" * 78)
        shown = f"[{host}]" if ":" in host else host
        typer.echo(f"engram serving on http://{shown}:{port}  (API docs: http://{shown}:{port}/docs)",
                   err=True)
        application = create_app(config, auth=not no_auth, limits=limits)
    uvicorn.run(application, host=host, port=port, log_level="info", access_log=False)


# -- sessions and chat (engram/working, engram/chat.py) ----------------------------------------

sessions_app = typer.Typer(help="Persisted conversations: list, show, delete.", no_args_is_help=True)
app.add_typer(sessions_app, name="sessions")
MAX_SESSIONS = 1000


def _one_session(mem: Memory, session_id: str, user: str | None, agent: str | None) -> Any:
    """The session with this id in the given scope; refuses an ambiguous id."""
    found = [s for s in mem.sessions(user_id=user, agent_id=agent, limit=MAX_SESSIONS)
             if s.scope.session_id == session_id]
    if not found:
        raise NotFound(f"no session {session_id!r}" + (f" for user {user!r}" if user else ""))
    if len(found) > 1:
        raise InvalidInput(f"session id {session_id!r} exists in {len(found)} scopes; "
                           "add --user / --agent")
    return found[0]


@sessions_app.command("list")
def sessions_list(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
                  limit: LimitOpt = 50, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Stored sessions, most recently updated first."""
    state = _state(ctx, db, as_json)
    with _memory(state) as mem:
        found = mem.sessions(user_id=user, agent_id=agent, limit=limit)
    if state.json:
        _print_json([s.to_dict() for s in found])
        return
    if not found:
        typer.echo("no sessions", err=True)
        return
    from rich.table import Table

    table = Table()
    for col in ("session", "user", "agent", "policy", "updated", "ended", "summary"):
        table.add_column(col)
    for s in found:
        table.add_row(_text(s.scope.session_id or ""), _text(s.scope.user_id or ""),
                      _text(s.scope.agent_id or ""), s.policy.get("name", ""),
                      _date(s.updated_at), _date(s.ended_at) if s.ended_at else "",
                      _text(" ".join(s.summary.split())[:60]))
    _console().print(table)


@sessions_app.command("show")
def sessions_show(ctx: typer.Context,
                  session_id: Annotated[str, typer.Argument(metavar="ID", help="A session id.")],
                  user: UserOpt = None, agent: AgentOpt = None,
                  db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """A session: its policy, summary and messages."""
    state = _state(ctx, db, as_json)
    with _memory(state) as mem, _guard():
        row = _one_session(mem, session_id, user, agent)
        s = mem.session(session_id=session_id, user_id=row.scope.user_id,
                        agent_id=row.scope.agent_id)
        messages = s.messages()
    if state.json:
        _print_json({**row.to_dict(), "messages": [
            {**m.to_chat(), "id": m.id, "observed_at": m.observed_at.isoformat() if m.observed_at else None}
            for m in messages]})
        return
    console = _console()
    console.print(f"[bold]session {session_id}[/] of {_scope_text(row.scope)}: policy "
                  f"{row.policy}, {len(messages)} messages, updated {_date(row.updated_at)}"
                  + (f", ended {_date(row.ended_at)}" if row.ended_at else ""), highlight=False)
    if row.summary:
        console.print("[bold]summary[/]")
        console.print(_text(row.summary))
    for m in messages:
        who = m.name or m.role
        console.print(_text(f"{_date(m.observed_at)} {who}: {m.text}"))


def _scope_text(scope: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in scope.as_dict().items() if v and k != "session_id") or "-"


@sessions_app.command("delete")
def sessions_delete(ctx: typer.Context,
                    session_id: Annotated[str, typer.Argument(metavar="ID", help="A session id.")],
                    user: UserOpt = None, agent: AgentOpt = None,
                    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
                    db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Erase a session: its messages, summaries and row (extracted facts stay)."""
    state = _state(ctx, db, as_json)
    with _memory(state) as mem, _guard():
        row = _one_session(mem, session_id, user, agent)
        if not yes and not typer.confirm(f"erase session {session_id} and its messages?"):
            _fail("not confirmed", EXIT_NOT_FOUND)
        erased = mem.session(session_id=session_id, user_id=row.scope.user_id,
                             agent_id=row.scope.agent_id).delete()
    if state.json:
        _print_json({"deleted": session_id, "erased": erased})
    else:
        typer.echo(f"deleted session {session_id} ({erased} memories erased)")


@app.command()
def chat(ctx: typer.Context,
         user: Annotated[str | None, typer.Option(
             "--user", "-u", metavar="ID", help="Who you are (default: your login name).")] = None,
         agent: AgentOpt = None,
         session: Annotated[str | None, typer.Option(
             "--session", "-s", metavar="ID", help="Resume this session (default: a new one).")]
         = None,
         policy: Annotated[str, typer.Option(
             "--policy", help="What the model sees of a new session: all, window, tokens, turns, "
                              "summary, incremental, progressive.")] = "incremental",
         budget: Annotated[int, typer.Option(
             "--budget", help="Context budget per answer, in tokens.")] = 2000,
         max_tokens: Annotated[int, typer.Option(
             "--max-tokens", help="Longest answer, in tokens.")] = 512,
         end: Annotated[bool, typer.Option(
             "--end/--no-end", help="On leaving, write the session summary and extract facts.")]
         = True,
         db: DbOpt = None) -> None:
    """Chat with an OpenAI-compatible model that remembers you across runs."""
    import getpass

    from .chat import NO_ENDPOINT, Chat, ChatSettings
    from .config import Config
    from .providers.llms import get_llm

    state = _state(ctx, db, False)
    with _guard():
        config = Config.from_env(path=state.db)
        llm = get_llm(config)
    if llm is None:
        typer.echo(NO_ENDPOINT)
        raise typer.Exit(EXIT_OK)
    from contextlib import suppress

    with suppress(ImportError):  # line editing and history at the prompt, where there is readline
        import readline  # noqa: F401
    with _guard():
        from .working.policies import as_policy

        as_policy(policy)  # a bad name fails before the model loads
        from .memory import Memory

        mem = Memory(config=config, llm=llm)
        try:
            settings = ChatSettings(user_id=user or getpass.getuser() or "me", agent_id=agent,
                                    session_id=session, policy=policy, budget_tokens=budget,
                                    max_tokens=max_tokens, end=end)
            code = Chat(mem, settings).run()
        finally:
            mem.close()
    raise typer.Exit(code)


if __name__ == "__main__":  # pragma: no cover
    app()

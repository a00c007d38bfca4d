"""`engram export` and `engram import`: a scope to a JSON-lines file and back, with a progress
bar on import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import InvalidImport
from . import output
from .base import AgentOpt, DbOpt, JsonOpt, SessionOpt, UserOpt, open_memory, print_json, state


def export(ctx: typer.Context,
           path: Annotated[Path, typer.Argument(dir_okay=False, help="Output file (JSON lines).")],
           user: UserOpt = None, agent: AgentOpt = None, session: SessionOpt = None,
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Write a scope (deleted and superseded memories too, with history) to a file."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem:
        count = mem.export(path, user_id=user, agent_id=agent, session_id=session)
    if st.json:
        print_json({"exported": count, "path": str(path)})
    else:
        typer.echo(f"exported {count} memories to {path}")


def import_memories(ctx: typer.Context,
                    path: Annotated[Path, typer.Argument(help="A file written by `engram export`.")],
                    db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Read an export back; all or nothing, ids already present are skipped."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    st = state(ctx, db, as_json)
    # Started on the first report, so a file refused up front prints only the error.
    progress = Progress(TextColumn("importing"), BarColumn(), MofNCompleteColumn(),
                        console=output.console(stderr=True), disable=st.json)
    task = progress.add_task("import", total=None, start=False)

    def advance(done: int, total: int) -> None:
        if not progress.live.is_started:
            progress.start()
            progress.start_task(task)
        progress.update(task, completed=done, total=total)

    try:
        with open_memory(st, create=True) as mem:
            try:
                count = mem.import_(path, progress=advance)
            except InvalidImport as exc:  # the library does not name the file: say which one
                raise InvalidImport(f"{path}: {exc}") from None
    finally:
        progress.stop()
    if st.json:
        print_json({"imported": count, "path": str(path)})
    else:
        typer.echo(f"imported {count} memories from {path}")

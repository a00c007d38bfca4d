"""The `engram` command line: a thin typer face over `Memory`, with rich tables and `--json`.

Exit codes: 0 ok, 1 not found (or a declined confirmation), 2 invalid input or usage,
3 any other engram error (store, provider, file system). Heavy imports happen inside commands.
This module is the command table; each group of commands lives in its own module.
"""

from __future__ import annotations

from typing import Annotated

import typer

from . import chat, demo, graph, jobs, memories, reindex, service, sessions, transfer, trust
from .base import DbOpt, JsonOpt, State, TenantOpt

__all__ = ["app"]

app = typer.Typer(
    name="engram",
    help="Long-term memory for LLM agents, from the shell.",
    epilog="Exit codes: 0 ok, 1 not found or declined, 2 invalid input or usage, 3 other errors.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"engram {__version__}")
        raise typer.Exit()


@app.callback()
def main(ctx: typer.Context, db: DbOpt = None, as_json: JsonOpt = False, tenant: TenantOpt = None,
         version: Annotated[bool, typer.Option(
             "--version", callback=_version, is_eager=True,
             help="Print the version and exit.")] = False) -> None:
    """Long-term memory for LLM agents, from the shell."""
    ctx.obj = State(db, as_json, tenant)


# The order here is the order of `engram --help` (groups are listed after the commands).
app.command()(memories.add)
app.command()(memories.update)
app.command()(memories.search)
app.command("list")(memories.list_memories)
app.command()(memories.show)
app.command()(memories.history)
app.command()(memories.delete)
app.command()(memories.erase)
app.command()(transfer.export)
app.command("import")(transfer.import_memories)
app.command()(memories.stats)
app.command()(jobs.worker)
app.command()(jobs.jobs)
app.command()(jobs.retry)
app.command()(memories.reflect)
app.command()(reindex.reindex)  # a new embedder: re-embed the database (cli/reindex.py)
app.command()(graph.entities)  # the knowledge graph (cli/graph.py)
app.command()(graph.entity)
app.command()(graph.relations)
app.command()(graph.relate)
app.add_typer(service.mcp_app, name="mcp")
app.command()(demo.demo)
app.add_typer(service.keys_app, name="keys")
app.command()(service.serve)
app.add_typer(sessions.app, name="sessions")
app.command()(chat.chat)
# trust: backups, encryption at rest, erasure receipts, retention, the audit trail
for command in (trust.backup, trust.restore, trust.check, trust.encrypt, trust.rekey,
                trust.receipts, trust.retain, trust.audit):
    app.command()(command)

"""`engram reindex`: re-embed a database (or a scope) with the configured embedder, with a
progress bar; an interrupted run continues where it stopped when run again."""

from __future__ import annotations

from typing import Annotated

import typer

from .. import Memory
from .base import EXIT_NOT_FOUND, AgentOpt, DbOpt, JsonOpt, UserOpt, existing, fail, guard, print_json, state


def reindex(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
            yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
            db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Re-embed every memory with the configured embedder (ENGRAM_EMBEDDER) and record its
    embedding space. Needed after changing the embedder; resumable. Stop other writers first."""
    import click
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    st = state(ctx, db, as_json)
    with guard():
        mem = Memory(config=existing(st), tenant=st.tenant, check_space=False)
        try:
            spaces = mem.embedding_space()
            recorded, target = spaces["recorded"], spaces["configured"]
            if not yes:
                what = (f"from {recorded} into {target}"
                        if recorded is not None and recorded != target else f"in {target}")
                try:
                    ok = click.confirm(f"Re-embed the memories {what}? This runs the model over "
                                       "every memory", err=True)
                except click.Abort:
                    typer.echo("", err=True)
                    ok = False
                if not ok:
                    fail("not confirmed; nothing was re-embedded", EXIT_NOT_FOUND)
            with Progress("[progress.description]{task.description}", BarColumn(),
                          MofNCompleteColumn(), TimeRemainingColumn(),
                          disable=st.json, transient=False) as bar:
                task = bar.add_task(f"re-embedding into {target}", total=None)

                def advance(done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total)

                count = mem.reindex(user_id=user, agent_id=agent, progress=advance)
        finally:
            mem.close()
    if st.json:
        print_json({"reindexed": count, "space": target})
    else:
        typer.echo(f"re-embedded {count} {'memory' if count == 1 else 'memories'} into {target}")

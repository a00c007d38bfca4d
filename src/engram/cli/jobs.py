"""`engram worker` and `engram jobs`: run the durable background jobs (adds, extraction,
reflection) of a database, and list them.
"""

from __future__ import annotations

import threading
from typing import Annotated

import typer

from .base import AgentOpt, DbOpt, JsonOpt, SessionOpt, UserOpt, open_memory, print_json, state


def worker(ctx: typer.Context,
           until_idle: Annotated[bool, typer.Option("--until-idle",
                                                    help="Stop when no job is runnable.")] = False,
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Run background jobs (adds, extraction, reflection) from the database's job table."""
    st = state(ctx, db, as_json)
    with open_memory(st, create=True) as mem:
        stop = threading.Event()
        if not st.json:
            typer.echo(f"engram worker on {mem.config.path}: waiting for jobs (Ctrl-C stops)", err=True)
        try:
            ran = mem.work(until_idle=until_idle, stop=stop)
        except KeyboardInterrupt:
            stop.set()
            ran = -1
    if st.json:
        print_json({"ran": ran})
    elif ran >= 0:
        typer.echo(f"ran {ran} jobs")


def jobs(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
         session: SessionOpt = None,
         status: Annotated[str | None, typer.Option("--status",
                                                    help="queued, running, done or failed.")] = None,
         limit: Annotated[int, typer.Option("--limit", "-n", help="How many, newest first.")] = 20,
         db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Background jobs, newest first."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem:
        found = mem.jobs(user_id=user, agent_id=agent, session_id=session, status=status, limit=limit)
    if st.json:
        print_json([j.to_dict() for j in found])
        return
    if not found:
        typer.echo(f"no {status} jobs" if status else "no jobs", err=True)
        return
    for j in found:
        typer.echo(f"{j.id}  {j.task:8} {j.status.value:8} attempts={j.attempts}"
                   + (f"  error: {j.error}" if j.error else ""))


def retry(ctx: typer.Context, id: Annotated[str, typer.Argument(help="The failed job's id.")],
          db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Queue a failed job again, its attempts reset."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem:
        job = mem.retry(id)
    if st.json:
        print_json(job.to_dict())
    else:
        typer.echo(f"queued job {job.id} ({job.task}) again")

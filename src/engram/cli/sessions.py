"""`engram sessions`: the persisted conversations of a database (working memory: a policy,
summaries, an end), started or continued a message at a time, listed, shown, or erased.

A conversation's messages are episodes of its session scope. The other way round does not hold:
`engram add --session ID` only labels memories with a session id, and starts no conversation.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .. import Memory
from ..errors import InvalidInput, NotFound
from ..model import Scope, Session
from . import output
from .base import (
    EXIT_NOT_FOUND,
    AgentOpt,
    DbOpt,
    JsonOpt,
    LimitOpt,
    UserOpt,
    fail,
    guard,
    open_memory,
    print_json,
    state,
)

app = typer.Typer(help="Conversations (working memory, as `engram chat` holds them): add, list, "
                       "show, delete. `engram add --session ID` only labels memories.",
                  no_args_is_help=True)
NO_SESSIONS = ("no sessions (a session is a conversation: `engram sessions add ID TEXT` or "
               "`engram chat` holds one; memories added with `engram add --session ID` are "
               "listed by `engram list --session ID`)")
MAX_SESSIONS = 1000


def _one_session(mem: Memory, session_id: str, user: str | None, agent: str | None) -> Session:
    """The session with this id in the given scope; refuses an ambiguous id."""
    found = mem.sessions(user_id=user, agent_id=agent, session_id=session_id, limit=MAX_SESSIONS)
    if not found:
        raise NotFound(f"no session {session_id!r}" + (f" for user {user!r}" if user else ""))
    if len(found) > 1:
        raise InvalidInput(f"session id {session_id!r} exists in {len(found)} scopes; "
                           "add --user / --agent")
    return found[0]


def _end_summary(mem: Memory, row: Session) -> str | None:
    """The summary `end()` stored for the session (an episode; the row keeps its id), if any."""
    summary_id = row.state.get("summary_id")
    if not isinstance(summary_id, str):
        return None
    try:
        return mem.get(summary_id).text
    except NotFound:  # erased or deleted since
        return None


def _shown_summary(mem: Memory, row: Session) -> str:
    """What the summary column shows: after the end, the end-of-session summary (it covers every
    message); before, the running summary (policies that summarise)."""
    ended = _end_summary(mem, row) if row.ended_at is not None else None
    return ended or row.summary or _end_summary(mem, row) or ""


def _scope_text(scope: Scope) -> str:
    return ", ".join(f"{k}={v}" for k, v in scope.as_dict().items() if v and k != "session_id") or "-"


@app.command("add")
def add(ctx: typer.Context,
        session_id: Annotated[str, typer.Argument(metavar="ID", help="A session id.")],
        text: Annotated[str, typer.Argument(help="The message.")],
        user: UserOpt = None, agent: AgentOpt = None,
        role: Annotated[str, typer.Option(
            "--role", "-r", help="user, assistant, system or tool.")] = "user",
        name: Annotated[str | None, typer.Option(
            "--name", metavar="NAME", help="Who said it (the speaker).")] = None,
        policy: Annotated[str | None, typer.Option(
            "--policy", help="What a model sees of a new session: all, window, tokens, turns, "
                             "summary, incremental, progressive (default: the stored one).")]
        = None,
        db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Add a message to a conversation, starting it if it is new."""
    st = state(ctx, db, as_json)
    message = {"role": role, "content": text, **({"name": name} if name else {})}
    with open_memory(st, create=True) as mem:
        stored = mem.session(session_id=session_id, user_id=user, agent_id=agent,
                             policy=policy).add(message)
    if st.json:
        print_json([m.to_dict() for m in stored])
    else:
        typer.echo(f"added {', '.join(m.id for m in stored)} to session {session_id}")


@app.command("list")
def list_sessions(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
                  limit: LimitOpt = 50, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Stored sessions, most recently updated first."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem:
        found = mem.sessions(user_id=user, agent_id=agent, limit=limit)
        summaries = [_shown_summary(mem, s) for s in found]
        ends = [_end_summary(mem, s) for s in found] if st.json else []
    if st.json:
        print_json([{**s.to_dict(), "end_summary": end} for s, end in zip(found, ends, strict=True)])
        return
    if not found:
        typer.echo(NO_SESSIONS, err=True)
        return
    from rich.table import Table

    table = Table()
    for col in ("session", "user", "agent", "policy", "updated", "ended", "summary"):
        table.add_column(col)
    for s, summary in zip(found, summaries, strict=True):
        table.add_row(output.text(s.scope.session_id or ""), output.text(s.scope.user_id or ""),
                      output.text(s.scope.agent_id or ""), s.policy.get("name", ""),
                      output.date(s.updated_at), output.date(s.ended_at) if s.ended_at else "",
                      output.text(" ".join(summary.split())[:60]))
    output.console().print(table)


@app.command("show")
def show(ctx: typer.Context,
         session_id: Annotated[str, typer.Argument(metavar="ID", help="A session id.")],
         user: UserOpt = None, agent: AgentOpt = None,
         db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """A session: its policy, summary and messages."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem, guard():
        row = _one_session(mem, session_id, user, agent)
        s = mem.session(session_id=session_id, user_id=row.scope.user_id,
                        agent_id=row.scope.agent_id)
        messages = s.messages()
        end_summary = _end_summary(mem, row)
    if st.json:
        print_json({**row.to_dict(), "end_summary": end_summary, "messages": [
            {**m.to_chat(), "id": m.id, "observed_at": m.observed_at.isoformat() if m.observed_at else None}
            for m in messages]})
        return
    console = output.console()
    console.print(f"[bold]session {session_id}[/] of {_scope_text(row.scope)}: policy "
                  f"{row.policy}, {len(messages)} messages, updated {output.date(row.updated_at)}"
                  + (f", ended {output.date(row.ended_at)}" if row.ended_at else ""), highlight=False)
    if row.summary:
        console.print("[bold]summary[/]")
        console.print(output.text(row.summary))
    if end_summary:
        console.print("[bold]end-of-session summary[/]")
        console.print(output.text(end_summary))
    for m in messages:
        who = m.name or m.role
        console.print(output.text(f"{output.date(m.observed_at)} {who}: {m.text}"))


@app.command("delete")
def delete(ctx: typer.Context,
           session_id: Annotated[str, typer.Argument(metavar="ID", help="A session id.")],
           user: UserOpt = None, agent: AgentOpt = None,
           yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Erase a session: its messages, summaries and row (extracted facts stay)."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem, guard():
        row = _one_session(mem, session_id, user, agent)
        if not yes and not typer.confirm(f"erase session {session_id} and its messages?"):
            fail("not confirmed", EXIT_NOT_FOUND)
        erased = mem.session(session_id=session_id, user_id=row.scope.user_id,
                             agent_id=row.scope.agent_id).delete()
    if st.json:
        print_json({"deleted": session_id, "erased": erased})
    else:
        typer.echo(f"deleted session {session_id} ({erased} memories erased)")

"""The memory commands of `engram`: add, update, search, list, show, history, delete, erase,
stats and reflect, each one `Memory` call with its output as a rich table or, with --json, as JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from ..errors import InvalidFilter, InvalidInput
from ..model import Event, EventType, Kind
from . import output
from .base import (
    EXIT_INVALID,
    EXIT_NOT_FOUND,
    AgentOpt,
    DbOpt,
    FilterOpt,
    JsonOpt,
    KindsOpt,
    LimitOpt,
    SessionOpt,
    UserOpt,
    database,
    fail,
    guard,
    open_memory,
    parse_json,
    parse_time,
    print_json,
    state,
)


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
        name: Annotated[str | None, typer.Option(
            "--name", metavar="NAME",
            help="Who said it (the speaker): 'I ...' is then about NAME, and questions naming "
                 "NAME find it.")] = None,
        supersedes: Annotated[str | None, typer.Option(
            "--supersedes", metavar="ID",
            help="The memory this one replaces (the world changed): the old one is closed and "
                 "kept as history.")] = None,
        db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Remember a message (episode) or a fact."""
    st = state(ctx, db, as_json)
    with guard():
        if text == "-":
            try:
                text = sys.stdin.read().rstrip("\n")
            except UnicodeDecodeError as exc:
                raise InvalidInput(f"stdin is not valid UTF-8: {exc.reason}") from None
        meta = parse_json(metadata, "--metadata")
        observed = parse_time(observed_at, "--observed-at")
        expires = parse_time(expires_at, "--expires-at")
    with open_memory(st, create=True) as mem:
        message: str | dict[str, str] = text if name is None else {"role": "user", "content": text,
                                                                   "name": name}
        result = mem.add(message, user_id=user, agent_id=agent, session_id=session, kind=kind,
                         importance=importance, infer=infer, background=background,
                         metadata=meta, observed_at=observed, expires_at=expires,
                         supersedes=supersedes)
    if st.json:
        print_json({"memories": [m.to_dict() for m in result.memories],
                    "events": [e.to_dict() for e in result.events], "notes": list(result.notes),
                    "job": result.job.to_dict() if result.job else None})
        return
    if result.job:
        typer.echo(f"queued job {result.job.id}")
    for note in result.notes:  # the library's words for an option, the command's here
        typer.echo(note.replace("supersedes=...", "--supersedes ID"), err=True)
    touched = {e.memory_id for e in result.events}
    verbs = {EventType.ADD: "added", EventType.MERGE: "merged into", EventType.DELETE: "evicted",
             EventType.SUPERSEDE: "superseded"}
    for ev in result.events:
        note = f" ({ev.reason})" if ev.type is not EventType.ADD and ev.reason else ""
        typer.echo(f"{verbs.get(ev.type, ev.type.value)} {ev.memory_id}{note}")
    for rec in result.memories:
        if rec.id not in touched:
            typer.echo(f"already remembered as {rec.id}")


def update(ctx: typer.Context, id: Annotated[str, typer.Argument(help="A memory id.")],
           text: Annotated[str | None, typer.Option(
               "--text", "-t", help="What it should have said all along (a correction).")] = None,
           metadata: Annotated[str | None, typer.Option(
               "--metadata", "-m", metavar="JSON",
               help="A JSON object that replaces its metadata (null clears it).")] = None,
           importance: Annotated[float | None, typer.Option(
               "--importance", help="0 to 1.")] = None,
           expires_at: Annotated[str | None, typer.Option(
               "--expires-at", metavar="ISO", help="Forget it after this time ('never' clears it).")]
           = None,
           valid_from: Annotated[str | None, typer.Option(
               "--valid-from", metavar="ISO", help="When it started to hold.")] = None,
           user: UserOpt = None, agent: AgentOpt = None, session: SessionOpt = None,
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Correct a memory in place (the UPDATE event keeps before and after). When the world
    changed instead, add the new fact with --supersedes ID."""
    st = state(ctx, db, as_json)
    changes: dict[str, object] = {}
    with guard():
        if text is not None:
            changes["text"] = text
        if metadata is not None:
            changes["metadata"] = parse_json(metadata, "--metadata")
        if importance is not None:
            changes["importance"] = importance
        if expires_at is not None:
            changes["expires_at"] = None if expires_at == "never" else parse_time(expires_at,
                                                                                   "--expires-at")
        if valid_from is not None:
            changes["valid_from"] = parse_time(valid_from, "--valid-from")
        if not changes:
            raise InvalidInput("update needs at least one of --text, --metadata, --importance, "
                               "--expires-at, --valid-from")
    with open_memory(st) as mem:
        rec = mem.update(id, user_id=user, agent_id=agent, session_id=session,
                         **changes)  # type: ignore[arg-type]
    if st.json:
        print_json(rec.to_dict())
    else:
        typer.echo(f"updated {rec.id} ({', '.join(changes)})")


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
    st = state(ctx, db, as_json)
    with guard():
        filters = parse_json(filter, "--filter", InvalidFilter)
        when = parse_time(as_of, "--as-of")
    with open_memory(st) as mem:
        hits = mem.search(query, user_id=user, agent_id=agent, session_id=session,
                          filters=filters, limit=limit, kinds=kinds or None, as_of=when)
    if st.json:
        print_json([output.hit_dict(h) for h in hits])
        return
    if not hits:
        typer.echo("no memories found", err=True)
        return
    console = output.console()
    console.print(output.records_table([h.memory for h in hits], hits))
    if explain:
        console.print(output.explain_table(hits, fit=console))


def list_memories(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
                  session: SessionOpt = None, filter: FilterOpt = None, kinds: KindsOpt = None,
                  limit: LimitOpt = 20,
                  cursor: Annotated[str | None, typer.Option(
                      "--cursor", "-c", help="Continue after this cursor (from the previous page).")]
                  = None,
                  db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Memories in the order they were learned, one page at a time."""
    st = state(ctx, db, as_json)
    with guard():
        filters = parse_json(filter, "--filter", InvalidFilter)
    with open_memory(st) as mem:
        page = mem.list(user_id=user, agent_id=agent, session_id=session, filters=filters,
                        kinds=kinds or None, cursor=cursor, limit=limit)
    if st.json:
        print_json({"items": [r.to_dict() for r in page.items], "next_cursor": page.next_cursor})
        return
    if page.items:
        output.console().print(output.records_table(page.items))
    else:
        typer.echo("no memories", err=True)
    if page.next_cursor:
        typer.echo(f"next cursor: {page.next_cursor}  (engram list --cursor {page.next_cursor})")


def show(ctx: typer.Context, id: Annotated[str, typer.Argument(help="A memory id.")],
         db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Every field of one memory."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem:
        rec = mem.get(id)
    if st.json:
        print_json(rec.to_dict())
        return
    from rich.table import Table

    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rec.to_dict().items():
        if key == "scope":
            value = output.scope_str(rec)
        elif isinstance(value, dict | list):
            value = json.dumps(value, ensure_ascii=False) if value else "-"
        table.add_row(key, output.text("-" if value in (None, "") else str(value)))
    output.console().print(table)


def _changes(ev: Event) -> str:
    if not ev.before or not ev.after:
        return ""
    return ", ".join(k for k in ev.after if k != "updated_at" and ev.after[k] != ev.before.get(k))


def history(ctx: typer.Context, id: Annotated[str, typer.Argument(help="A memory id.")],
            db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """The audit trail of one memory, oldest first (deleted and erased ids too)."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem:
        events = mem.history(id)
    if st.json:
        print_json([e.to_dict() for e in events])
        return
    from rich.table import Table

    table = Table(title=f"history of {id}", title_justify="left")
    for col in ("at", "event", "changed", "reason"):
        table.add_column(col, no_wrap=col in ("at", "event"))
    for ev in events:
        table.add_row(output.date(ev.at), ev.type.value, _changes(ev), output.text(ev.reason or ""))
    output.console().print(table)


def delete(ctx: typer.Context, id: Annotated[str, typer.Argument(help="A memory id.")],
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Soft delete: hidden from every read, kept in the history."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem:
        mem.delete(id)
    if st.json:
        print_json({"deleted": id})
    else:
        typer.echo(f"deleted {id} (still in its history; `engram erase --id` removes every trace)")


def erase(ctx: typer.Context,
          id: Annotated[str | None, typer.Option("--id", help="Erase this one memory.")] = None,
          user: UserOpt = None, agent: AgentOpt = None, session: SessionOpt = None,
          yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
          db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Hard delete of one memory or a whole scope, history included. Cannot be undone."""
    import click

    st = state(ctx, db, as_json)
    scope = {"user_id": user, "agent_id": agent, "session_id": session}
    if id is None and not any(scope.values()):
        fail("erase needs --id or at least one of --user, --agent, --session", EXIT_INVALID)
    with open_memory(st) as mem:
        if not yes:
            if id is not None:
                what = f"memory {id}"
            else:
                counts = mem.stats(user_id=user, agent_id=agent, session_id=session)
                named = " ".join(f"{k.removesuffix('_id')}={v}" for k, v in scope.items() if v)
                total = counts.memories + counts.superseded + counts.deleted + counts.expired
                what = f"{total} memories of {named}"
            try:
                ok = click.confirm(f"Erase {what} and their history? This cannot be undone",
                                   err=True)
            except click.Abort:
                typer.echo("", err=True)
                ok = False
            if not ok:
                fail("not confirmed; nothing was erased", EXIT_NOT_FOUND)
        count = mem.erase(id=id, user_id=user, agent_id=agent, session_id=session)
    if st.json:
        print_json({"erased": count})
    else:
        typer.echo(f"erased {count} {'memory' if count == 1 else 'memories'}")


def stats(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
          session: SessionOpt = None, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Counts by kind and state, for the whole database or a scope."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem:
        counts = mem.stats(user_id=user, agent_id=agent, session_id=session)
        where = database(mem.config, st.tenant)
    if st.json:
        print_json(counts.to_dict())
        return
    output.console().print(output.stats_table(where, counts.to_dict()))


def reflect(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
            session: SessionOpt = None,
            limit: Annotated[int, typer.Option("--limit", "-n", help="Recent episodes to read.")] = 50,
            db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Learn lessons (procedural) and insights (semantic) from recent episodes; needs an LLM."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem:
        result = mem.reflect(user_id=user, agent_id=agent, session_id=session, limit=limit)
    if st.json:
        print_json({"memories": [m.to_dict() for m in result.memories], "notes": list(result.notes)})
        return
    for note in result.notes:
        typer.echo(note, err=True)
    if result.memories:
        output.console().print(output.records_table(result.memories))

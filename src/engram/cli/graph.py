"""The knowledge graph commands of `engram`: entities, entity (and its --delete), relations and
relate, each one `Memory` call with its output as a rich table or, with --json, as JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import typer

from ..model import Relation
from . import output
from .base import (
    EXIT_NOT_FOUND,
    AgentOpt,
    DbOpt,
    JsonOpt,
    LimitOpt,
    State,
    UserOpt,
    fail,
    guard,
    open_memory,
    parse_time,
    print_json,
    state,
)


def entities(ctx: typer.Context,
             query: Annotated[str | None, typer.Argument(help="Search by name (optional).")] = None,
             type: Annotated[str | None, typer.Option("--type", "-t", help="Only this type.")] = None,
             user: UserOpt = None, agent: AgentOpt = None, limit: LimitOpt = 50,
             db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """List the entities of the knowledge graph (people, places, things), or search them."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem:
        found = mem.entities(query, type=type, limit=limit, user_id=user, agent_id=agent)
    if st.json:
        print_json([e.to_dict() for e in found])
        return
    from rich.table import Table

    table = Table(title="entities", title_justify="left")
    for col in ("id", "name", "type", "aliases", "summary"):
        table.add_column(col, no_wrap=col in ("id", "type"))
    for e in found:
        table.add_row(e.id, output.text(e.name), e.type, output.text(", ".join(e.aliases)),
                      output.text(e.summary))
    output.console().print(table)


def entity(ctx: typer.Context,
           name: Annotated[str, typer.Argument(help="A name, alias or entity id.")],
           user: UserOpt = None, agent: AgentOpt = None,
           delete: Annotated[bool, typer.Option(
               "--delete", help="Remove it, its relations and its mentions.")] = False,
           yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """What is known about one entity: type, aliases, what holds now, recent mentions (or,
    with --delete, remove it)."""
    st = state(ctx, db, as_json)
    if delete:
        _delete(st, name, user, agent, yes)
        return
    with open_memory(st) as mem:
        prof = mem.entity(name, user_id=user, agent_id=agent)
    if st.json:
        print_json(prof.to_dict())
        return
    e = prof.entity
    con = output.console()
    con.print(output.text(f"{e.name} ({e.type})" + (f", also {', '.join(e.aliases)}"
                                                     if e.aliases else "")))
    if e.summary:
        con.print(output.text(e.summary))
    _relations_table(prof.relations, "what holds now")
    for m in prof.mentions:
        con.print(output.text(f"  [{output.date(m.observed_at)}] {m.name or m.role}: {m.text}"))


def _delete(st: State, name: str, user: str | None, agent: str | None, yes: bool) -> None:
    import click

    with open_memory(st) as mem:
        if not yes:
            e = mem.entity(name, user_id=user, agent_id=agent).entity
            try:
                ok = click.confirm(f"Delete the entity {e.name} ({e.id}) with its relations and "
                                   "mentions?", err=True)
            except click.Abort:
                typer.echo("", err=True)
                ok = False
            if not ok:
                fail("not confirmed; nothing was deleted", EXIT_NOT_FOUND)
            name = e.id
        gone = mem.delete_entity(name, user_id=user, agent_id=agent)
    if st.json:
        print_json(gone.to_dict())
        return
    e = gone.entities[0]
    typer.echo(f"deleted {e.name} ({e.id}) and {len(gone.relations)} relations")


def relations(ctx: typer.Context,
              # no -s: that is --session in every other command
              subject: Annotated[str | None, typer.Option("--subject", help="A name.")] = None,
              predicate: Annotated[str | None, typer.Option("--predicate", "-p")] = None,
              object: Annotated[str | None, typer.Option("--object", "-o",
                                                          help="A name or a value.")] = None,
              as_of: Annotated[str | None, typer.Option(
                  "--as-of", metavar="ISO", help="What held then (default: now).")] = None,
              history: Annotated[bool, typer.Option(
                  "--history", help="Every stored edge, closed ones too.")] = False,
              user: UserOpt = None, agent: AgentOpt = None, limit: LimitOpt = 100,
              db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """The s/p/o query of the knowledge graph: relations that hold now (or at --as-of)."""
    st = state(ctx, db, as_json)
    with guard():
        at = parse_time(as_of, "--as-of")
    with open_memory(st) as mem:
        found = mem.relations(subject, predicate, object, as_of=at, history=history,
                              limit=limit, user_id=user, agent_id=agent)
    if st.json:
        print_json([r.to_dict() for r in found])
        return
    _relations_table(found, "relations")


def relate(ctx: typer.Context, subject: Annotated[str, typer.Argument()],
           predicate: Annotated[str, typer.Argument()], object: Annotated[str, typer.Argument()],
           valid_from: Annotated[str | None, typer.Option(
               "--from", metavar="ISO", help="Since when it holds (default: now).")] = None,
           literal: Annotated[bool, typer.Option(
               "--literal", help="The object is a value, not an entity.")] = False,
           user: UserOpt = None, agent: AgentOpt = None,
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Record a relation (a single-valued predicate's current edge is closed, not deleted)."""
    st = state(ctx, db, as_json)
    with guard():
        start = parse_time(valid_from, "--from")
    with open_memory(st, create=True) as mem:
        rel = mem.relate(subject, predicate, object, valid_from=start, literal=literal,
                         user_id=user, agent_id=agent)
    if st.json:
        print_json(rel.to_dict())
        return
    _relations_table([rel], "related")


def _relations_table(rels: Sequence[Relation], title: str) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in ("subject", "predicate", "object", "from", "to"):
        table.add_column(col, no_wrap=col in ("from", "to"))
    for r in rels:
        table.add_row(output.text(r.subject_name), r.predicate, output.text(r.object_name),
                      output.date(r.valid_from), output.date(r.valid_to))
    output.console().print(table)

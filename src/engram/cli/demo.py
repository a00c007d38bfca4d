"""`engram demo`: remember the bundled sample conversation (three sessions with Ana) and show
how questions about it are answered, with each hit's score breakdown.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..model import Hit, Kind
from . import output
from .base import DbOpt, JsonOpt, State, open_memory, parse_time, print_json, state

if TYPE_CHECKING:
    from rich.table import Table


def demo(ctx: typer.Context,
         limit: Annotated[int, typer.Option("--limit", "-n", help="Hits per question.")] = 3,
         db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Remember a sample conversation (3 sessions with Ana) and ask it questions.

    Uses a temporary database unless --db is given.
    """
    st = state(ctx, db, as_json)
    with tempfile.TemporaryDirectory(prefix="engram-demo-") as tmp:
        if st.db is None:
            st = State(Path(tmp) / "demo.db", st.json)
            keep = False
        else:
            keep = True
        _run(st, limit, keep)


def _sample() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        files("engram").joinpath("data/sample_conversation.json").read_text(encoding="utf-8"))
    return data


def _run(st: State, limit: int, keep: bool) -> None:
    data = _sample()
    user_id, agent_id = data["user_id"], data["agent_id"]
    console = output.console()
    t0 = time.perf_counter()
    results: list[tuple[str, list[Hit]]] = []
    with open_memory(st, create=True) as mem:
        if not st.json:
            console.print(f"[bold]engram demo[/] - database: {st.db}"
                          + ("" if keep else " (temporary)"))
            console.print("loading the embedder and remembering the sample conversation...")
        n_messages = 0
        for s in data["sessions"]:
            start = datetime.fromisoformat(s["date"])
            messages = [{**m, "observed_at": start + timedelta(minutes=2 * i)}
                        for i, m in enumerate(s["messages"])]
            mem.add(messages, session_id=s["session_id"], user_id=user_id, agent_id=agent_id)
            n_messages += len(messages)
        for fact in data["facts"]:
            mem.add(fact["text"], kind=Kind.SEMANTIC, importance=fact.get("importance"),
                    observed_at=parse_time(fact["observed_at"], "observed_at"),
                    user_id=user_id, agent_id=agent_id)
        for query in data["queries"]:
            results.append((query, mem.search(query, user_id=user_id, limit=limit)))
    took = time.perf_counter() - t0
    ingested = {"sessions": len(data["sessions"]), "messages": n_messages,
                "facts": len(data["facts"])}
    if st.json:
        print_json({"db": str(st.db) if keep else None, "ingested": ingested,
                    "queries": [{"query": q, "hits": [output.hit_dict(h) for h in hits]}
                                for q, hits in results],
                    "seconds": round(took, 2)})
        return
    console.print(f"remembered {n_messages} messages from {ingested['sessions']} sessions and "
                  f"{ingested['facts']} facts for user {user_id!r} in {took:.1f}s\n")
    for query, hits in results:
        console.rule(output.text(query), align="left")
        console.print(_table(hits))
    if keep:
        console.print(f"try: engram --db {st.db} search \"Ana's trip\" --user "
                      f"{user_id} --explain", markup=False)


def _table(hits: Sequence[Hit]) -> Table:
    """Hits with their score breakdown; ids left out, they mean nothing here."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_lines=True)
    table.add_column("#", justify="right")
    table.add_column("score", justify="right", style="bold")
    table.add_column("memory, and how its score was made", ratio=1)
    for i, h in enumerate(hits, start=1):
        cell = output.memory_cell(h.memory, with_id=False)
        cell.append(f" · {output.date(h.memory.observed_at or h.memory.created_at)}", style="dim")
        cell.append("\n" + output.breakdown(h), style="cyan")
        table.add_row(str(i), f"{h.score:.3f}", cell)
    return table

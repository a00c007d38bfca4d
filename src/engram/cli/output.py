"""How the `engram` command shows things: rich tables of memories and hits, score breakdowns,
dates and scopes. User text is always plain text, never rich markup.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..model import Event, Hit, Kind, MemoryRecord

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

# The order stages are shown in; keys a future stage adds are appended after these.
STAGES = ("dense", "window", "fact", "lexical", "fused", "speaker", "when", "session", "newer", "recency",
          "importance", "score")


def console(stderr: bool = False) -> Console:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def hit_dict(hit: Hit) -> dict[str, Any]:
    return {"memory": hit.memory.to_dict(), "score": hit.score, "explain": hit.explain}


def text(value: str) -> Text:
    """User text as-is: square brackets in a memory are not rich markup."""
    from rich.text import Text

    return Text(value)


def date(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


def scope_str(rec: MemoryRecord | Event) -> str:
    return " ".join(f"{k.removesuffix('_id')}={v}" for k, v in rec.scope.as_dict().items()
                    if v is not None) or "-"


def memory_cell(rec: MemoryRecord, *, with_id: bool = True) -> Text:
    from rich.text import Text

    who = rec.name or (rec.role if rec.kind is Kind.EPISODIC else None)
    cell = Text(f"{who}: " if who else "", style="bold")
    cell.append(rec.text)
    tags = [rec.kind.value, *([rec.id] if with_id else [])]
    if rec.superseded_by:
        tags.append(f"superseded by {rec.superseded_by}")
    cell.append("\n" + " · ".join(tags), style="dim")
    return cell


def records_table(records: Sequence[MemoryRecord], hits: Sequence[Hit] | None = None, *,
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
        table.add_row(*lead, date(rec.observed_at or rec.created_at),
                      memory_cell(rec, with_id=with_id))
    return table


def explain_table(hits: Sequence[Hit], title: str = "score breakdown") -> Table:
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


def breakdown(hit: Hit) -> str:
    """`dense 0.41 + lexical 0.50 + recency 0.00 = 0.91`: the stages that add up to the score."""
    parts = [s for s in STAGES if s in hit.explain and s not in ("fused", "score")]
    parts += sorted(set(hit.explain) - set(STAGES))
    return " + ".join(f"{s} {hit.explain[s]:.3f}" for s in parts) + f" = {hit.score:.3f}"

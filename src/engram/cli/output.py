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
STAGES = ("dense", "window", "fact", "lexical", "fused", "speaker", "when", "date", "session", "newer",
          "recency", "importance", "score")


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


def explain_table(hits: Sequence[Hit], title: str = "score breakdown",
                  fit: Console | None = None) -> Table:
    """A hit per row and a stage per column; turned the other way (a stage per row) when that
    would not fit the width of console `fit`: rich would cut the headers ("impor…")."""
    from rich import box
    from rich.measure import Measurement
    from rich.table import Table

    present = {k for h in hits for k in h.explain}
    stages = [s for s in STAGES if s in present] + sorted(present - set(STAGES))

    def cell(h: Hit, stage: str) -> str:
        return f"{h.explain[stage]:.3f}" if stage in h.explain else "-"

    wide = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    wide.add_column("#", justify="right")
    for name in stages:
        wide.add_column(name, justify="right", style="bold" if name == "score" else None)
    for i, h in enumerate(hits, start=1):
        wide.add_row(str(i), *(cell(h, s) for s in stages))
    if fit is None or Measurement.get(fit, fit.options.update(max_width=10_000),
                                      wide).maximum <= fit.width:
        return wide
    tall = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    tall.add_column("stage")
    for i in range(1, len(hits) + 1):
        tall.add_column(f"#{i}", justify="right")
    for name in stages:
        tall.add_row(name, *(cell(h, name) for h in hits), style="bold" if name == "score" else None)
    return tall


def size(n: int) -> str:
    """Bytes as a person reads them: 248 KiB, 1.5 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def stats_table(database: str, counts: dict[str, Any]) -> Table:
    """`engram stats`: a row per count; the nested ones (memories by kind, jobs by status, the
    retention policy) as indented rows under their heading."""
    from rich.table import Table

    table = Table(show_header=False, box=None)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(justify="right", overflow="fold")  # a long path folds, never cut
    table.add_row("database", text(database))
    for key, value in counts.items():
        if key == "by_kind":
            for k in Kind:
                table.add_row(f"  {k.value}", str(value.get(k.value, 0)))
        elif key == "retention":
            table.add_row("retention", "")
            for name, days in value.items():
                kept = str(days) if name == "removed" else (
                    "no limit" if days is None else f"{days:g} days")
                table.add_row(f"  {name}", kept)
        elif isinstance(value, dict):
            table.add_row(key, "")
            for name, count in value.items():
                table.add_row(f"  {name}", "-" if count is None else str(count))
        elif key == "db_bytes" and isinstance(value, int):
            table.add_row("size", size(value))
        else:
            table.add_row(key, "-" if value is None else str(value))
    return table


def breakdown(hit: Hit) -> str:
    """`dense 0.41 + lexical 0.50 + recency 0.00 = 0.91`: the stages that add up to the score."""
    parts = [s for s in STAGES if s in hit.explain and s not in ("fused", "score")]
    parts += sorted(set(hit.explain) - set(STAGES))
    return " + ".join(f"{s} {hit.explain[s]:.3f}" for s in parts) + f" = {hit.score:.3f}"

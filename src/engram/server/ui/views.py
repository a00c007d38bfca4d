"""What the console's pages show, built from `Memory`'s public methods only (the same calls the
REST routes make): scope summaries, a fact's history chain, the explain columns, the timeline.

No HTML here and no request handling; the functions that do no I/O are plain and tested alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from ... import Event, Hit, Kind, Memory, MemoryRecord, NotFound, Session
from ...errors import InvalidFilter, InvalidInput

# The order score stages are shown in, as `engram search --explain` shows them; stages a future
# retriever adds (graph, ...) come after these, by name.
STAGES = ("dense", "window", "fact", "lexical", "fused", "speaker", "when", "date", "session",
          "newer", "recency", "importance", "score")
SCAN_LIMIT = 5000   # memories read to summarise the scopes of a tenant (the page says when it stops)
CHAIN_LIMIT = 20    # versions followed each way along a supersede chain
PAGE = 100          # the REST API's largest page (MAX_PAGE)


def explain_columns(hits: Sequence[Hit]) -> list[str]:
    present = {k for h in hits for k in h.explain}
    return [s for s in STAGES if s in present] + sorted(present - set(STAGES))


def number(value: float | None) -> str:
    """Scores as the CLI prints them (three decimals), so the two can be compared."""
    return "-" if value is None else f"{value:.3f}"


def when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


def validity(rec: MemoryRecord) -> str:
    start = rec.valid_from.strftime("%Y-%m-%d %H:%M") if rec.valid_from else "…"
    end = rec.valid_to.strftime("%Y-%m-%d %H:%M") if rec.valid_to else "now"
    return f"{start} → {end}"


# -- scopes ------------------------------------------------------------------------------------

@dataclass
class ScopeRow:
    id: str
    memories: int = 0
    last: datetime | None = None
    users: set[str] = field(default_factory=set)

    def seen(self, at: datetime, user_id: str | None) -> None:
        self.last = at if self.last is None or at > self.last else self.last
        if user_id is not None:
            self.users.add(user_id)


@dataclass
class ScopeSummary:
    users: list[ScopeRow]
    agents: list[ScopeRow]
    sessions: list[ScopeRow]
    scanned: int
    complete: bool


def summarise(records: Iterable[MemoryRecord], sessions: Iterable[Session], *, scanned: int,
              complete: bool) -> ScopeSummary:
    """Users, agents and sessions with their memory counts and last activity (the latest
    update of a memory or session of theirs), most recent first."""
    rows: dict[str, dict[str, ScopeRow]] = {"user_id": {}, "agent_id": {}, "session_id": {}}
    for rec in records:
        for name, value in rec.scope.as_dict().items():
            if value is not None:
                row = rows[name].setdefault(value, ScopeRow(value))
                row.memories += 1
                row.seen(rec.updated_at, rec.scope.user_id)
    for s in sessions:
        for name, value in s.scope.as_dict().items():
            if value is not None:
                rows[name].setdefault(value, ScopeRow(value)).seen(s.updated_at, s.scope.user_id)

    def ordered(found: dict[str, ScopeRow]) -> list[ScopeRow]:
        return sorted(found.values(), key=lambda r: (r.last is None, -(r.last.timestamp() if r.last else 0),
                                                     r.id))

    return ScopeSummary(users=ordered(rows["user_id"]), agents=ordered(rows["agent_id"]),
                        sessions=ordered(rows["session_id"]), scanned=scanned, complete=complete)


def scopes(mem: Memory) -> ScopeSummary:
    records: list[MemoryRecord] = []
    cursor = None
    while len(records) < SCAN_LIMIT:
        page = mem.list(cursor=cursor, limit=PAGE)
        records += page.items
        cursor = page.next_cursor
        if cursor is None:
            break
    return summarise(records, mem.sessions(limit=PAGE), scanned=len(records), complete=cursor is None)


# -- a memory's history chain ------------------------------------------------------------------

@dataclass
class Version:
    """One memory of a supersede chain, with its own events (ADD, UPDATE, MERGE, SUPERSEDE...)."""

    id: str
    record: MemoryRecord | None  # None: deleted or erased (its history is all that is left)
    events: list[Event]
    current: bool                # the memory the page is about


def _predecessors(mem: Memory, rec: MemoryRecord) -> list[MemoryRecord]:
    """The memories `rec` superseded: they held until it began, so they are visible `as_of` an
    instant before its start, closed with `superseded_by` = its id."""
    if rec.valid_from is None:
        return []
    before = rec.valid_from - timedelta(microseconds=1)
    found: list[MemoryRecord] = []
    cursor = None
    for _ in range(SCAN_LIMIT // PAGE):
        # the same owner (a correction may come in another session of theirs)
        page = mem.list(user_id=rec.scope.user_id, agent_id=rec.scope.agent_id, kinds=[rec.kind],
                        as_of=before, cursor=cursor, limit=PAGE)
        found += [r for r in page.items if r.superseded_by == rec.id]
        cursor = page.next_cursor
        if cursor is None:
            break
    return found


def chain(mem: Memory, id: str, scope: Mapping[str, Any]) -> list[Version]:
    """The versions of a fact, oldest first: what it superseded (back along `superseded_by`),
    itself, and what superseded it, each with its events. A deleted or erased memory is shown
    by its history alone."""
    try:
        rec: MemoryRecord | None = mem.get(id, **scope)
    except NotFound:
        rec = None
    events = mem.history(id, **scope)  # NotFound when the id is not this tenant's, in this scope
    here = Version(id, rec, events, current=True)
    if rec is None:
        return [here]
    older: list[Version] = []
    frontier = [rec]
    while frontier and len(older) < CHAIN_LIMIT:
        step = [p for r in frontier for p in _predecessors(mem, r)]
        older = [Version(p.id, p, mem.history(p.id), current=False) for p in step] + older
        frontier = step
    newer: list[Version] = []
    nxt = rec.superseded_by
    while nxt is not None and len(newer) < CHAIN_LIMIT:
        try:
            succ: MemoryRecord | None = mem.get(nxt)
        except NotFound:
            succ = None
        newer.append(Version(nxt, succ, mem.history(nxt), current=False))
        nxt = succ.superseded_by if succ is not None else None
    return [*older, here, *newer]


def change(event: Event) -> list[tuple[str, str, str]]:
    """(field, before, after) of what an event changed, for the fields a reader cares about."""
    if event.before is None or event.after is None:
        return []
    out = []
    for name in ("text", "importance", "valid_from", "valid_to", "superseded_by", "metadata",
                 "expires_at"):
        a, b = event.before.get(name), event.after.get(name)
        if a != b:
            out.append((name, _show(a), _show(b)))
    return out


def _show(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# -- timeline ----------------------------------------------------------------------------------

@dataclass
class SessionEpisodes:
    session_id: str | None
    episodes: list[MemoryRecord]
    first: datetime | None
    last: datetime | None
    session: Session | None = None


def timeline(records: Iterable[MemoryRecord], sessions: Iterable[Session]) -> list[SessionEpisodes]:
    """Episodes grouped by session, each group oldest first, the latest session first."""
    groups: dict[str | None, list[MemoryRecord]] = {}
    for rec in records:
        groups.setdefault(rec.scope.session_id, []).append(rec)
    known = {s.scope.session_id: s for s in sessions}
    out = []
    for sid, episodes in groups.items():
        episodes.sort(key=lambda r: (r.observed_at or r.created_at, r.id))
        times = [r.observed_at or r.created_at for r in episodes]
        out.append(SessionEpisodes(sid, episodes, times[0], times[-1], known.get(sid)))
    return sorted(out, key=lambda g: g.last.timestamp() if g.last else 0, reverse=True)


def episodes(mem: Memory, scope: Mapping[str, Any]) -> tuple[list[MemoryRecord], bool]:
    found: list[MemoryRecord] = []
    cursor = None
    while len(found) < SCAN_LIMIT:
        page = mem.list(**scope, kinds=[Kind.EPISODIC], cursor=cursor, limit=PAGE)
        found += page.items
        cursor = page.next_cursor
        if cursor is None:
            break
    return found, cursor is None


# -- filters from the memories page's form -----------------------------------------------------

TIME_FIELDS = ("created_at", "observed_at", "valid_from")


def filters(metadata: str | None, time_field: str | None, start: str | None,
            end: str | None) -> dict[str, Any] | None:
    """The `filters` of `Memory.list` from the form: a metadata JSON object, and a time range
    on one of the record's times (validated by the core: InvalidFilter names what is wrong)."""
    out: dict[str, Any] = {}
    if metadata:
        try:
            parsed = json.loads(metadata)
        except json.JSONDecodeError as exc:
            raise InvalidFilter(f"the metadata filter is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise InvalidFilter('the metadata filter must be a JSON object, e.g. {"topic": "food"}')
        out.update(parsed)
    field_name = time_field or "created_at"
    if field_name not in TIME_FIELDS:
        raise InvalidInput(f"the time field must be one of {list(TIME_FIELDS)}")
    bounds = {op: value for op, value in (("gte", start), ("lt", end)) if value}
    if bounds:
        out[field_name] = bounds
    return out or None


# -- the entity graph: a neighbourhood, drawn --------------------------------------------------

GRAPH_SIZE = 640   # the drawing's width and height, SVG user units
MAX_NODES = 60     # a neighbourhood, not a hairball: the nearest rings are kept


@dataclass
class Node:
    id: str
    name: str
    type: str
    ring: int
    x: float = 0.0
    y: float = 0.0


@dataclass
class Edge:
    id: str
    subject: str        # names, as the wire format gives them
    predicate: str
    object: str
    valid_from: str | None
    valid_to: str | None
    drawn: bool         # both ends are entities in the drawing (a literal value is not)
    x1: float = 0.0
    y1: float = 0.0
    x2: float = 0.0
    y2: float = 0.0


@dataclass
class Drawing:
    nodes: list[Node]
    edges: list[Edge]
    truncated: bool


def layout(subgraph: Mapping[str, Any], center: str) -> Drawing:
    """Place a neighbourhood (`Subgraph.to_dict()`: the REST shape) on rings around the entity
    named `center`: ring n holds the entities n hops away, spread evenly around it."""
    entities = {e["id"]: e for e in subgraph.get("entities", [])}
    relations = list(subgraph.get("relations", []))
    by_name = {str(e["name"]).casefold(): i for i, e in entities.items()}

    def end(rel: Mapping[str, Any], side: str) -> str | None:
        found = rel.get(f"{side}_id")
        if found in entities:
            return str(found)
        return by_name.get(str(rel.get(side, "")).casefold())

    root = by_name.get(center.casefold()) or next(iter(entities), None)
    ring: dict[str, int] = {}
    if root is not None:
        ring[root] = 0
        frontier = [root]
        while frontier:
            step = []
            for here in frontier:
                for rel in relations:
                    a, b = end(rel, "subject"), end(rel, "object")
                    for src, dst in ((a, b), (b, a)):
                        if src == here and dst is not None and dst not in ring:
                            ring[dst] = ring[here] + 1
                            step.append(dst)
            frontier = step
    for i in entities:  # entities the relations do not reach still belong to the neighbourhood
        ring.setdefault(i, max(ring.values(), default=0) + 1)
    kept = sorted(ring, key=lambda i: (ring[i], str(entities[i]["name"]).casefold()))[:MAX_NODES]
    nodes = {i: Node(i, str(entities[i]["name"]), str(entities[i].get("type", "")), ring[i]) for i in kept}
    _place(list(nodes.values()))
    edges = []
    for rel in relations:
        a, b = end(rel, "subject"), end(rel, "object")
        edge = Edge(str(rel.get("id", "")), str(rel.get("subject", "")), str(rel.get("predicate", "")),
                    str(rel.get("object", "")), rel.get("valid_from"), rel.get("valid_to"),
                    drawn=a in nodes and b in nodes)
        if edge.drawn:
            assert a is not None and b is not None
            edge.x1, edge.y1, edge.x2, edge.y2 = nodes[a].x, nodes[a].y, nodes[b].x, nodes[b].y
        edges.append(edge)
    return Drawing(list(nodes.values()), edges, truncated=len(ring) > len(kept))


def _place(nodes: list[Node]) -> None:
    half = GRAPH_SIZE / 2
    rings = max((n.ring for n in nodes), default=0)
    step = (half - 70) / rings if rings else 0.0
    for r in range(rings + 1):
        members = [n for n in nodes if n.ring == r]
        for k, n in enumerate(members):
            angle = 2 * math.pi * k / max(len(members), 1) + r * 0.5 - math.pi / 2
            n.x = round(half + step * r * math.cos(angle), 1)
            n.y = round(half + step * r * math.sin(angle), 1)

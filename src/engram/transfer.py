"""Export and import: a scope as JSON lines (a header, then one memory with its history a line).

Import is all or nothing: the whole file is read and validated before anything is written, and
the memories are re-indexed with this engine's embedder.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import validate as valid
from .errors import EngramError, InvalidImport
from .model import Event, EventType, Kind, MemoryRecord, Scope, utcnow
from .pipeline import extract as extraction
from .pipeline.engine import Engine
from .pipeline.index import Keys, index
from .pipeline.text import content_hash
from .redact import redact, redact_value

log = logging.getLogger("engram.memory")

EXPORT_FORMAT = "engram-export"
EXPORT_VERSION = 1
INDEX_BATCH = 256  # memories embedded per call on import


def export(engine: Engine, path: Path, scope: Scope) -> int:
    """Write every memory of `scope` (deleted and superseded too, with history); returns how
    many. Written to a temporary name first: a half-written export never has the real name."""
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    # 0600: an export holds every memory of the scope; only its owner may read it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT keeps the mode of a file left by an earlier attempt
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps({"format": EXPORT_FORMAT, "version": EXPORT_VERSION,
                            "exported_at": utcnow().isoformat(), "scope": scope.as_dict()}) + "\n")
        for rec, events in engine.store.iter_export(scope):
            f.write(json.dumps({"memory": rec.to_dict(), "events": [e.to_dict() for e in events]},
                               ensure_ascii=False) + "\n")
            count += 1
    tmp.replace(path)
    return count


def import_(engine: Engine, path: Path, progress: Callable[[int, int], None] | None = None) -> int:
    """Read an export back; memories whose id exists are skipped. Returns how many were new."""
    items = [redacted(rec, events, engine.config.redact)
             for rec, events in read(path, engine.config.max_text_chars)]
    existing = engine.store.get([rec.id for rec, _ in items])
    todo = [(rec, events) for rec, events in items if rec.id not in existing]
    keys: dict[str, Keys] = {}
    history: dict[Scope, list[MemoryRecord]] = {}
    for i in range(0, len(todo), INDEX_BATCH):
        keys.update(index(engine, [rec for rec, _ in todo[i:i + INDEX_BATCH]], history))
        if progress:
            progress(min(i + INDEX_BATCH, len(todo)), len(todo))
    with engine.store.write() as tx:
        for rec, events in todo:
            tx.insert(rec, *keys[rec.id])
            if rec.deleted_at is not None:
                tx.soft_delete([rec.id], rec.deleted_at)
            for ev in events:
                tx.append(ev)
    log.info("imported %d memories from %s (%d already present)",
             len(todo), path, len(items) - len(todo))
    return len(todo)


def redacted(rec: MemoryRecord, events: list[Event],
             policy: str) -> tuple[MemoryRecord, list[Event]]:
    """A memory and its history as this engine would have stored them (ENGRAM_REDACT): an
    export made with redaction off, or a weaker policy, is redacted on the way in (text and
    metadata, also in the events' snapshots and reasons). Idempotent: an export of this engine
    comes back unchanged."""
    text = redact(rec.text, policy).text
    meta = redact_value(rec.metadata, policy)
    if text != rec.text or meta != rec.metadata:
        rec = replace(rec, text=text, metadata=meta, content_hash=content_hash(text))

    def snapshot(d: dict[str, Any] | None) -> dict[str, Any] | None:
        if not isinstance(d, dict):
            return d
        out = dict(d)
        if isinstance(out.get("text"), str):
            out["text"] = redact(out["text"], policy).text
        if "metadata" in out:
            out["metadata"] = redact_value(out["metadata"], policy)
        return out

    return rec, [replace(e, before=snapshot(e.before), after=snapshot(e.after),
                         reason=None if e.reason is None else redact(e.reason, policy).text)
                 for e in events]


MAX_HEADER_BYTES = 64 * 1024  # a header is a few hundred bytes: read no more to check one
# Ids an import may bring: what engram makes (uuid7 strings) and other tools' plain ids; never
# a "/" or a space, which a route or a shell could not name.
IMPORT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,255}")


def read(path: Path, max_text_chars: int = 32_000) -> list[tuple[MemoryRecord, list[Event]]]:
    """Every memory line of an export, validated as `add` validates its input (InvalidImport
    names the bad line, never the file's path: the CLI adds it, and a service must not show
    its temporary paths). The header is checked before anything else is read."""
    try:
        with path.open("rb") as f:
            first = f.readline(MAX_HEADER_BYTES + 1)
            _header(first)
            out: list[tuple[MemoryRecord, list[Event]]] = []
            seen: set[str] = set()
            events_seen: set[str] = set()
            for n, raw in enumerate(f, start=2):
                if not raw.strip():
                    continue
                try:
                    item = json.loads(raw.decode("utf-8"))
                    if not isinstance(item, dict) or not isinstance(item.get("memory"), dict):
                        raise ValueError("a line is {\"memory\": {...}, \"events\": [...]}")
                    rec = _record(item["memory"], max_text_chars)
                    events = item.get("events", [])
                    if not isinstance(events, list):
                        raise ValueError("events must be a list")
                    history = [_event(e, rec) for e in events]
                except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
                        RecursionError, EngramError) as exc:
                    raise InvalidImport(f"line {n}: not a valid memory line ({exc})") from None
                if rec.id in seen:
                    raise InvalidImport(f"line {n}: memory id {rec.id!r} appears twice")
                for ev in history:
                    if ev.id in events_seen:
                        raise InvalidImport(f"line {n}: event id {ev.id!r} appears twice")
                    events_seen.add(ev.id)
                seen.add(rec.id)
                out.append((rec, history))
    except OSError as exc:
        raise InvalidImport(f"cannot read the file: {exc.strerror or exc}") from None
    return out


def _header(first: bytes) -> None:
    header = None
    if len(first) <= MAX_HEADER_BYTES:
        try:
            header = json.loads(first.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            header = None
    if not isinstance(header, dict) or header.get("format") != EXPORT_FORMAT:
        raise InvalidImport("not an engram export (bad or missing header)")
    if header.get("version") != EXPORT_VERSION:
        raise InvalidImport(f"export version {header.get('version')!r}; "
                            f"this engram reads version {EXPORT_VERSION}")


def _id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not IMPORT_ID.fullmatch(value):
        raise ValueError(f"{what} must be 1-256 characters of letters, digits and _.:@+- "
                         f"(no '/' or spaces), not {value!r:.80}")
    return value


def _optional_str(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, not {type(value).__name__}")
    return valid.utf8(value, what)


def _record(d: dict[str, Any], max_text_chars: int) -> MemoryRecord:
    times = {k: valid.moment(d.get(k), k) for k in ("created_at", "updated_at", "observed_at",
                                                     "valid_from", "valid_to", "last_accessed_at",
                                                     "expires_at", "deleted_at")}
    created, updated = times.pop("created_at"), times.pop("updated_at")
    if created is None or updated is None:
        raise ValueError("created_at and updated_at are required")
    text = valid.text(d["text"], max_text_chars)
    s = d["scope"]
    if not isinstance(s, dict):
        raise ValueError("scope must be an object")
    kind = Kind(d["kind"])
    role = None if d.get("role") is None else valid.message_role(d["role"])
    name = _optional_str(d.get("name"), "name")
    metadata = valid.metadata(d.get("metadata"))
    provenance = d.get("provenance", [])
    if not isinstance(provenance, list) or len(provenance) > valid.MAX_LIMIT:
        raise ValueError("provenance must be a list of ids")
    count = d.get("access_count", 0)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= valid.INT_MAX:
        raise ValueError("access_count must be a non-negative 64-bit integer")
    superseded = d.get("superseded_by")
    if d.get("importance") is None:
        raise ValueError("importance must be a number in [0, 1]")
    # a rule or a pin is trusted as an add's would be (see `extract.check_direct`)
    extraction.check_direct(text, frozenset({role or "user"}), kind, metadata)
    return MemoryRecord(
        id=_id(d["id"], "id"), scope=valid.scope(s.get("user_id"), s.get("agent_id"), s.get("session_id")),
        kind=kind, text=text, metadata=metadata,
        importance=valid.importance(d.get("importance")), role=role, name=name,
        provenance=tuple(_id(p, "a provenance id") for p in provenance),
        superseded_by=None if superseded is None else _id(superseded, "superseded_by"),
        access_count=count, content_hash=content_hash(text), created_at=created, updated_at=updated,
        **times,
    )


def _event(d: Any, rec: MemoryRecord) -> Event:
    """One event of `rec`'s history: an import brings history only for the memories it brings,
    never for one already stored (or another line's)."""
    if not isinstance(d, dict):
        raise ValueError("an event must be an object")
    if d.get("memory_id") != rec.id:
        raise ValueError(f"an event about {d.get('memory_id')!r} is in the line of {rec.id!r}: "
                         "a line holds the history of its own memory only")
    s = d.get("scope") or {}
    if not isinstance(s, dict):
        raise ValueError("an event's scope must be an object")
    scope = valid.scope(s.get("user_id"), s.get("agent_id"), s.get("session_id"))
    if scope != rec.scope:
        raise ValueError("an event's scope must be its memory's")
    at = valid.moment(d["at"], "at")
    if at is None:
        raise ValueError("an event needs its time 'at'")
    snapshots = {k: d.get(k) for k in ("before", "after")}
    for k, v in snapshots.items():
        if v is not None:
            if not isinstance(v, dict):
                raise ValueError(f"an event's {k!r} must be an object or null")
            valid.metadata(v)  # JSON a database takes: depth, 64-bit integers, no NUL
    return Event(id=_id(d["id"], "an event id"), memory_id=rec.id, type=EventType(d["type"]), at=at,
                 scope=scope, before=snapshots["before"], after=snapshots["after"],
                 reason=_optional_str(d.get("reason"), "reason"))

"""Export and import: a scope as JSON lines (a header, then one memory with its history a line).

Import is all or nothing: the whole file is read and validated before anything is written, and
the memories are re-indexed with this engine's embedder.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import validate as valid
from .errors import EngramError, InvalidImport
from .model import Event, EventType, Kind, MemoryRecord, Scope, utcnow
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
    with tmp.open("w", encoding="utf-8") as f:
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
    items = [redacted(rec, events, engine.config.redact) for rec, events in read(path)]
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


def read(path: Path) -> list[tuple[MemoryRecord, list[Event]]]:
    """Every memory line of an export, validated (InvalidImport names the bad line)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidImport(f"cannot read {path}: {exc}") from exc
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != EXPORT_FORMAT:
        raise InvalidImport(f"{path} is not an engram export (bad or missing header)")
    if header.get("version") != EXPORT_VERSION:
        raise InvalidImport(f"{path} has export version {header.get('version')!r}; "
                            f"this engram reads version {EXPORT_VERSION}")
    out = []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            out.append((_record(item["memory"]), [_event(e) for e in item.get("events", [])]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, EngramError) as exc:
            raise InvalidImport(f"{path}:{n}: not a valid memory line ({exc})") from exc
    return out


def _record(d: dict[str, Any]) -> MemoryRecord:
    times = {k: valid.moment(d.get(k), k) for k in ("created_at", "updated_at", "observed_at",
                                                     "valid_from", "valid_to", "last_accessed_at",
                                                     "expires_at", "deleted_at")}
    created, updated = times.pop("created_at"), times.pop("updated_at")
    if created is None or updated is None:
        raise ValueError("created_at and updated_at are required")
    text = d["text"]
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text must be a non-empty string")
    s = d["scope"]
    return MemoryRecord(
        id=valid.ident(d["id"]), scope=valid.scope(s.get("user_id"), s.get("agent_id"), s.get("session_id")),
        kind=Kind(d["kind"]), text=text, metadata=valid.metadata(d.get("metadata")),
        importance=valid.importance(d.get("importance")), role=d.get("role"), name=d.get("name"),
        provenance=tuple(str(p) for p in d.get("provenance", [])),
        superseded_by=d.get("superseded_by"), access_count=int(d.get("access_count", 0)),
        content_hash=content_hash(text), created_at=created, updated_at=updated, **times,
    )


def _event(d: dict[str, Any]) -> Event:
    s = d.get("scope") or {}
    at = valid.moment(d["at"], "at")
    if at is None:
        raise ValueError("an event needs its time 'at'")
    return Event(id=valid.ident(d["id"]), memory_id=d.get("memory_id"), type=EventType(d["type"]), at=at,
                 scope=valid.scope(s.get("user_id"), s.get("agent_id"), s.get("session_id")),
                 before=d.get("before"), after=d.get("after"), reason=d.get("reason"))

"""Export and import: everything a scope owns as JSON lines — a header, then its memories (each
with its history), its sessions, and its owner's knowledge graph (entities, relations with
their history, mentions, the records of deleted entities). docs/export.md has the format.

Import is all or nothing: the whole file is read and validated before anything is written; the
memories are re-indexed and the entity names re-embedded with this engine's embedder. An export
of version 1 (memories only) still imports.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import validate as valid
from .errors import EngramError, InvalidImport
from .graph import entities as graph_entities
from .graph import rules as g
from .model import (
    Entity,
    Event,
    EventType,
    Kind,
    MemoryRecord,
    Mention,
    Relation,
    Scope,
    Session,
    utcnow,
)
from .pipeline import extract as extraction
from .pipeline.engine import Engine
from .pipeline.fence import Fence
from .pipeline.index import Keys, index
from .pipeline.text import content_hash
from .redact import redact, redact_value
from .store import Store
from .store.base import EntitySelect, RelationSelect, Tx

log = logging.getLogger("engram.memory")

EXPORT_FORMAT = "engram-export"
EXPORT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: memories and their history only
INDEX_BATCH = 256  # memories embedded per call on import
EVERYTHING = 2**62  # "no limit" for the store's bounded reads
SUMMARY_BY = frozenset({"", "rules", "llm", "caller"})


@dataclass
class Contents:
    """What an export holds, each part in the order it was written."""

    memories: list[tuple[MemoryRecord, list[Event]]] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    entities: list[Entity] = field(default_factory=list)
    relations: list[tuple[Relation, list[Event]]] = field(default_factory=list)
    mentions: list[Mention] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)  # of entities deleted before the export


# -- export --------------------------------------------------------------------------------------

def export(engine: Engine, path: Path, scope: Scope) -> int:
    """Write everything `scope` owns (deleted and superseded memories too, with history);
    returns how many memories. The knowledge graph belongs to an owner (user, agent), not to
    a conversation: an export of one session carries its memories and its session only.
    Written to a temporary name first: a half-written export never has the real name."""
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    # 0600: an export holds every memory of the scope; only its owner may read it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT keeps the mode of a file left by an earlier attempt
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps({"format": EXPORT_FORMAT, "version": EXPORT_VERSION,
                            "exported_at": utcnow().isoformat(), "scope": scope.as_dict()}) + "\n")
        ids: set[str] = set()
        for rec, events in engine.store.iter_export(scope):
            f.write(json.dumps({"memory": rec.to_dict(), "events": [e.to_dict() for e in events]},
                               ensure_ascii=False) + "\n")
            ids.add(rec.id)
            count += 1
        for line in owned(engine.store, scope, ids):
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return count


def owned(store: Store, scope: Scope, episodes: set[str]) -> Iterator[dict[str, Any]]:
    """The export lines after the memories (`episodes`: their ids): sessions, then (for an
    owner) the graph. The reads are not one snapshot, so while others write, a relation or a
    mention may be newer than the entities read before it: those are left out (they happened
    after the export), and the file always imports."""
    sessions = store.read_sessions(scope, exact=False, limit=EVERYTHING)
    for s in sorted(sessions, key=lambda s: (s.created_at, *map(str, s.scope.as_dict().values()))):
        yield {"session": s.to_dict()}
    if scope.session_id is not None:
        return
    owner = Scope(scope.user_id, scope.agent_id)
    found = store.read_entities(EntitySelect(owner))
    for e in found:
        yield {"entity": e.to_dict()}
    live = {e.id for e in found}
    for r in store.read_relations(RelationSelect(owner, seen="all")):
        if r.subject in live and (r.object is None or r.object in live):
            yield {"relation": relation_dict(r),
                   "events": [e.to_dict() for e in store.events(r.id)]}
    mentions = [m for m in store.read_mentions(owner)
                if m.entity_id in live and m.episode_id in episodes]
    for m in sorted(mentions, key=lambda m: (m.episode_id, m.entity_id)):
        yield {"mention": {"episode_id": m.episode_id, "entity_id": m.entity_id,
                           "scope": m.scope.as_dict(),
                           "at": None if m.at is None else m.at.isoformat()}}
    gone = [e for e in store.events_of(EventType.DELETE.value, owner, limit=EVERYTHING)
            if e.reason == graph_entities.DELETED and e.memory_id not in live]
    for ev in sorted(gone, key=lambda e: (e.at, e.id)):
        yield {"event": ev.to_dict()}


def relation_dict(r: Relation) -> dict[str, Any]:
    """A relation as stored (ends by id), not as shown (`Relation.to_dict` names the ends)."""
    t = _iso
    return {"id": r.id, "scope": r.scope.as_dict(), "subject_id": r.subject,
            "predicate": r.predicate, "object_id": r.object, "value": r.value, "fact": r.fact,
            "valid_from": t(r.valid_from), "valid_to": t(r.valid_to),
            "created_at": t(r.created_at), "expired_at": t(r.expired_at),
            "provenance": list(r.provenance), "confidence": r.confidence,
            "metadata": r.metadata}


def _iso(value: Any) -> str | None:
    return None if value is None else value.isoformat()


# -- import --------------------------------------------------------------------------------------

def import_(engine: Engine, path: Path, progress: Callable[[int, int], None] | None = None) -> int:
    """Read an export back; records whose id exists are skipped (sessions: whose scope has a
    session). Returns how many memories were new. An entity whose name its owner has already
    (another id) is that entity: the imported relations and mentions attach to it."""
    contents = read(path, engine.config.max_text_chars)
    policy = engine.config.redact
    items = [redacted(rec, events, policy) for rec, events in contents.memories]
    store = engine.store
    fence = Fence.take(store, Scope())  # before anything is read
    existing = store.get([rec.id for rec, _ in items])
    todo = [(rec, events) for rec, events in items if rec.id not in existing]
    keys: dict[str, Keys] = {}
    history: dict[Scope, list[MemoryRecord]] = {}
    for i in range(0, len(todo), INDEX_BATCH):
        keys.update(index(engine, [rec for rec, _ in todo[i:i + INDEX_BATCH]], history))
        if progress:
            progress(min(i + INDEX_BATCH, len(todo)), len(todo))
    entities = [_redacted_entity(e, policy) for e in contents.entities]
    known = {e.id for e in store.read_entities(EntitySelect(ids=tuple(e.id for e in entities)))} \
        if entities else set()
    new_entities = [e for e in entities if e.id not in known]
    names = [e.name for e in new_entities]
    vectors = np.asarray(engine.embedder.embed_batch(names)) if names else np.zeros((0, 0))
    with store.write() as tx:
        # a scope erased while the import embedded is not brought back by it: Erased
        fence.hold_all(tx, {*(rec.scope for rec, _ in items), *(s.scope for s in contents.sessions),
                            *(e.scope for e in contents.entities)})
        for rec, events in todo:
            tx.insert(rec, *keys[rec.id])
            if rec.deleted_at is not None:
                tx.soft_delete([rec.id], rec.deleted_at)
            for ev in events:
                tx.append(ev)
        restore(store, tx, contents, new_entities, vectors, policy)
    log.info("imported %d memories from %s (%d already present), %d entities, %d relations",
             len(todo), path, len(items) - len(todo), len(new_entities), len(contents.relations))
    return len(todo)


def restore(store: Store, tx: Tx, contents: Contents, new_entities: list[Entity],
            vectors: np.ndarray, policy: str) -> None:
    """Inside the import's write: sessions, entities (under their claim keys, as `create`
    inserts them), relations with their history, mentions, deletion records."""
    for s in contents.sessions:
        if store.session(s.scope) is None:
            tx.put_session(_redacted_session(s, policy))
    same: dict[str, str] = {}  # an imported entity id -> the id its owner knows it by
    for e, vector in zip(new_entities, vectors, strict=True):
        for key in g.claim_keys(e.name, e.type):
            holder = tx.add_entity(e, g.name_keys(e.name, e.aliases), key, vector)
            if holder == e.id:
                break
            held = store.read_entities(EntitySelect(ids=(holder,)))[0]
            if g.compatible(held.type, e.type):
                same[e.id] = holder
                break
        else:
            raise InvalidImport(f"entity {e.id!r}: its owner has entities of another type "
                                f"under both of its names")
    relations = [r for r, _ in contents.relations]
    present = {r.id for r in store.read_relations(
        RelationSelect(ids=tuple(r.id for r in relations), seen="all"))} if relations else set()
    for rel, events in contents.relations:
        if rel.id in present:
            continue
        obj = None if rel.object is None else same.get(rel.object, rel.object)
        tx.put_relation(replace(rel, subject=same.get(rel.subject, rel.subject), object=obj,
                                fact=redact(rel.fact, policy).text,
                                metadata=redact_value(rel.metadata, policy)))
        for ev in events:
            tx.append(ev)
    tx.put_mentions([replace(m, entity_id=same.get(m.entity_id, m.entity_id))
                     for m in contents.mentions])
    for ev in contents.events:
        if ev.memory_id is None or not any(e.id == ev.id for e in store.events(ev.memory_id)):
            tx.append(ev)


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


def _redacted_session(s: Session, policy: str) -> Session:
    return replace(s, summary=redact(s.summary, policy).text,
                   state=redact_value(s.state, policy), metadata=redact_value(s.metadata, policy))


def _redacted_entity(e: Entity, policy: str) -> Entity:
    # names and aliases are how the graph finds an entity: they stay as they are
    return replace(e, summary=redact(e.summary, policy).text,
                   attributes=redact_value(e.attributes, policy))


# -- reading and checking a file -----------------------------------------------------------------

MAX_HEADER_BYTES = 64 * 1024  # a header is a few hundred bytes: read no more to check one
# Ids an import may bring: what engram makes (uuid7 strings) and other tools' plain ids; never
# a "/" or a space, which a route or a shell could not name.
IMPORT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,255}")
KINDS = ("memory", "session", "entity", "relation", "mention", "event")


def read(path: Path, max_text_chars: int = 32_000) -> Contents:
    """Every line of an export, validated as `add` validates its input (InvalidImport names
    the bad line, never the file's path: the CLI adds it, and a service must not show its
    temporary paths). The header is checked before anything else is read; then that every id
    is unique and every relation and mention names an entity of the file."""
    out = Contents()
    try:
        with path.open("rb") as f:
            version = _header(f.readline(MAX_HEADER_BYTES + 1))
            seen: set[tuple[str, str]] = set()
            for n, raw in enumerate(f, start=2):
                if not raw.strip():
                    continue
                try:
                    item = json.loads(raw.decode("utf-8"))
                    kind = _kind(item, version)
                    _line(out, kind, item, max_text_chars)
                except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
                        RecursionError, EngramError) as exc:
                    raise InvalidImport(f"line {n}: not a valid export line ({exc})") from None
                for what, ident in _ids(out, kind):
                    if (what, ident) in seen:
                        raise InvalidImport(f"line {n}: {what} id {ident!r} appears twice")
                    seen.add((what, ident))
    except OSError as exc:
        raise InvalidImport(f"cannot read the file: {exc.strerror or exc}") from None
    _linked(out)
    return out


def _kind(item: Any, version: int) -> str:
    if not isinstance(item, dict):
        raise ValueError("a line is a JSON object")
    kinds = [k for k in KINDS if isinstance(item.get(k), dict)]
    if len(kinds) != 1 or (version == 1 and kinds != ["memory"]):
        allowed = "memory" if version == 1 else ", ".join(KINDS)
        raise ValueError(f"a line holds one of: {allowed} (an object)")
    return kinds[0]


def _line(out: Contents, kind: str, item: dict[str, Any], max_text_chars: int) -> None:
    if kind == "memory":
        rec = _record(item["memory"], max_text_chars)
        out.memories.append((rec, _events(item, rec.id, rec.scope)))
    elif kind == "session":
        out.sessions.append(_session(item["session"]))
    elif kind == "entity":
        out.entities.append(_entity(item["entity"]))
    elif kind == "relation":
        rel = _relation(item["relation"])
        out.relations.append((rel, _events(item, rel.id, rel.scope)))
    elif kind == "mention":
        out.mentions.append(_mention(item["mention"]))
    else:
        ev = _event(item["event"], None, None)
        if ev.type is not EventType.DELETE:
            raise ValueError("an event line is the DELETE event of a deleted entity")
        out.events.append(ev)


def _ids(out: Contents, kind: str) -> list[tuple[str, str]]:
    """The ids the line just read brings (to refuse one brought twice)."""
    if kind == "memory":
        rec, events = out.memories[-1]
        return [("memory", rec.id), *(("event", e.id) for e in events)]
    if kind == "session":
        return [("session", json.dumps(out.sessions[-1].scope.as_dict()))]
    if kind == "entity":
        return [("entity", out.entities[-1].id)]
    if kind == "relation":
        rel, events = out.relations[-1]
        return [("relation", rel.id), *(("event", e.id) for e in events)]
    if kind == "mention":
        m = out.mentions[-1]
        return [("mention", f"{m.episode_id} {m.entity_id}")]
    return [("event", out.events[-1].id)]


def _linked(out: Contents) -> None:
    """Every relation end and mention names an entity of the file, of the same owner."""
    owners = {e.id: e.scope for e in out.entities}
    for rel, _ in out.relations:
        for end in (rel.subject, rel.object):
            if end is not None and owners.get(end) != rel.scope:
                raise InvalidImport(f"relation {rel.id!r} names entity {end!r}, which is not "
                                    "an entity of its owner in the file")
    for m in out.mentions:
        if owners.get(m.entity_id) != Scope(m.scope.user_id, m.scope.agent_id):
            raise InvalidImport(f"a mention names entity {m.entity_id!r}, which is not an "
                                "entity of its owner in the file")


def _header(first: bytes) -> int:
    header = None
    if len(first) <= MAX_HEADER_BYTES:
        try:
            header = json.loads(first.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            header = None
    if not isinstance(header, dict) or header.get("format") != EXPORT_FORMAT:
        raise InvalidImport("not an engram export (bad or missing header)")
    version = header.get("version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise InvalidImport(f"export version {version!r}; this engram reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}")
    return int(version)


def _id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not IMPORT_ID.fullmatch(value):
        raise ValueError(f"{what} must be 1-256 characters of letters, digits and _.:@+- "
                         f"(no '/' or spaces), not {value!r:.80}")
    return value


def _optional_id(value: Any, what: str) -> str | None:
    return None if value is None else _id(value, what)


def _optional_str(value: Any, what: str) -> str | None:
    if value is None:
        return None
    return _str(value, what)


def _str(value: Any, what: str, max_chars: int | None = None) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, not {type(value).__name__}")
    if max_chars is not None and len(value) > max_chars:
        raise ValueError(f"{what} has {len(value)} characters; at most {max_chars}")
    return valid.utf8(value, what)


def _ids_list(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > valid.MAX_LIMIT:
        raise ValueError(f"{what} must be a list of at most {valid.MAX_LIMIT} ids")
    return tuple(_id(p, f"an id of {what}") for p in value)


def _scope(s: Any, what: str = "scope") -> Scope:
    if not isinstance(s, dict):
        raise ValueError(f"{what} must be an object")
    return valid.scope(s.get("user_id"), s.get("agent_id"), s.get("session_id"))


def _owner(s: Any) -> Scope:
    scope = _scope(s)
    if scope.session_id is not None:
        raise ValueError("a graph record belongs to an owner (user_id, agent_id), not a session")
    return scope


def _times(d: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, Any]:
    times = {k: valid.moment(d.get(k), k) for k in (*required, *optional)}
    missing = [k for k in required if times[k] is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} required")
    return times


def _json_object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be an object")
    try:
        return valid.metadata(value)  # JSON a database takes: depth, 64-bit integers, no NUL
    except EngramError as exc:
        raise ValueError(str(exc).replace("metadata", what)) from None


def _record(d: dict[str, Any], max_text_chars: int) -> MemoryRecord:
    times = _times(d, ("created_at", "updated_at"),
                   ("observed_at", "valid_from", "valid_to", "last_accessed_at", "expires_at",
                    "deleted_at"))
    text = valid.text(d["text"], max_text_chars)
    kind = Kind(d["kind"])
    role = None if d.get("role") is None else valid.message_role(d["role"])
    name = _optional_str(d.get("name"), "name")
    metadata = valid.metadata(d.get("metadata"))
    count = d.get("access_count", 0)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= valid.INT_MAX:
        raise ValueError("access_count must be a non-negative 64-bit integer")
    if d.get("importance") is None:
        raise ValueError("importance must be a number in [0, 1]")
    # a rule or a pin is trusted as an add's would be (see `extract.check_direct`)
    extraction.check_direct(text, frozenset({role or "user"}), kind, metadata)
    return MemoryRecord(
        id=_id(d["id"], "id"), scope=_scope(d["scope"]), kind=kind, text=text,
        metadata=metadata, importance=valid.importance(d.get("importance")), role=role, name=name,
        provenance=_ids_list(d.get("provenance", []), "provenance"),
        superseded_by=_optional_id(d.get("superseded_by"), "superseded_by"),
        access_count=count, content_hash=content_hash(text), **times,
    )


def _events(item: dict[str, Any], owner_id: str, scope: Scope) -> list[Event]:
    events = item.get("events", [])
    if not isinstance(events, list):
        raise ValueError("events must be a list")
    return [_event(e, owner_id, scope) for e in events]


def _event(d: Any, owner_id: str | None, scope: Scope | None) -> Event:
    """One event of the history of `owner_id` (a memory or a relation): an import brings
    history only for the records it brings, never for one already stored (or another line's).
    Without `owner_id`: a deleted entity's record."""
    if not isinstance(d, dict):
        raise ValueError("an event must be an object")
    if owner_id is not None and d.get("memory_id") != owner_id:
        raise ValueError(f"an event about {d.get('memory_id')!r} is in the line of {owner_id!r}: "
                         "a line holds the history of its own record only")
    event_scope = _scope(d.get("scope") or {}, "an event's scope")
    if scope is not None and event_scope != scope:
        raise ValueError("an event's scope must be its record's")
    at = valid.moment(d["at"], "at")
    if at is None:
        raise ValueError("an event needs its time 'at'")
    snapshots = {k: d.get(k) for k in ("before", "after")}
    for k, v in snapshots.items():
        if v is not None:
            _json_object(v, f"an event's {k!r}")
    return Event(id=_id(d["id"], "an event id"),
                 memory_id=owner_id if owner_id is not None else _id(d.get("memory_id"), "memory_id"),
                 type=EventType(d["type"]), at=at, scope=event_scope,
                 before=snapshots["before"], after=snapshots["after"],
                 reason=_optional_str(d.get("reason"), "reason"))


def _session(d: dict[str, Any]) -> Session:
    scope = _scope(d["scope"])
    if scope.session_id is None:
        raise ValueError("a session's scope needs its session_id")
    times = _times(d, ("created_at", "updated_at"), ("ended_at",))
    return Session(scope=scope, policy=_json_object(d.get("policy"), "policy"),
                   summary=_str(d.get("summary", ""), "summary"),
                   summary_upto=_optional_id(d.get("summary_upto"), "summary_upto"),
                   state=_json_object(d.get("state", {}), "state"),
                   metadata=_json_object(d.get("metadata", {}), "metadata"), **times)


def _entity(d: dict[str, Any]) -> Entity:
    aliases = d.get("aliases", [])
    if not isinstance(aliases, list) or len(aliases) > valid.MAX_LIMIT:
        raise ValueError(f"aliases must be a list of at most {valid.MAX_LIMIT} names")
    by = d.get("summary_by", "")
    if by not in SUMMARY_BY:
        raise ValueError(f"summary_by must be one of {sorted(SUMMARY_BY)}")
    name = _str(d["name"], "name", 256)
    if not name.strip():
        raise ValueError("an entity's name is empty")
    return Entity(id=_id(d["id"], "id"), scope=_owner(d["scope"]), name=name,
                  type=_str(d["type"], "type", 64),
                  aliases=tuple(_str(a, "an alias", 256) for a in aliases),
                  summary=_str(d.get("summary", ""), "summary"), summary_by=by,
                  attributes=_json_object(d.get("attributes", {}), "attributes"),
                  provenance=_ids_list(d.get("provenance", []), "provenance"),
                  **_times(d, ("created_at", "updated_at"), ()))


def _relation(d: dict[str, Any]) -> Relation:
    confidence = d.get("confidence", 1.0)
    if isinstance(confidence, bool) or not isinstance(confidence, int | float) \
            or not 0 <= confidence <= 1:
        raise ValueError("confidence must be a number in [0, 1]")
    obj = _optional_id(d.get("object_id"), "object_id")
    value = _optional_str(d.get("value"), "value")
    if (obj is None) == (value is None):
        raise ValueError("a relation's object is an entity (object_id) or a value, one of them")
    predicate = _str(d["predicate"], "predicate", 128)
    if not predicate.strip():
        raise ValueError("a relation's predicate is empty")
    return Relation(id=_id(d["id"], "id"), scope=_owner(d["scope"]),
                    subject=_id(d["subject_id"], "subject_id"), predicate=predicate, object=obj,
                    value=value, fact=_str(d["fact"], "fact"),
                    provenance=_ids_list(d.get("provenance", []), "provenance"),
                    confidence=float(confidence),
                    metadata=_json_object(d.get("metadata", {}), "metadata"),
                    **_times(d, ("created_at",), ("valid_from", "valid_to", "expired_at")))


def _mention(d: dict[str, Any]) -> Mention:
    return Mention(episode_id=_id(d["episode_id"], "episode_id"),
                   entity_id=_id(d["entity_id"], "entity_id"), scope=_scope(d["scope"]),
                   at=valid.moment(d.get("at"), "at"))

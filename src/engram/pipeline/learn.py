"""The learn pipeline (with an LLM): episodes -> extracted facts -> consolidation plans -> apply.

Extraction and reflection are the two tasks of `extract.py`; the plans (ADD, UPDATE, MERGE,
NOOP, SUPERSEDE) come from `consolidate.py`. A late fact is fitted into its target's chain of
versions. With no LLM, or when it fails, nothing is lost: the episodes are stored anyway.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

import numpy as np

from .. import redact as redaction
from ..errors import InvalidInput, ProviderError
from ..graph import entities
from ..model import (
    AddResult,
    Event,
    EventType,
    Kind,
    MemoryRecord,
    Relation,
    Scope,
    event,
    new_id,
    utcnow,
)
from ..store import Query, Tx
from . import consolidate
from . import extract as extraction
from .engine import Engine
from .fence import Fence
from .index import Keys, index, speaker_text
from .read import ranked, visible
from .text import content_hash

log = logging.getLogger("engram.memory")

EXTRACT_BATCH = 20  # messages per extraction call
RELATED = 5  # existing memories a new fact is compared with
RELATED_POOL = 100  # candidates per retriever when looking them up (a scope's facts, not its turns)
MAX_CHAIN = 20  # versions walked back to fit a late fact into a fact's history
LLM_MAX_TOKENS = 1024  # bounds a reply (a small model in JSON mode can ramble until the context ends)
SUMMARY_MARK = "session_summary"  # metadata["engram"] of a session's end-of-session summary


@dataclass(frozen=True)
class Learned:
    """An extracted memory with its keys and the plan for it (and the keys of its new text
    when the plan rewrites the target's)."""

    record: MemoryRecord
    keys: Keys
    plan: consolidate.Plan
    retext: Keys | None = None
    chain: tuple[MemoryRecord, ...] = ()  # for SUPERSEDE: the target's versions, oldest first
    redacted: dict[str, int] = field(default_factory=dict)  # what redaction replaced, by type


def learn(engine: Engine, episodes: Sequence[MemoryRecord], scope: Scope, task: extraction.Task,
          now: datetime, notes: list[str],
          graph: list[entities.Staged] | None = None) -> list[Learned]:
    """Extract candidate memories from `episodes` and decide how each joins what is known.

    Runs outside any transaction (it calls the LLM). Failures never lose anything: the
    episodes are stored anyway, and `notes` records why nothing (or less) was learned.
    With `graph`, the entities and relations the same calls returned are resolved and
    appended to it, for `apply_graph` to write in the facts' transaction.
    """
    llm = engine.llm
    if llm is None:
        return []
    store = engine.store
    fact_scope = scope if scope.user_id is None and scope.agent_id is None \
        else Scope(scope.user_id, scope.agent_id, None)  # facts outlive the session
    recent = [r for r in store.recent_episodes(scope, 4)[::-1]
              if r.id not in {e.id for e in episodes}] if task.with_recent else []
    session = store.session(scope) if scope.session_id else None
    found: list[extraction.Candidate] = []
    drawn: list[tuple[extraction.Graph, Sequence[MemoryRecord]]] = []
    for i in range(0, len(episodes), EXTRACT_BATCH):
        chunk = episodes[i:i + EXTRACT_BATCH]
        try:
            reply = llm.complete(task.prompt(chunk, recent, session.summary if session else ""),
                                 extraction.Extraction, max_tokens=LLM_MAX_TOKENS)
        except ProviderError as exc:
            notes.append(f"{task.name} failed ({type(exc).__name__}: {exc}); messages kept as episodes")
            log.warning("%s failed for %d messages: %s", task.name, len(chunk), exc)
            continue
        assert reply.parsed is not None
        got = extraction.candidates(reply.parsed, chunk, recent)
        if len(got) < len(reply.parsed.facts):
            notes.append(f"{task.name}: left out {len(reply.parsed.facts) - len(got)} "
                         "fragments that were not sentences")
        found += got
        if graph is not None:
            drawn.append((extraction.graph(reply.parsed, chunk), chunk))
        recent = list(chunk[-4:])
    origin = {"extractor": f"{llm.name}:{llm.model}", "prompt": task.version}
    if graph is not None:
        graph += stage_graph(engine, scope, drawn, origin, notes)
    if not found:
        return []
    facts = []
    redacted: dict[str, dict[str, int]] = {}
    for c in found:
        # The model may echo a secret (from memories stored before redaction was on, or of its
        # own making): an extracted fact is redacted like a message, before anything else.
        done = redaction.redact(c.text, engine.config.redact)
        c = replace(c, text=done.text)
        kind, why = extraction.trust(c)
        if why != "ok":
            log.warning("not stored as a rule: %r (%s)", c.text[:80], why)
        facts.append(MemoryRecord(
            id=new_id(), scope=fact_scope, kind=kind, text=c.text,
            metadata={"origin": {**origin, "source": extraction.source_of(c.source_roles),
                                 **({"trust": why} if why != "ok" else {})}},
            importance=c.importance, created_at=now, updated_at=now, observed_at=c.valid_from,
            valid_from=c.valid_from, provenance=c.sources, content_hash=content_hash(c.text)))
        if done.counts:
            redacted[facts[-1].id] = done.counts
    return consider(engine, facts, index(engine, facts), now, notes, redacted)


def stage_graph(engine: Engine, scope: Scope,
                drawn: Sequence[tuple[extraction.Graph, Sequence[MemoryRecord]]],
                origin: Mapping[str, str], notes: list[str]) -> list[entities.Staged]:
    """The entities and relations of each extraction call, resolved against the owner's
    entities (model time: embeddings, the LLM for ambiguous names), outside any transaction.
    A name or value that redaction would change holds a secret: that item is left out (a
    secret is never an entity's name). What is left out is said in `notes`; a failure to
    resolve loses the graph of that call, never its facts or episodes."""
    out = []
    policy = engine.config.redact
    for found, chunk in drawn:
        dropped = list(found.dropped)

        def secret(*texts: str | None) -> bool:
            return any(redaction.redact(t, policy).counts for t in texts if t)

        names = []
        for e in found.entities:
            if secret(e.name, *e.aliases):
                dropped.append(f"entity: holds a secret ({e.type or 'entity'})")
            else:
                names.append((e.name, e.type, e.aliases))
        edges = []
        for r in found.relations:
            if secret(r.subject, r.object, r.value):
                dropped.append(f"relation {r.predicate!r}: holds a secret")
            else:
                edges.append((r.subject, r.predicate, r.object, r.value, r.valid_from, r.valid_to))
        if dropped:
            notes.append(f"graph: left out {len(dropped)} extracted items ("
                         + "; ".join(dropped[:3]) + ("; ..." if len(dropped) > 3 else "") + ")")
            log.info("graph items left out: %s", dropped)
        if not names and not edges:
            continue
        meta = {"origin": {**origin, "source": extraction.source_of(found.source_roles)}}
        try:
            out.append(entities.stage(engine, scope, names, edges, chunk, meta))
        except (ProviderError, InvalidInput) as exc:
            notes.append(f"graph: entities not resolved ({type(exc).__name__}: {exc}); "
                         "facts and messages kept")
            log.warning("graph staging failed: %s", exc)
    return out


def apply_graph(engine: Engine, tx: Tx, staged: Sequence[entities.Staged]) -> list[Relation]:
    """Inside the facts' transaction: write the staged entities, mentions and relations (an
    error rolls back the facts with them: nothing half-written)."""
    return [r for s in staged for r in entities.commit(engine, tx, s)]


def consider(engine: Engine, facts: Sequence[MemoryRecord], keys: dict[str, Keys],
             now: datetime, notes: list[str],
             redacted: Mapping[str, Mapping[str, int]] | None = None) -> list[Learned]:
    """How each fact (extracted, or given to `add` directly) joins what is known: the LLM's
    plan against the current facts it may repeat, refine or contradict. Runs outside any
    transaction (it calls the LLM); `learn.apply` writes the plans.

    The plan's new text and reason are the model's words: redacted like the facts.
    `redacted` (fact id -> counts by type) is what was redacted in each fact already; a plan's
    reason says all of it (the event's history line)."""
    near = [related(engine, f, keys[f.id][0][0].vector, now) for f in facts]
    chosen = plans(engine, list(facts), near, keys, notes)
    counts = []
    for n, (f, p) in enumerate(zip(facts, chosen, strict=True)):
        found: Counter[str] = Counter((redacted or {}).get(f.id, {}))
        text = None
        if p.text:
            done = redaction.redact(p.text, engine.config.redact)
            text = done.text
            found.update(done.counts)
        reason = redaction.redact(p.reason, engine.config.redact)
        found.update(reason.counts)
        counts.append(redaction.add_counts(found))
        chosen[n] = replace(p, text=text, reason=redaction.noted(reason.text, counts[-1]))
    texts = {p.fact: p.text for p in chosen if p.text and p.action in ("UPDATE", "MERGE")}
    retext = index(engine, [replace(facts[i], text=t) for i, t in texts.items()])
    return [Learned(f, keys[f.id], p, retext.get(f.id),
                    chain(engine, p.target, f, keys[f.id][0][0].vector, now)
                    if p.action == "SUPERSEDE" and p.target else (), c)
            for f, p, c in zip(facts, chosen, counts, strict=True)]


def chain(engine: Engine, current: MemoryRecord, new: MemoryRecord, vector: np.ndarray,
          now: datetime) -> tuple[MemoryRecord, ...]:
    """The versions of `current` back to the one that held when `new` starts (oldest
    first), for fitting a late fact into the timeline. Each step finds the predecessor
    among the related facts valid just before a version began."""
    versions = [current]
    start = new.valid_from or new.created_at
    while len(versions) < MAX_CHAIN and (versions[0].valid_from or versions[0].created_at) > start:
        since = versions[0].valid_from or versions[0].created_at
        q = Query(scope=current.scope, now=now, kinds=(current.kind,),
                  as_of=since - timedelta(microseconds=1))
        ids = [mid for mid, _, _ in ranked(engine, new.text, q, RELATED, vector, pool=RELATED_POOL)]
        before = next((r for r in engine.store.get(ids).values()
                       if r.superseded_by == versions[0].id), None)
        if before is None:
            break
        versions.insert(0, before)
    return tuple(versions)


def related(engine: Engine, fact: MemoryRecord, vector: np.ndarray,
            now: datetime) -> list[MemoryRecord]:
    """Current facts of the scope that a new fact may repeat, refine or contradict: found by
    hybrid search (a contradiction often shares words, not meaning: "lives in Porto" vs
    "moved to Lisbon" share the subject)."""
    q = Query(scope=fact.scope, now=now, kinds=(Kind.SEMANTIC, Kind.PROCEDURAL))
    best = ranked(engine, fact.text, q, RELATED, vector, pool=RELATED_POOL)
    found = engine.store.get([mid for mid, _, _ in best])
    return [found[mid] for mid, _, _ in best if mid in found]


def plans(engine: Engine, facts: list[MemoryRecord], near: list[list[MemoryRecord]],
          keys: dict[str, Keys], notes: list[str]) -> list[consolidate.Plan]:
    """The LLM's plan for each fact against its related memories; if the LLM fails, the
    plan of embedding-based deduplication."""
    if not any(near):
        return [consolidate.Plan(i, "ADD", None, None, "new: no related memory")
                for i in range(len(facts))]
    assert engine.llm is not None
    messages, local = consolidate.decide_prompt([f.text for f in facts], near)
    try:
        reply = engine.llm.complete(messages, consolidate.LLMDecisions, max_tokens=LLM_MAX_TOKENS)
        assert reply.parsed is not None
        return consolidate.plans(reply.parsed, len(facts), local, near)
    except ProviderError as exc:
        notes.append(f"consolidation by the LLM failed ({type(exc).__name__}); "
                     "facts deduplicated without it")
        log.warning("consolidation failed, deduplicating without the LLM: %s", exc)
    known = {m.id: m for rel in near for m in rel}
    vectors = dict(zip(known, engine.embedder.embed_batch([speaker_text(m) for m in known.values()]),
                       strict=True))
    out = []
    for i, f in enumerate(facts):
        vec = keys[f.id][0][0].vector
        scored = [(m, float(np.dot(vec, vectors[m.id]))) for m in near[i]]
        d = consolidate.decide(f, scored, threshold=engine.config.dedupe_threshold,
                               min_overlap=engine.config.dedupe_min_overlap)
        out.append(consolidate.Plan(i, d.action, d.target, None, d.reason))
    return out


def apply(engine: Engine, tx: Tx, learned: Sequence[Learned],
          now: datetime) -> tuple[list[MemoryRecord], list[Event]]:
    """Write the planned decisions. A target changed by another writer since the plan was
    made (deleted, superseded) turns the plan into an ADD: a fact is never dropped."""
    stored: list[MemoryRecord] = []
    events: list[Event] = []

    def write(ev: Event) -> None:
        tx.append(ev)
        events.append(ev)

    for item in learned:
        rec, plan = item.record, item.plan
        target = None
        if plan.target is not None:
            target = visible(engine.store, plan.target.id, now)
            if target is not None and (target.valid_to is not None or target.superseded_by):
                target = None
        action = plan.action if target is not None else "ADD"
        if action == "NOOP":
            assert target is not None
            stored.append(target)
            log.info("noop %r: known as %s (%s)", rec.text[:60], target.id, plan.reason)
            continue
        if action in ("UPDATE", "MERGE"):
            assert target is not None
            merged = consolidate.merge(target, rec, now)
            keys = None
            if item.retext is not None:
                merged = replace(merged, text=plan.text or merged.text,
                                 content_hash=content_hash(plan.text or merged.text))
                keys = item.retext
            elif merged.text == rec.text:
                keys = item.keys
            merged = replace(merged, provenance=tuple(dict.fromkeys(
                (*target.provenance, *rec.provenance))))
            tx.update(merged, *(keys or (None, None)))
            write(event(EventType(action), merged, now, before=target, after=merged,
                        reason=plan.reason))
            stored.append(merged)
            continue
        if action == "SUPERSEDE":
            assert target is not None
            versions = [v for v in (visible(engine.store, c.id, now) for c in item.chain[:-1]) if v]
            changed, new = consolidate.place(rec, [*versions, target], now)
            for before, after in zip([next(v for v in [*versions, target] if v.id == c.id)
                                      for c in changed], changed, strict=True):
                tx.update(after)
                write(event(EventType.SUPERSEDE, after, now, before=before, after=after,
                            reason=plan.reason))
            tx.insert(new, *item.keys)
            reason = plan.reason
            if new.valid_to is not None:
                reason = f"arrived late: held until {new.valid_to.isoformat()}; {reason}"
            write(event(EventType.ADD, new, now, after=new, reason=reason))
            stored.append(new)
            continue
        tx.insert(rec, *item.keys)
        write(event(EventType.ADD, rec, now, after=rec, reason=plan.reason))
        stored.append(rec)
    return stored, events


def learn_from(engine: Engine, scope: Scope, task: extraction.Task, limit: int | None,
               fence: Fence | None = None) -> AddResult:
    """Run `task` over the stored episodes of a scope (the `limit` most recent ones), apart
    from session summaries, scope by scope. No LLM: nothing to learn, and the notes say so.
    An erasure in the scope committed after it began (after `fence`) makes it raise `Erased`
    with nothing written: what it learned may come from what was erased."""
    if engine.llm is None:
        return AddResult(memories=[], events=[], notes=("no LLM configured: nothing to learn",))
    fence = fence or Fence.take(engine.store, scope)
    now = utcnow()
    q = Query(scope=scope, now=now, kinds=(Kind.EPISODIC,))
    episodes: list[MemoryRecord] = []
    cursor = None
    while items := engine.store.select(q, after_id=cursor, limit=500):
        episodes += items
        cursor = items[-1].id
        if limit is not None:
            episodes = episodes[-limit:]
    # a session summary is derived from episodes already here: learning from it again
    # would only repeat them
    episodes = [e for e in episodes if e.metadata.get("engram") != SUMMARY_MARK]
    episodes.sort(key=lambda r: (r.observed_at or r.created_at, r.id))
    by_scope: dict[Scope, list[MemoryRecord]] = {}
    for e in episodes:
        by_scope.setdefault(e.scope, []).append(e)
    notes: list[str] = []
    graph: list[entities.Staged] = []
    learned = [item for s, eps in by_scope.items()
               for item in learn(engine, eps, s, task, now, notes, graph)]
    with engine.store.write() as tx:
        fence.hold(tx)
        stored, events = apply(engine, tx, learned, now)
        related = apply_graph(engine, tx, graph)
    entities.summarize(engine, entities.ends(related), fence)  # graph_summaries="llm" only
    total = redaction.add_counts(*(item.redacted for item in learned))
    said = redaction.describe(total)
    return AddResult(memories=stored, events=events,
                     notes=(said, *notes) if said else tuple(notes), redacted=total)

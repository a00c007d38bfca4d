"""The facade: `Memory` (sync) and `AsyncMemory` (the same methods as coroutines).

Every face (CLI, service, adapters) calls these methods. Validation happens first; then the
embedder runs outside any transaction; then one store transaction writes the rows and their
events. `AsyncMemory` runs the very same code in a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from . import validate as valid
from .config import Config
from .errors import Conflict, EngramError, InvalidImport, InvalidInput, NotFound, ProviderError
from .filters import parse_filters
from .model import (
    AddResult,
    Event,
    EventType,
    Hit,
    Job,
    JobStatus,
    Kind,
    MemoryRecord,
    Message,
    Page,
    Scope,
    new_id,
    utcnow,
)
from .pipeline import consolidate, forget
from .pipeline import extract as extraction
from .pipeline.retrieve import RetrievalConfig, fuse, get_preset, rank
from .pipeline.text import content_hash, terms
from .providers.embedders import Embedder, get_embedder
from .providers.llms import LLM, get_llm
from .store import Key, Lexical, Query, Stats, Store, open_store

if TYPE_CHECKING:
    from .context import Block as ContextBlock
    from .context import Context
    from .model import Session
    from .working.session import AsyncSessionHandle, SessionHandle

log = logging.getLogger("engram.memory")
T = TypeVar("T")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


# Aliases: inside the classes below, `list` names the method.
Hits = list[Hit]
Events = list[Event]
builtins_list = list

UNSET: Any = _Unset()  # "not given", as opposed to an explicit None
WINDOW = 3  # turns in an episode's `window` key: itself and the two before it
EXTRACT_BATCH = 20  # messages per extraction call
RELATED = 5  # existing memories a new fact is compared with
RELATED_POOL = 100  # candidates per retriever when looking them up (a scope's facts, not its turns)
MAX_CHAIN = 20  # versions walked back to fit a late fact into a fact's history
JOB_LEASE_S = 300  # a claimed job whose worker died is run again after this
LLM_MAX_TOKENS = 1024  # bounds a reply (a small model in JSON mode can ramble until the context ends)
EXPORT_FORMAT = "engram-export"
EXPORT_VERSION = 1


class Memory:
    """Long-term memory for an agent, on the embedded default (one SQLite file)."""

    def __init__(self, path: str | Path | None = None, *, config: Config | None = None,
                 embedder: Embedder | None = None, store: Store | None = None,
                 retrieval: str | RetrievalConfig | None = None,
                 tenant: str | None = None, llm: LLM | None = UNSET) -> None:
        """`tenant` isolates a service tenant's data (see `store.open_store`); libraries and
        single-user apps leave it None."""
        self.config = config or Config.from_env(path=path)
        if self.config.log_level:
            _configure_logging(self.config.log_level)
        if tenant is not None:
            valid.ident(tenant, "tenant")
        self.tenant = tenant
        self.store: Store = store or open_store(self.config, tenant)
        self.embedder = embedder or get_embedder(self.config.embedder)
        preset = retrieval or self.config.retrieval
        self.retrieval = get_preset(preset) if isinstance(preset, str) else preset
        self.llm: LLM | None = get_llm(self.config) if llm is UNSET else llm
        self._worker: threading.Thread | None = None
        self._worker_lock = threading.Lock()
        self._stop = threading.Event()
        self._sessions: weakref.WeakSet[SessionHandle] = weakref.WeakSet()

    def close(self) -> None:
        """Stop the background worker and let running session summaries finish, then close."""
        self._stop.set()
        for handle in list(self._sessions):
            handle.wait(timeout=self.config.llm_timeout_s)
        if self._worker is not None:
            self._worker.join(timeout=self.config.llm_timeout_s)
        self.store.close()

    def __enter__(self) -> Memory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- write -------------------------------------------------------------------------------

    def add(self, messages: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]], *,
            user_id: str | None = None, agent_id: str | None = None,
            session_id: str | None = None, metadata: Mapping[str, Any] | None = None,
            observed_at: datetime | None = None, infer: bool = True, kind: str | Kind | None = None,
            importance: float | None = None, expires_at: datetime | None = None,
            background: bool = False, idempotency_key: str | None = None) -> AddResult:
        """Store messages (episodes) or facts (`kind="semantic"` / `"procedural"`).

        Messages are always kept as episodes. With an LLM configured and `infer=True`, durable
        facts are also extracted from them and consolidated against what is known (ADD, UPDATE,
        MERGE, NOOP, or SUPERSEDE: the old fact is closed, not deleted). With no LLM, or when the
        LLM fails, only the episodes are stored and `AddResult.notes` says why. Facts given
        directly are deduplicated (exact duplicates add nothing, near-duplicates merge).

        `background=True` validates, queues a durable job and returns at once (`result.job`);
        `wait(job.id)` gives the outcome. The same `idempotency_key` never does the work twice:
        a retry returns the first result, a different request under the same key is a `Conflict`.
        """
        req = self._add_request(messages, valid.scope(user_id, agent_id, session_id), metadata,
                                observed_at, infer, kind, importance, expires_at)
        if not isinstance(background, bool):
            raise InvalidInput("background must be a bool")
        key = None if idempotency_key is None else valid.ident(idempotency_key, "idempotency_key")
        if background:
            return AddResult(memories=[], events=[],
                             job=self._enqueue("add", req.scope, req.payload(), key))
        failed = None
        if key is not None:
            known, failed = self._replay(key, req.fingerprint())
            if known is not None:
                return known
        try:
            # a failed earlier attempt under this key is done again, in its own job row
            return self._add(req, key=key, job=failed)
        except Conflict:  # another writer took the key meanwhile: its result is ours
            known, _ = self._replay(key or "", req.fingerprint())
            if known is None:
                raise
            return known

    def _add_request(self, messages: Any, scope: Scope, metadata: Any, observed_at: Any,
                     infer: Any, kind: Any, importance: Any, expires_at: Any) -> _AddRequest:
        if not isinstance(infer, bool):
            raise InvalidInput("infer must be a bool")
        return _AddRequest(
            messages=tuple(self._message(m) for m in valid.as_list(messages)), scope=scope,
            kind=valid.kind(kind) or Kind.EPISODIC, metadata=valid.metadata(metadata),
            observed_at=valid.moment(observed_at, "observed_at"), importance=valid.importance(importance),
            expires_at=valid.moment(expires_at, "expires_at"), infer=infer)

    def _add(self, req: _AddRequest, *, key: str | None = None, job: Job | None = None) -> AddResult:
        now = utcnow()
        records = [self._record(m, req.scope, req.kind, req.metadata, req.observed_at,
                                req.importance, req.expires_at, now) for m in req.messages]
        # Model time (embedding, LLM) before the transaction: the write lock is held for
        # milliseconds.
        index = self._index(records)
        notes: list[str] = []
        learned: list[_Learned] = []
        if req.infer and req.kind is Kind.EPISODIC:
            learned = self._learn(records, req.scope, extraction.EXTRACT, now, notes)
        # A turn is also found by what was learned from it: each extracted fact becomes an
        # extra `fact` key of its source episodes.
        fact_keys: dict[str, list[Key]] = {}
        for item in learned:
            for source in item.record.provenance:
                fact_keys.setdefault(source, []).append(Key("fact", item.index[0][0].vector))
        with self.store.write() as tx:
            # Reads first (neighbours for consolidation), writes after.
            neighbours = {r.id: self._neighbours(r, index[r.id][0][0].vector, now)
                          for r in records if r.kind is not Kind.EPISODIC}
            stored: list[MemoryRecord] = []
            events: list[Event] = []
            batch: list[tuple[MemoryRecord, np.ndarray]] = []
            for rec in records:
                vec = index[rec.id][0][0].vector
                earlier = [(r, float(np.dot(vec, v))) for r, v in batch]
                decision = consolidate.decide(
                    rec, [*neighbours.get(rec.id, []), *earlier],
                    threshold=self.config.dedupe_threshold,
                    min_overlap=self.config.dedupe_min_overlap)
                if decision.action == "NOOP":
                    assert decision.target is not None
                    stored.append(decision.target)
                    log.info("noop %s: %s", decision.target.id, decision.reason)
                    continue
                if decision.action == "MERGE":
                    assert decision.target is not None
                    target = next((r for r, _ in batch if r.id == decision.target.id),
                                  decision.target)
                    merged = consolidate.merge(target, rec, now)
                    # The merged text is one of the two, already embedded: no model call here.
                    tx.update(merged, *(index[rec.id] if merged.text == rec.text else (None, None)))
                    ev = _event(EventType.MERGE, merged, now, before=target, after=merged,
                                reason=decision.reason)
                    batch = [(merged, v) if r.id == merged.id else (r, v) for r, v in batch]
                    stored = [merged if r.id == merged.id else r for r in stored]
                    if merged.id not in {r.id for r in stored}:
                        stored.append(merged)
                    log.info("merged into %s: %s", merged.id, decision.reason)
                else:
                    reason = decision.reason
                    if rec.kind is Kind.EPISODIC and notes:
                        reason = f"{reason}; {'; '.join(notes)}"  # the history says why no facts
                    keys, lexical = index[rec.id]
                    tx.insert(rec, [*keys, *fact_keys.get(rec.id, [])], lexical)
                    ev = _event(EventType.ADD, rec, now, after=rec, reason=reason)
                    batch.append((rec, vec))
                    stored.append(rec)
                    log.info("added %s %s in %s", rec.kind.value, rec.id, req.scope)
                tx.append(ev)
                events.append(ev)
            facts, fact_events = self._apply(tx, learned, now)
            stored += facts
            events += fact_events
            events += self._evict(tx, req.scope, now)
            result = AddResult(memories=stored, events=events, notes=tuple(notes))
            if key is not None or job is not None:
                tx.put_job(self._done(job, key, req, result, now))
        self._maybe_reflect(req.scope, sum(r.kind is Kind.EPISODIC for r in records))
        return result

    def _maybe_reflect(self, scope: Scope, added: int) -> None:
        """With ENGRAM_REFLECT_EVERY=N and an LLM: queue a reflection job each time a scope's
        episode count crosses a multiple of N (its idempotency key makes it one job per step)."""
        every = self.config.reflect_every
        if not every or not added or self.llm is None:
            return
        count = self.store.stats(scope, utcnow()).by_kind.get(Kind.EPISODIC.value, 0)
        if count // every > (count - added) // every:
            step = count // every
            self._enqueue("reflect", scope, {"limit": 2 * every},
                          f"reflect:{json.dumps(list(scope.as_dict().values()))}:{step}")

    # -- understanding: extraction and consolidation with an LLM ------------------------------

    def _learn(self, episodes: Sequence[MemoryRecord], scope: Scope, task: extraction.Task,
               now: datetime, notes: list[str]) -> list[_Learned]:
        """Extract candidate memories from `episodes` and decide how each joins what is known.

        Runs outside any transaction (it calls the LLM). Failures never lose anything: the
        episodes are stored anyway, and `notes` records why nothing (or less) was learned.
        """
        if self.llm is None:
            return []
        fact_scope = scope if scope.user_id is None and scope.agent_id is None \
            else Scope(scope.user_id, scope.agent_id, None)  # facts outlive the session
        recent = [r for r in self.store.recent_episodes(scope, 4)[::-1]
                  if r.id not in {e.id for e in episodes}] if task.with_recent else []
        session = self.store.session(scope) if scope.session_id else None
        found: list[extraction.Candidate] = []
        for i in range(0, len(episodes), EXTRACT_BATCH):
            chunk = episodes[i:i + EXTRACT_BATCH]
            try:
                reply = self.llm.complete(task.prompt(chunk, recent, session.summary if session else ""),
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
            recent = list(chunk[-4:])
        if not found:
            return []
        origin = {"extractor": f"{self.llm.name}:{self.llm.model}", "prompt": task.version}
        facts = []
        for c in found:
            kind, why = extraction.trust(c)
            if why != "ok":
                log.warning("not stored as a rule: %r (%s)", c.text[:80], why)
            facts.append(MemoryRecord(
                id=new_id(), scope=fact_scope, kind=kind, text=c.text,
                metadata={"origin": {**origin, "source": extraction.source_of(c.source_roles),
                                     **({"trust": why} if why != "ok" else {})}},
                importance=c.importance, created_at=now, updated_at=now, observed_at=c.valid_from,
                valid_from=c.valid_from, provenance=c.sources, content_hash=content_hash(c.text)))
        index = self._index(facts)
        related = [self._related(f, index[f.id][0][0].vector, now) for f in facts]
        plans = self._plans(facts, related, index, notes)
        texts = {p.fact: p.text for p in plans if p.text and p.action in ("UPDATE", "MERGE")}
        retext = self._index([replace(facts[i], text=t) for i, t in texts.items()])
        return [_Learned(f, index[f.id], p, retext.get(f.id),
                         self._chain(p.target, f, index[f.id][0][0].vector, now)
                         if p.action == "SUPERSEDE" and p.target else ())
                for f, p in zip(facts, plans, strict=True)]

    def _chain(self, current: MemoryRecord, new: MemoryRecord, vector: np.ndarray,
               now: datetime) -> tuple[MemoryRecord, ...]:
        """The versions of `current` back to the one that held when `new` starts (oldest
        first), for fitting a late fact into the timeline. Each step finds the predecessor
        among the related facts valid just before a version began."""
        chain = [current]
        start = new.valid_from or new.created_at
        while len(chain) < MAX_CHAIN and (chain[0].valid_from or chain[0].created_at) > start:
            since = chain[0].valid_from or chain[0].created_at
            q = Query(scope=current.scope, now=now, kinds=(current.kind,),
                      as_of=since - timedelta(microseconds=1))
            ids = [mid for mid, _, _ in self._rank(new.text, q, RELATED, vector, pool=RELATED_POOL)]
            before = next((r for r in self.store.get(ids).values()
                           if r.superseded_by == chain[0].id), None)
            if before is None:
                break
            chain.insert(0, before)
        return tuple(chain)

    def _related(self, fact: MemoryRecord, vector: np.ndarray, now: datetime) -> list[MemoryRecord]:
        """Current facts of the scope that a new fact may repeat, refine or contradict: found by
        hybrid search (a contradiction often shares words, not meaning: "lives in Porto" vs
        "moved to Lisbon" share the subject)."""
        q = Query(scope=fact.scope, now=now, kinds=(Kind.SEMANTIC, Kind.PROCEDURAL))
        best = self._rank(fact.text, q, RELATED, vector, pool=RELATED_POOL)
        found = self.store.get([mid for mid, _, _ in best])
        return [found[mid] for mid, _, _ in best if mid in found]

    def _plans(self, facts: list[MemoryRecord], related: list[list[MemoryRecord]],
               index: dict[str, tuple[list[Key], Lexical]], notes: list[str]) -> list[consolidate.Plan]:
        if not any(related):
            return [consolidate.Plan(i, "ADD", None, None, "new: no related memory")
                    for i in range(len(facts))]
        assert self.llm is not None
        messages, local = consolidate.decide_prompt([f.text for f in facts], related)
        try:
            reply = self.llm.complete(messages, consolidate.LLMDecisions, max_tokens=LLM_MAX_TOKENS)
            assert reply.parsed is not None
            return consolidate.plans(reply.parsed, len(facts), local, related)
        except ProviderError as exc:
            notes.append(f"consolidation by the LLM failed ({type(exc).__name__}); "
                         "facts deduplicated without it")
            log.warning("consolidation failed, deduplicating without the LLM: %s", exc)
        known = {m.id: m for rel in related for m in rel}
        vectors = dict(zip(known, self.embedder.embed_batch([_speaker_text(m) for m in known.values()]),
                           strict=True))
        out = []
        for i, f in enumerate(facts):
            vec = index[f.id][0][0].vector
            near = [(m, float(np.dot(vec, vectors[m.id]))) for m in related[i]]
            d = consolidate.decide(f, near, threshold=self.config.dedupe_threshold,
                                   min_overlap=self.config.dedupe_min_overlap)
            out.append(consolidate.Plan(i, d.action, d.target, None, d.reason))
        return out

    def _apply(self, tx: Any, learned: Sequence[_Learned], now: datetime,
               ) -> tuple[list[MemoryRecord], list[Event]]:
        """Write the planned decisions. A target changed by another writer since the plan was
        made (deleted, superseded) turns the plan into an ADD: a fact is never dropped."""
        stored: list[MemoryRecord] = []
        events: list[Event] = []
        for item in learned:
            rec, plan = item.record, item.plan
            target = None
            if plan.target is not None:
                target = self._visible(plan.target.id, now)
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
                    keys = item.index
                merged = replace(merged, provenance=tuple(dict.fromkeys(
                    (*target.provenance, *rec.provenance))))
                tx.update(merged, *(keys or (None, None)))
                ev = _event(EventType(action), merged, now, before=target, after=merged,
                            reason=plan.reason)
                tx.append(ev)
                events.append(ev)
                stored.append(merged)
                continue
            if action == "SUPERSEDE":
                assert target is not None
                chain = [v for v in (self._visible(c.id, now) for c in item.chain[:-1]) if v]
                changed, new = consolidate.place(rec, [*chain, target], now)
                for before, after in zip([next(v for v in [*chain, target] if v.id == c.id)
                                          for c in changed], changed, strict=True):
                    tx.update(after)
                    ev = _event(EventType.SUPERSEDE, after, now, before=before, after=after,
                                reason=plan.reason)
                    tx.append(ev)
                    events.append(ev)
                tx.insert(new, *item.index)
                reason = plan.reason
                if new.valid_to is not None:
                    reason = f"arrived late: held until {new.valid_to.isoformat()}; {reason}"
                ev = _event(EventType.ADD, new, now, after=new, reason=reason)
                tx.append(ev)
                events.append(ev)
                stored.append(new)
                continue
            tx.insert(rec, *item.index)
            ev = _event(EventType.ADD, rec, now, after=rec, reason=plan.reason)
            tx.append(ev)
            events.append(ev)
            stored.append(rec)
        return stored, events

    def extract(self, *, user_id: str | None = None, agent_id: str | None = None,
                session_id: str | None = None) -> AddResult:
        """Run extraction and consolidation over the stored episodes of a scope (e.g. at the end
        of a session whose messages were added with `infer=False`). No LLM: nothing to do."""
        return self._learn_from(valid.scope(user_id, agent_id, session_id), extraction.EXTRACT, limit=None)

    def reflect(self, *, user_id: str | None = None, agent_id: str | None = None,
                session_id: str | None = None, limit: int = 50) -> AddResult:
        """Synthesise lessons (procedural) and insights (semantic) from the most recent episodes
        of a scope, stored with their source episodes as provenance.

        Rules are only kept when they come from the user's own words (see `extraction.trust`). No
        LLM: nothing is synthesised and `notes` says so.
        """
        return self._learn_from(valid.scope(user_id, agent_id, session_id), extraction.REFLECT,
                                limit=valid.limit(limit))

    def _learn_from(self, scope: Scope, task: extraction.Task, limit: int | None) -> AddResult:
        if self.llm is None:
            return AddResult(memories=[], events=[], notes=("no LLM configured: nothing to learn",))
        now = utcnow()
        q = Query(scope=scope, now=now, kinds=(Kind.EPISODIC,))
        episodes: list[MemoryRecord] = []
        cursor = None
        while page := self.store.select(q, after_id=cursor, limit=500):
            episodes += page
            cursor = page[-1].id
            if limit is not None:
                episodes = episodes[-limit:]
        # a session summary is derived from episodes already here: learning from it again
        # would only repeat them
        episodes = [e for e in episodes if e.metadata.get("engram") != "session_summary"]
        episodes.sort(key=lambda r: (r.observed_at or r.created_at, r.id))
        by_scope: dict[Scope, list[MemoryRecord]] = {}
        for e in episodes:
            by_scope.setdefault(e.scope, []).append(e)
        notes: list[str] = []
        learned = [item for s, eps in by_scope.items() for item in self._learn(eps, s, task, now, notes)]
        with self.store.write() as tx:
            stored, events = self._apply(tx, learned, now)
        return AddResult(memories=stored, events=events, notes=tuple(notes))

    # -- background jobs ---------------------------------------------------------------------

    def _enqueue(self, task: str, scope: Scope, payload: dict[str, Any], key: str | None) -> Job:
        fingerprint = _fingerprint(task, payload)
        now = utcnow()
        if key is not None:
            known = self.store.job_by_key(key)
            if known is not None:
                if known.fingerprint != fingerprint:
                    raise Conflict(f"idempotency key {key!r} was used for a different request")
                if known.status is not JobStatus.FAILED:
                    return known
                # the same request again after it failed for good: run it again
                job = replace(known, status=JobStatus.QUEUED, attempts=0, run_at=now, error=None,
                              updated_at=now)
                with self.store.write() as tx:
                    tx.put_job(job)
                self._start_worker()
                return job
        job = Job(id=new_id(), task=task, scope=scope, payload=payload, status=JobStatus.QUEUED,
                  created_at=now, updated_at=now, run_at=now, key=key, fingerprint=fingerprint)
        try:
            with self.store.write() as tx:
                tx.put_job(job)
        except Conflict:
            known = self.store.job_by_key(key or "")
            if known is None or known.fingerprint != fingerprint:
                raise
            return known
        log.info("queued %s job %s", task, job.id)
        self._start_worker()
        return job

    def _replay(self, key: str, fingerprint: str) -> tuple[AddResult | None, Job | None]:
        """The result of an earlier request with this idempotency key; else None, with the
        earlier job if it failed (so doing it again is right)."""
        job = self.store.job_by_key(key)
        if job is None:
            return None, None
        if job.fingerprint != fingerprint:
            raise Conflict(f"idempotency key {key!r} was used for a different request")
        if job.status is JobStatus.QUEUED and self.config.worker != "thread":
            # no worker here to wait for: never block on `engram worker` processes
            raise Conflict(f"the request with idempotency key {key!r} is queued; retry later")
        if job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
            job = self.wait(job.id, timeout=JOB_LEASE_S)
            if job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
                raise Conflict(f"the request with idempotency key {key!r} is still running; "
                               "retry later")
        if job.status is not JobStatus.DONE or job.result is None:
            return None, job
        return self._result(job.result), None

    def _result(self, result: Mapping[str, Any]) -> AddResult:
        ids = list(result.get("memories", []))
        found = self.store.get(ids)
        wanted = set(result.get("events", []))
        events = [e for mid in dict.fromkeys(ids) for e in self.store.events(mid) if e.id in wanted]
        return AddResult(memories=[found[i] for i in ids if i in found], events=events,
                         notes=tuple(result.get("notes", [])))

    def _done(self, job: Job | None, key: str | None, req: _AddRequest, result: AddResult,
              now: datetime) -> Job:
        summary = {"memories": [m.id for m in result.memories], "events": [e.id for e in result.events],
                   "notes": list(result.notes)}
        if job is None:
            payload = req.payload()
            job = Job(id=new_id(), task="add", scope=req.scope, payload=payload,
                      status=JobStatus.DONE, created_at=now, updated_at=now, run_at=now, attempts=1,
                      key=key, fingerprint=_fingerprint("add", payload))
        return replace(job, status=JobStatus.DONE, result=summary, error=None, updated_at=now,
                       lease_until=None)

    def job(self, id: str) -> Job:
        """A background job by id (NotFound if unknown)."""
        found = self.store.job(valid.ident(id))
        if found is None:
            raise NotFound(f"no job with id {id!r}")
        return found

    def jobs(self, *, user_id: str | None = None, agent_id: str | None = None,
             session_id: str | None = None, status: str | JobStatus | None = None,
             limit: int = 50) -> builtins_list[Job]:
        """Background jobs of a scope, newest first."""
        if status is not None:
            try:
                status = JobStatus(status)
            except ValueError:
                raise InvalidInput(f"status must be one of {[s.value for s in JobStatus]}") from None
        return self.store.jobs(valid.scope(user_id, agent_id, session_id),
                               status=None if status is None else status.value, limit=valid.limit(limit))

    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Block until a job is done or failed (running it in this process if no worker is
        running), or until `timeout` seconds pass; returns the job as it then is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self.job(job_id)
        self._start_worker()
        delay = 0.01
        while job.status in (JobStatus.QUEUED, JobStatus.RUNNING):
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
            job = self.job(job_id)
        return job

    def work(self, *, until_idle: bool = False, stop: threading.Event | None = None,
             poll_s: float = 0.5) -> int:
        """Run queued jobs (this is what `engram worker` and the in-process worker do); returns
        how many ran. Many workers, in many processes, can share one database."""
        stop = stop or threading.Event()
        ran = 0
        while not stop.is_set():
            now = utcnow()
            job = self.store.claim_job(now, now + timedelta(seconds=JOB_LEASE_S))
            if job is None:
                if until_idle:
                    break
                stop.wait(poll_s)
                continue
            self._run(job)
            ran += 1
        return ran

    def _run(self, job: Job) -> None:
        try:
            if job.task == "add":
                self._add(_AddRequest.from_payload(job.payload), key=job.key, job=job)
                return
            scope = job.scope
            task = extraction.REFLECT if job.task == "reflect" else extraction.EXTRACT
            result = self._learn_from(scope, task, job.payload.get("limit"))
            with self.store.write() as tx:
                tx.put_job(replace(job, status=JobStatus.DONE, updated_at=utcnow(), lease_until=None,
                                   result={"memories": [m.id for m in result.memories],
                                           "events": [e.id for e in result.events],
                                           "notes": list(result.notes)}))
        except Exception as exc:  # a job must end in a state, whatever went wrong
            now = utcnow()
            final = isinstance(exc, InvalidInput | NotFound) or job.attempts > self.config.job_retries
            status = JobStatus.FAILED if final else JobStatus.QUEUED
            retry = now + timedelta(seconds=min(2 ** job.attempts, 60))
            log.warning("job %s (%s) attempt %d failed: %r%s", job.id, job.task, job.attempts, exc,
                        "" if final else f"; retrying at {retry:%H:%M:%S}")
            with self.store.write() as tx:
                tx.put_job(replace(job, status=status, error=f"{type(exc).__name__}: {exc}",
                                   run_at=retry, lease_until=None, updated_at=now))

    def _start_worker(self) -> None:
        """The in-process worker thread (ENGRAM_WORKER=thread, the default), started on demand;
        with ENGRAM_WORKER=off, jobs wait for `engram worker`."""
        if self.config.worker != "thread":
            return
        with self._worker_lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self.work, kwargs={"stop": self._stop},
                                                name="engram-worker", daemon=True)
                self._worker.start()

    def _message(self, m: str | Mapping[str, Any]) -> Message:
        if isinstance(m, str):
            return Message(content=self._text(m))
        if not isinstance(m, Mapping):
            raise InvalidInput(f"a message must be a string or a mapping, not {type(m).__name__}")
        unknown = set(m) - {"role", "content", "name", "observed_at", "metadata"}
        if unknown:
            raise InvalidInput(f"unknown message fields: {sorted(unknown)}")
        if "content" not in m:
            raise InvalidInput("a message needs a 'content'")
        role = m.get("role", "user")
        if not isinstance(role, str) or not role:
            raise InvalidInput("a message 'role' must be a non-empty string")
        name = m.get("name")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise InvalidInput("a message 'name' must be a non-empty string")
        valid.utf8(role, "a message 'role'")
        if name is not None:
            valid.utf8(name, "a message 'name'")
        return Message(content=self._text(m["content"]), role=role, name=name,
                       observed_at=valid.moment(m.get("observed_at"), "observed_at"),
                       metadata=valid.metadata(m.get("metadata")))

    def _text(self, text: Any) -> str:
        if not isinstance(text, str):
            raise InvalidInput(f"text must be a string, not {type(text).__name__}")
        if not text.strip():
            raise InvalidInput("text is empty")
        if len(text) > self.config.max_text_chars:
            raise InvalidInput(f"text has {len(text)} characters; the limit is "
                               f"{self.config.max_text_chars} (ENGRAM_MAX_TEXT_CHARS)")
        return valid.utf8(text, "text")

    def _record(self, m: Message, scope: Scope, kind: Kind, meta: dict[str, Any],
                when: datetime | None, importance: float, expires_at: datetime | None,
                now: datetime) -> MemoryRecord:
        observed = m.observed_at or when
        return MemoryRecord(
            id=new_id(), scope=scope, kind=kind, text=m.content,
            metadata={**meta, **m.metadata}, importance=importance, role=m.role, name=m.name,
            created_at=now, updated_at=now, observed_at=observed, valid_from=observed or now,
            expires_at=expires_at, content_hash=content_hash(m.content),
        )

    def _index(self, records: Sequence[MemoryRecord],
               history: dict[Scope, list[MemoryRecord]] | None = None,
               ) -> dict[str, tuple[list[Key], Lexical]]:
        """How each memory is found: its retrieval keys and its lexical document.

        An episode is indexed with its conversational context, because a turn is often
        understood only with the turns before it ("Yes, since 2019!"): a `window` key embeds
        the turn with the two before it in the same scope, and the lexical index holds the
        previous turn as a lower-weighted column. A fact stands alone: its window is itself.
        """
        texts: list[str] = []
        plan: dict[str, tuple[int, int, Lexical]] = {}  # id -> text row, window row, lexical
        history = {} if history is None else history  # the last turns seen, per scope
        for rec in records:
            own = _speaker_text(rec)
            texts.append(own)
            if rec.kind is not Kind.EPISODIC:
                plan[rec.id] = (len(texts) - 1, len(texts) - 1, Lexical(own))
                continue
            if rec.scope not in history:
                history[rec.scope] = self.store.recent_episodes(rec.scope, WINDOW - 1)[::-1]
            before = [r for r in history[rec.scope] if r.id != rec.id][-(WINDOW - 1):]
            texts.append("\n".join([*map(_speaker_text, before), own]))
            plan[rec.id] = (len(texts) - 2, len(texts) - 1,
                            Lexical(own, _speaker_text(before[-1]) if before else ""))
            history[rec.scope] = [*before, rec]
        vectors = self.embedder.embed_batch(texts)
        return {mid: ([Key("text", vectors[t]), Key("window", vectors[w])], lex)
                for mid, (t, w, lex) in plan.items()}

    def _reindex_followers(self, rec: MemoryRecord, replacement: MemoryRecord | None,
                           ) -> list[tuple[MemoryRecord, tuple[list[Key], Lexical]]]:
        """The episodes whose index holds `rec` as context, re-indexed without it (or with
        `replacement`): so a deleted, erased or edited turn leaves no trace in its neighbours."""
        if rec.kind is not Kind.EPISODIC:
            return []
        before, after = self.store.episodes_around(rec.id, WINDOW - 1)
        if not after:
            return []
        history = {rec.scope: [*before, *([replacement] if replacement else [])]}
        index = self._index(after, history)
        return [(r, index[r.id]) for r in after]

    def _neighbours(self, rec: MemoryRecord, vec: np.ndarray,
                    now: datetime) -> list[tuple[MemoryRecord, float]]:
        """Existing memories of the same scope and kind that may repeat `rec`, with cosines."""
        same = self.store.find_hash(rec.scope, rec.kind, rec.content_hash, now)
        if same is not None:
            return [(same, 1.0)]
        found = self.store.dense(Query(scope=rec.scope, now=now, kinds=(rec.kind,)), vec, 5)
        records = self.store.get([mid for mid, _ in found])
        return [(records[mid], sim) for mid, sim in found if records[mid].scope == rec.scope]

    def _evict(self, tx: Any, scope: Scope, now: datetime) -> Events:
        cap = self.config.max_memories_per_scope
        if cap is None:
            return []
        victims = forget.to_evict(self.store.eviction_pool(scope, now), cap, now)
        if not victims:
            return []
        tx.soft_delete([v.id for v in victims], now)
        events = []
        for v in victims:
            ev = _event(EventType.DELETE, v, now, before=v,
                        reason=f"evicted: scope over capacity {cap}, "
                               f"retention {forget.retention(v, now):.3f}")
            tx.append(ev)
            events.append(ev)
            log.info("evicted %s (%s)", v.id, ev.reason)
        return events

    def update(self, id: str, *, text: str | None = UNSET, metadata: Mapping[str, Any] | None = UNSET,
               importance: float = UNSET, expires_at: datetime | None = UNSET) -> MemoryRecord:
        """Change a memory in place; the UPDATE event keeps the before and after."""
        before = self.get(id)
        changes: dict[str, Any] = {}
        if text is not UNSET:
            changes["text"] = self._text(text)
            changes["content_hash"] = content_hash(changes["text"])
        if metadata is not UNSET:
            changes["metadata"] = valid.metadata(metadata)
        if importance is not UNSET:
            changes["importance"] = valid.importance(importance)
        if expires_at is not UNSET:
            changes["expires_at"] = valid.moment(expires_at, "expires_at")
        if not changes:
            raise InvalidInput("update needs at least one of text, metadata, importance, expires_at")
        now = utcnow()
        after = replace(before, **changes, updated_at=now)
        index, followers = None, []
        if "text" in changes:
            prior, _ = self.store.episodes_around(before.id, WINDOW - 1)  # its own context
            index = self._index([after], {after.scope: prior})[after.id]
            followers = self._reindex_followers(before, after)
        with self.store.write() as tx:
            if self._visible(before.id, now) is None:  # deleted meanwhile by another writer
                raise NotFound(f"no memory with id {id!r}")
            tx.update(after, *(index or (None, None)))
            for rec, (keys, lexical) in followers:
                tx.update(rec, keys, lexical)
            tx.append(_event(EventType.UPDATE, after, now, before=before, after=after))
        log.info("updated %s: %s", id, sorted(changes))
        return after

    def delete(self, id: str) -> None:
        """Soft delete: hidden from every read, kept in the history."""
        rec = self.get(id)
        now = utcnow()
        followers = self._reindex_followers(rec, None)
        with self.store.write() as tx:
            tx.soft_delete([rec.id], now)
            for other, (keys, lexical) in followers:
                tx.update(other, keys, lexical)
            tx.append(_event(EventType.DELETE, rec, now, before=rec, reason="deleted by caller"))
        log.info("deleted %s", id)

    def erase(self, *, id: str | None = None, user_id: str | None = None,
              agent_id: str | None = None, session_id: str | None = None) -> int:
        """Hard delete of one memory or a whole scope: rows, vectors, index, history text.

        Returns how many memories were erased. The freed bytes are overwritten (secure_delete)
        and checkpointed out of the write-ahead log.
        """
        scope = valid.scope(user_id, agent_id, session_id)
        if id is None and scope.is_empty():
            raise InvalidInput("erase needs an id or at least one of user_id, agent_id, session_id")
        if id is not None:
            valid.ident(id)
            found = self.store.get([id]).get(id)
            if found is None or not valid.in_scope(found.scope, scope):
                raise NotFound(f"no memory with id {id!r}")
            ids = [id]
            scope = found.scope
            followers = self._reindex_followers(found, None)
        else:
            # A whole scope goes: every episode's context lies within its own scope, so no
            # surviving memory holds an erased turn.
            ids = self.store.ids(scope, include_deleted=True)
            followers = []
        # What was derived from the erased memories goes too: facts extracted from them and
        # summaries of them (their provenance names the erased ids), wherever they are stored.
        ids += self._derived(set(ids), scope)
        followers = [(r, ix) for r, ix in followers if r.id not in ids]
        now = utcnow()
        with self.store.write() as tx:
            tx.erase(ids)
            for other, (keys, lexical) in followers:
                tx.update(other, keys, lexical)
            if id is None:
                tx.erase_scope(scope)  # sessions (their summaries) and jobs (their payloads)
            elif scope.session_id is not None:
                from .working.session import reset_summaries

                reset_summaries(self.store, tx, scope)  # rebuilt from the messages that remain
            tx.append(Event(id=new_id(), memory_id=id, type=EventType.ERASE, at=now, scope=scope,
                            reason=f"erased {len(ids)} memories"))
        self.store.reclaim()
        log.info("erased %d memories (%s)", len(ids), f"id {id}" if id else scope)
        return len(ids)

    def _derived(self, erased: set[str], scope: Scope) -> builtins_list[str]:
        """Ids of memories derived from `erased` (directly or through other derived ones) among
        the memories of the scope's user or agent: facts live outside the session they came
        from."""
        if not erased:
            return []
        owner = Scope(scope.user_id, scope.agent_id, None)
        candidates = [i for i in self.store.ids(owner, include_deleted=True) if i not in erased]
        records: dict[str, MemoryRecord] = {}
        for i in range(0, len(candidates), 500):
            records.update(self.store.get(candidates[i:i + 500]))
        found: builtins_list[str] = []
        gone = set(erased)
        changed = True
        while changed:
            changed = False
            for rid, rec in records.items():
                if rid not in gone and gone.intersection(rec.provenance):
                    gone.add(rid)
                    found.append(rid)
                    changed = True
        return found

    # -- read --------------------------------------------------------------------------------

    def _visible(self, id: str, now: datetime) -> MemoryRecord | None:
        rec = self.store.get([id]).get(id)
        if rec is None or rec.deleted_at is not None:
            return None
        if rec.expires_at is not None and rec.expires_at <= now:
            return None
        return rec

    def get(self, id: str) -> MemoryRecord:
        """A memory by id (superseded ones too); NotFound if unknown, deleted or expired."""
        valid.ident(id)
        rec = self._visible(id, utcnow())
        if rec is None:
            raise NotFound(f"no memory with id {id!r}")
        return rec

    def list(self, *, user_id: str | None = None, agent_id: str | None = None,
             session_id: str | None = None, filters: Mapping[str, Any] | None = None,
             kinds: Iterable[str | Kind] | None = None, as_of: datetime | None = None,
             cursor: str | None = None, limit: int = 50) -> Page:
        """Visible memories in creation order, one page at a time."""
        query = self._query(user_id, agent_id, session_id, filters, kinds, as_of)
        limit = valid.limit(limit)
        if cursor is not None and (not isinstance(cursor, str) or len(cursor) > valid.MAX_ID_CHARS):
            raise InvalidInput("cursor must be the next_cursor of a previous page")
        items = self.store.select(query, after_id=cursor, limit=limit + 1)
        more = len(items) > limit
        items = items[:limit]
        return Page(items=items, next_cursor=items[-1].id if more else None)

    def search(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
               session_id: str | None = None, filters: Mapping[str, Any] | None = None,
               limit: int = 10, kinds: Iterable[str | Kind] | None = None,
               as_of: datetime | None = None) -> Hits:
        """Hybrid search: dense + lexical candidates, fused, adjusted; each hit explains itself."""
        text = self._text(query)
        q = self._query(user_id, agent_id, session_id, filters, kinds, as_of)
        best = self._rank(text, q, valid.limit(limit))
        records = self.store.get([mid for mid, _, _ in best])
        hits = [Hit(records[mid], score, explain) for mid, score, explain in best]
        self.store.touch([h.memory.id for h in hits], q.now)
        if log.isEnabledFor(logging.DEBUG):
            for h in hits:
                log.debug("search %r -> %s %.3f %s", text[:80], h.memory.id, h.score, h.explain)
        return hits

    def _rank(self, text: str, q: Query, limit: int, vector: np.ndarray | None = None,
              pool: int | None = None) -> builtins_list[tuple[str, float, dict[str, float]]]:
        """Candidates per retriever (`pool` each, default the preset's), then fused and ranked
        on light rows (ids, scores, why)."""
        cfg = self.retrieval
        n = max(pool or cfg.candidates, limit)
        ranked: dict[str, builtins_list[tuple[str, float]]] = {}
        if cfg.dense_weight or cfg.window_weight or cfg.fact_weight:
            if vector is None:
                vector = self.embedder.embed_batch([text])[0]
            for label, key, w in (("dense", "text", cfg.dense_weight),
                                  ("window", "window", cfg.window_weight),
                                  ("fact", "fact", cfg.fact_weight)):
                if w:
                    ranked[label] = self.store.dense(q, vector, n, key=key)
        if cfg.lexical_weight:
            ranked["lexical"] = self.store.lexical(q, terms(text), n, cfg.previous_weight)
        fused = fuse(ranked, {"dense": cfg.dense_weight, "window": cfg.window_weight,
                              "fact": cfg.fact_weight, "lexical": cfg.lexical_weight}, cfg)
        return rank(fused, self.store.candidates(list(fused)), text, cfg, q.as_of or q.now)[:limit]

    def history(self, id: str) -> Events:
        """Every event of a memory, oldest first (also for deleted and erased ids)."""
        valid.ident(id)
        events = self.store.events(id)
        if not events and not self.store.get([id]):
            raise NotFound(f"no memory with id {id!r}")
        return events

    def stats(self, *, user_id: str | None = None, agent_id: str | None = None,
              session_id: str | None = None) -> Stats:
        return self.store.stats(valid.scope(user_id, agent_id, session_id), utcnow())

    def _query(self, user_id: str | None, agent_id: str | None, session_id: str | None,
               filters: Mapping[str, Any] | None, kinds: Iterable[str | Kind] | None,
               as_of: datetime | None) -> Query:
        if kinds is not None and isinstance(kinds, str | Kind):
            kinds = [kinds]
        the_kinds = tuple(valid.kind(k) for k in kinds) if kinds is not None else None
        return Query(scope=valid.scope(user_id, agent_id, session_id), now=utcnow(),
                     kinds=the_kinds or None,  # type: ignore[arg-type]
                     conditions=parse_filters(filters), as_of=valid.moment(as_of, "as_of"))

    # -- working memory: sessions and context (see working/ and context.py) -------------------

    def session(self, *, session_id: str | None = None, user_id: str | None = None,
                agent_id: str | None = None, policy: Any = None,
                metadata: Mapping[str, Any] | None = None) -> SessionHandle:
        """A persisted conversation: `s.add(message)`, `s.messages()`, `s.view()`, `s.end()`.

        An existing session (same scope) resumes exactly, with its stored policy unless
        `policy` is given (a `engram.working` policy, its dict, or a name such as "summary").
        No `session_id` starts a new session. With no LLM, summaries are extractive.
        """
        from .working.session import open_session

        return open_session(self, session_id=session_id, user_id=user_id, agent_id=agent_id,
                            policy=policy, metadata=metadata)

    def sessions(self, *, user_id: str | None = None, agent_id: str | None = None,
                 limit: int = 50) -> builtins_list[Session]:
        """Stored sessions of a scope, most recently updated first."""
        from .working.session import list_sessions

        return list_sessions(self, user_id=user_id, agent_id=agent_id, limit=limit)

    def context(self, query_or_messages: str | Sequence[Mapping[str, Any]], *,
                user_id: str | None = None, agent_id: str | None = None,
                session_id: str | None = None, budget_tokens: int = 2000,
                blocks: Sequence[ContextBlock] | None = None,
                instructions: str | None = None) -> Context:
        """The messages to send to a model next, within `budget_tokens` (cl100k tokens): a
        system message with `instructions` and the memories as quoted, dated data, then the
        session per its policy, then the new message(s). See `engram.context.DEFAULT_BLOCKS`."""
        from .context import assemble

        return assemble(self, query_or_messages, user_id=user_id, agent_id=agent_id,
                        session_id=session_id, budget_tokens=budget_tokens, blocks=blocks,
                        instructions=instructions)

    # -- export / import ---------------------------------------------------------------------

    def export(self, path: str | Path, *, user_id: str | None = None,
               agent_id: str | None = None, session_id: str | None = None) -> int:
        """Write a scope (every memory, deleted and superseded too, with history) as JSON lines."""
        scope = valid.scope(user_id, agent_id, session_id)
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        count = 0
        with tmp.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"format": EXPORT_FORMAT, "version": EXPORT_VERSION,
                                "exported_at": utcnow().isoformat(),
                                "scope": scope.as_dict()}) + "\n")
            for rec, events in self.store.iter_export(scope):
                f.write(json.dumps({"memory": rec.to_dict(),
                                    "events": [e.to_dict() for e in events]},
                                   ensure_ascii=False) + "\n")
                count += 1
        tmp.replace(path)  # never leave a half-written export under the real name
        return count

    def import_(self, path: str | Path,
                progress: Callable[[int, int], None] | None = None) -> int:
        """Read an export back. All or nothing: the whole file is validated before any write.

        Memories whose id already exists are skipped. Returns how many were imported.
        """
        items = _read_export(Path(path))
        existing = self.store.get([rec.id for rec, _ in items])
        todo = [(rec, events) for rec, events in items if rec.id not in existing]
        index: dict[str, tuple[list[Key], Lexical]] = {}
        history: dict[Scope, list[MemoryRecord]] = {}
        for i in range(0, len(todo), 256):
            index.update(self._index([rec for rec, _ in todo[i:i + 256]], history))
            if progress:
                progress(min(i + 256, len(todo)), len(todo))
        with self.store.write() as tx:
            for rec, events in todo:
                tx.insert(rec, *index[rec.id])
                if rec.deleted_at is not None:
                    tx.soft_delete([rec.id], rec.deleted_at)
                for ev in events:
                    tx.append(ev)
        log.info("imported %d memories from %s (%d already present)",
                 len(todo), path, len(items) - len(todo))
        return len(todo)


class AsyncMemory:
    """`Memory` with coroutine methods. The same implementation runs in a worker thread."""

    def __init__(self, path: str | Path | None = None, **kwargs: Any) -> None:
        self.sync = Memory(path, **kwargs)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def add(self, messages: Any, **kwargs: Any) -> AddResult:
        return await self._run(self.sync.add, messages, **kwargs)

    async def search(self, query: str, **kwargs: Any) -> Hits:
        return await self._run(self.sync.search, query, **kwargs)

    async def get(self, id: str) -> MemoryRecord:
        return await self._run(self.sync.get, id)

    async def list(self, **kwargs: Any) -> Page:
        return await self._run(self.sync.list, **kwargs)

    async def update(self, id: str, **kwargs: Any) -> MemoryRecord:
        return await self._run(self.sync.update, id, **kwargs)

    async def delete(self, id: str) -> None:
        return await self._run(self.sync.delete, id)

    async def erase(self, **kwargs: Any) -> int:
        return await self._run(self.sync.erase, **kwargs)

    async def history(self, id: str) -> Events:
        return await self._run(self.sync.history, id)

    async def stats(self, **kwargs: Any) -> Stats:
        return await self._run(self.sync.stats, **kwargs)

    async def session(self, **kwargs: Any) -> AsyncSessionHandle:
        from .working.session import AsyncSessionHandle

        return AsyncSessionHandle(await self._run(self.sync.session, **kwargs))

    async def sessions(self, **kwargs: Any) -> builtins_list[Session]:
        return await self._run(self.sync.sessions, **kwargs)

    async def context(self, query_or_messages: Any, **kwargs: Any) -> Context:
        return await self._run(self.sync.context, query_or_messages, **kwargs)

    async def export(self, path: str | Path, **kwargs: Any) -> int:
        return await self._run(self.sync.export, path, **kwargs)

    async def import_(self, path: str | Path, **kwargs: Any) -> int:
        return await self._run(self.sync.import_, path, **kwargs)

    async def extract(self, **kwargs: Any) -> AddResult:
        return await self._run(self.sync.extract, **kwargs)

    async def reflect(self, **kwargs: Any) -> AddResult:
        return await self._run(self.sync.reflect, **kwargs)

    async def job(self, id: str) -> Job:
        return await self._run(self.sync.job, id)

    async def jobs(self, **kwargs: Any) -> builtins_list[Job]:
        return await self._run(self.sync.jobs, **kwargs)

    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        return await self._run(self.sync.wait, job_id, timeout)

    async def work(self, **kwargs: Any) -> int:
        return await self._run(self.sync.work, **kwargs)

    async def close(self) -> None:
        await self._run(self.sync.close)

    async def __aenter__(self) -> AsyncMemory:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


@dataclass(frozen=True)
class _AddRequest:
    """A validated `add` call: what a background job stores and runs later."""

    messages: tuple[Message, ...]
    scope: Scope
    kind: Kind
    metadata: dict[str, Any]
    observed_at: datetime | None
    importance: float
    expires_at: datetime | None
    infer: bool

    def payload(self) -> dict[str, Any]:
        def t(value: datetime | None) -> str | None:
            return None if value is None else value.isoformat()
        return {
            "messages": [{"content": m.content, "role": m.role, "name": m.name,
                          "observed_at": t(m.observed_at), "metadata": dict(m.metadata)}
                         for m in self.messages],
            "scope": self.scope.as_dict(), "kind": self.kind.value, "metadata": self.metadata,
            "observed_at": t(self.observed_at), "importance": self.importance,
            "expires_at": t(self.expires_at), "infer": self.infer,
        }

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> _AddRequest:
        s = d["scope"]
        return cls(
            messages=tuple(Message(content=m["content"], role=m["role"], name=m["name"],
                                   observed_at=valid.moment(m["observed_at"], "observed_at"),
                                   metadata=m["metadata"]) for m in d["messages"]),
            scope=Scope(s["user_id"], s["agent_id"], s["session_id"]), kind=Kind(d["kind"]),
            metadata=d["metadata"], observed_at=valid.moment(d["observed_at"], "observed_at"),
            importance=d["importance"], expires_at=valid.moment(d["expires_at"], "expires_at"),
            infer=d["infer"])

    def fingerprint(self) -> str:
        return _fingerprint("add", self.payload())


@dataclass(frozen=True)
class _Learned:
    """An extracted memory with its index and the plan for it (and the index of its new text
    when the plan rewrites the target's)."""

    record: MemoryRecord
    index: tuple[list[Key], Lexical]
    plan: consolidate.Plan
    retext: tuple[list[Key], Lexical] | None = field(default=None)
    chain: tuple[MemoryRecord, ...] = ()  # for SUPERSEDE: the target's versions, oldest first


def _fingerprint(kind: str, payload: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps([kind, payload], sort_keys=True, ensure_ascii=False)
                          .encode()).hexdigest()


def _configure_logging(level: str) -> None:
    """ENGRAM_LOG_LEVEL opts in to engram's logs on stderr (the library is quiet otherwise)."""
    logger = logging.getLogger("engram")
    try:
        logger.setLevel(level.upper())
    except ValueError:
        raise InvalidInput(f"ENGRAM_LOG_LEVEL={level!r} is not a logging level") from None
    if not any(getattr(h, "engram", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        handler.engram = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


def _speaker_text(rec: MemoryRecord) -> str:
    return f"{rec.name}: {rec.text}" if rec.name else rec.text


def _event(typ: EventType, rec: MemoryRecord, at: datetime, *, before: MemoryRecord | None = None,
           after: MemoryRecord | None = None, reason: str | None = None) -> Event:
    return Event(id=new_id(), memory_id=rec.id, type=typ, at=at, scope=rec.scope,
                 before=before.to_dict() if before else None,
                 after=after.to_dict() if after else None, reason=reason)


def _read_export(path: Path) -> list[tuple[MemoryRecord, list[Event]]]:
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
            out.append((_record_from_dict(item["memory"]),
                        [_event_from_dict(e) for e in item.get("events", [])]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, EngramError) as exc:
            raise InvalidImport(f"{path}:{n}: not a valid memory line ({exc})") from exc
    return out


def _record_from_dict(d: dict[str, Any]) -> MemoryRecord:
    times = {k: valid.moment(d.get(k), k) for k in ("created_at", "updated_at", "observed_at",
                                             "valid_from", "valid_to", "last_accessed_at",
                                             "expires_at", "deleted_at")}
    if times["created_at"] is None or times["updated_at"] is None:
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
        content_hash=content_hash(text), **times,  # type: ignore[arg-type]
    )


def _event_from_dict(d: dict[str, Any]) -> Event:
    s = d.get("scope") or {}
    at = valid.moment(d["at"], "at")
    assert at is not None
    return Event(id=valid.ident(d["id"]), memory_id=d.get("memory_id"), type=EventType(d["type"]), at=at,
                 scope=valid.scope(s.get("user_id"), s.get("agent_id"), s.get("session_id")),
                 before=d.get("before"), after=d.get("after"), reason=d.get("reason"))

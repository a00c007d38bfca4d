"""The facade: `Memory`, what every face (library, CLI, service, MCP, adapters) calls.

Each method validates its input at the boundary (a raised error means nothing was written),
hands the work to the pipeline that does it (write, learn, read, erase, the job queue, export)
and returns. `AsyncMemory` (aio.py) runs these same methods in a worker thread.
"""

from __future__ import annotations

import builtins
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from . import context as assembly
from . import jobs, logs, transfer
from . import validate as valid
from .config import Config
from .errors import InvalidInput
from .graph import entities
from .model import (
    UNSET,
    AddResult,
    Entity,
    EntityProfile,
    Event,
    EventType,
    Hit,
    Job,
    JobStatus,
    Kind,
    MemoryRecord,
    Page,
    Receipt,
    Relation,
    Session,
    Subgraph,
    Unset,
    utcnow,
)
from .pipeline import erase, learn, read, retention, write
from .pipeline import extract as extraction
from .pipeline import reindex as reindexing
from .pipeline.engine import Engine
from .pipeline.retrieve import RetrievalConfig
from .pipeline.text import content_hash
from .providers.embedders import Embedder
from .providers.llms import LLM
from .redact import redact, redact_value
from .store import Stats, Store
from .working.policies import Policy
from .working.session import SessionHandle, open_session


class Memory:
    """Long-term memory for an agent, on the embedded default (one SQLite file)."""

    def __init__(self, path: str | Path | None = None, *, config: Config | None = None,
                 embedder: Embedder | None = None, store: Store | None = None,
                 retrieval: str | RetrievalConfig | None = None,
                 tenant: str | None = None, llm: LLM | None | Unset = UNSET,
                 check_space: bool = True) -> None:
        """The parts not given come from `config` (default: `Config.from_env(path=path)`; a
        `path` is the SQLite file even when ENGRAM_DATABASE_URL is set); `llm=None` turns the
        LLM off even if one is configured. `tenant` isolates a service
        tenant's data (see `store.open_store`); libraries and single-user apps leave it None.

        A database records the embedding space of its vectors on first use; one recorded with
        another space raises `EmbeddingMismatch`. `check_space=False` opens it anyway, only
        to `reindex()` it (searches before that compare vectors of two spaces)."""
        config = config or Config.from_env(path=path)
        if config.log_level:
            logs.configure(config.log_level)
        if tenant is not None:
            valid.ident(tenant, "tenant")
        self.tenant = tenant
        self._engine = Engine.build(config, store=store, embedder=embedder, llm=llm,
                                    retrieval=retrieval, tenant=tenant)
        if check_space:
            try:
                reindexing.check(self._engine)
            except BaseException:
                self._engine.store.close()
                raise
        self._queue = jobs.Queue(self._engine)
        self._queue.retention = config.retention(tenant)  # enforced by the worker
        self._sessions: weakref.WeakSet[SessionHandle] = weakref.WeakSet()

    # The engine's parts, for callers that tune or inspect them (benchmarks, tests).
    @property
    def config(self) -> Config:
        return self._engine.config

    @property
    def store(self) -> Store:
        return self._engine.store

    @property
    def embedder(self) -> Embedder:
        return self._engine.embedder

    @property
    def llm(self) -> LLM | None:
        return self._engine.llm

    @property
    def retrieval(self) -> RetrievalConfig:
        return self._engine.retrieval

    def close(self) -> None:
        """Stop the background worker and let running session summaries finish, then close."""
        timeout = self.config.llm_timeout_s
        self._queue.stop()
        for handle in builtins.list(self._sessions):
            handle.wait(timeout=timeout)
        self._queue.join(timeout=timeout)
        self.store.close()

    def __enter__(self) -> Memory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- write -------------------------------------------------------------------------------

    def add(self, messages: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]], *,
            user_id: str | None = None, agent_id: str | None = None,
            session_id: str | None = None, metadata: Mapping[str, Any] | None = None,
            observed_at: datetime | str | None = None, infer: bool = True, kind: str | Kind | None = None,
            importance: float | None = None, expires_at: datetime | str | None = None,
            supersedes: str | Sequence[str] | None = None,
            background: bool = False, idempotency_key: str | None = None) -> AddResult:
        """Store messages (episodes) or facts (`kind="semantic"` / `"procedural"`).

        Messages are always kept as episodes. With an LLM configured and `infer=True`, durable
        facts are also extracted from them and consolidated against what is known (ADD, UPDATE,
        MERGE, NOOP, or SUPERSEDE: the old fact is closed, not deleted). With no LLM, or when the
        LLM fails, only the episodes are stored and `AddResult.notes` says why. Facts given
        directly are deduplicated (exact duplicates add nothing, near-duplicates merge) and,
        with an LLM and `infer=True`, checked against the current facts the same way as
        extracted ones (unless `supersedes` says what they replace); with no LLM or
        `infer=False` no contradiction check runs, and `notes` says so.

        `supersedes` (an id or a list of ids) says "this replaces that" without an LLM: the
        one message given is stored as a new memory (never merged into another), and each
        named memory is closed as an LLM's SUPERSEDE closes a fact: `valid_to` = the new
        memory's `valid_from`, `superseded_by` = its id, a SUPERSEDE event "superseded by
        caller". `search` then finds the new one, `search(as_of=...)` the old one, `history`
        the chain. All in one transaction with the add. Each named memory must be of the
        same kind and owner (`user_id` and `agent_id`; the session may differ): `NotFound` if
        it is unknown, deleted, expired or another scope's; `InvalidInput` for another kind,
        or if the new memory would start (`observed_at`) before it. An episode is an event:
        that it was said stays true, but a superseded turn ("the trip is in May", replaced by
        "I changed my mind: October") is no longer what holds — it leaves current search and
        context and stays in `as_of` reads, `history` and its session's transcript. A memory
        already superseded is a `Conflict` naming its current version: replacing a successor
        the caller has not seen would silently lose it (compare-and-swap, not last-writer-wins).

        Redaction (`ENGRAM_REDACT`, default `secrets`; see `engram.redact`): before anything
        is stored, embedded or queued, secrets in the messages' text and metadata (API keys and
        tokens, private keys, passwords in obvious forms, card numbers, IBANs; with `pii` also
        emails and phone numbers) are replaced by typed placeholders (`[REDACTED:api_key]`).
        `result.redacted` counts them by type, `notes` says "redacted: api_key×1, card×1", and
        each memory's ADD (or MERGE) event says what was redacted in it, never the value.
        Facts extracted by the LLM are redacted too.

        `background=True` validates, queues a durable job and returns at once (`result.job`);
        `wait(job.id)` gives the outcome. The same `idempotency_key` never does the work twice:
        a retry returns the first result, a different request under the same key is a
        `Conflict`, and a retry while the first request is still queued or running is
        `InProgress` (with `retry_after`).
        """
        req = write.AddRequest.build(
            messages, valid.scope(user_id, agent_id, session_id), metadata=metadata,
            observed_at=observed_at, infer=infer, kind=kind, importance=importance,
            expires_at=expires_at, max_text_chars=self.config.max_text_chars,
            redact=self.config.redact, supersedes=supersedes)
        valid.flag(background, "background")
        key = None if idempotency_key is None else valid.ident(idempotency_key, "idempotency_key")
        if req.supersedes and background and (key is None or self.store.job_by_key(key) is None):
            # A queued job would only fail later: say now that a target is missing (the job
            # checks again, in its transaction). A keyed retry of a done job is not checked:
            # it returns the first result.
            now = utcnow()
            write.superseded(self._engine, req, req.start(now), now)
        return self._queue.add(req, key, background)

    def extract(self, *, user_id: str | None = None, agent_id: str | None = None,
                session_id: str | None = None) -> AddResult:
        """Run extraction and consolidation over the stored episodes of a scope (e.g. at the end
        of a session whose messages were added with `infer=False`). No LLM: nothing to do."""
        return learn.learn_from(self._engine, valid.scope(user_id, agent_id, session_id),
                                extraction.EXTRACT, None)

    def reflect(self, *, user_id: str | None = None, agent_id: str | None = None,
                session_id: str | None = None, limit: int = 50) -> AddResult:
        """Synthesise lessons (procedural) and insights (semantic) from the most recent episodes
        of a scope, stored with their source episodes as provenance.

        Rules are only kept when they come from the user's own words (see `extraction.trust`). No
        LLM: nothing is synthesised and `notes` says so.
        """
        return learn.learn_from(self._engine, valid.scope(user_id, agent_id, session_id),
                                extraction.REFLECT, valid.limit(limit))

    def update(self, id: str, *, text: str | Unset = UNSET,
               metadata: Mapping[str, Any] | None | Unset = UNSET,
               importance: float | Unset = UNSET, expires_at: datetime | str | None | Unset = UNSET,
               valid_from: datetime | str | Unset = UNSET,
               user_id: str | None = None, agent_id: str | None = None,
               session_id: str | None = None) -> MemoryRecord:
        """Change a memory of the scope in place (only what is given; `metadata=None` clears
        the metadata, `expires_at=None` the expiry). The UPDATE event keeps before and after.

        An update is a correction of what is stored, not a change in the world: new `text`
        says what the memory should have said all along, so it keeps its `valid_from` (and
        `search(as_of=...)` still finds it over the time it held). When the world changed
        ("Tom moved to Leeds"), add the new fact with `supersedes=id` instead: the old one is
        closed and kept as history, and the new one holds from its own time. `valid_from`
        corrects the start itself (InvalidInput after the memory's `valid_to`).

        New `text` and `metadata` are redacted as `add` redacts them (`ENGRAM_REDACT`); the
        UPDATE event's reason says what was ("redacted: password×1").
        """
        before = self.get(id, user_id=user_id, agent_id=agent_id, session_id=session_id)
        changes: dict[str, Any] = {}
        policy = self.config.redact
        found: Counter[str] = Counter()
        if not isinstance(text, Unset):
            done = redact(valid.text(text, self.config.max_text_chars), policy)
            found.update(done.counts)
            changes["text"] = valid.text(done.text, self.config.max_text_chars,
                                         "text once redacted")
            changes["content_hash"] = content_hash(changes["text"])
        if not isinstance(metadata, Unset):
            changes["metadata"] = redact_value(valid.metadata(metadata), policy, found)
        if not isinstance(importance, Unset):
            changes["importance"] = valid.importance(importance)
        if not isinstance(expires_at, Unset):
            changes["expires_at"] = valid.moment(expires_at, "expires_at")
        if not isinstance(valid_from, Unset):
            start = valid.moment(valid_from, "valid_from")
            if start is None:
                raise InvalidInput("valid_from must be a datetime or ISO-8601 string")
            if before.valid_to is not None and start > before.valid_to:
                raise InvalidInput(f"valid_from {start.isoformat()} is after the memory's "
                                   f"valid_to {before.valid_to.isoformat()}")
            changes["valid_from"] = start
        if not changes:
            raise InvalidInput("update needs at least one of text, metadata, importance, "
                               "expires_at, valid_from")
        if "text" in changes or "metadata" in changes:  # a rule or a pin passes the trust rules
            extraction.check_direct(changes.get("text", before.text),
                                    frozenset({before.role or "user"}), before.kind,
                                    changes.get("metadata", before.metadata))
        return write.update(self._engine, before, changes, redacted=found)

    def delete(self, id: str, *, user_id: str | None = None, agent_id: str | None = None,
               session_id: str | None = None) -> None:
        """Soft delete of a memory of the scope: hidden from every read, kept in the history."""
        write.delete(self._engine, self.get(id, user_id=user_id, agent_id=agent_id,
                                            session_id=session_id))

    def erase(self, *, id: str | None = None, user_id: str | None = None,
              agent_id: str | None = None, session_id: str | None = None) -> int:
        """Hard delete of one memory (of the scope) or of a whole scope: rows, vectors, index,
        history text, and everything derived from them (extracted facts, summaries, session
        rows, job payloads).

        Returns how many memories were erased; `receipts()` has the erasure's receipt. The
        freed bytes are overwritten (secure_delete) and checkpointed out of the write-ahead log.
        """
        return self.erase_receipt(id=id, user_id=user_id, agent_id=agent_id,
                                  session_id=session_id).memories

    def erase_receipt(self, *, id: str | None = None, user_id: str | None = None,
                      agent_id: str | None = None, session_id: str | None = None) -> Receipt:
        """`erase`, returning its receipt: what was removed (counts by kind, sessions, jobs),
        the scope, the time and a SHA-256 of the erased ids; never their content."""
        scope = valid.scope(user_id, agent_id, session_id)
        if id is not None:
            return erase.memory(self._engine, valid.ident(id), scope)
        if scope.is_empty():
            raise InvalidInput("erase needs an id or at least one of user_id, agent_id, session_id")
        return erase.scope(self._engine, scope)

    def receipts(self, *, user_id: str | None = None, agent_id: str | None = None,
                 session_id: str | None = None, limit: int = 50) -> builtins.list[Receipt]:
        """The receipts of past erasures (and retention deletes) in a scope, newest first."""
        return erase.receipts(self.store, valid.scope(user_id, agent_id, session_id),
                              valid.limit(limit))

    # -- read --------------------------------------------------------------------------------

    def get(self, id: str, *, user_id: str | None = None, agent_id: str | None = None,
            session_id: str | None = None) -> MemoryRecord:
        """A memory by id (superseded ones too); NotFound if unknown, deleted, expired or
        outside the given scope."""
        return read.get(self.store, id, valid.scope(user_id, agent_id, session_id))

    def list(self, *, user_id: str | None = None, agent_id: str | None = None,
             session_id: str | None = None, filters: Mapping[str, Any] | None = None,
             kinds: Iterable[str | Kind] | None = None, as_of: datetime | str | None = None,
             cursor: str | None = None, limit: int = 50) -> Page:
        """Visible memories in creation order, one page at a time."""
        q = read.query(valid.scope(user_id, agent_id, session_id), filters, kinds, as_of)
        return read.page(self.store, q, cursor, valid.limit(limit))

    def search(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
               session_id: str | None = None, filters: Mapping[str, Any] | None = None,
               limit: int = 10, kinds: Iterable[str | Kind] | None = None,
               as_of: datetime | str | None = None) -> builtins.list[Hit]:
        """Hybrid search: dense + lexical candidates, fused, adjusted; each hit explains itself.

        The query is not redacted (`ENGRAM_REDACT` applies to what is written): it is never
        stored, only embedded for this one search and then dropped, and changing it would
        change what is found. A search for a placeholder finds the memories it replaced a
        value in (`search("[REDACTED:card]")`); a search for a raw secret finds nothing by
        that value, since no stored text holds it. With a remote embedder the query, like
        every text embedded, goes to that endpoint. At DEBUG level the query is logged
        redacted.
        """
        text = valid.text(query, self.config.max_text_chars)
        q = read.query(valid.scope(user_id, agent_id, session_id), filters, kinds, as_of)
        return read.search(self._engine, text, q, valid.limit(limit))

    def history(self, id: str, *, user_id: str | None = None, agent_id: str | None = None,
                session_id: str | None = None) -> builtins.list[Event]:
        """Every event of a memory of the scope, oldest first (also for deleted and erased
        ids)."""
        return read.history(self.store, id, valid.scope(user_id, agent_id, session_id))

    # -- the knowledge graph (graph/entities.py, docs/graph.md) -- ----------------------------

    def relate(self, subject: str, predicate: str, object: str | int | float | datetime, *,
               valid_from: datetime | str | None = None, valid_to: datetime | str | None = None,
               user_id: str | None = None, agent_id: str | None = None,
               metadata: Mapping[str, Any] | None = None, single: bool | None = None,
               literal: bool = False, subject_type: str | None = None,
               object_type: str | None = None, fact: str | None = None) -> Relation:
        """Record `subject -[predicate]-> object` holding from `valid_from` (default now). The
        ends are resolved among the owner's entities (exact name or alias, acronym, a part of
        a name only one entity has) or created. A non-string object, or `literal=True`, is a
        value rather than an entity. For a single-valued predicate (`works_at`, `lives_in`,
        ...; `single=` overrides, see docs/graph.md) the edge holding then is closed
        (`valid_to`, a SUPERSEDE event), never deleted; the same value holding already is
        returned as it is."""
        scope = valid.scope(user_id, agent_id, None)
        start = valid.moment(valid_from, "valid_from")
        end = valid.moment(valid_to, "valid_to")
        return entities.relate(self._engine, scope, subject, predicate,
                               entities.target(object, literal, object_type),
                               valid_from=start, valid_to=end, metadata=valid.metadata(metadata),
                               single=single, subject_type=subject_type, fact=fact)

    def unrelate(self, subject: str, predicate: str,
                 object: str | int | float | datetime | None = None, *,
                 at: datetime | str | None = None, retract: bool = False, literal: bool = False,
                 user_id: str | None = None, agent_id: str | None = None) -> builtins.list[Relation]:
        """End the edges `subject -[predicate]-> object` that hold at `at` (default now; any
        object if None): they get `valid_to` and stay as history. `retract=True`: they never
        held (a mistake), so they are retired (`expired_at`) and leave as-of reads too."""
        scope = valid.scope(user_id, agent_id, None)
        target = None if object is None else entities.target(object, literal)
        return entities.unrelate(self._engine, scope, subject, predicate, target,
                                 at=valid.moment(at, "at"), retract=valid.flag(retract, "retract"))

    def upsert_entity(self, name: str, *, type: str | None = None,
                      aliases: Sequence[str] | None = None, summary: str | None = None,
                      attributes: Mapping[str, Any] | None = None,
                      user_id: str | None = None, agent_id: str | None = None) -> Entity:
        """Create the entity `name`, or update the one it resolves to: aliases accumulate
        (`IBM` for `International Business Machines`, `Bob` for `Robert`), the summary and
        attributes are replaced / merged."""
        scope = valid.scope(user_id, agent_id, None)
        return entities.upsert(self._engine, scope, name, type=type,
                               aliases=entities.clean_aliases(aliases), summary=summary,
                               attributes=valid.metadata(attributes))

    def delete_entity(self, name: str, *, user_id: str | None = None,
                      agent_id: str | None = None) -> Subgraph:
        """Remove the entity a name, alias or id names: its names and aliases, every relation
        touching it (both directions, with their history) and its mentions. A DELETE event
        (`history(entity_id)`) records that it went, without its name. Returns what was
        removed: `Subgraph([entity], relations)`. NotFound if the owner has no such entity.
        A later message, relation or extraction that names it again creates a new entity."""
        return entities.delete(self._engine, valid.scope(user_id, agent_id, None), name)

    def entity(self, name: str, *, user_id: str | None = None, agent_id: str | None = None,
               session_id: str | None = None, mentions: int = 5) -> EntityProfile:
        """What is known about the entity a name, alias or id names: its type, aliases and
        summary, the relations that hold now (both directions) and the episodes that mention it
        most recently (of the session, if given). NotFound if there is none."""
        return entities.profile(self.store, valid.scope(user_id, agent_id, session_id), name,
                                valid.limit(mentions))

    def entities(self, query: str | None = None, *, type: str | None = None, limit: int = 50,
                 cursor: str | None = None, user_id: str | None = None,
                 agent_id: str | None = None) -> builtins.list[Entity]:
        """The owner's entities: all in creation order (after the id `cursor`), or the best
        matches of `query` (exact names and aliases first, then by meaning of the name)."""
        if query is not None:
            valid.text(query, self.config.max_text_chars, "query")
        return entities.entities(self._engine, valid.scope(user_id, agent_id, None), query,
                                 type=type, limit=valid.limit(limit), after_id=cursor)

    def relations(self, subject: str | None = None, predicate: str | None = None,
                  object: str | None = None, *, as_of: datetime | str | None = None,
                  history: bool = False, limit: int = 100, user_id: str | None = None,
                  agent_id: str | None = None) -> builtins.list[Relation]:
        """The s/p/o query of the knowledge graph: relations matching every end given (a name,
        alias or id; the object may be a literal value), those that hold now by default, those
        valid at `as_of`, or every stored edge with `history=True`."""
        return entities.relations(self.store, valid.scope(user_id, agent_id, None),
                                  subject=subject, predicate=predicate, obj=object,
                                  as_of=valid.moment(as_of, "as_of"),
                                  history=valid.flag(history, "history"), limit=valid.limit(limit))

    def neighbours(self, name: str, *, depth: int = 1, as_of: datetime | str | None = None,
                   user_id: str | None = None, agent_id: str | None = None) -> Subgraph:
        """The entity and every entity within `depth` hops (1 to 4), with the relations
        between them, current or valid at `as_of`."""
        return entities.neighbours(self.store, valid.scope(user_id, agent_id, None), name,
                                   depth, valid.moment(as_of, "as_of"))

    def path(self, a: str, b: str, *, max_depth: int = 4, as_of: datetime | str | None = None,
             user_id: str | None = None, agent_id: str | None = None) -> Subgraph:
        """A shortest chain of relations between two entities (either direction), with its
        entities in order from `a`; empty when none within `max_depth` hops."""
        return entities.path(self.store, valid.scope(user_id, agent_id, None), a, b, max_depth,
                             valid.moment(as_of, "as_of"))

    def stats(self, *, user_id: str | None = None, agent_id: str | None = None,
              session_id: str | None = None) -> Stats:
        """Counts of a scope: memories by kind and state, events, scopes, database size."""
        scope = valid.scope(user_id, agent_id, session_id)
        found = self.store.stats(scope, utcnow())
        policy = self._queue.retention
        removed = self.store.count_events(EventType.DELETE.value, scope, retention.REASON)
        return replace(found, retention={**policy, "removed": removed})

    def retain(self, *, now: datetime | None = None) -> Receipt | None:
        """Enforce the retention policy now (the worker does it when idle, hourly): remove
        what has outlived it, leaving DELETE events with the reason and a receipt (returned;
        None when nothing had outlived it)."""
        return retention.enforce(self._engine, self._queue.retention, now or utcnow())

    # -- background jobs (jobs.py) -----------------------------------------------------------

    def job(self, id: str) -> Job:
        """A background job by id (NotFound if unknown)."""
        return self._queue.job(id)

    def retry(self, id: str) -> Job:
        """Queue a failed job again, its attempts reset (NotFound if unknown; Conflict unless
        it failed)."""
        return self._queue.retry(valid.ident(id))

    def jobs(self, *, user_id: str | None = None, agent_id: str | None = None,
             session_id: str | None = None, status: str | JobStatus | None = None,
             limit: int = 50) -> builtins.list[Job]:
        """Background jobs of a scope, newest first."""
        wanted = None
        if status is not None:
            try:
                wanted = JobStatus(status).value
            except ValueError:
                raise InvalidInput(f"status must be one of {[s.value for s in JobStatus]}") from None
        return self.store.jobs(valid.scope(user_id, agent_id, session_id), status=wanted,
                               limit=valid.limit(limit))

    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Block until a job is done or failed (running it in this process if no worker is
        running), or until `timeout` seconds pass; returns the job as it then is."""
        return self._queue.wait(job_id, timeout)

    def resume(self) -> bool:
        """Start the in-process worker (ENGRAM_WORKER=thread) if jobs are waiting: queued ones,
        or running ones whose lease has ended (their process died). True if it was started."""
        return self._queue.resume()

    def work(self, *, until_idle: bool = False, stop: threading.Event | None = None,
             poll_s: float = 0.5) -> int:
        """Run queued jobs (this is what `engram worker` and the in-process worker do); returns
        how many ran. Many workers, in many processes, can share one database."""
        return self._queue.work(until_idle=until_idle, stop=stop, poll_s=poll_s)

    def embedding_space(self) -> dict[str, str | None]:
        """The embedding spaces: `recorded` (the database's vectors'), `configured` (this
        Memory's embedder's) and `reindexing` (the target of an unfinished reindex, or None)."""
        state = self.store.space()
        return {"recorded": state.space if state else None,
                "configured": reindexing.space(self._engine),
                "reindexing": state.target if state else None}

    def reindex(self, *, user_id: str | None = None, agent_id: str | None = None,
                progress: Callable[[int, int], None] | None = None) -> int:
        """Re-embed every live memory's retrieval keys (and entity names) with this Memory's
        embedder, a batch per transaction, then record its embedding space; returns how many
        memories were re-embedded. Resumable: after an interruption the same call continues
        after the last finished batch. Moving to another embedding space (a Memory opened with
        `check_space=False`) takes the whole database; a scope (`user_id` / `agent_id`) can be
        re-embedded in the same space. `progress(done, total)` is called after each batch.
        Stop other writers first: one still using the old embedder would write old keys."""
        scope = valid.scope(user_id, agent_id, None)
        return reindexing.reindex(self._engine, scope, progress)

    # -- working memory: sessions and context (working/, context.py) -------------------------

    def session(self, *, session_id: str | None = None, user_id: str | None = None,
                agent_id: str | None = None, policy: Policy | Mapping[str, Any] | str | None = None,
                metadata: Mapping[str, Any] | None = None) -> SessionHandle:
        """A persisted conversation: `s.add(message)`, `s.messages()`, `s.view()`, `s.end()`.

        An existing session (same scope) resumes exactly, with its stored policy unless
        `policy` is given (a `engram.working` policy, its dict, or a name such as "summary").
        No `session_id` starts a new session. With no LLM, summaries are extractive.
        """
        handle = open_session(self._queue, session_id=session_id, user_id=user_id,
                              agent_id=agent_id, policy=policy, metadata=metadata)
        self._sessions.add(handle)  # so that close() lets its summaries finish
        return handle

    def sessions(self, *, user_id: str | None = None, agent_id: str | None = None,
                 session_id: str | None = None, limit: int = 50) -> builtins.list[Session]:
        """Stored sessions of a scope, most recently updated first. Whether session X exists:
        `bool(mem.sessions(user_id=..., session_id=X, limit=1))`."""
        return self.store.sessions(valid.scope(user_id, agent_id, session_id),
                                   limit=valid.limit(limit))

    def context(self, query_or_messages: str | Sequence[Mapping[str, Any]], *,
                user_id: str | None = None, agent_id: str | None = None,
                session_id: str | None = None, budget_tokens: int = 2000,
                blocks: Sequence[assembly.Block] | None = None,
                instructions: str | None = None) -> assembly.Context:
        """The messages to send to a model next, within `budget_tokens` (cl100k tokens): a
        system message with `instructions` and the memories as quoted, dated data, then the
        session per its policy, then the new message(s). See `engram.context.DEFAULT_BLOCKS`."""
        return assembly.assemble(self._engine, query_or_messages, user_id=user_id,
                                 agent_id=agent_id, session_id=session_id,
                                 budget_tokens=budget_tokens, blocks=blocks,
                                 instructions=instructions)

    # -- export / import (transfer.py) -------------------------------------------------------

    def export(self, path: str | Path, *, user_id: str | None = None,
               agent_id: str | None = None, session_id: str | None = None) -> int:
        """Write everything a scope owns as JSON lines (docs/export.md): every memory, deleted
        and superseded too, with history; its sessions; its owner's knowledge graph. Returns
        how many memories."""
        return transfer.export(self._engine, Path(path), valid.scope(user_id, agent_id, session_id))

    def import_(self, path: str | Path,
                progress: Callable[[int, int], None] | None = None) -> int:
        """Read an export back. All or nothing: the whole file is validated before any write.

        Records whose id already exists are skipped. Returns how many memories were imported
        (sessions and the graph come with them).
        """
        return transfer.import_(self._engine, Path(path), progress)

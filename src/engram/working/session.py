"""The session handle: a persisted conversation with a policy for what the model sees of it.

Messages are episodes of the session's scope; the session row holds what is derived from them
(summaries). Summaries are brought up to date by a background thread after `add`; a summary
that fails or lags only means more messages are shown verbatim: none is ever lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from .. import validate as valid
from ..errors import Erased, InvalidInput, ProviderError
from ..jobs import Queue
from ..model import EventType, Kind, MemoryRecord, Scope, Session, event, new_id, utcnow
from ..pipeline import erase, learn
from ..pipeline import extract as extraction
from ..pipeline.fence import Fence
from ..pipeline.index import index
from ..pipeline.learn import SUMMARY_MARK
from ..pipeline.text import content_hash
from ..pipeline.write import AddRequest
from ..providers.tokens import Tokenizer, get_tokenizer
from ..redact import redact, redact_value
from ..store import Seen, Select, Store
from .policies import (
    DEFAULT_POLICY,
    Digests,
    Fold,
    Policy,
    SessionMessage,
    View,
    as_policy,
    from_dict,
    plan,
    view,
)
from .policies import apply as apply_fold
from .summarize import Summarizer

log = logging.getLogger("engram.working")

ROLES = ("user", "assistant", "system", "tool")
END_SUMMARY_TOKENS = 400
PAGE = 500


def is_session_summary(rec: MemoryRecord) -> bool:
    return rec.metadata.get("engram") == SUMMARY_MARK


def records(store: Store, scope: Scope, after: str | None = None) -> list[MemoryRecord]:
    """The messages of the session of exactly `scope` after the id `after`, oldest first.

    A turn superseded by a later one (`add(..., supersedes=...)`) is still here: it no longer
    holds, but it was said, and the conversation is what was said (deleted and expired turns
    are gone)."""
    sel = Select(scope=scope, exact=True, seen=Seen.UNEXPIRED, now=utcnow(),
                 kinds=(Kind.EPISODIC,), limit=PAGE)
    out: list[MemoryRecord] = []
    cursor = after
    while True:
        page = store.read_memories(replace(sel, after_id=cursor))
        out += [r for r in page if r.scope == scope and not is_session_summary(r)]
        if len(page) < PAGE:
            return out
        cursor = page[-1].id


def digests(row: Session | None) -> Digests:
    return Digests() if row is None else Digests.load(row.summary, row.summary_upto, row.state)


def stored_view(store: Store, scope: Scope, tokenizer: Tokenizer) -> View:
    """What the stored policy of the session of `scope` shows the model now (nothing, for a
    session that does not exist): a read, for context assembly."""
    row = store.session(scope)
    policy = from_dict(row.policy) if row is not None and row.policy else DEFAULT_POLICY
    return _view(store, scope, policy, digests(row), tokenizer)


def _view(store: Store, scope: Scope, policy: Policy, stored: Digests, tokenizer: Tokenizer) -> View:
    shown = stored if policy.summarizes else Digests()
    pending = [to_session_message(r) for r in records(store, scope, shown.upto)]
    return view(policy, shown, pending, tokenizer.count_message)


def to_session_message(rec: MemoryRecord) -> SessionMessage:
    meta = rec.metadata
    calls = meta.get("tool_calls")
    return SessionMessage(
        role=rec.role or "user",
        content=None if meta.get("content_is_rendered") else rec.text,
        name=rec.name, id=rec.id, observed_at=rec.observed_at or rec.created_at,
        tool_calls=calls if isinstance(calls, list) else None,
        tool_call_id=meta.get("tool_call_id"))


def to_episode(message: str | Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """A chat message (OpenAI shape, tool calls included) as a `Memory.add` message: tool call
    fields travel in the metadata, so the stored episode gives the exact message back."""
    if isinstance(message, str):
        return {"role": "user", "content": message, "observed_at": now}
    if not isinstance(message, Mapping):
        raise InvalidInput(f"a message must be a string or a mapping, not {type(message).__name__}")
    msg = dict(message)
    role = msg.get("role", "user")
    if role not in ROLES:
        raise InvalidInput(f"a session message's role must be one of {list(ROLES)}, not {role!r}")
    meta = dict(msg.pop("metadata", None) or {})
    calls = msg.pop("tool_calls", None)
    call_id = msg.pop("tool_call_id", None)
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list) or not calls or not all(
                isinstance(c, Mapping) for c in calls):
            raise InvalidInput("tool_calls must be a non-empty list of calls on an assistant message")
        meta["tool_calls"] = [dict(c) for c in calls]
    if call_id is not None:
        if role != "tool" or not isinstance(call_id, str) or not call_id:
            raise InvalidInput("tool_call_id must be a non-empty string on a tool message")
        meta["tool_call_id"] = call_id
    if not msg.get("content") and calls:
        # A call with no text: store a readable rendering, give back the empty content.
        msg["content"] = SessionMessage("assistant", None, tool_calls=meta["tool_calls"]).text
        meta["content_is_rendered"] = True
    msg["role"] = role
    msg.setdefault("observed_at", now)
    msg["metadata"] = meta
    return msg


class SessionHandle:
    """One conversation: `add` messages, read `messages()` or the policy's `view()`, `end()`.

    Made by `Memory.session(...)`. Thread-safe; several handles (or processes) on one session
    are safe too: summaries are written only if nobody advanced them meanwhile.
    """

    def __init__(self, queue: Queue, scope: Scope, policy: Policy, *,
                 tokenizer: Tokenizer | None = None, metadata: Mapping[str, Any] | None = None,
                 ) -> None:
        self._queue = queue  # messages are added the way `Memory.add` adds them
        self._engine = queue.engine
        self._metadata = dict(metadata) if metadata is not None else None  # for a new row
        self.scope = scope
        self._policy = policy
        self.tokenizer = tokenizer or get_tokenizer()
        self._summarizer: Summarizer | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = False
        self._dirty = False
        self.last_error: BaseException | None = None  # of the latest background summary

    @property
    def id(self) -> str:
        assert self.scope.session_id is not None
        return self.scope.session_id

    @property
    def policy(self) -> Policy:
        return self._policy

    def __repr__(self) -> str:
        return f"SessionHandle({self.scope}, policy={self._policy.to_dict()})"

    def __enter__(self) -> SessionHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the persisted row -------------------------------------------------------------------

    def info(self) -> Session:
        """The stored session (or, before the first message, the one that would be stored)."""
        row = self._engine.store.session(self.scope)
        if row is None:
            now = utcnow()
            return Session(scope=self.scope, policy=self._policy.to_dict(), created_at=now,
                           updated_at=now)
        return row

    def save(self) -> Session:
        """Store the session now, before any message (a client that creates a session with a
        policy expects to find it): the row is created with the handle's policy and metadata,
        or, if it exists, left as it is. Returns the stored row."""
        with self._engine.store.write() as tx:
            row = self._engine.store.session(self.scope)
            if row is None:
                now = utcnow()
                row = Session(scope=self.scope, policy=self._policy.to_dict(), created_at=now,
                              updated_at=now, metadata=self._metadata or {})
                tx.put_session(row)
        return row

    def _save_settings(self, metadata: Mapping[str, Any] | None) -> None:
        """Store a changed policy or metadata on an existing session."""
        with self._engine.store.write() as tx:
            row = self._engine.store.session(self.scope)
            if row is None:
                return
            changed = replace(row, policy=self._policy.to_dict(),
                              metadata=dict(metadata) if metadata is not None else row.metadata)
            if changed != row:
                tx.put_session(replace(changed, updated_at=utcnow()))

    # -- write -------------------------------------------------------------------------------

    def add(self, messages: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]],
            ) -> list[MemoryRecord]:
        """Append messages (a string is a user message; dicts in OpenAI chat shape, tool calls
        and tool results included). Returns the stored episodes. Summaries catch up in the
        background: `add` never waits for a model."""
        if isinstance(messages, str | Mapping):
            items: list[Any] = [messages]
        elif isinstance(messages, Sequence) and not isinstance(messages, bytes | bytearray):
            items = list(messages)
        else:
            raise InvalidInput(f"messages must be a string, a mapping or a list of them, "
                               f"not {type(messages).__name__}")
        if not items:
            raise InvalidInput("messages is empty")
        now = utcnow()
        req = AddRequest.build(
            [to_episode(m, now) for m in items], self.scope, metadata=None, observed_at=None,
            infer=False, kind=None, importance=None, expires_at=None,
            max_text_chars=self._engine.config.max_text_chars,
            redact=self._engine.config.redact)  # tool calls in the metadata too
        fence = Fence.take(self._engine.store, self.scope)
        result = self._queue.add(req, key=None, background=False, fence=fence)
        with self._engine.store.write() as tx:
            # deleted since the add began: its messages went with it, and so does its row
            fence.hold(tx, reads=False)
            row = self._engine.store.session(self.scope)
            if row is None:
                row = Session(scope=self.scope, policy=self._policy.to_dict(), created_at=now,
                              updated_at=now, metadata=self._metadata or {})
            tx.put_session(replace(row, updated_at=utcnow(), ended_at=None))
        if self._policy.summarizes:
            self._schedule()
        return result.memories

    # -- read --------------------------------------------------------------------------------

    def _records(self, after: str | None = None) -> list[MemoryRecord]:
        return records(self._engine.store, self.scope, after)

    def messages(self) -> list[SessionMessage]:
        """Every message of the session, oldest first."""
        return [to_session_message(r) for r in self._records()]

    def digests(self) -> Digests:
        return digests(self._engine.store.session(self.scope))

    def view(self) -> View:
        """What the policy shows the model now: summaries, then the verbatim messages."""
        return _view(self._engine.store, self.scope, self._policy, self.digests(), self.tokenizer)

    # -- summaries ---------------------------------------------------------------------------

    def _get_summarizer(self) -> Summarizer:
        if self._summarizer is None:
            self._summarizer = Summarizer(self._engine.embedder, self.tokenizer, self._engine.llm)
        return self._summarizer

    def _schedule(self) -> None:
        with self._lock:
            self._dirty = True
            if self._running:
                return  # the running worker re-plans once it is done
            self._running = True
        threading.Thread(target=self._work, name=f"engram-summary-{self.id}", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._dirty:
                    self._running = False
                    self._idle.notify_all()
                    return
                self._dirty = False
            try:
                self.refresh()
                self.last_error = None
            except Exception as exc:  # a failed summary loses nothing; the next add retries
                self.last_error = exc
                log.warning("session %s: summary failed, messages stay verbatim: %r", self.id, exc)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until background summaries are done; False if `timeout` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._running, timeout)

    def close(self) -> None:
        """Let background summaries finish (the session stays open: see `end`)."""
        self.wait()

    def refresh(self) -> int:
        """Bring the summaries up to date now, in this thread. Returns the folds written."""
        if not self._policy.summarizes:
            return 0
        store = self._engine.store
        done = 0
        while True:
            fence = Fence.take(store, self.scope)
            row = store.session(self.scope)
            if row is None:
                return done
            digests = Digests.load(row.summary, row.summary_upto, row.state)
            pending = [to_session_message(r) for r in self._records(digests.upto)]
            fold = plan(self._policy, digests, pending)
            if fold is None:
                return done
            text, mode = self._summarize(fold, self._max_tokens())
            after = apply_fold(digests, fold, text)
            try:
                with store.write() as tx:
                    now = store.session(self.scope)
                    if now is None:
                        return done  # deleted meanwhile
                    fence.hold(tx)  # a message erased meanwhile: its summary is not written
                    if (now.summary_upto, now.summary, now.state) != (
                            row.summary_upto, row.summary, row.state):
                        continue  # another writer moved the summaries: plan again from theirs
                    tx.put_session(replace(now, summary=after.summary, summary_upto=after.upto,
                                           state={**now.state, **after.state(), "mode": mode}))
            except Erased:
                continue  # plan again from what remains
            done += 1
            log.info("session %s: folded %d messages (%s, level %d)", self.id, fold.count, mode,
                     fold.level)

    def _summarize(self, fold: Fold, max_tokens: int) -> tuple[str, str]:
        """A summary of `fold`, redacted: its messages were, but an LLM's summary is the
        model's words, and it may see messages stored before redaction was on."""
        text, mode = self._get_summarizer().summarize(fold, max_tokens)
        return redact(text, self._engine.config.redact).text, mode

    def _max_tokens(self) -> int:
        return int(getattr(self._policy, "max_tokens", END_SUMMARY_TOKENS))

    # -- end, delete -------------------------------------------------------------------------

    def end(self) -> MemoryRecord | None:
        """Close the session: write its summary as an episode (provenance: every message it
        covers; a summary from an earlier `end` is superseded), mark it ended, then run
        extraction over what it said. Returns the summary, or None with no new messages.

        With no LLM the summary is extractive and extraction stores nothing new.
        """
        self.wait()
        store = self._engine.store
        fence = Fence.take(store, self.scope)
        row = store.session(self.scope)
        if row is None:
            return None
        records = self._records()
        if not records or row.state.get("ended_upto") == records[-1].id:
            if row.ended_at is None:
                with store.write() as tx:
                    tx.put_session(replace(row, ended_at=utcnow()))
            return None
        digests = Digests.load(row.summary, row.summary_upto, row.state)
        if not self._policy.summarizes:
            digests = Digests()
        covered = digests.upto
        pending = tuple(to_session_message(r) for r in records
                        if covered is None or r.id > covered)
        lower = tuple(d for level in reversed(digests.levels) for d in level)
        text, mode = self._summarize(Fold(0, digests.summary, pending, lower), END_SUMMARY_TOKENS)
        if not text.strip():
            text = "\n".join(m.text for m in pending)[:2000] or "(empty session)"
        self._extract(fence)  # first: what the session said, not its summary
        return self._write_summary(row, records, text, mode, fence)

    def _write_summary(self, row: Session, records: list[MemoryRecord], text: str,
                       mode: str, fence: Fence) -> MemoryRecord:
        store = self._engine.store
        now = utcnow()
        first, last = records[0], records[-1]
        rec = MemoryRecord(
            id=new_id(), scope=self.scope, kind=Kind.EPISODIC, text=text,
            metadata={"engram": SUMMARY_MARK, "messages": len(records), "mode": mode,
                      "from": (first.observed_at or first.created_at).isoformat()},
            importance=0.6, created_at=now, updated_at=now, role="system",
            observed_at=last.observed_at or last.created_at,
            valid_from=last.observed_at or now, provenance=tuple(r.id for r in records),
            content_hash=content_hash(text))
        keys, lexical = index(self._engine, [rec])[rec.id]
        previous_id = row.state.get("summary_id")
        with store.write() as tx:
            fence.hold(tx)  # deleted, or a message erased, since `end` began: no summary
            tx.insert(rec, keys, lexical)
            tx.append(event(EventType.ADD, rec, now, after=rec, reason="end of session summary"))
            old = store.get([previous_id]).get(previous_id) if previous_id else None
            if old is not None and old.deleted_at is None and old.superseded_by is None:
                newer = replace(old, valid_to=now, superseded_by=rec.id, updated_at=now)
                tx.update(newer)
                tx.append(event(EventType.SUPERSEDE, newer, now, before=old, after=newer,
                                 reason="the session went on; a new summary covers it"))
            cur = store.session(self.scope) or row
            tx.put_session(replace(cur, ended_at=now, state={
                **cur.state, "ended_upto": last.id, "summary_id": rec.id}))
        log.info("session %s ended: summary %s over %d messages (%s)", self.id, rec.id,
                 len(records), mode)
        return rec

    def _extract(self, fence: Fence) -> None:
        try:
            learn.learn_from(self._engine, self.scope, extraction.EXTRACT, None, fence)
        except ProviderError as exc:
            log.warning("session %s: extraction failed, the episodes are kept: %s", self.id, exc)

    def delete(self) -> int:
        """Erase the session: its messages, its summaries, its row, its jobs and the memories
        derived from it (facts extracted into the user's scope too). Returns how many memories
        were erased; NotFound if the session does not exist."""
        self.wait()
        return erase.session(self._engine, self.scope).memories


def open_session(queue: Queue, *, session_id: str | None, user_id: str | None,
                 agent_id: str | None, policy: Policy | Mapping[str, Any] | str | None,
                 metadata: Mapping[str, Any] | None) -> SessionHandle:
    """The handle of a stored session (its stored policy unless `policy` is given) or of a new
    one (no `session_id`: a new id). A resumed session catches up on its summaries in the
    background (after a crash, they may lag)."""
    scope = valid.scope(user_id, agent_id, session_id if session_id is not None else new_id())
    wanted = as_policy(policy)
    meta = (redact_value(valid.metadata(metadata), queue.engine.config.redact)
            if metadata is not None else None)
    row = queue.engine.store.session(scope)
    stored = from_dict(row.policy) if row is not None and row.policy else None
    chosen = wanted or stored or DEFAULT_POLICY

    handle = SessionHandle(queue, scope, chosen, metadata=meta)
    if row is not None and (chosen != stored or (meta is not None and meta != row.metadata)):
        handle._save_settings(meta)
    if row is not None and chosen.summarizes:
        handle._schedule()
    return handle

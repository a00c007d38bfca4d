"""The session handle: a persisted conversation with a policy for what the model sees of it.

Messages are episodes of the session's scope; the session row holds what is derived from them
(summaries). Summaries are brought up to date by a background thread after `add`; a summary
that fails or lags only means more messages are shown verbatim: none is ever lost.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import InvalidInput, NotFound, ProviderError
from ..model import Event, EventType, Kind, MemoryRecord, Scope, Session, new_id, utcnow
from ..pipeline.text import content_hash
from ..providers.tokens import Tokenizer, get_tokenizer
from ..store import Query
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

if TYPE_CHECKING:
    from ..memory import Memory
    from ..providers.llms import LLM

log = logging.getLogger("engram.working")
T = TypeVar("T")

ROLES = ("user", "assistant", "system", "tool")
SUMMARY_MARK = "session_summary"  # metadata["engram"] of a session's end-of-session summary
END_SUMMARY_TOKENS = 400
PAGE = 500


def is_session_summary(rec: MemoryRecord) -> bool:
    return rec.metadata.get("engram") == SUMMARY_MARK


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

    def __init__(self, memory: Memory, scope: Scope, policy: Policy, *,
                 tokenizer: Tokenizer | None = None, llm: LLM | None | Callable[[], LLM | None] = None,
                 metadata: Mapping[str, Any] | None = None) -> None:
        self.memory = memory
        self._metadata = dict(metadata) if metadata is not None else None  # for a new row
        self.scope = scope
        self._policy = policy
        self.tokenizer = tokenizer or get_tokenizer()
        self._llm = llm
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
        row = self.memory.store.session(self.scope)
        if row is None:
            now = utcnow()
            return Session(scope=self.scope, policy=self._policy.to_dict(), created_at=now,
                           updated_at=now)
        return row

    def _save_settings(self, metadata: Mapping[str, Any] | None) -> None:
        """Store a changed policy or metadata on an existing session."""
        with self.memory.store.write() as tx:
            row = self.memory.store.session(self.scope)
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
        episodes = [to_episode(m, now) for m in items]
        s = self.scope
        result = self.memory.add(episodes, user_id=s.user_id, agent_id=s.agent_id,
                                 session_id=s.session_id, infer=False)
        with self.memory.store.write() as tx:
            row = self.memory.store.session(self.scope)
            if row is None:
                row = Session(scope=self.scope, policy=self._policy.to_dict(), created_at=now,
                              updated_at=now, metadata=self._metadata or {})
            tx.put_session(replace(row, updated_at=utcnow(), ended_at=None))
        if self._policy.summarizes:
            self._schedule()
        return result.memories

    # -- read --------------------------------------------------------------------------------

    def _records(self, after: str | None = None) -> list[MemoryRecord]:
        """The session's messages after the id `after`, oldest first."""
        q = Query(scope=self.scope, now=utcnow(), kinds=(Kind.EPISODIC,))
        out: list[MemoryRecord] = []
        cursor = after
        while True:
            page = self.memory.store.select(q, after_id=cursor, limit=PAGE)
            out += [r for r in page if r.scope == self.scope and not is_session_summary(r)]
            if len(page) < PAGE:
                return out
            cursor = page[-1].id

    def messages(self) -> list[SessionMessage]:
        """Every message of the session, oldest first."""
        return [to_session_message(r) for r in self._records()]

    def digests(self) -> Digests:
        row = self.memory.store.session(self.scope)
        if row is None:
            return Digests()
        return Digests.load(row.summary, row.summary_upto, row.state)

    def view(self) -> View:
        """What the policy shows the model now: summaries, then the verbatim messages."""
        digests = self.digests() if self._policy.summarizes else Digests()
        pending = [to_session_message(r) for r in self._records(digests.upto)]
        return view(self._policy, digests, pending, self.tokenizer.count_message)

    # -- summaries ---------------------------------------------------------------------------

    def _get_summarizer(self) -> Summarizer:
        if self._summarizer is None:
            llm = self._llm() if callable(self._llm) else self._llm
            self._summarizer = Summarizer(self.memory.embedder, self.tokenizer, llm)
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
        store = self.memory.store
        done = 0
        while True:
            row = store.session(self.scope)
            if row is None:
                return done
            digests = Digests.load(row.summary, row.summary_upto, row.state)
            pending = [to_session_message(r) for r in self._records(digests.upto)]
            fold = plan(self._policy, digests, pending)
            if fold is None:
                return done
            text, mode = self._get_summarizer().summarize(fold, self._max_tokens())
            after = apply_fold(digests, fold, text)
            with store.write() as tx:
                now = store.session(self.scope)
                if now is None:
                    return done  # deleted meanwhile
                if (now.summary_upto, now.summary, now.state) != (row.summary_upto, row.summary,
                                                                   row.state):
                    continue  # another writer moved the summaries: plan again from theirs
                tx.put_session(replace(now, summary=after.summary, summary_upto=after.upto,
                                       state={**now.state, **after.state(), "mode": mode}))
            done += 1
            log.info("session %s: folded %d messages (%s, level %d)", self.id, fold.count, mode,
                     fold.level)

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
        store = self.memory.store
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
        text, mode = self._get_summarizer().summarize(
            Fold(0, digests.summary, pending, lower), END_SUMMARY_TOKENS)
        if not text.strip():
            text = "\n".join(m.text for m in pending)[:2000] or "(empty session)"
        self._extract()  # first: what the session said, not its summary
        return self._write_summary(row, records, text, mode)

    def _write_summary(self, row: Session, records: list[MemoryRecord], text: str,
                       mode: str) -> MemoryRecord:
        from ..memory import _event

        store = self.memory.store
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
        keys, lexical = self.memory._index([rec])[rec.id]
        previous_id = row.state.get("summary_id")
        with store.write() as tx:
            tx.insert(rec, keys, lexical)
            tx.append(_event(EventType.ADD, rec, now, after=rec, reason="end of session summary"))
            old = store.get([previous_id]).get(previous_id) if previous_id else None
            if old is not None and old.deleted_at is None and old.superseded_by is None:
                newer = replace(old, valid_to=now, superseded_by=rec.id, updated_at=now)
                tx.update(newer)
                tx.append(_event(EventType.SUPERSEDE, newer, now, before=old, after=newer,
                                 reason="the session went on; a new summary covers it"))
            cur = store.session(self.scope) or row
            tx.put_session(replace(cur, ended_at=now, state={
                **cur.state, "ended_upto": last.id, "summary_id": rec.id}))
        log.info("session %s ended: summary %s over %d messages (%s)", self.id, rec.id,
                 len(records), mode)
        return rec

    def _extract(self) -> None:
        extract = getattr(self.memory, "extract", None)  # LLM extraction (lifecycle issue)
        if extract is None:
            return
        s = self.scope
        try:
            extract(user_id=s.user_id, agent_id=s.agent_id, session_id=s.session_id)
        except ProviderError as exc:
            log.warning("session %s: extraction failed, the episodes are kept: %s", self.id, exc)

    def delete(self) -> int:
        """Erase the session: its messages, its summaries and its row. Returns how many
        memories were erased. Facts extracted from it into the user's scope stay."""
        self.wait()
        store = self.memory.store
        ids = store.ids(self.scope, include_deleted=True)
        records = store.get(ids)
        mine = [i for i in ids if i in records and records[i].scope == self.scope]
        if not mine and store.session(self.scope) is None:
            raise NotFound(f"no session {self.id!r} in this scope")
        now = utcnow()
        with store.write() as tx:
            tx.erase(mine)
            tx.delete_session(self.scope)
            tx.append(Event(id=new_id(), memory_id=None, type=EventType.ERASE, at=now,
                            scope=self.scope, reason=f"session deleted: {len(mine)} memories"))
        store.reclaim()
        log.info("session %s deleted (%d memories)", self.id, len(mine))
        return len(mine)


def reset_summaries(store: Any, tx: Any, scope: Scope) -> bool:
    """Drop the running summaries of the session of `scope` (inside the caller's write
    transaction), so they are rebuilt from the messages that remain: for `Memory.erase` of one
    message, whose text a summary may quote. Returns whether there was anything to drop."""
    row = store.session(scope)
    if row is None or not (row.summary or row.summary_upto or row.state.get("levels")):
        return False
    state = {k: v for k, v in row.state.items() if k not in ("levels", "folded", "mode")}
    tx.put_session(replace(row, summary="", summary_upto=None, state=state))
    return True


# -- the Memory methods delegate here ----------------------------------------------------------

def open_session(memory: Memory, *, session_id: str | None, user_id: str | None,
                 agent_id: str | None, policy: Policy | Mapping[str, Any] | str | None,
                 metadata: Mapping[str, Any] | None, catch_up: bool = True) -> SessionHandle:
    from .. import validate as valid

    scope = valid.scope(user_id, agent_id, session_id if session_id is not None else new_id())
    wanted = as_policy(policy)
    meta = valid.metadata(metadata) if metadata is not None else None
    row = memory.store.session(scope)
    stored = from_dict(row.policy) if row is not None and row.policy else None
    chosen = wanted or stored or DEFAULT_POLICY

    handle = SessionHandle(memory, scope, chosen, llm=getattr(memory, "llm", None), metadata=meta)
    memory._sessions.add(handle)  # so that Memory.close() lets its summaries finish
    if row is not None and (chosen != stored or (meta is not None and meta != row.metadata)):
        handle._save_settings(meta)
    if catch_up and row is not None and chosen.summarizes:
        handle._schedule()  # a session resumed after a crash catches up on its summaries
    return handle


def list_sessions(memory: Memory, *, user_id: str | None, agent_id: str | None,
                  session_id: str | None = None, limit: int = 50) -> list[Session]:
    from .. import validate as valid

    return memory.store.sessions(valid.scope(user_id, agent_id, session_id), limit=valid.limit(limit))


class AsyncSessionHandle:
    """`SessionHandle` with coroutine methods (the same code, in a worker thread)."""

    def __init__(self, handle: SessionHandle) -> None:
        self.sync = handle

    @property
    def id(self) -> str:
        return self.sync.id

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    async def add(self, messages: Any) -> list[MemoryRecord]:
        return await self._run(self.sync.add, messages)

    async def messages(self) -> list[SessionMessage]:
        return await self._run(self.sync.messages)

    async def view(self) -> View:
        return await self._run(self.sync.view)

    async def wait(self, timeout: float | None = None) -> bool:
        return await self._run(self.sync.wait, timeout)

    async def end(self) -> MemoryRecord | None:
        return await self._run(self.sync.end)

    async def delete(self) -> int:
        return await self._run(self.sync.delete)

    async def info(self) -> Session:
        return await self._run(self.sync.info)

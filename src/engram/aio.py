"""`AsyncMemory` and `AsyncSessionHandle`: the same methods, with the same signatures, as
coroutines. One implementation: each call runs the sync method in a worker thread.

tests/test_async.py holds the two classes to `Memory` / `SessionHandle` signature by signature.
"""

from __future__ import annotations

import asyncio
import builtins
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from .config import Config
from .context import Block, Context
from .memory import Memory
from .model import (
    UNSET,
    AddResult,
    Entity,
    EntityProfile,
    Event,
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
)
from .pipeline.retrieve import RetrievalConfig
from .providers.embedders import Embedder
from .providers.llms import LLM
from .store import Stats, Store
from .working.policies import Digests, Policy, SessionMessage, View
from .working.session import SessionHandle

P = ParamSpec("P")
T = TypeVar("T")


async def _in_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    return await asyncio.to_thread(fn, *args, **kwargs)


class AsyncMemory:
    """`Memory` with coroutine methods. The same implementation runs in a worker thread."""

    def __init__(self, path: str | Path | None = None, *, config: Config | None = None,
                 embedder: Embedder | None = None, store: Store | None = None,
                 retrieval: str | RetrievalConfig | None = None,
                 tenant: str | None = None, llm: LLM | None | Unset = UNSET,
                 check_space: bool = True) -> None:
        self.sync = Memory(path, config=config, embedder=embedder, store=store,
                           retrieval=retrieval, tenant=tenant, llm=llm, check_space=check_space)

    async def close(self) -> None:
        await _in_thread(self.sync.close)

    async def __aenter__(self) -> AsyncMemory:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def add(self, messages: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]], *,
                  user_id: str | None = None, agent_id: str | None = None,
                  session_id: str | None = None, metadata: Mapping[str, Any] | None = None,
                  observed_at: datetime | str | None = None, infer: bool = True,
                  kind: str | Kind | None = None, importance: float | None = None,
                  expires_at: datetime | str | None = None,
                  supersedes: str | Sequence[str] | None = None, background: bool = False,
                  idempotency_key: str | None = None) -> AddResult:
        return await _in_thread(
            self.sync.add, messages, user_id=user_id, agent_id=agent_id, session_id=session_id,
            metadata=metadata, observed_at=observed_at, infer=infer, kind=kind,
            importance=importance, expires_at=expires_at, supersedes=supersedes,
            background=background, idempotency_key=idempotency_key)

    async def extract(self, *, user_id: str | None = None, agent_id: str | None = None,
                      session_id: str | None = None) -> AddResult:
        return await _in_thread(self.sync.extract, user_id=user_id, agent_id=agent_id,
                                session_id=session_id)

    async def reflect(self, *, user_id: str | None = None, agent_id: str | None = None,
                      session_id: str | None = None, limit: int = 50) -> AddResult:
        return await _in_thread(self.sync.reflect, user_id=user_id, agent_id=agent_id,
                                session_id=session_id, limit=limit)

    async def update(self, id: str, *, text: str | Unset = UNSET,
                     metadata: Mapping[str, Any] | None | Unset = UNSET,
                     importance: float | Unset = UNSET, expires_at: datetime | str | None | Unset = UNSET,
                     valid_from: datetime | str | Unset = UNSET,
                     user_id: str | None = None, agent_id: str | None = None,
                     session_id: str | None = None) -> MemoryRecord:
        return await _in_thread(self.sync.update, id, text=text, metadata=metadata,
                                importance=importance, expires_at=expires_at,
                                valid_from=valid_from, user_id=user_id, agent_id=agent_id,
                                session_id=session_id)

    async def delete(self, id: str, *, user_id: str | None = None, agent_id: str | None = None,
                     session_id: str | None = None) -> None:
        await _in_thread(self.sync.delete, id, user_id=user_id, agent_id=agent_id,
                         session_id=session_id)

    async def erase(self, *, id: str | None = None, user_id: str | None = None,
                    agent_id: str | None = None, session_id: str | None = None) -> int:
        return await _in_thread(self.sync.erase, id=id, user_id=user_id, agent_id=agent_id,
                                session_id=session_id)

    async def erase_receipt(self, *, id: str | None = None, user_id: str | None = None,
                            agent_id: str | None = None, session_id: str | None = None) -> Receipt:
        return await _in_thread(self.sync.erase_receipt, id=id, user_id=user_id,
                                agent_id=agent_id, session_id=session_id)

    async def receipts(self, *, user_id: str | None = None, agent_id: str | None = None,
                       session_id: str | None = None, limit: int = 50) -> builtins.list[Receipt]:
        return await _in_thread(self.sync.receipts, user_id=user_id, agent_id=agent_id,
                                session_id=session_id, limit=limit)

    async def retain(self, *, now: datetime | None = None) -> Receipt | None:
        return await _in_thread(self.sync.retain, now=now)

    async def get(self, id: str, *, user_id: str | None = None, agent_id: str | None = None,
                  session_id: str | None = None) -> MemoryRecord:
        return await _in_thread(self.sync.get, id, user_id=user_id, agent_id=agent_id,
                                session_id=session_id)

    async def list(self, *, user_id: str | None = None, agent_id: str | None = None,
                   session_id: str | None = None, filters: Mapping[str, Any] | None = None,
                   kinds: Iterable[str | Kind] | None = None, as_of: datetime | str | None = None,
                   cursor: str | None = None, limit: int = 50) -> Page:
        return await _in_thread(self.sync.list, user_id=user_id, agent_id=agent_id,
                                session_id=session_id, filters=filters, kinds=kinds, as_of=as_of,
                                cursor=cursor, limit=limit)

    async def search(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
                     session_id: str | None = None, filters: Mapping[str, Any] | None = None,
                     limit: int = 10, kinds: Iterable[str | Kind] | None = None,
                     as_of: datetime | str | None = None) -> builtins.list[Hit]:
        return await _in_thread(self.sync.search, query, user_id=user_id, agent_id=agent_id,
                                session_id=session_id, filters=filters, limit=limit, kinds=kinds,
                                as_of=as_of)

    async def history(self, id: str, *, user_id: str | None = None, agent_id: str | None = None,
                      session_id: str | None = None) -> builtins.list[Event]:
        return await _in_thread(self.sync.history, id, user_id=user_id, agent_id=agent_id,
                                session_id=session_id)

    # -- the knowledge graph ----------------------------------------------------------------

    async def relate(self, subject: str, predicate: str, object: str | int | float | datetime, *,
                     valid_from: datetime | str | None = None, valid_to: datetime | str | None = None,
                     user_id: str | None = None, agent_id: str | None = None,
                     metadata: Mapping[str, Any] | None = None, single: bool | None = None,
                     literal: bool = False, subject_type: str | None = None,
                     object_type: str | None = None, fact: str | None = None) -> Relation:
        return await _in_thread(
            self.sync.relate, subject, predicate, object, valid_from=valid_from,
            valid_to=valid_to, user_id=user_id, agent_id=agent_id, metadata=metadata,
            single=single, literal=literal, subject_type=subject_type, object_type=object_type,
            fact=fact)

    async def unrelate(self, subject: str, predicate: str,
                       object: str | int | float | datetime | None = None, *,
                       at: datetime | str | None = None, retract: bool = False, literal: bool = False,
                       user_id: str | None = None,
                       agent_id: str | None = None) -> builtins.list[Relation]:
        return await _in_thread(self.sync.unrelate, subject, predicate, object, at=at,
                                retract=retract, literal=literal, user_id=user_id,
                                agent_id=agent_id)

    async def upsert_entity(self, name: str, *, type: str | None = None,
                            aliases: Sequence[str] | None = None, summary: str | None = None,
                            attributes: Mapping[str, Any] | None = None,
                            user_id: str | None = None, agent_id: str | None = None) -> Entity:
        return await _in_thread(self.sync.upsert_entity, name, type=type, aliases=aliases,
                                summary=summary, attributes=attributes, user_id=user_id,
                                agent_id=agent_id)

    async def delete_entity(self, name: str, *, user_id: str | None = None,
                            agent_id: str | None = None) -> Subgraph:
        return await _in_thread(self.sync.delete_entity, name, user_id=user_id, agent_id=agent_id)

    async def entity(self, name: str, *, user_id: str | None = None, agent_id: str | None = None,
                     session_id: str | None = None, mentions: int = 5) -> EntityProfile:
        return await _in_thread(self.sync.entity, name, user_id=user_id, agent_id=agent_id,
                                session_id=session_id, mentions=mentions)

    async def entities(self, query: str | None = None, *, type: str | None = None,
                       limit: int = 50, cursor: str | None = None, user_id: str | None = None,
                       agent_id: str | None = None) -> builtins.list[Entity]:
        return await _in_thread(self.sync.entities, query, type=type, limit=limit, cursor=cursor,
                                user_id=user_id, agent_id=agent_id)

    async def relations(self, subject: str | None = None, predicate: str | None = None,
                        object: str | None = None, *, as_of: datetime | str | None = None,
                        history: bool = False, limit: int = 100, user_id: str | None = None,
                        agent_id: str | None = None) -> builtins.list[Relation]:
        return await _in_thread(self.sync.relations, subject, predicate, object, as_of=as_of,
                                history=history, limit=limit, user_id=user_id, agent_id=agent_id)

    async def neighbours(self, name: str, *, depth: int = 1, as_of: datetime | str | None = None,
                         user_id: str | None = None, agent_id: str | None = None) -> Subgraph:
        return await _in_thread(self.sync.neighbours, name, depth=depth, as_of=as_of,
                                user_id=user_id, agent_id=agent_id)

    async def path(self, a: str, b: str, *, max_depth: int = 4, as_of: datetime | str | None = None,
                   user_id: str | None = None, agent_id: str | None = None) -> Subgraph:
        return await _in_thread(self.sync.path, a, b, max_depth=max_depth, as_of=as_of,
                                user_id=user_id, agent_id=agent_id)

    async def stats(self, *, user_id: str | None = None, agent_id: str | None = None,
                    session_id: str | None = None) -> Stats:
        return await _in_thread(self.sync.stats, user_id=user_id, agent_id=agent_id,
                                session_id=session_id)

    async def job(self, id: str) -> Job:
        return await _in_thread(self.sync.job, id)

    async def retry(self, id: str) -> Job:
        return await _in_thread(self.sync.retry, id)

    async def jobs(self, *, user_id: str | None = None, agent_id: str | None = None,
                   session_id: str | None = None, status: str | JobStatus | None = None,
                   limit: int = 50) -> builtins.list[Job]:
        return await _in_thread(self.sync.jobs, user_id=user_id, agent_id=agent_id,
                                session_id=session_id, status=status, limit=limit)

    async def wait(self, job_id: str, timeout: float | None = None) -> Job:
        return await _in_thread(self.sync.wait, job_id, timeout)

    async def resume(self) -> bool:
        return await _in_thread(self.sync.resume)

    async def work(self, *, until_idle: bool = False, stop: threading.Event | None = None,
                   poll_s: float = 0.5) -> int:
        return await _in_thread(self.sync.work, until_idle=until_idle, stop=stop, poll_s=poll_s)

    async def embedding_space(self) -> dict[str, str | None]:
        return await _in_thread(self.sync.embedding_space)

    async def reindex(self, *, user_id: str | None = None, agent_id: str | None = None,
                      progress: Callable[[int, int], None] | None = None) -> int:
        return await _in_thread(self.sync.reindex, user_id=user_id, agent_id=agent_id,
                                progress=progress)

    async def session(self, *, session_id: str | None = None, user_id: str | None = None,
                      agent_id: str | None = None,
                      policy: Policy | Mapping[str, Any] | str | None = None,
                      metadata: Mapping[str, Any] | None = None) -> AsyncSessionHandle:
        return AsyncSessionHandle(await _in_thread(
            self.sync.session, session_id=session_id, user_id=user_id, agent_id=agent_id,
            policy=policy, metadata=metadata))

    async def sessions(self, *, user_id: str | None = None, agent_id: str | None = None,
                       session_id: str | None = None, limit: int = 50) -> builtins.list[Session]:
        return await _in_thread(self.sync.sessions, user_id=user_id, agent_id=agent_id,
                                session_id=session_id, limit=limit)

    async def context(self, query_or_messages: str | Sequence[Mapping[str, Any]], *,
                      user_id: str | None = None, agent_id: str | None = None,
                      session_id: str | None = None, budget_tokens: int = 2000,
                      blocks: Sequence[Block] | None = None,
                      instructions: str | None = None) -> Context:
        return await _in_thread(self.sync.context, query_or_messages, user_id=user_id,
                                agent_id=agent_id, session_id=session_id,
                                budget_tokens=budget_tokens, blocks=blocks,
                                instructions=instructions)

    async def export(self, path: str | Path, *, user_id: str | None = None,
                     agent_id: str | None = None, session_id: str | None = None) -> int:
        return await _in_thread(self.sync.export, path, user_id=user_id, agent_id=agent_id,
                                session_id=session_id)

    async def import_(self, path: str | Path,
                      progress: Callable[[int, int], None] | None = None) -> int:
        return await _in_thread(self.sync.import_, path, progress)


class AsyncSessionHandle:
    """`SessionHandle` with coroutine methods (the same code, in a worker thread)."""

    def __init__(self, handle: SessionHandle) -> None:
        self.sync = handle

    @property
    def id(self) -> str:
        return self.sync.id

    @property
    def policy(self) -> Policy:
        return self.sync.policy

    def __repr__(self) -> str:
        return f"Async{self.sync!r}"

    async def __aenter__(self) -> AsyncSessionHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def info(self) -> Session:
        return await _in_thread(self.sync.info)

    async def save(self) -> Session:
        return await _in_thread(self.sync.save)

    async def add(self, messages: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]],
                  ) -> builtins.list[MemoryRecord]:
        return await _in_thread(self.sync.add, messages)

    async def messages(self) -> builtins.list[SessionMessage]:
        return await _in_thread(self.sync.messages)

    async def digests(self) -> Digests:
        return await _in_thread(self.sync.digests)

    async def view(self) -> View:
        return await _in_thread(self.sync.view)

    async def wait(self, timeout: float | None = None) -> bool:
        return await _in_thread(self.sync.wait, timeout)

    async def close(self) -> None:
        await _in_thread(self.sync.close)

    async def refresh(self) -> int:
        return await _in_thread(self.sync.refresh)

    async def end(self) -> MemoryRecord | None:
        return await _in_thread(self.sync.end)

    async def delete(self) -> int:
        return await _in_thread(self.sync.delete)

"""The /v1 routes: each handler authenticates, picks the tenant's `Memory` and calls one method.

No memory logic lives here (ARCHITECTURE rule 1): validation of texts, times, filters and ids
happens in `Memory` and comes back as `InvalidInput` (422). Handlers are plain `def`s, run in
the server's thread pool, because `Memory` is synchronous.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from ..errors import InvalidFilter, InvalidInput, NotFound
from ..memory import Memory
from ..model import Job, Kind, new_id
from .auth import Principal, require_admin
from .errors import ServiceError
from .ratelimit import retry_after_header
from .schemas import (
    MAX_ID,
    MAX_PAGE,
    AddIn,
    AddOut,
    ContextIn,
    ContextOut,
    EraseIn,
    EraseOut,
    ErrorOut,
    HistoryOut,
    ImportOut,
    JobOut,
    MemoryOut,
    PageOut,
    SearchIn,
    SearchOut,
    SessionIn,
    SessionMessagesIn,
    SessionOut,
    UpdateIn,
    as_messages,
)

MAX_IDEMPOTENCY_KEY = 200
NDJSON = "application/x-ndjson"


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    described = {401: "No or a bad API key", 403: "The key's role may not do this",
                 404: "Not found in this tenant", 409: "Idempotency-Key reused with another body",
                 413: "Request body too large", 422: "Invalid input",
                 429: "Rate limited (see Retry-After)",
                 503: "Database unavailable or busy (see Retry-After)"}
    return {s: {"model": ErrorOut, "description": described[s]} for s in statuses}


COMMON = _errors(401, 413, 422, 429, 503)
router = APIRouter(prefix="/v1", responses=COMMON)


@dataclass(frozen=True)
class Ctx:
    principal: Principal
    mem: Memory


def _context(request: Request, authorization: Annotated[str | None, Header()] = None) -> Ctx:
    """Authenticate, spend a rate-limit token, open the tenant's memory."""
    state = request.app.state
    principal = state.auth(authorization)
    wait = state.limiter.take(principal.bucket)
    if wait > 0:
        raise ServiceError(429, "rate_limited",
                           f"rate limit of {state.limiter.rate:g} requests/s reached; retry later",
                           {"Retry-After": retry_after_header(wait)})
    return Ctx(principal, state.tenants.get(principal.tenant))


Context = Annotated[Ctx, Depends(_context)]
MemoryId = Annotated[str, PathParam(min_length=1, max_length=MAX_ID)]
ScopeQ = Annotated[str | None, Query(min_length=1, max_length=MAX_ID)]


def _supports(method: Any, *params: str) -> bool:
    """Whether this engram's `Memory` has a feature yet (background jobs, sessions)."""
    try:
        names = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return all(p in names for p in params)


# -- memories ----------------------------------------------------------------------------------

@router.post("/memories", status_code=201, response_model=AddOut, tags=["memories"],
             responses={202: {"model": AddOut, "description": "Queued as a background job"},
                        **_errors(409)})
def add_memories(body: AddIn, ctx: Context,
                 idempotency_key: Annotated[str | None, Header(
                     min_length=1, max_length=MAX_IDEMPOTENCY_KEY,
                     description="Retries with the same key and body do the add once; the same "
                                 "key with another body answers 409.")] = None) -> Any:
    kwargs: dict[str, Any] = dict(
        **body.scope(), metadata=body.metadata, observed_at=body.observed_at, infer=body.infer,
        kind=body.kind, importance=body.importance, expires_at=body.expires_at)
    if body.background or idempotency_key is not None:
        if not _supports(ctx.mem.add, "background", "idempotency_key"):
            raise InvalidInput("background adds and Idempotency-Key need the job queue, which this "
                               "engram does not have yet")
        kwargs.update(background=body.background, idempotency_key=idempotency_key)
    result = ctx.mem.add(as_messages(body.messages), **kwargs)
    if isinstance(result, Job):
        return JSONResponse({"memories": [], "events": [], "job": result.to_dict()}, status_code=202)
    return {"memories": [m.to_dict() for m in result.memories],
            "events": [e.to_dict() for e in result.events], "job": None}


@router.post("/memories/search", response_model=SearchOut, tags=["memories"])
def search_memories(body: SearchIn, ctx: Context) -> Any:
    hits = ctx.mem.search(body.query, **body.scope(), filters=body.filters, limit=body.limit,
                          kinds=body.kinds, as_of=body.as_of)
    return {"hits": [{"memory": h.memory.to_dict(), "score": h.score, "explain": h.explain}
                     for h in hits]}


@router.get("/memories", response_model=PageOut, tags=["memories"])
def list_memories(ctx: Context, user_id: ScopeQ = None, agent_id: ScopeQ = None,
                  session_id: ScopeQ = None,
                  kind: Annotated[list[Kind] | None, Query(max_length=3)] = None,
                  filters: Annotated[str | None, Query(
                      max_length=10_000, description='JSON, e.g. {"topic": "food"}')] = None,
                  cursor: Annotated[str | None, Query(max_length=MAX_ID)] = None,
                  limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20) -> Any:
    parsed = None
    if filters is not None:
        try:
            parsed = json.loads(filters)
        except json.JSONDecodeError as exc:
            raise InvalidFilter(f"filters is not valid JSON: {exc}") from None
    page = ctx.mem.list(user_id=user_id, agent_id=agent_id, session_id=session_id, filters=parsed,
                        kinds=kind or None, cursor=cursor, limit=limit)
    return {"items": [m.to_dict() for m in page.items], "next_cursor": page.next_cursor}


@router.get("/memories/{id}", response_model=MemoryOut, tags=["memories"], responses=_errors(404))
def get_memory(id: MemoryId, ctx: Context) -> Any:
    return ctx.mem.get(id).to_dict()


@router.patch("/memories/{id}", response_model=MemoryOut, tags=["memories"], responses=_errors(404))
def update_memory(id: MemoryId, body: UpdateIn, ctx: Context) -> Any:
    changes = {name: getattr(body, name) for name in body.model_fields_set}
    return ctx.mem.update(id, **changes).to_dict()


@router.delete("/memories/{id}", status_code=204, tags=["memories"], responses=_errors(404))
def delete_memory(id: MemoryId, ctx: Context) -> Response:
    ctx.mem.delete(id)
    return Response(status_code=204)


@router.get("/memories/{id}/history", response_model=HistoryOut, tags=["memories"],
            responses=_errors(404))
def memory_history(id: MemoryId, ctx: Context) -> Any:
    return {"events": [e.to_dict() for e in ctx.mem.history(id)]}


@router.post("/erase", response_model=EraseOut, tags=["memories"], responses=_errors(403, 404))
def erase(body: EraseIn, ctx: Context) -> Any:
    """GDPR erasure of one memory or a whole scope (user, agent, session): every trace goes."""
    require_admin(ctx.principal, "erase")
    return {"erased": ctx.mem.erase(id=body.id, **body.scope())}


@router.get("/jobs/{id}", response_model=JobOut, tags=["jobs"], responses=_errors(404))
def get_job(id: MemoryId, ctx: Context) -> Any:
    job = ctx.mem.job(id) if hasattr(ctx.mem, "job") else ctx.mem.store.job(id)
    if job is None:
        raise NotFound(f"no job with id {id!r}")
    return job.to_dict()


# -- export / import ---------------------------------------------------------------------------

@router.get("/export", tags=["export"], response_class=FileResponse,
            responses={200: {"content": {NDJSON: {"schema": {"type": "string"}}},
                             "description": "JSON lines: a header, then a memory and its history a line"},
                       **_errors(403)})
def export(ctx: Context, user_id: ScopeQ = None, agent_id: ScopeQ = None,
           session_id: ScopeQ = None) -> Any:
    """Every memory of the tenant (or of a scope), deleted and superseded ones too, with history."""
    require_admin(ctx.principal, "export")
    fd, name = tempfile.mkstemp(prefix="engram-export-", suffix=".jsonl")
    os.close(fd)
    path = Path(name)
    try:
        ctx.mem.export(path, user_id=user_id, agent_id=agent_id, session_id=session_id)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return FileResponse(path, media_type=NDJSON, background=BackgroundTask(path.unlink, missing_ok=True))


@router.post("/import", response_model=ImportOut, tags=["export"], responses=_errors(403),
             openapi_extra={"requestBody": {"required": True, "content": {
                 NDJSON: {"schema": {"type": "string"}}}}})
async def import_(request: Request, ctx: Context) -> Any:
    """Read an export back: all or nothing; ids already present are skipped."""
    require_admin(ctx.principal, "import")
    body = await request.body()  # bounded by the body size limit

    def run() -> int:
        with tempfile.TemporaryDirectory(prefix="engram-import-") as tmp:
            path = Path(tmp) / "import.jsonl"
            path.write_bytes(body)
            return ctx.mem.import_(path)

    return {"imported": await run_in_threadpool(run)}


# -- sessions and context ----------------------------------------------------------------------
# Until `Memory.session` exists, a session is its scope: its messages are the episodes with its
# session_id, and deleting it erases them.

SessionId = Annotated[str, PathParam(min_length=1, max_length=MAX_ID)]


def _session_out(mem: Memory, user_id: str | None, agent_id: str | None, session_id: str,
                 require: bool) -> dict[str, Any]:
    page = mem.list(user_id=user_id, agent_id=agent_id, session_id=session_id, limit=1)
    if require and not page.items:
        raise NotFound(f"no session with id {session_id!r}")
    first = page.items[0] if page.items else None
    created = first.created_at.isoformat() if first else None
    return {"scope": {"user_id": user_id, "agent_id": agent_id, "session_id": session_id},
            "policy": {}, "created_at": created, "updated_at": created, "summary": "",
            "summary_upto": None, "metadata": {}, "ended_at": None}


@router.post("/sessions", status_code=201, response_model=SessionOut, tags=["sessions"])
def create_session(body: SessionIn, ctx: Context) -> Any:
    from ..model import utcnow

    sid = body.session_id or new_id()
    now = utcnow().isoformat()
    return {"scope": {"user_id": body.user_id, "agent_id": body.agent_id, "session_id": sid},
            "policy": body.policy or {}, "created_at": now, "updated_at": now, "summary": "",
            "summary_upto": None, "metadata": body.metadata or {}, "ended_at": None}


@router.get("/sessions/{id}", response_model=SessionOut, tags=["sessions"], responses=_errors(404))
def get_session(id: SessionId, ctx: Context, user_id: ScopeQ = None, agent_id: ScopeQ = None) -> Any:
    return _session_out(ctx.mem, user_id, agent_id, id, require=True)


@router.delete("/sessions/{id}", status_code=204, tags=["sessions"], responses=_errors(403, 404))
def delete_session(id: SessionId, ctx: Context, user_id: ScopeQ = None,
                   agent_id: ScopeQ = None) -> Response:
    """Erase the session and its messages (an admin key: this is an erasure)."""
    require_admin(ctx.principal, "deleting a session")
    _session_out(ctx.mem, user_id, agent_id, id, require=True)
    ctx.mem.erase(user_id=user_id, agent_id=agent_id, session_id=id)
    return Response(status_code=204)


@router.post("/sessions/{id}/messages", status_code=201, response_model=AddOut, tags=["sessions"])
def add_session_messages(id: SessionId, body: SessionMessagesIn, ctx: Context,
                         user_id: ScopeQ = None, agent_id: ScopeQ = None) -> Any:
    result = ctx.mem.add(as_messages(body.messages), user_id=user_id, agent_id=agent_id,
                         session_id=id, observed_at=body.observed_at, metadata=body.metadata)
    return {"memories": [m.to_dict() for m in result.memories],
            "events": [e.to_dict() for e in result.events], "job": None}


@router.post("/context", response_model=ContextOut, tags=["sessions"])
def context(body: ContextIn, ctx: Context) -> Any:
    """What to put in the next prompt: the session's recent messages and the relevant memories."""
    recent: list[Any] = []
    if body.session_id is not None:
        recent = ctx.mem.list(user_id=body.user_id, agent_id=body.agent_id,
                              session_id=body.session_id, kinds=["episodic"], limit=MAX_PAGE).items
        recent = recent[-body.limit:]
    hits = ctx.mem.search(body.query, user_id=body.user_id, agent_id=body.agent_id,
                          limit=body.limit)
    lines = [f"{m.name or m.role or 'user'}: {m.text}" for m in recent]
    facts = [f"- {h.memory.text}" for h in hits]
    text = "\n".join((["Relevant memories:", *facts] if facts else [])
                     + (["", "Recent messages:", *lines] if lines else []))
    return {"text": text, "messages": [m.to_dict() for m in recent],
            "hits": [{"memory": h.memory.to_dict(), "score": h.score, "explain": h.explain}
                     for h in hits]}

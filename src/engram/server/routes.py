"""The /v1 routes: each handler authenticates, picks the tenant's `Memory` and calls one method.

No memory logic lives here (ARCHITECTURE rule 1): validation of texts, times, filters and ids
happens in `Memory` and comes back as `InvalidInput` (422). Handlers are plain `def`s, run in
the server's thread pool, because `Memory` is synchronous.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response, Security
from fastapi import Path as PathParam
from fastapi.encoders import jsonable_encoder
from fastapi.responses import FileResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from .. import Memory, SessionHandle
from ..errors import InvalidFilter, InvalidInput, NotFound
from ..model import Kind, Scope, Session, is_pinned
from ..working import SessionMessage
from ..working.policies import as_data
from .auth import Principal, require_access, require_admin, require_may_change
from .errors import ServiceError
from .guard import PRINCIPAL, authorization
from .limits import EMBED_CHARS_PER_UNIT, cost
from .ratelimit import RateLimiter, retry_after_header
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
    SessionEndOut,
    SessionIn,
    SessionMessagesIn,
    SessionMessagesOut,
    SessionOut,
    SessionsOut,
    SessionTranscriptOut,
    SessionViewOut,
    StatsOut,
    UpdateIn,
    as_messages,
)

MAX_IDEMPOTENCY_KEY = 200
NDJSON = "application/x-ndjson"


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    described = {401: "No or a bad API key", 403: "The key's role may not do this",
                 404: "Not found in this tenant",
                 409: "The first request with this Idempotency-Key is still in progress "
                      "(code in_progress; see Retry-After)",
                 413: "Request body too large", 422: "Invalid input",
                 429: "Rate limited (see Retry-After)",
                 503: "Database unavailable or busy (see Retry-After)"}
    return {s: {"model": ErrorOut, "description": described[s]} for s in statuses}


COMMON = _errors(401, 413, 422, 429, 503)
# Declared for the OpenAPI document (securitySchemes, and Swagger's Authorize button); the header
# itself is checked by `Authenticator`, the same way on every route and on /mcp.
BEARER = HTTPBearer(auto_error=False, scheme_name="bearer", bearerFormat="engram API key",
                    description="`Authorization: Bearer <API key>` (`engram keys create`); "
                                "not needed when the service runs with --no-auth.")


@dataclass(frozen=True)
class Ctx:
    principal: Principal
    mem: Memory
    limiter: RateLimiter


def _texts(messages: Any) -> list[str]:
    if isinstance(messages, str):
        return [messages]
    return [m if isinstance(m, str) else m.content for m in messages]


def _charge(ctx: Ctx, texts: list[str]) -> None:
    """Costly requests (much text to embed) pay for it from the tenant's rate-limit bucket."""
    ctx.limiter.charge(ctx.principal.bucket, cost(texts))


def _context(request: Request,
             _: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]) -> Ctx:
    """Authenticate, spend a rate-limit token, open the tenant's memory."""
    state = request.app.state
    principal = state.auth(authorization(request.headers.getlist("authorization")))
    # the route's template (/v1/memories/{id}), whatever prefix the app is mounted under
    require_access(principal, request.method, getattr(request.scope.get("route"), "path", request.url.path))
    request.scope[PRINCIPAL] = principal  # for the audit trail (server/audit.py)
    wait = state.limiter.take(principal.bucket)
    if wait > 0:
        raise ServiceError(429, "rate_limited",
                           f"rate limit of {state.limiter.rate:g} requests/s reached; retry later",
                           {"Retry-After": retry_after_header(wait)})
    return Ctx(principal, state.tenants.get(principal.tenant), state.limiter)


Context = Annotated[Ctx, Depends(_context)]
router = APIRouter(prefix="/v1", responses=COMMON)
MemoryId = Annotated[str, PathParam(min_length=1, max_length=MAX_ID)]
ScopeQ = Annotated[str | None, Query(min_length=1, max_length=MAX_ID)]


# -- memories ----------------------------------------------------------------------------------

@router.post("/memories", status_code=201, response_model=AddOut, tags=["memories"],
             responses={202: {"model": AddOut, "description": "Queued as a background job"},
                        **_errors(409),
                        422: {"model": ErrorOut, "description": "Invalid input, or an "
                              "Idempotency-Key reused with another body (idempotency_key_reused)"}})
def add_memories(body: AddIn, ctx: Context,
                 idempotency_key: Annotated[str | None, Header(
                     min_length=1, max_length=MAX_IDEMPOTENCY_KEY,
                     description="Retries with the same key and body do the add once; while the "
                                 "first is still running they answer 409 with Retry-After; the "
                                 "same key with another body answers 422.")] = None) -> Any:
    if body.kind is Kind.PROCEDURAL or _pins(body.metadata, body.messages):
        require_admin(ctx.principal, "writing a rule (kind procedural) or a pinned memory")
    _charge(ctx, _texts(body.messages))
    kwargs: dict[str, Any] = dict(
        **body.scope(), metadata=body.metadata, observed_at=body.observed_at, infer=body.infer,
        kind=body.kind, importance=body.importance, expires_at=body.expires_at)
    # KeyReused (another body under this key) answers 422, InProgress 409 with Retry-After
    # (server/errors.py), as the IETF Idempotency-Key draft says
    result = ctx.mem.add(as_messages(body.messages), **kwargs, background=body.background,
                         idempotency_key=idempotency_key)
    out = {"memories": [m.to_dict() for m in result.memories],
           "events": [e.to_dict() for e in result.events], "notes": list(result.notes),
           "job": result.job.to_dict() if result.job else None}
    if result.job is not None and body.background:
        return JSONResponse(jsonable_encoder(AddOut.model_validate(out)), status_code=202)
    return out


def _pins(metadata: dict[str, Any] | None, messages: Any) -> bool:
    """Does the request pin a memory (its metadata, or one of its messages' metadata)?"""
    listed = messages if isinstance(messages, list) else []
    return is_pinned(metadata or {}) or any(
        not isinstance(m, str) and is_pinned(m.metadata or {}) for m in listed)


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
        except RecursionError:
            raise InvalidFilter("filters is nested too deep") from None
    page = ctx.mem.list(user_id=user_id, agent_id=agent_id, session_id=session_id, filters=parsed,
                        kinds=kind or None, cursor=cursor, limit=limit)
    return {"items": [m.to_dict() for m in page.items], "next_cursor": page.next_cursor}


@router.get("/memories/{id}", response_model=MemoryOut, tags=["memories"], responses=_errors(404))
def get_memory(id: MemoryId, ctx: Context) -> Any:
    return ctx.mem.get(id).to_dict()


@router.patch("/memories/{id}", response_model=MemoryOut, tags=["memories"], responses=_errors(404))
def update_memory(id: MemoryId, body: UpdateIn, ctx: Context) -> Any:
    changes = {name: getattr(body, name) for name in body.model_fields_set}
    if "importance" in changes and changes["importance"] is None:
        raise InvalidInput("importance must be a number in [0, 1]; null does not clear it")
    if "text" in changes or "metadata" in changes:
        require_may_change(ctx.principal, ctx.mem.get(id), changes)
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
    receipt = ctx.mem.erase_receipt(id=body.id, **body.scope())
    return {"erased": receipt.memories, "receipt": receipt.to_dict()}


@router.get("/jobs/{id}", response_model=JobOut, tags=["jobs"], responses=_errors(404))
def get_job(id: MemoryId, ctx: Context) -> Any:
    return ctx.mem.job(id).to_dict()


@router.post("/jobs/{id}/retry", response_model=JobOut, tags=["jobs"], responses=_errors(404, 409))
def retry_job(id: MemoryId, ctx: Context) -> Any:
    """Queue a failed job again (its attempts reset); 409 unless it failed."""
    return ctx.mem.retry(id).to_dict()


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
    ctx.limiter.charge(ctx.principal.bucket, len(body) / EMBED_CHARS_PER_UNIT)

    def run() -> int:
        with tempfile.TemporaryDirectory(prefix="engram-import-") as tmp:
            path = Path(tmp) / "import.jsonl"
            path.write_bytes(body)
            return ctx.mem.import_(path)

    return {"imported": await run_in_threadpool(run)}


# -- sessions and context ----------------------------------------------------------------------

SessionId = Annotated[str, PathParam(min_length=1, max_length=MAX_ID)]


def _stored(mem: Memory, scope: Scope) -> Session | None:
    """The stored session of exactly this scope."""
    found = mem.sessions(user_id=scope.user_id, agent_id=scope.agent_id, session_id=scope.session_id,
                         limit=MAX_PAGE)
    return next((s for s in found if s.scope == scope), None)


def _find_session(mem: Memory, id: str, user_id: str | None, agent_id: str | None) -> Session:
    """The stored session with this id (in the given user / agent scope, if any); an id stored
    in several scopes needs the scope."""
    found = mem.sessions(user_id=user_id, agent_id=agent_id, session_id=id, limit=2)
    if not found:
        raise NotFound(f"no session with id {id!r}")
    if len(found) > 1:
        raise InvalidInput(f"session id {id!r} exists in several scopes: give user_id / agent_id")
    return found[0]


def _handle(mem: Memory, id: str, user_id: str | None, agent_id: str | None) -> SessionHandle:
    scope = _find_session(mem, id, user_id, agent_id).scope
    return mem.session(session_id=id, user_id=scope.user_id, agent_id=scope.agent_id)


def _unambiguous(mem: Memory, scope: Scope, user_id: str | None, agent_id: str | None) -> None:
    """An erasure names one session: refuse when messages of this session id are stored in
    another scope the request's user_id / agent_id would also match (a session row is not the
    only sign of a session: messages added with its id are one too)."""
    cursor = None
    while True:
        page = mem.list(user_id=user_id, agent_id=agent_id, session_id=scope.session_id,
                        cursor=cursor, limit=MAX_PAGE)
        other = next((m.scope for m in page.items if m.scope != scope), None)
        if other is not None:
            raise InvalidInput(f"session id {scope.session_id!r} is ambiguous: it is stored in "
                               "several scopes; give user_id / agent_id")
        if page.next_cursor is None:
            return
        cursor = page.next_cursor


def _message_out(m: SessionMessage) -> dict[str, Any]:
    return {"id": m.id, "role": m.role, "content": m.content, "name": m.name,
            "observed_at": m.observed_at, "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id}


@router.post("/sessions", status_code=201, response_model=SessionOut, tags=["sessions"],
             responses={200: {"model": SessionOut, "description": "The session exists (same id, "
                              "user and agent): it is resumed, with the policy and metadata given"}})
def create_session(body: SessionIn, ctx: Context, response: Response) -> Any:
    """Start a session (201), or resume the one with this id in this scope (200): as
    `Memory.session`, a `policy` or `metadata` given replaces the stored one."""
    scope = Scope(user_id=body.user_id, agent_id=body.agent_id, session_id=body.session_id)
    existed = body.session_id is not None and _stored(ctx.mem, scope) is not None
    handle = ctx.mem.session(session_id=body.session_id, user_id=body.user_id,
                             agent_id=body.agent_id, policy=body.policy, metadata=body.metadata)
    if existed:
        response.status_code = 200
    return handle.save().to_dict()


@router.get("/sessions", response_model=SessionsOut, tags=["sessions"])
def list_sessions(ctx: Context, user_id: ScopeQ = None, agent_id: ScopeQ = None,
                  limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20) -> Any:
    """Stored sessions (of a user / agent, if given), most recently updated first."""
    found = ctx.mem.sessions(user_id=user_id, agent_id=agent_id, limit=limit)
    return {"items": [s.to_dict() for s in found]}


@router.get("/sessions/{id}", response_model=SessionOut, tags=["sessions"], responses=_errors(404))
def get_session(id: SessionId, ctx: Context, user_id: ScopeQ = None, agent_id: ScopeQ = None) -> Any:
    return _find_session(ctx.mem, id, user_id, agent_id).to_dict()


@router.get("/sessions/{id}/messages", response_model=SessionTranscriptOut, tags=["sessions"],
            responses=_errors(404))
def session_messages(id: SessionId, ctx: Context, user_id: ScopeQ = None,
                     agent_id: ScopeQ = None) -> Any:
    """Every message of the session, oldest first."""
    return {"messages": [_message_out(m) for m in _handle(ctx.mem, id, user_id, agent_id).messages()]}


@router.get("/sessions/{id}/view", response_model=SessionViewOut, tags=["sessions"],
            responses=_errors(404))
def session_view(id: SessionId, ctx: Context, user_id: ScopeQ = None, agent_id: ScopeQ = None) -> Any:
    """What the session's policy shows a model now: summaries, then the verbatim messages."""
    view = _handle(ctx.mem, id, user_id, agent_id).view()
    return {"summaries": list(view.summaries), "messages": [_message_out(m) for m in view.messages],
            "omitted": view.omitted, "chat": as_data(view).chat()}  # stored system messages as data


@router.post("/sessions/{id}/end", response_model=SessionEndOut, tags=["sessions"],
             responses=_errors(404))
def end_session(id: SessionId, ctx: Context, user_id: ScopeQ = None, agent_id: ScopeQ = None) -> Any:
    """End the session: its summary is stored as an episode, it is marked ended, and (with an
    LLM) facts are extracted from what it said. A later message reopens it."""
    handle = _handle(ctx.mem, id, user_id, agent_id)
    summary = handle.end()
    return {"session": handle.info().to_dict(), "summary": summary.to_dict() if summary else None}


@router.delete("/sessions/{id}", status_code=204, tags=["sessions"], responses=_errors(403, 404))
def delete_session(id: SessionId, ctx: Context, user_id: ScopeQ = None,
                   agent_id: ScopeQ = None) -> Response:
    """Erase the session: its messages, summaries and row (an admin key: this is an erasure)."""
    require_admin(ctx.principal, "deleting a session")
    try:
        handle = _handle(ctx.mem, id, user_id, agent_id)
    except NotFound:  # no row yet: a session whose first messages are queued is its work
        handle = ctx.mem.session(session_id=id, user_id=user_id, agent_id=agent_id)
    if user_id is None or agent_id is None:
        _unambiguous(ctx.mem, handle.scope, user_id, agent_id)
    handle.delete()
    return Response(status_code=204)


@router.post("/sessions/{id}/messages", status_code=201, response_model=SessionMessagesOut,
             tags=["sessions"])
def add_session_messages(id: SessionId, body: SessionMessagesIn, ctx: Context,
                         user_id: ScopeQ = None, agent_id: ScopeQ = None) -> Any:
    """Append chat messages (OpenAI shape, tool calls included) to the session."""
    if _pins(None, body.messages):
        require_admin(ctx.principal, "writing a pinned memory")
    _charge(ctx, [m.content or "" for m in body.messages])
    handle = ctx.mem.session(session_id=id, user_id=user_id, agent_id=agent_id)
    stored = handle.add([m.as_message() for m in body.messages])
    return {"memories": [m.to_dict() for m in stored]}


@router.get("/stats", response_model=StatsOut, tags=["memories"])
def stats(ctx: Context, user_id: ScopeQ = None, agent_id: ScopeQ = None,
          session_id: ScopeQ = None) -> Any:
    """Counts of the tenant (or of a scope): memories by kind and state, events, scopes, jobs."""
    return ctx.mem.stats(user_id=user_id, agent_id=agent_id, session_id=session_id).to_dict()


@router.post("/context", response_model=ContextOut, tags=["sessions"])
def context(body: ContextIn, ctx: Context) -> Any:
    """The messages to send to a model next, within `budget_tokens`: instructions and the
    relevant memories as quoted data, the session per its policy, then the new message."""
    assembled = ctx.mem.context(body.query, user_id=body.user_id, agent_id=body.agent_id,
                                session_id=body.session_id, budget_tokens=body.budget_tokens,
                                instructions=body.instructions)
    return {"messages": assembled.messages, "text": assembled.text,
            "blocks": {name: b.to_dict() for name, b in assembled.blocks.items()},
            "total_tokens": assembled.total_tokens, "budget_tokens": assembled.budget_tokens}

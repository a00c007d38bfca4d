"""The audit trail: every call to the service's memory routes (/v1/..., /mcp) is recorded with
the API key's id (never the key), the tenant, the route template, the scope it named, the
status and the result's size: a structured log line (logger `engram.audit`) and a row of the
`audit` table, which an admin reads with `engram audit` or `GET /v1/audit`. Never memory text:
the scope fields are the only part of a request body that is read.

The table is `audit.db` beside the database (encrypted with the database's key when one is
set), or `engram_audit` in the PostgreSQL database; its migrations and SQL are the store's
(store/service.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from fastapi import APIRouter, FastAPI, Query
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..backup import AUDIT_FILE
from ..config import Config
from ..errors import StoreBusy, StoreUnavailable
from ..model import new_id
from ..store.sqlite import SQLiteAudit
from .auth import Principal, require_admin
from .guard import PRINCIPAL
from .routes import COMMON, Context

if TYPE_CHECKING:
    from ..store.postgres import PostgresAudit

log = logging.getLogger("engram.audit")

SCOPE_FIELDS = ("user_id", "agent_id", "session_id")
MAX_SCANNED_BODY = 64 * 1024  # a scope is found in the first 64 KB of a JSON body, or not at all
MAX_LIMIT = 1000


@dataclass(frozen=True)
class Entry:
    """One audited call."""

    id: str
    at: datetime
    key_id: str | None      # the API key's public id; None with --no-auth
    tenant: str | None
    method: str
    route: str              # the route template (/v1/memories/{id}), never the raw path
    status: int
    user_id: str | None
    agent_id: str | None
    session_id: str | None
    result_bytes: int
    duration_ms: float

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["at"] = self.at.isoformat()
        return out


class AuditLog(Protocol):
    def record_many(self, entries: list[Entry]) -> None: ...

    def entries(self, *, tenant: str | None, all_tenants: bool = False, key_id: str | None = None,
                route: str | None = None, limit: int = 100) -> list[Entry]: ...

    def close(self) -> None: ...


class _TableAuditLog:
    """The audit log over the store's audit table (`SQLiteAudit`, `PostgresAudit`)."""

    def __init__(self, table: SQLiteAudit | PostgresAudit) -> None:
        self._table = table

    def record_many(self, entries: list[Entry]) -> None:
        self._table.insert([tuple(asdict(e).values()) for e in entries])

    def entries(self, *, tenant: str | None, all_tenants: bool = False, key_id: str | None = None,
                route: str | None = None, limit: int = 100) -> list[Entry]:
        rows = self._table.entries(tenant=tenant, all_tenants=all_tenants, key_id=key_id,
                                   route=route, limit=limit)
        return [Entry(*r) for r in rows]

    def close(self) -> None:
        self._table.close()


class SQLiteAuditLog(_TableAuditLog):
    """The audit table in its own SQLite file."""

    def __init__(self, path: Path, key: str | None = None) -> None:
        super().__init__(SQLiteAudit(path, key))


class PostgresAuditLog(_TableAuditLog):
    """The audit table `engram_audit` of the shared PostgreSQL database."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0) -> None:
        from ..store.postgres import PostgresAudit  # psycopg is only imported when used

        super().__init__(PostgresAudit(url, connect_timeout_s=connect_timeout_s))


class GroupWriter:
    """An audit log written off the request path: a call queues its entry and goes on; one
    thread writes whatever has queued meanwhile in one transaction. Each call used to commit
    (and fsync) its own row, and under 50 clients the audit file's write lock was where
    request threads waited most. Reads and `close` wait for what is queued first, so the
    trail read back is complete; an entry queued when the process is killed is lost from the
    table but was logged (the `engram.audit` line is written before it is queued)."""

    def __init__(self, log_: AuditLog) -> None:
        self.log = log_
        self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._queue: list[Entry] = []
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def record(self, entry: Entry) -> None:
        if self._pid != os.getpid():  # a forked worker: its parent's thread is not here
            self._start()
        with self._cond:
            self._queue.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="engram-audit",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
                self._busy = True
            self._write(batch)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _write(self, batch: list[Entry]) -> None:
        """One transaction for the batch; if a row of it is refused, each row alone, so one bad
        row never costs the others. The calls are done: a lost row is logged, loudly."""
        try:
            self.log.record_many(batch)
            return
        except (StoreBusy, StoreUnavailable):  # the store, not a row: each alone would fail too
            log.exception("could not record %d audit entries", len(batch))
            return
        except Exception:
            if len(batch) == 1:
                log.exception("could not record audit entry %s", batch[0].id)
                return
        for entry in batch:
            try:
                self.log.record_many([entry])
            except Exception:
                log.exception("could not record audit entry %s", entry.id)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued entry is written."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def entries(self, *, tenant: str | None, all_tenants: bool = False, key_id: str | None = None,
                route: str | None = None, limit: int = 100) -> list[Entry]:
        self.flush()
        return self.log.entries(tenant=tenant, all_tenants=all_tenants, key_id=key_id,
                                route=route, limit=limit)

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.log.close()


def open_audit_log(config: Config) -> AuditLog:
    if config.database_url:
        return PostgresAuditLog(config.database_url, connect_timeout_s=config.pg_connect_timeout_s)
    return SQLiteAuditLog(config.path.parent / AUDIT_FILE, key=config.encryption_key)


def scope_of(query: bytes, body: bytes) -> dict[str, str | None]:
    """The scope a call named: its query parameters, else the top level of its JSON body (a
    console form's body is not JSON: its scope is in the query string)."""
    from urllib.parse import parse_qs

    found: dict[str, str | None] = dict.fromkeys(SCOPE_FIELDS)
    params = parse_qs(query.decode("latin-1"))
    for name in SCOPE_FIELDS:
        if params.get(name):
            found[name] = params[name][0][:200]
    if body and not any(found.values()):
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, cut at the scan limit, or nested
            # deeper than the parser goes (the route answers 422 for that)
            data = None
        if isinstance(data, dict):
            for name in SCOPE_FIELDS:
                value = data.get(name)
                if isinstance(value, str):
                    found[name] = _text(value[:200])
    return found


def _text(value: str) -> str:
    """`value` as text UTF-8 can encode: JSON's `\\ud800` escape decodes to a lone surrogate,
    which no database and no log stream accepts; it becomes U+FFFD (a pair is rejoined)."""
    return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class AuditMiddleware:
    """Records each call under /v1, /mcp and the console's /ui once its response is sent."""

    def __init__(self, app: ASGIApp, log_: GroupWriter) -> None:
        self.app = app
        self.log = log_

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        # the console's pages read and change memory too; its static files do not
        if not (path.startswith(("/v1/", "/ui/")) or path in ("/mcp", "/ui")) \
                or path.startswith("/ui/static/"):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        body = bytearray()
        status = [500]
        size = [0]

        async def receive_body() -> Message:
            message = await receive()
            if message["type"] == "http.request" and len(body) < MAX_SCANNED_BODY:
                body.extend(message.get("body", b"")[:MAX_SCANNED_BODY - len(body)])
            return message

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                size[0] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive_body, send_counted)
        finally:
            principal = scope.get(PRINCIPAL)
            route = getattr(scope.get("route"), "path", None) or scope.get("engram.route") or (
                "/mcp" if path == "/mcp" else "unmatched")
            entry = Entry(
                id=new_id(), at=datetime.now(UTC),
                key_id=principal.key_id if isinstance(principal, Principal) else None,
                tenant=principal.tenant if isinstance(principal, Principal) else None,
                method=scope.get("method", ""), route=route, status=status[0],
                **scope_of(scope.get("query_string", b""), bytes(body)),
                result_bytes=size[0], duration_ms=round((time.perf_counter() - start) * 1000, 3))
            log.info("audit %s", json.dumps(entry.to_dict(), ensure_ascii=False))
            self.log.record(entry)  # queued: a GroupWriter writes it off the request path


class AuditOut(BaseModel):
    entries: list[dict[str, Any]]


class ReceiptsOut(BaseModel):
    receipts: list[dict[str, Any]]


def install(app: FastAPI, config: Config) -> None:
    """Record every memory call and serve `GET /v1/audit` (admin keys, their own tenant)."""
    audit_log = GroupWriter(open_audit_log(config))
    app.state.audit = audit_log
    router = APIRouter(prefix="/v1", tags=["audit"], responses=COMMON)

    @router.get("/audit", response_model=AuditOut)
    def read_audit(ctx: Context,
                   limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 100,
                   key_id: Annotated[str | None, Query(max_length=200)] = None,
                   route: Annotated[str | None, Query(max_length=200)] = None) -> Any:
        """The audit trail of this key's tenant, newest first (admin keys): who called which
        route, on which scope, with what result size. Never memory text."""
        require_admin(ctx.principal, "reading the audit trail")
        found = audit_log.entries(tenant=ctx.principal.tenant, key_id=key_id, route=route,
                                  limit=limit)
        return {"entries": [e.to_dict() for e in found]}

    @router.get("/receipts", response_model=ReceiptsOut)
    def read_receipts(ctx: Context, limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
                      user_id: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
                      agent_id: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
                      session_id: Annotated[str | None, Query(min_length=1, max_length=200)] = None
                      ) -> Any:
        """Erasure receipts of this tenant (admin keys), newest first: what each erasure and
        retention delete removed (counts by kind, scope, time, a hash of the ids)."""
        require_admin(ctx.principal, "reading erasure receipts")
        found = ctx.mem.receipts(user_id=user_id, agent_id=agent_id, session_id=session_id, limit=limit)
        return {"receipts": [r.to_dict() for r in found]}

    app.include_router(router)
    app.add_middleware(AuditMiddleware, log_=audit_log)


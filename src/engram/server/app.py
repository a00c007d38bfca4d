"""The REST service: `create_app(config)` builds a FastAPI app over one `Memory` per tenant.

    engram serve                  # API keys required (engram keys create --tenant acme)
    engram serve --no-auth        # local single-user use: no keys, the default database

Layers, outermost first: metrics (latency per route), the body size limit (413), FastAPI
(auth, rate limit and the tenant's `Memory` in one dependency; errors mapped to JSON).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from .. import Memory, __version__
from ..config import Config
from ..errors import EngramError
from ..providers.embedders import Embedder
from ..providers.embedders import load as load_embedder
from . import audit
from .auth import Authenticator, require_admin
from .docs import add_docs
from .errors import ServiceError, error_response, from_engram_error, validation_message
from .graph import router as graph_router
from .guard import Guard, authorization, principal_of
from .keys import KeyStore, Role, open_key_store
from .limits import BodyLimitMiddleware, ServiceLimits
from .local import BrowserGuard
from .metrics import Metrics, MetricsMiddleware
from .ratelimit import open_rate_limiter
from .routes import router
from .schemas import ErrorOut, HealthOut
from .tenants import Tenants
from .ui import mount as mount_console

if TYPE_CHECKING:
    from ..mcp.mount import Mount

log = logging.getLogger("engram.server")


def create_app(config: Config | None = None, *, auth: bool = True, embedder: Embedder | None = None,
               keys: KeyStore | None = None, limits: ServiceLimits | None = None,
               mcp: bool = True, local_only: bool | None = None) -> FastAPI:
    """The service app. `embedder` is shared by every tenant (default: the configured one, and
    with `auto` each tenant's database's own: `Tenants`); `keys` defaults to the key store
    beside the database; `auth=False` serves the single-user database to anyone who can reach
    the port. The MCP server is at /mcp unless `mcp=False` or the MCP SDK (the mcp extra) is
    not installed. `local_only` (default: when auth is off) answers only requests whose Host
    and Origin are loopback (see server/local.py)."""
    config = config or Config.from_env()
    limits = limits or ServiceLimits()
    own_keys = auth and keys is None
    key_store = (keys or open_key_store(config)) if auth else None
    tenants = Tenants(config, embedder)
    metrics = Metrics()
    # /mcp is served when the MCP SDK (engram's mcp extra) is installed.
    mcp_mount = _mcp_mount(tenants) if mcp and importlib.util.find_spec("mcp") is not None else None

    def warm() -> None:
        # The model loads before the first request is served (/ready included): no request
        # pays for it. The one new tenants get, and the single-user database's own.
        load_embedder(tenants.embedder())
        if not auth:
            try:
                load_embedder(tenants.get(None).embedder)
            except EngramError as exc:  # its requests will answer with the error
                log.warning("cannot open the database yet: %s", exc)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(warm)
        try:
            if mcp_mount is not None:
                async with mcp_mount.lifespan():
                    yield
            else:
                yield
        finally:
            app.state.audit.close()  # writes what is still queued
            tenants.close()
            limiter.close()
            if own_keys and key_store is not None:
                key_store.close()

    app = FastAPI(
        title="engram", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
        summary="Long-term memory for LLM agents: memories, sessions and context over HTTP.",
        description="Every /v1 route needs `Authorization: Bearer <API key>` (unless the service "
                    "runs with --no-auth). Errors are `{\"error\": {\"code\", \"message\"}}`. "
                    "Times are ISO-8601 with a numeric offset (`+00:00`).")
    app.state.config = config
    app.state.tenants = tenants
    app.state.auth = Authenticator(key_store)
    app.state.limiter = limiter = open_rate_limiter(config, limits.rate, limits.burst,
                                                    shared=limits.shared)
    app.state.metrics = metrics
    app.include_router(router)
    mount_console(app)  # the memory console at /ui: the same keys, tenants and Memory methods
    audit.install(app, config)  # the audit trail: every memory call, and GET /v1/audit
    app.include_router(graph_router)  # the knowledge graph (server/graph.py)
    add_docs(app)
    _add_probes(app, key_store, tenants)
    _add_error_handlers(app)
    if mcp_mount is not None:
        # A route, not a mount: a mount would redirect /mcp to /mcp/, which MCP clients do not follow.
        guarded = Guard(mcp_mount.app, app.state.auth, app.state.limiter, route="/mcp")
        # No GET: in stateless mode there is no server-to-client stream to open, and the SDK's
        # GET would hold the connection open forever; it answers 405 instead.
        app.router.routes.append(Route("/mcp", guarded, methods=["POST", "DELETE"],
                                       include_in_schema=False))
    # Outermost last: the body limit wraps FastAPI, the metrics wrap everything.
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes)
    app.add_middleware(BrowserGuard, local_only=not auth if local_only is None else local_only)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def _add_probes(app: FastAPI, key_store: KeyStore | None, tenants: Tenants) -> None:
    @app.get("/health", response_model=HealthOut, tags=["ops"])
    def health() -> Any:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/ready", response_model=HealthOut, tags=["ops"],
             responses={503: {"model": ErrorOut, "description": "The database cannot be reached"}})
    def ready() -> Any:
        """Readiness: the database answers (the key store with auth, else the default database)."""
        if key_store is not None:
            key_store.ping()
        else:
            tenants.get(None).stats()
        return {"status": "ok"}

    @app.get("/metrics", tags=["ops"], response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics(request: Request) -> Response:
        """Process metrics (request latency per route) for anyone; the stored-memory and queued-job
        gauges only for an admin key, of its own tenant (with auth off: the single database)."""
        auth: Authenticator = app.state.auth
        shown: list[Memory] = []
        given = authorization(request.headers.getlist("authorization"))
        if not auth.enabled or given is not None:
            principal = auth(given)
            require_admin(principal, "tenant metrics")
            shown = [await run_in_threadpool(tenants.get, principal.tenant)]
        body, content_type = await run_in_threadpool(app.state.metrics.render, shown)
        return Response(body, media_type=content_type)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(EngramError)
    async def engram_error(request: Request, exc: EngramError) -> Response:
        response = from_engram_error(exc)
        if response.status_code >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.url.path, response.status_code, exc)
        return response

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> Response:
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        return error_response(422, "invalid_input", validation_message(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400:  # a body FastAPI could not parse: bad input like any other
            return error_response(422, "invalid_input", f"the request body cannot be read: {exc.detail}")
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail), dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal_error", "internal error (logged on the server)")


def _mcp_mount(tenants: Tenants) -> Mount:
    """The MCP server at /mcp: each tool call acts on the tenant of the key it came with."""
    from ..mcp.mount import Mount  # the SDK is imported only when the endpoint is served

    def resolve(request: Request | None) -> Memory:
        return tenants.get(principal_of(request.scope if request is not None else None).tenant)

    def may_write_rules(request: Request | None) -> bool:
        return principal_of(request.scope if request is not None else None).role is Role.ADMIN

    return Mount(resolve, may_write_rules)

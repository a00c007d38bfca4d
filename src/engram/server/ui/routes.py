"""The console's pages under /ui: each authenticates like a /v1 route (the same `Authenticator`,
rate limit and tenant `Memory`), calls the public `Memory` methods the REST handlers call, and
renders a Jinja2 template. Writes are form POSTs that need the session's CSRF token (or a
bearer header, which a browser never adds to a cross-site request) and a role that may write.

Errors come back as HTML pages with the status the REST API would give.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.routing import APIRoute
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.concurrency import run_in_threadpool

from ... import JobStatus, Kind, Memory
from ...errors import EngramError, InvalidInput
from ..auth import LOCAL, Principal, require_admin, require_may_change, require_writer
from ..errors import ServiceError, classify
from ..guard import PRINCIPAL, authorization
from ..keys import Role
from ..ratelimit import retry_after_header
from . import views
from .sessions import COOKIE, ConsoleSession, anonymous, csrf_ok, log_in, log_out, logged_in

SCOPE_FIELDS = ("user_id", "agent_id", "session_id")
MAX_FIELD = 10_000  # characters of one form or query field (memory texts are bounded by Memory)
STATIC = {"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8"}
# Everything the pages load comes from this origin; no inline script, no framing, forms post here.
# Referrer same-origin, not no-referrer: with no-referrer a browser posts forms with `Origin: null`,
# which the no-auth guard (server/local.py) rightly refuses.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "same-origin", "X-Frame-Options": "DENY",
                    "Cache-Control": "no-store"}


class LoginNeeded(Exception):
    """No bearer header and no logged-in console session."""


class ConsoleRoute(APIRoute):
    """Every /ui response carries the security headers; errors become HTML pages."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                response = await handler(request)
            except LoginNeeded:
                if request.method == "GET":
                    response = RedirectResponse("/ui/login", status_code=303)
                else:
                    response = _error(request, 401, "unauthorized", "log in first")
            except ServiceError as exc:
                response = _error(request, exc.status, exc.code, exc.message, exc.headers)
            except EngramError as exc:
                status, code, headers = classify(exc)
                response = _error(request, status, code, str(exc), headers)
            response.headers.update(SECURITY_HEADERS)
            return response

        return route


router = APIRouter(prefix="/ui", include_in_schema=False, route_class=ConsoleRoute)
_templates = Environment(loader=PackageLoader("engram.server.ui"), autoescape=select_autoescape(default=True),
                         trim_blocks=True, lstrip_blocks=True)
_templates.globals.update(number=views.number, when=views.when, validity=views.validity,
                          kinds=[k.value for k in Kind], job_statuses=[s.value for s in JobStatus])


@dataclass
class Page:
    """One console request: who asks, their tenant's memory, the scope in the query string."""

    request: Request
    principal: Principal
    mem: Memory
    session: ConsoleSession | None
    bearer: bool
    scope: dict[str, Any]  # user_id, agent_id, session_id: a str or None each

    @property
    def q(self) -> Mapping[str, str]:
        return self.request.query_params

    def arg(self, name: str) -> str | None:
        value = self.q.get(name)
        if value is not None and len(value) > MAX_FIELD:
            raise InvalidInput(f"{name} is longer than {MAX_FIELD} characters")
        return value or None

    def url(self, path: str, **params: Any) -> str:
        """A console URL keeping the page's scope (params override it; None drops one)."""
        merged = {**self.scope, **params}
        query = urlencode({k: v for k, v in merged.items() if v not in (None, "")}, doseq=True)
        return f"/ui{path}" + (f"?{query}" if query else "")

    def render(self, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        writer = self.principal.role is not Role.READER
        body = _templates.get_template(template).render(
            page=self, scope=self.scope, url=self.url, writer=writer,
            admin=self.principal.role is Role.ADMIN, csrf=self.session.csrf if self.session else "",
            auth=self.request.app.state.auth.enabled, **context)
        return HTMLResponse(body, status_code=status)


async def _page(request: Request) -> Page:
    """Authenticate as a /v1 route does: a bearer header, else the console login the cookie
    names (found with its key on every request, so revoking the key logs the browser out), else
    (auth off) the local admin. Then the tenant's rate limit and its memory."""
    state = request.app.state
    cookie = request.cookies.get(COOKIE)
    session: ConsoleSession | None = None
    header = authorization(request.headers.getlist("authorization"))  # two are refused, as on /v1
    if header is not None:
        principal = await run_in_threadpool(state.auth, header)
    elif not state.auth.enabled:
        principal, session = LOCAL, anonymous(cookie)
    else:
        session = await run_in_threadpool(logged_in, state.auth.keys, cookie)
        if session is None or session.principal is None:
            raise LoginNeeded
        principal = session.principal
    request.scope[PRINCIPAL] = principal  # for the audit trail (server/audit.py)
    wait = state.limiter.take(principal.bucket)
    if wait > 0:
        raise ServiceError(429, "rate_limited", "rate limit reached; retry later",
                           {"Retry-After": retry_after_header(wait)})
    mem = await run_in_threadpool(state.tenants.get, principal.tenant)
    scope: dict[str, Any] = {}
    for name in SCOPE_FIELDS:
        value = request.query_params.get(name) or None
        if value is not None and len(value) > 256:
            raise InvalidInput(f"{name} is longer than 256 characters")
        scope[name] = value
    return Page(request, principal, mem, session, header is not None, scope)


async def _form(request: Request, page: Page) -> dict[str, str]:
    """The url-encoded form of a POST, after the CSRF check: the session's token must be in it,
    unless the request authenticated with a bearer header (a browser never sends one cross-site)."""
    form = _fields(await request.body(), 50)
    if any(len(v) > MAX_FIELD * 4 for v in form.values()):
        raise InvalidInput("a form field is too long")
    if not page.bearer and not csrf_ok(page.session, form.get("csrf")):
        raise ServiceError(403, "csrf", "the form's CSRF token is missing or stale: reload the page "
                                        "and submit it again")
    return form


def _fields(body: bytes, most: int) -> dict[str, str]:
    """A url-encoded form's fields (the last value of a repeated one); more than `most` fields
    is a bad request (400, as a malformed /v1 body), never an unhandled ValueError."""
    try:
        parsed = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True,
                          max_num_fields=most)
    except ValueError:
        raise ServiceError(400, "bad_request", f"the form has more than {most} fields") from None
    return {k: v[-1] for k, v in parsed.items()}


def _with_session(request: Request, response: Response, session: ConsoleSession | None) -> Response:
    """Set the console cookie: opaque, HttpOnly, SameSite=Strict, sent to /ui only."""
    if session is not None and request.cookies.get(COOKIE) != session.id:
        response.set_cookie(COOKIE, session.id, httponly=True, samesite="strict", path="/ui",
                            secure=request.url.scheme == "https")
    return response


def _error(request: Request, status: int, code: str, message: str,
           headers: Mapping[str, str] | None = None) -> HTMLResponse:
    body = _templates.get_template("error.html").render(status=status, code=code, message=message,
                                                        auth=request.app.state.auth.enabled)
    return HTMLResponse(body, status_code=status, headers=dict(headers or {}))


async def _run(page: Page, template: str, build: Callable[[], dict[str, Any]],
               status: int = 200) -> Response:
    """Build the page's data in the thread pool (`Memory` is synchronous), then render it; with
    auth off, the cookie the forms' CSRF token is derived from is set on the way."""
    data = await run_in_threadpool(build)
    return _with_session(page.request, page.render(template, status, **data), page.session)


# -- login -------------------------------------------------------------------------------------

@router.get("/login")
async def login_form(request: Request) -> Response:
    if not request.app.state.auth.enabled:
        return RedirectResponse("/ui", status_code=303)
    session = anonymous(request.cookies.get(COOKIE))
    body = _templates.get_template("login.html").render(csrf=session.csrf, error=None, auth=True)
    return _with_session(request, HTMLResponse(body), session)


@router.post("/login")
async def login(request: Request) -> Response:
    if not request.app.state.auth.enabled:
        return RedirectResponse("/ui", status_code=303)
    cookie = request.cookies.get(COOKIE)
    before = anonymous(cookie)  # a missing or foreign cookie gets a new id: no token matches it
    form = _fields(await request.body(), 10)
    if before.id != cookie or not csrf_ok(before, form.get("csrf")):
        return _error(request, 403, "csrf", "the login form is stale: reload the page and log in again")
    secret = form.get("key", "").strip()
    auth = request.app.state.auth
    try:
        principal = await run_in_threadpool(auth, f"Bearer {secret}")
    except ServiceError:
        body = _templates.get_template("login.html").render(
            csrf=before.csrf, error="unknown or revoked API key", auth=True)
        return HTMLResponse(body, status_code=401)

    def switch() -> ConsoleSession:
        log_out(auth.keys, cookie)  # a login the browser had before ends with this one
        return log_in(auth.keys, principal)

    session = await run_in_threadpool(switch)
    return _with_session(request, RedirectResponse("/ui", status_code=303), session)


@router.post("/logout")
async def logout(request: Request) -> Response:
    page = await _page(request)
    await _form(request, page)
    if page.session is not None and page.session.principal is not None:
        await run_in_threadpool(log_out, request.app.state.auth.keys, page.session.id)
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui")
    return response


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:
        raise ServiceError(404, "not_found", f"no console file {name!r}")
    body = files("engram.server.ui").joinpath("static", name).read_bytes()
    return Response(body, media_type=STATIC[name], headers={"Cache-Control": "max-age=3600"})


# -- pages -------------------------------------------------------------------------------------

@router.get("")
async def home(request: Request) -> Response:
    page = await _page(request)
    return await _run(page, "scopes.html", lambda: {
        "summary": views.scopes(page.mem), "stats": page.mem.stats(**page.scope)})


@router.get("/memories")
async def memories(request: Request) -> Response:
    page = await _page(request)

    def build() -> dict[str, Any]:
        kind = page.arg("kind")
        found = views.filters(page.arg("metadata"), page.arg("time_field"), page.arg("from"),
                              page.arg("to"))
        limit = _int(page.arg("limit"), 20, "limit", 1, 100)
        result = page.mem.list(**page.scope, kinds=[kind] if kind else None, filters=found,
                               as_of=_moment(page.arg("as_of"), "as_of"), cursor=page.arg("cursor"),
                               limit=limit)
        return {"items": result.items, "next_cursor": result.next_cursor}

    return await _run(page, "memories.html", build)


@router.get("/memories/{id}")
async def memory(request: Request, id: str) -> Response:
    page = await _page(request)
    return await _run(page, "memory.html", lambda: {
        "versions": views.chain(page.mem, id, page.scope), "id": id, "change": views.change})


@router.post("/memories/{id}/edit")
async def edit(request: Request, id: str) -> Response:
    page = await _page(request)
    form = await _form(request, page)
    require_writer(page.principal, "editing a memory")

    def run() -> None:
        before = page.mem.get(id, **page.scope)
        changes: dict[str, Any] = {}
        text = form.get("text")
        if text is not None and text.replace("\r\n", "\n") != before.text:
            changes["text"] = text.replace("\r\n", "\n")  # a browser sends a textarea's lines as CRLF
        if form.get("importance"):
            importance = _float(form["importance"], "importance")
            if importance != before.importance:
                changes["importance"] = importance
        if not changes:
            raise InvalidInput("nothing to change: the text and importance are as stored")
        require_may_change(page.principal, before, changes)
        page.mem.update(id, **page.scope, **changes)

    await run_in_threadpool(run)
    return RedirectResponse(page.url(f"/memories/{id}"), status_code=303)


@router.post("/memories/{id}/delete")
async def delete(request: Request, id: str) -> Response:
    page = await _page(request)
    await _form(request, page)
    require_writer(page.principal, "deleting a memory")
    await run_in_threadpool(lambda: page.mem.delete(id, **page.scope))
    return RedirectResponse(page.url(f"/memories/{id}"), status_code=303)


@router.get("/search")
async def search(request: Request) -> Response:
    page = await _page(request)

    def build() -> dict[str, Any]:
        query = page.arg("q")
        if not query:
            return {"hits": None, "columns": []}
        kind = page.arg("kind")
        hits = page.mem.search(query, **page.scope, limit=_int(page.arg("limit"), 10, "limit", 1, 100),
                               kinds=[kind] if kind else None, as_of=_moment(page.arg("as_of"), "as_of"))
        return {"hits": hits, "columns": views.explain_columns(hits)}

    return await _run(page, "search.html", build)


@router.get("/timeline")
async def timeline(request: Request) -> Response:
    page = await _page(request)

    def build() -> dict[str, Any]:
        found, complete = views.episodes(page.mem, page.scope)
        sessions = page.mem.sessions(user_id=page.scope["user_id"], agent_id=page.scope["agent_id"],
                                     session_id=page.scope["session_id"], limit=views.PAGE)
        return {"groups": views.timeline(found, sessions), "complete": complete}

    return await _run(page, "timeline.html", build)


@router.get("/context")
async def context(request: Request) -> Response:
    page = await _page(request)

    def build() -> dict[str, Any]:
        query = page.arg("q")
        budget = _int(page.arg("budget"), 2000, "budget", 1, 1_000_000)
        if not query:
            return {"assembled": None, "budget": budget}
        assembled = page.mem.context(query, **page.scope, budget_tokens=budget)
        return {"assembled": assembled, "budget": budget}

    return await _run(page, "context.html", build)


@router.get("/jobs")
async def jobs(request: Request) -> Response:
    page = await _page(request)
    return await _run(page, "jobs.html", lambda: {
        "jobs": page.mem.jobs(**page.scope, status=page.arg("status"), limit=100)})


@router.post("/jobs/{id}/retry")
async def retry(request: Request, id: str) -> Response:
    page = await _page(request)
    await _form(request, page)
    require_writer(page.principal, "retrying a job")
    await run_in_threadpool(lambda: page.mem.retry(id))
    return RedirectResponse(page.url("/jobs"), status_code=303)


@router.get("/graph")
async def graph(request: Request) -> Response:
    """An entity's neighbourhood (`Memory.neighbours`, as GET /v1/graph/neighbours), drawn."""
    page = await _page(request)

    def build() -> dict[str, Any]:
        depth = _int(page.arg("depth"), 1, "depth", 1, 4)
        # the graph API arrives with the graph store; a build without it says so
        neighbours = getattr(page.mem, "neighbours", None)
        name = page.arg("name")
        if neighbours is None or not name:
            return {"available": neighbours is not None, "drawing": None, "depth": depth,
                    "size": views.GRAPH_SIZE}
        found = neighbours(name, depth=depth, user_id=page.scope["user_id"],
                           agent_id=page.scope["agent_id"])
        return {"available": True, "drawing": views.layout(found.to_dict(), name), "depth": depth,
                "size": views.GRAPH_SIZE}

    return await _run(page, "graph.html", build)


@router.get("/erase")
async def erase_form(request: Request) -> Response:
    page = await _page(request)
    return await _run(page, "erase.html", lambda: {"erased": None})


@router.post("/erase")
async def erase(request: Request) -> Response:
    """Erase a user or a session (every trace, as POST /v1/erase): the id must be typed again."""
    page = await _page(request)
    form = await _form(request, page)
    require_admin(page.principal, "erase")
    what, target = form.get("what", ""), form.get("target", "").strip()
    if what not in ("user_id", "session_id") or not target:
        raise InvalidInput("say what to erase: a user id or a session id")
    if form.get("confirm", "").strip() != target:
        raise InvalidInput(f"not erased: type {target!r} in the confirmation box to erase it")
    scope = {what: target}
    if what == "session_id" and page.scope["user_id"]:
        scope["user_id"] = page.scope["user_id"]
    count = await run_in_threadpool(lambda: page.mem.erase(**scope))
    return await _run(page, "erase.html", lambda: {"erased": count, "what": what, "target": target})


def _int(value: str | None, default: int, name: str, low: int, high: int) -> int:
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise InvalidInput(f"{name} must be a whole number") from None
    if not low <= number <= high:
        raise InvalidInput(f"{name} must be in [{low}, {high}]")
    return number


def _moment(value: str | None, name: str) -> datetime | None:
    """A time from a datetime-local field (no offset: UTC, as the labels say) or ISO-8601."""
    if value is None:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise InvalidInput(f"{name} must be a date and time (ISO-8601)") from None


def _float(value: str, name: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise InvalidInput(f"{name} must be a number") from None
    if not math.isfinite(number):
        raise InvalidInput(f"{name} must be a finite number")
    return number

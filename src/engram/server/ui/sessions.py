"""Console sessions: an opaque random cookie, and once logged in, a login stored in the key
store's database by the cookie's digest (key id, tenant, role, CSRF token, expiry; never the
cookie, never the API key: server/keys.py).

Every request looks its login up together with its key in one statement, so a revoked key ends
its logins at once, and any service process or node answers for any login: nothing is sticky
and a restart logs nobody out. Before login (and with auth off, where nobody logs in) the
cookie is a random id and the forms' CSRF token is derived from it, so that needs no state
anywhere either: a login form served by one node is accepted by another.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from ..auth import Principal
from ..keys import ConsoleLogin, KeyStore

COOKIE = "engram_console"
TTL_S = 8 * 3600  # absolute lifetime of a login, set when it is made, never extended
_ID = re.compile(r"[A-Za-z0-9_-]{43}")  # secrets.token_urlsafe(32)


@dataclass(frozen=True)
class ConsoleSession:
    id: str  # the cookie's value
    csrf: str
    principal: Principal | None = None  # who logged in; None before login (and with auth off)


def digest(id: str) -> str:
    """What is stored of a cookie: a stolen table logs nobody in."""
    return hashlib.sha256(id.encode()).hexdigest()


def anonymous(cookie: str | None) -> ConsoleSession:
    """The browser's session before login: its cookie if it is one of ours, else a new one. Its
    CSRF token is a hash of the cookie, which a page may show and no other site can compute."""
    id = cookie if cookie is not None and _ID.fullmatch(cookie) else secrets.token_urlsafe(32)
    return ConsoleSession(id=id, csrf=hashlib.sha256(b"engram console csrf\0" + id.encode()).hexdigest())


def logged_in(keys: KeyStore, cookie: str | None) -> ConsoleSession | None:
    """The login the cookie names, if it has not expired and its key is still live."""
    if cookie is None or not _ID.fullmatch(cookie):
        return None
    login = keys.find_login(digest(cookie))
    if login is None:
        return None
    return ConsoleSession(id=cookie, csrf=login.csrf,
                          principal=Principal(tenant=login.tenant, role=login.role, key_id=login.key_id))


def log_in(keys: KeyStore, principal: Principal, ttl_s: float = TTL_S) -> ConsoleSession:
    """A new login for a key just checked (a new cookie: logging in never promotes the cookie
    the browser had before, so one planted before login is worth nothing)."""
    if principal.key_id is None or principal.tenant is None:
        raise ValueError("a console login needs an API key")
    id, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    keys.add_login(ConsoleLogin(digest=digest(id), key_id=principal.key_id, tenant=principal.tenant,
                                role=principal.role, csrf=csrf), ttl_s)
    return ConsoleSession(id=id, csrf=csrf, principal=principal)


def log_out(keys: KeyStore, cookie: str | None) -> None:
    if cookie is not None and _ID.fullmatch(cookie):
        keys.end_login(digest(cookie))


def csrf_ok(session: ConsoleSession | None, token: str | None) -> bool:
    """The form's token is the session's (constant-time compare)."""
    return session is not None and bool(token) and hmac.compare_digest(
        session.csrf.encode(), (token or "").encode())

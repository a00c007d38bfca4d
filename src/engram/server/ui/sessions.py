"""Console sessions: an opaque random cookie names a server-side record holding the API key the
browser logged in with, its CSRF token and its expiry.

The cookie carries no data (nothing to forge, nothing to decode); the key stays in this process
and every request re-authenticates it through the service's `Authenticator`, so a revoked key
ends its console sessions at once. Sessions live in this process's memory: a restart logs every
browser out, and several service processes behind a balancer need sticky sessions (scripts use
`Authorization: Bearer`, which needs neither).
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

COOKIE = "engram_console"
TTL_S = 8 * 3600          # absolute lifetime of a session, set at login, never extended
ANONYMOUS_TTL_S = 3600    # a session before login (it only carries the login form's CSRF token)
MAX_SESSIONS = 10_000     # the oldest go first: a flood of cookie-less requests cannot grow memory


@dataclass
class ConsoleSession:
    id: str
    csrf: str
    expires_at: float          # time.monotonic() seconds
    secret: str | None = None  # the API key; None before login (and always with auth off)


class Sessions:
    def __init__(self, *, ttl_s: float = TTL_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._live: OrderedDict[str, ConsoleSession] = OrderedDict()
        self._lock = threading.Lock()

    def new(self, secret: str | None = None) -> ConsoleSession:
        """A fresh session (a new id and CSRF token: logging in never reuses the id the browser
        had before, so a planted cookie cannot be promoted to a logged-in one)."""
        ttl = self.ttl_s if secret is not None else min(self.ttl_s, ANONYMOUS_TTL_S)
        session = ConsoleSession(id=secrets.token_urlsafe(32), csrf=secrets.token_urlsafe(32),
                                 expires_at=time.monotonic() + ttl, secret=secret)
        with self._lock:
            self._live[session.id] = session
            while len(self._live) > self.max_sessions:
                self._live.popitem(last=False)
        return session

    def get(self, id: str | None) -> ConsoleSession | None:
        if not id or len(id) > 100:
            return None
        with self._lock:
            session = self._live.get(id)
            if session is not None and session.expires_at <= time.monotonic():
                del self._live[id]
                return None
        return session

    def end(self, id: str) -> None:
        with self._lock:
            self._live.pop(id, None)


def csrf_ok(session: ConsoleSession | None, token: str | None) -> bool:
    """The form's token is the session's (constant-time compare)."""
    return session is not None and bool(token) and hmac.compare_digest(
        session.csrf.encode(), (token or "").encode())

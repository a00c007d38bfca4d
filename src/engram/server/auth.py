"""Who is calling: a bearer API key names a tenant and a role.

Every route except /health, /ready and /metrics needs `Authorization: Bearer <key>`. With
auth off (`engram serve --no-auth`, local single-user use) every caller is the admin of the
single-user database.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..model import Kind, MemoryRecord, is_pinned
from .errors import ServiceError
from .keys import KeyStore, Role

MAX_KEY_CHARS = 200


@dataclass(frozen=True)
class Principal:
    tenant: str | None  # None: the single-user database (auth off)
    role: Role
    key_id: str | None

    @property
    def bucket(self) -> str:
        """The rate-limit bucket: one per tenant (all of a tenant's keys share it)."""
        return self.tenant if self.tenant is not None else ""


LOCAL = Principal(tenant=None, role=Role.ADMIN, key_id=None)


def _unauthorized(message: str) -> ServiceError:
    return ServiceError(401, "unauthorized", message, {"WWW-Authenticate": 'Bearer realm="engram"'})


class Authenticator:
    def __init__(self, keys: KeyStore | None) -> None:
        self.keys = keys  # None: auth is off

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def __call__(self, authorization: str | None) -> Principal:
        if self.keys is None:
            return LOCAL
        if not authorization:
            raise _unauthorized("missing Authorization: Bearer <API key>")
        scheme, _, secret = authorization.partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret or len(secret) > MAX_KEY_CHARS:
            raise _unauthorized("the Authorization header must be: Bearer <API key>")
        # A StoreError here (the key database is down) propagates as a 503, not a 401: the key
        # may well be valid, and the client should retry rather than give up.
        key = self.keys.authenticate(secret)
        if key is None:
            raise _unauthorized("unknown or revoked API key")
        return Principal(tenant=key.tenant, role=key.role, key_id=key.id)


def require_admin(principal: Principal, action: str) -> None:
    if principal.role is not Role.ADMIN:
        raise ServiceError(403, "forbidden",
                           f"{action} needs an admin key; this key is a {principal.role.value} key")


def require_writer(principal: Principal, action: str) -> None:
    """A reader key sees everything of its tenant and changes nothing."""
    if principal.role is Role.READER:
        raise ServiceError(403, "forbidden", f"{action} needs a member or admin key; this key is "
                                             "a read-only reader key")


def require_may_change(principal: Principal, current: MemoryRecord, changes: Mapping[str, Any]) -> None:
    """The one rule of an update, which REST's PATCH and the console's edit both call: changing the
    text or metadata of a rule (kind procedural) or a pinned memory, or pinning one, needs an
    admin key (a member key may still change its importance)."""
    require_writer(principal, "changing a memory")
    if "text" not in changes and "metadata" not in changes:
        return
    if (current.kind is Kind.PROCEDURAL or is_pinned(current.metadata)
            or is_pinned(changes.get("metadata") or {})):
        require_admin(principal, "changing a rule (kind procedural) or a pinned memory")


# The POST routes that only read (a query in a body): everything else that is not a GET is a
# write. Fail closed: a route added later is refused to readers until it is listed here.
READ_ONLY_POSTS = frozenset({"/v1/memories/search", "/v1/context"})


def require_access(principal: Principal, method: str, path: str) -> None:
    """The role check every /v1 request passes: readers may only read."""
    if method not in ("GET", "HEAD", "OPTIONS") and path not in READ_ONLY_POSTS:
        require_writer(principal, f"{method} {path}")

"""API keys of the REST service: which tenant a bearer key belongs to, and with what role.

Only a SHA-256 digest of each key is stored (the key itself is shown once, at creation); a key
is 32 random bytes, so a fast hash is enough — there is nothing to brute-force. The keys live
in a small table beside the memories: `keys.db` next to the SQLite default, or the
`engram_api_keys` table when ENGRAM_DATABASE_URL points at PostgreSQL.

The console's logins live beside the keys they were made with (`console_logins`,
`engram_console_logins`), so every service process and node finds them, and each lookup checks
its key in the same statement: a revoked key ends its logins at once (server/ui/sessions.py).
The tables, their migrations and their SQL are the store's (store/service.py).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import InvalidInput, NotFound
from ..model import utcnow
from ..store.sqlite import SQLiteKeys

if TYPE_CHECKING:
    from ..config import Config
    from ..store.postgres import PostgresKeys

KEY_PREFIX = "engram_"  # makes a leaked key easy to spot (and to grep for) in logs and repos
MAX_TENANT_CHARS = 128
MAX_NAME_CHARS = 200


class Role(StrEnum):
    ADMIN = "admin"    # everything, including erase and export of the tenant's data
    MEMBER = "member"  # read and write memories; no erase, no export
    READER = "reader"  # read only: lists, searches, history, context; every write is refused


@dataclass(frozen=True)
class ApiKey:
    """A stored key, without its secret: `id` is public (it names the key in lists and logs)."""

    id: str
    tenant: str
    role: Role
    name: str
    created_at: datetime
    revoked_at: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "tenant": self.tenant, "role": self.role.value, "name": self.name,
                "created_at": self.created_at.isoformat(),
                "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None}


@dataclass(frozen=True)
class ConsoleLogin:
    """A console login as stored: the digest of its cookie (never the cookie, never the API
    key), the key it was made with, and the CSRF token of its forms."""

    digest: str
    key_id: str
    tenant: str
    role: Role
    csrf: str


MAX_LOGINS_PER_KEY = 100  # a key's oldest logins go first: logging in in a loop cannot grow the table


class KeyStore(Protocol):
    def create(self, tenant: str, role: str | Role = Role.MEMBER, name: str = "") -> tuple[ApiKey, str]:
        """A new key: the stored record, and the secret to hand to the caller (shown once)."""

    def authenticate(self, secret: str) -> ApiKey | None:
        """The live (not revoked) key with this secret, or None."""

    def list(self, tenant: str | None = None) -> list[ApiKey]: ...

    def revoke(self, id: str) -> ApiKey:
        """Revoke a key by id (idempotent), ending its console logins; NotFound if there is
        no such key."""

    def add_login(self, login: ConsoleLogin, ttl_s: float) -> None:
        """Store a console login for `ttl_s` seconds (expired logins are dropped on the way)."""

    def find_login(self, digest: str) -> ConsoleLogin | None:
        """The unexpired login with this digest, if its key is still live; else None."""

    def end_login(self, digest: str) -> None:
        """Delete a login (idempotent)."""

    def ping(self) -> None:
        """Raise StoreUnavailable unless the database answers (the service's readiness)."""

    def close(self) -> None: ...


def open_key_store(config: Config) -> KeyStore:
    if config.database_url:
        return PostgresKeyStore(config.database_url, connect_timeout_s=config.pg_connect_timeout_s)
    return SQLiteKeyStore(config.path.parent / "keys.db")


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def _validate(tenant: Any, role: Any, name: Any) -> tuple[str, Role, str]:
    if not isinstance(tenant, str) or not tenant.strip() or len(tenant) > MAX_TENANT_CHARS:
        raise InvalidInput(f"tenant must be a non-empty string of at most {MAX_TENANT_CHARS} characters")
    if not tenant.isprintable():
        raise InvalidInput("tenant must be printable text")
    try:
        the_role = Role(role)
    except ValueError:
        raise InvalidInput(f"role must be one of {[r.value for r in Role]}, not {role!r}") from None
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise InvalidInput(f"name must be printable text of at most {MAX_NAME_CHARS} characters")
    return tenant, the_role, name


def _new_key(tenant: str, role: Role, name: str) -> tuple[ApiKey, str]:
    key_id = secrets.token_hex(6)
    secret = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    return ApiKey(id=key_id, tenant=tenant, role=role, name=name, created_at=utcnow()), secret


class _TableKeyStore:
    """The key store over the store's key tables (`SQLiteKeys`, `PostgresKeys`): the
    secrets, roles and rows are this module's; the SQL is the store's."""

    def __init__(self, table: SQLiteKeys | PostgresKeys) -> None:
        self._table = table

    def create(self, tenant: str, role: str | Role = Role.MEMBER, name: str = "") -> tuple[ApiKey, str]:
        tenant, the_role, name = _validate(tenant, role, name)
        key, secret = _new_key(tenant, the_role, name)
        self._table.insert_key(key.id, digest(secret), tenant, the_role.value, name, key.created_at)
        return key, secret

    def authenticate(self, secret: str) -> ApiKey | None:
        row = self._table.live_key(digest(secret))
        return None if row is None else _row_to_key(row)

    def list(self, tenant: str | None = None) -> list[ApiKey]:
        return [_row_to_key(r) for r in self._table.keys(tenant)]

    def revoke(self, id: str) -> ApiKey:
        row = self._table.revoke_key(id)
        if row is None:
            raise NotFound(f"no API key with id {id!r}")
        return _row_to_key(row)

    def add_login(self, login: ConsoleLogin, ttl_s: float) -> None:
        self._table.add_login((login.digest, login.key_id, login.tenant, login.role.value,
                               login.csrf), ttl_s, MAX_LOGINS_PER_KEY)

    def find_login(self, digest: str) -> ConsoleLogin | None:
        row = self._table.find_login(digest)
        return None if row is None else ConsoleLogin(digest=row[0], key_id=row[1], tenant=row[2],
                                                     role=Role(row[3]), csrf=row[4])

    def end_login(self, digest: str) -> None:
        self._table.end_login(digest)

    def ping(self) -> None:
        self._table.ping()

    def close(self) -> None:
        self._table.close()


def _row_to_key(row: Any) -> ApiKey:
    return ApiKey(id=row[0], tenant=row[1], role=Role(row[2]), name=row[3], created_at=row[4],
                  revoked_at=row[5])


class SQLiteKeyStore(_TableKeyStore):
    """Keys in their own SQLite file (the tenants' memories are in other files)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        super().__init__(SQLiteKeys(self.path))


class PostgresKeyStore(_TableKeyStore):
    """Keys in a table of the shared PostgreSQL database (every service process sees them).
    It connects on demand: a service can start while the database is down and becomes ready
    when it returns; a connection broken by a restart is replaced before any work is done on it."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0) -> None:
        from ..store.postgres import PostgresKeys  # psycopg is only imported when used

        self.url = url
        super().__init__(PostgresKeys(url, connect_timeout_s=connect_timeout_s))

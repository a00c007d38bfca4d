"""API keys of the REST service: which tenant a bearer key belongs to, and with what role.

Only a SHA-256 digest of each key is stored (the key itself is shown once, at creation); a key
is 32 random bytes, so a fast hash is enough — there is nothing to brute-force. The keys live
in a small table beside the memories: `keys.db` next to the SQLite default, or the
`engram_api_keys` table when ENGRAM_DATABASE_URL points at PostgreSQL.

The console's logins live beside the keys they were made with (`console_logins`,
`engram_console_logins`), so every service process and node finds them, and each lookup checks
its key in the same statement: a revoked key ends its logins at once (server/ui/sessions.py).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import InvalidInput, NotFound, StoreUnavailable
from ..model import utcnow
from ..store.sqlite import Connections

if TYPE_CHECKING:
    from ..config import Config

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


# -- SQLite ------------------------------------------------------------------------------------

_SQLITE_SCHEMA = ("""
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    digest TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    role TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL
)""", """
CREATE TABLE IF NOT EXISTS console_logins (
    digest TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    role TEXT NOT NULL,
    csrf TEXT NOT NULL,
    expires_at REAL NOT NULL
)""", "CREATE INDEX IF NOT EXISTS console_logins_key ON console_logins (key_id)")

# The statements on logins, written once for both databases ({m}: the placeholder, {now}: the
# database's current time). A login is found only with its key, and only while the key is live.
_FIND_LOGIN = """
SELECT l.digest, l.key_id, l.tenant, l.role, l.csrf FROM {logins} l JOIN {keys} k ON k.id = l.key_id
WHERE l.digest = {m} AND l.expires_at > {now} AND k.revoked_at IS NULL"""
_DROP_EXPIRED = "DELETE FROM {logins} WHERE expires_at <= {now}"
_ADD_LOGIN = "INSERT INTO {logins} VALUES ({m}, {m}, {m}, {m}, {m}, {expires})"
_TRIM_LOGINS = """
DELETE FROM {logins} WHERE key_id = {m} AND digest NOT IN (
    SELECT digest FROM {logins} WHERE key_id = {m} ORDER BY expires_at DESC LIMIT {m})"""
_END_LOGIN = "DELETE FROM {logins} WHERE digest = {m}"
_END_KEY_LOGINS = "DELETE FROM {logins} WHERE key_id = {m}"


def _login_sql(template: str, *, logins: str, keys: str, m: str, now: str, expires: str) -> str:
    return template.format(logins=logins, keys=keys, m=m, now=now, expires=expires)


def _login_params(login: ConsoleLogin) -> tuple[str, str, str, str, str]:
    return (login.digest, login.key_id, login.tenant, login.role.value, login.csrf)


def _row_to_login(row: Any) -> ConsoleLogin:
    return ConsoleLogin(digest=row[0], key_id=row[1], tenant=row[2], role=Role(row[3]), csrf=row[4])


class SQLiteKeyStore:
    """Keys in their own SQLite file (the tenants' memories are in other files), over the
    SQLite store's connection layer."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db = Connections(self.path, busy_timeout_s=10.0, label=f"the key store {self.path}")
        try:
            with self._db.transaction() as conn:
                for stmt in _SQLITE_SCHEMA:
                    conn.execute(stmt)
        except OSError as exc:
            raise StoreUnavailable(f"cannot open the key store {self.path}: {exc}") from exc

    def create(self, tenant: str, role: str | Role = Role.MEMBER, name: str = "") -> tuple[ApiKey, str]:
        tenant, the_role, name = _validate(tenant, role, name)
        key, secret = _new_key(tenant, the_role, name)
        with self._db.transaction() as conn:
            conn.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, ?, NULL)",
                         (key.id, digest(secret), tenant, the_role.value, name,
                          key.created_at.timestamp()))
        return key, secret

    def authenticate(self, secret: str) -> ApiKey | None:
        rows = self._db.read(f"SELECT {_COLUMNS} FROM api_keys WHERE digest = ? AND revoked_at IS NULL",
                             (digest(secret),))
        return _row_to_key(rows[0]) if rows else None

    def list(self, tenant: str | None = None) -> list[ApiKey]:
        if tenant is None:
            rows = self._db.read(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at, id")
        else:
            rows = self._db.read(f"SELECT {_COLUMNS} FROM api_keys WHERE tenant = ? "
                                 "ORDER BY created_at, id", (tenant,))
        return [_row_to_key(r) for r in rows]

    def revoke(self, id: str) -> ApiKey:
        with self._db.transaction() as conn:
            conn.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                         (utcnow().timestamp(), id))
            conn.execute(self._sql(_END_KEY_LOGINS), (id,))
            rows = conn.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE id = ?", (id,)).fetchall()
        if not rows:
            raise NotFound(f"no API key with id {id!r}")
        return _row_to_key(rows[0])

    @staticmethod
    def _sql(template: str) -> str:
        # times are Unix seconds of this machine's clock (every process on the file shares it)
        return _login_sql(template, logins="console_logins", keys="api_keys", m="?", now="?",
                          expires="?")

    def add_login(self, login: ConsoleLogin, ttl_s: float) -> None:
        now = time.time()
        with self._db.transaction() as conn:
            conn.execute(self._sql(_DROP_EXPIRED), (now,))
            conn.execute(self._sql(_ADD_LOGIN), (*_login_params(login), now + ttl_s))
            conn.execute(self._sql(_TRIM_LOGINS), (login.key_id, login.key_id, MAX_LOGINS_PER_KEY))

    def find_login(self, digest: str) -> ConsoleLogin | None:
        rows = self._db.read(self._sql(_FIND_LOGIN), (digest, time.time()))
        return _row_to_login(rows[0]) if rows else None

    def end_login(self, digest: str) -> None:
        with self._db.transaction() as conn:
            conn.execute(self._sql(_END_LOGIN), (digest,))

    def ping(self) -> None:
        self._db.ping("SELECT count(*) FROM api_keys")

    def close(self) -> None:
        self._db.close()


_COLUMNS = "id, tenant, role, name, created_at, revoked_at"


def _row_to_key(row: Any) -> ApiKey:
    created, revoked = row[4], row[5]
    return ApiKey(id=row[0], tenant=row[1], role=Role(row[2]), name=row[3],
                  created_at=created if isinstance(created, datetime) else _from_ts(created),
                  revoked_at=None if revoked is None else
                  revoked if isinstance(revoked, datetime) else _from_ts(revoked))


def _from_ts(value: float) -> datetime:
    return datetime.fromtimestamp(value, UTC)


# -- PostgreSQL --------------------------------------------------------------------------------

_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS engram_api_keys (
    id TEXT PRIMARY KEY,
    digest TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    role TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    revoked_at TIMESTAMPTZ
)
"""
_PG_LOGINS = ("""
CREATE TABLE IF NOT EXISTS engram_console_logins (
    digest TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    role TEXT NOT NULL,
    csrf TEXT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
)""", "CREATE INDEX IF NOT EXISTS engram_console_logins_key ON engram_console_logins (key_id)")


class PostgresKeyStore:
    """Keys in a table of the shared PostgreSQL database (every service process sees them),
    over the PostgreSQL store's pool. It connects on demand: a service can start while the
    database is down and becomes ready when it returns; a connection broken by a restart is
    replaced before any work is done on it."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0) -> None:
        from ..store.postgres import Pool  # psycopg is only imported when used

        self.url = url
        self._pool = Pool(url, max_size=8, wait_s=connect_timeout_s,
                          connect_timeout_s=connect_timeout_s)
        self._schema_ready = False

    @contextmanager
    def _cursor(self) -> Iterator[Any]:
        with self._pool.transaction() as conn:
            if not self._schema_ready:
                from ..store.postgres import create_tables

                create_tables(conn, _PG_SCHEMA, *_PG_LOGINS)
                self._schema_ready = True
            with conn.cursor() as cur:
                yield cur

    def create(self, tenant: str, role: str | Role = Role.MEMBER, name: str = "") -> tuple[ApiKey, str]:
        tenant, the_role, name = _validate(tenant, role, name)
        key, secret = _new_key(tenant, the_role, name)
        with self._cursor() as cur:
            cur.execute("INSERT INTO engram_api_keys VALUES (%s, %s, %s, %s, %s, %s, NULL)",
                        (key.id, digest(secret), tenant, the_role.value, name, key.created_at))
        return key, secret

    def authenticate(self, secret: str) -> ApiKey | None:
        stmt = f"SELECT {_COLUMNS} FROM engram_api_keys WHERE digest = %s AND revoked_at IS NULL"
        if self._schema_ready:  # every request: one round trip (Pool.batch), not three
            rows = self._pool.batch(None, [(stmt, (digest(secret),))])[0]
            return _row_to_key(rows[0]) if rows else None
        with self._cursor() as cur:
            cur.execute(stmt, (digest(secret),))
            row = cur.fetchone()
        return _row_to_key(row) if row else None

    def list(self, tenant: str | None = None) -> list[ApiKey]:
        with self._cursor() as cur:
            if tenant is None:
                cur.execute(f"SELECT {_COLUMNS} FROM engram_api_keys ORDER BY created_at, id")
            else:
                cur.execute(f"SELECT {_COLUMNS} FROM engram_api_keys WHERE tenant = %s "
                            "ORDER BY created_at, id", (tenant,))
            rows = cur.fetchall()
        return [_row_to_key(r) for r in rows]

    def revoke(self, id: str) -> ApiKey:
        with self._cursor() as cur:
            cur.execute("UPDATE engram_api_keys SET revoked_at = now() "
                        "WHERE id = %s AND revoked_at IS NULL", (id,))
            cur.execute(self._sql(_END_KEY_LOGINS), (id,))
            cur.execute(f"SELECT {_COLUMNS} FROM engram_api_keys WHERE id = %s", (id,))
            row = cur.fetchone()
        if row is None:
            raise NotFound(f"no API key with id {id!r}")
        return _row_to_key(row)

    @staticmethod
    def _sql(template: str) -> str:
        # times are the database's clock, the one clock every node agrees on
        return _login_sql(template, logins="engram_console_logins", keys="engram_api_keys",
                          m="%s", now="now()", expires="now() + make_interval(secs => %s)")

    def add_login(self, login: ConsoleLogin, ttl_s: float) -> None:
        with self._cursor() as cur:
            cur.execute(self._sql(_DROP_EXPIRED))
            cur.execute(self._sql(_ADD_LOGIN), (*_login_params(login), ttl_s))
            cur.execute(self._sql(_TRIM_LOGINS), (login.key_id, login.key_id, MAX_LOGINS_PER_KEY))

    def find_login(self, digest: str) -> ConsoleLogin | None:
        stmt = self._sql(_FIND_LOGIN)
        if self._schema_ready:  # every console request: one round trip, as `authenticate`
            rows = self._pool.batch(None, [(stmt, (digest,))])[0]
        else:
            with self._cursor() as cur:
                cur.execute(stmt, (digest,))
                rows = cur.fetchall()
        return _row_to_login(rows[0]) if rows else None

    def end_login(self, digest: str) -> None:
        with self._cursor() as cur:
            cur.execute(self._sql(_END_LOGIN), (digest,))

    def ping(self) -> None:
        with self._cursor() as cur:
            cur.execute("SELECT 1")

    def close(self) -> None:
        self._pool.close()

"""The REST service's own tables — API keys and console logins, the audit trail, rate-limit
buckets — as statements built without I/O, written once for both backends. Their named
migrations and executors are each backend's `service` module; the server holds no SQL.

Rows cross the boundary as plain tuples in the column orders below, times as `datetime`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KEY_COLUMNS = ("id", "tenant", "role", "name", "created_at", "revoked_at")
LOGIN_COLUMNS = ("digest", "key_id", "tenant", "role", "csrf")
AUDIT_COLUMNS = ("id", "at", "key_id", "tenant", "method", "route", "status", "user_id",
                 "agent_id", "session_id", "result_bytes", "duration_ms")

# A login is found only with its key, and only while the key is live: a revoked key ends its
# logins at once, on every node.
_FIND_LOGIN = """
SELECT l.digest, l.key_id, l.tenant, l.role, l.csrf FROM {logins} l JOIN {keys} k ON k.id = l.key_id
WHERE l.digest = {m} AND l.expires_at > {now} AND k.revoked_at IS NULL"""
# A key's oldest logins go first: logging in in a loop cannot grow the table.
_TRIM_LOGINS = """
DELETE FROM {logins} WHERE key_id = {m} AND digest NOT IN (
    SELECT digest FROM {logins} WHERE key_id = {m} ORDER BY expires_at DESC LIMIT {m})"""

# One statement takes a token atomically, whichever process runs it: the row is created full
# (minus the token taken), else refilled for the time since `at` and decremented if it holds
# a whole token; `wait` says how long until the next one (0: taken). SQLite (3.35+: upsert
# with RETURNING) spells least/greatest of two values min/max.
_TAKE = """
INSERT INTO {buckets} AS b (bucket, tokens, at, wait) VALUES ({m}, {m} - 1, {m}, 0)
ON CONFLICT (bucket) DO UPDATE SET
    tokens = CASE WHEN {lo}({m}, b.tokens + {hi}(0, {m} - b.at) * {m}) >= 1
                  THEN {lo}({m}, b.tokens + {hi}(0, {m} - b.at) * {m}) - 1
                  ELSE {lo}({m}, b.tokens + {hi}(0, {m} - b.at) * {m}) END,
    wait = CASE WHEN {lo}({m}, b.tokens + {hi}(0, {m} - b.at) * {m}) >= 1 THEN 0
                ELSE (1 - {lo}({m}, b.tokens + {hi}(0, {m} - b.at) * {m})) / {m} END,
    at = {m}
RETURNING wait"""


def take_params(bucket: str, now: float, rate: float, burst: int) -> list[Any]:
    """The parameters of `ServiceSQL.take`, in the order its marks appear."""
    refilled = [burst, now, rate]  # lo(burst, tokens + hi(0, now - at) * rate)
    return [bucket, float(burst), now, *refilled * 4, *refilled, rate, now]


@dataclass(frozen=True)
class ServiceSQL:
    """Every statement on the service's tables in one backend's spelling."""

    mark: str
    rowid: str  # the audit rows' tie-break after `at` (insertion order where there is one)
    insert_key: str
    live_key: str
    all_keys: str
    tenant_keys: str
    revoke_key: str
    key_by_id: str
    drop_expired_logins: str
    add_login: str
    trim_logins: str
    find_login: str
    end_login: str
    end_key_logins: str
    insert_audit: str
    take: str
    charge: str
    prune_buckets: str
    audit: str  # the audit table's name

    def audit_entries(self, *, tenant: str | None, all_tenants: bool, key_id: str | None,
                      route: str | None, limit: int) -> tuple[str, list[Any]]:
        """The newest audit rows of a tenant (None: calls made with no key), or of all."""
        m = self.mark
        parts: list[str] = []
        params: list[Any] = []
        if not all_tenants:
            parts.append("tenant IS NULL" if tenant is None else f"tenant = {m}")
            params += [] if tenant is None else [tenant]
        for column, value in (("key_id", key_id), ("route", route)):
            if value is not None:
                parts.append(f"{column} = {m}")
                params.append(value)
        where = " AND ".join(parts) or "1 = 1"
        return (f"SELECT {', '.join(AUDIT_COLUMNS)} FROM {self.audit} WHERE {where} "
                f"ORDER BY at DESC, {self.rowid} DESC LIMIT {int(limit)}", params)


def service_sql(*, prefix: str, mark: str, now: str, expires: str, revoked_now: str,
                least: str, greatest: str, rowid: str) -> ServiceSQL:
    """`now`: the current time in a statement (a mark where the caller's clock is used);
    `expires`: an expiry `ttl` seconds from now; `revoked_now`: a revocation's time."""
    keys, logins, audit, buckets = (f"{prefix}{t}" for t in
                                    ("api_keys", "console_logins", "audit", "rate_buckets"))
    m = mark
    names = dict(keys=keys, logins=logins, m=m, now=now)
    cols = ", ".join(KEY_COLUMNS)
    return ServiceSQL(
        mark=m, rowid=rowid, audit=audit,
        insert_key=f"INSERT INTO {keys} VALUES ({m}, {m}, {m}, {m}, {m}, {m}, NULL)",
        live_key=f"SELECT {cols} FROM {keys} WHERE digest = {m} AND revoked_at IS NULL",
        all_keys=f"SELECT {cols} FROM {keys} ORDER BY created_at, id",
        tenant_keys=f"SELECT {cols} FROM {keys} WHERE tenant = {m} ORDER BY created_at, id",
        revoke_key=f"UPDATE {keys} SET revoked_at = {revoked_now} WHERE id = {m} AND revoked_at IS NULL",
        key_by_id=f"SELECT {cols} FROM {keys} WHERE id = {m}",
        drop_expired_logins=f"DELETE FROM {logins} WHERE expires_at <= {now}",
        add_login=f"INSERT INTO {logins} VALUES ({m}, {m}, {m}, {m}, {m}, {expires})",
        trim_logins=_TRIM_LOGINS.format(**names),
        find_login=_FIND_LOGIN.format(**names),
        end_login=f"DELETE FROM {logins} WHERE digest = {m}",
        end_key_logins=f"DELETE FROM {logins} WHERE key_id = {m}",
        insert_audit=f"INSERT INTO {audit} VALUES ({', '.join([m] * len(AUDIT_COLUMNS))})",
        take=_TAKE.format(buckets=buckets, m=m, lo=least, hi=greatest),
        # a costly request's extra units: the bucket may go below zero (debt, paid back by the refill)
        charge=f"UPDATE {buckets} SET tokens = tokens - {m} WHERE bucket = {m} RETURNING tokens",
        prune_buckets=f"DELETE FROM {buckets} WHERE at < {m}",
    )


# SQLite: times are Unix seconds of this machine's clock, which every process on the file shares.
SQLITE = service_sql(prefix="", mark="?", now="?", expires="?", revoked_now="?",
                     least="min", greatest="max", rowid="rowid")
# PostgreSQL: times are the database's clock, the one clock every node agrees on.
POSTGRES = service_sql(prefix="engram_", mark="%s", now="now()",
                       expires="now() + make_interval(secs => %s)", revoked_now="now()",
                       least="least", greatest="greatest", rowid="id")

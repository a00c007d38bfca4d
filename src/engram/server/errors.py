"""The service's error contract: every failure is JSON `{"error": {"code", "message"}}` with a
stable code, and each engram error maps to the HTTP status that tells a client what to do.

    code                 status  meaning
    bad_request          400     more than one Authorization header
    unauthorized         401     no bearer key, or a key that is unknown or revoked
    forbidden            403     the key's role may not do this (erase, export, import, rules, pins)
    host_not_allowed     403     auth off: the Host is not loopback (server/local.py)
    origin_not_allowed   403     auth off: a browser Origin that is not loopback
    not_found            404     no such memory / job / session in this tenant (never 403)
    in_progress          409     the first request with this Idempotency-Key is still queued or
                                 running (engram.errors.InProgress); retry after Retry-After
    conflict             409     the request conflicts with what is stored (engram.errors.Conflict)
    payload_too_large    413     the request body is over the limit
    unsupported_media_type 415   a write body that is not JSON (NDJSON for an import)
    invalid_input        422     bad arguments (engram.errors.InvalidInput, request validation)
    idempotency_key_reused 422   an Idempotency-Key reused with a different request body
    rate_limited         429     the tenant's request budget is spent; see Retry-After
    store_busy           503     the database stayed locked; retry after Retry-After
    store_unavailable    503     the database cannot be reached; retry after Retry-After
    store_misconfigured  500     the database's encryption key is missing or wrong (operator)
    provider_error       502     the embedder or LLM failed
    internal_error       500     a bug: logged with its traceback, never shown to the client
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from ..errors import (
    Conflict,
    EncryptionError,
    EngramError,
    InProgress,
    InvalidFilter,
    InvalidInput,
    KeyReused,
    NotFound,
    ProviderError,
    StoreBusy,
    StoreError,
)
from .ratelimit import retry_after_header

STORE_RETRY_AFTER_S = 1  # how long a client should wait before retrying a 503


class ServiceError(Exception):
    """An HTTP-level refusal raised by the service itself (auth, limits), not by `Memory`."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def error_response(status: int, code: str, message: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status,
                        headers=headers)


def from_engram_error(exc: EngramError) -> JSONResponse:
    status, code, headers = classify(exc)
    return error_response(status, code, str(exc) or type(exc).__name__, headers)


def classify(exc: EngramError) -> tuple[int, str, dict[str, str]]:
    """(HTTP status, stable code, headers) for an engram error."""
    retry = {"Retry-After": str(STORE_RETRY_AFTER_S)}
    if isinstance(exc, InvalidFilter):
        return 422, "invalid_filter", {}
    if isinstance(exc, InvalidInput):
        return 422, "invalid_input", {}
    if isinstance(exc, NotFound):
        return 404, "not_found", {}
    if isinstance(exc, InProgress):
        # The IETF Idempotency-Key draft: 409 while the first request is being processed.
        return 409, "in_progress", {"Retry-After": retry_after_header(exc.retry_after)}
    if isinstance(exc, KeyReused):
        # the IETF Idempotency-Key draft: a key reused with another payload is a 422
        return 422, "idempotency_key_reused", {}
    if isinstance(exc, Conflict):
        return 409, "conflict", {}
    if isinstance(exc, StoreBusy):
        return 503, "store_busy", retry
    if isinstance(exc, EncryptionError):  # a key the operator must fix: retrying cannot help
        return 500, "store_misconfigured", {}
    if isinstance(exc, StoreError):
        # Whatever the database said (down, disk full, locked), the write was rolled back and
        # a later retry may succeed: 503 with Retry-After, never a 500.
        return 503, "store_unavailable", retry
    if isinstance(exc, ProviderError):
        return 502, "provider_error", {}
    return 500, "internal_error", {}


def validation_message(errors: list[Any]) -> str:
    """FastAPI's validation errors as one readable line: `body.limit: ...; query.kind: ...`."""
    parts = []
    for err in errors[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more

"""Every error engram raises on purpose, under one root, so callers can catch `EngramError`.

    EngramError
    ├── InvalidInput          bad arguments: empty / oversized / non-UTF-8 text, wrong types
    │   ├── InvalidFilter     a malformed `filters` expression
    │   └── InvalidImport     an export file that cannot be read back
    ├── NotFound              an unknown (or erased, or other-scope) memory id
    ├── Conflict              the request conflicts with what is stored (a superseded target)
    │   ├── KeyReused         an idempotency key reused with a different request
    │   └── Erased            the scope was erased while the write ran: nothing was written
    ├── InProgress            the first request under an idempotency key is still running
    ├── StoreError            the database failed; the write did not happen
    │   ├── StoreBusy         the database stayed locked past the retry budget
    │   ├── StoreUnavailable  the database cannot be reached (retry later)
    │   ├── EncryptionError   the encryption key is missing or wrong, or the file is not
    │   │                     encrypted as configured (retrying will not help)
    │   └── EmbeddingMismatch the database's vectors were made by another embedding model
    │                         (`engram reindex` re-embeds them)
    └── ProviderError         an embedder / model could not be loaded or failed
        ├── LLMUnavailable    the LLM endpoint could not be reached or kept failing (5xx, 429)
        │   └── LLMTimeout    ... or gave no answer within the timeout
        ├── LLMRejected       the LLM endpoint refused the request (4xx): key, model, options
        └── LLMOutputError    no reply validated against the schema; carries replies and reasons

Validation happens at the boundary, before anything is written: a raised error means the
database is unchanged.
"""

from __future__ import annotations


class EngramError(Exception):
    """Root of every error engram raises on purpose."""


class InvalidInput(EngramError, ValueError):
    """An argument is malformed; nothing was written."""


class InvalidFilter(InvalidInput):
    """A `filters` expression is malformed."""


class InvalidImport(InvalidInput):
    """An import file is unreadable or not an engram export; nothing was imported."""


class NotFound(EngramError, KeyError):
    """No visible memory has this id."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want a plain message
        return str(self.args[0]) if self.args else "not found"


class Conflict(EngramError):
    """The request conflicts with what is stored: e.g. `add(supersedes=id)` names a memory
    another writer has already superseded (the message names its current version). Nothing was
    written. (A key whose first request is still running is `InProgress`, not a conflict: the
    same request will succeed later.)"""


class KeyReused(Conflict):
    """An idempotency key already used for a different request; nothing was written (the
    service answers 422, as the IETF Idempotency-Key draft says)."""


class Erased(Conflict):
    """An erasure committed while this write was under way, and the write was begun before
    it: nothing was written (an erasure is a fence; pipeline/fence.py). `covered`: the erasure
    took the write's whole scope, and writing there again is the caller's decision; otherwise
    it took part of what the write had read, and the same request can simply be made again."""

    def __init__(self, message: str, *, covered: bool) -> None:
        super().__init__(message)
        self.covered = covered


class InProgress(EngramError):
    """The first request under this idempotency key is still queued or running: ask again
    after `retry_after` seconds (the service answers 409 with a Retry-After header). Nothing
    was written."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StoreError(EngramError):
    """The storage backend failed; the operation was rolled back."""


class StoreBusy(StoreError):
    """The database stayed locked by another writer longer than the configured timeout."""


class StoreUnavailable(StoreError):
    """The database cannot be reached (down, restarting, network): retry later."""


class EncryptionError(StoreError):
    """The database cannot be opened as configured: encrypted but no key (or the wrong one)
    was given, or a key was given for a plain database (`engram encrypt` converts it). Nothing
    was read or written: a wrong key never shows an empty database."""


class EmbeddingMismatch(StoreError):
    """The database's vectors belong to another embedding space than the configured embedder's
    (another model, or another dimension): searching or writing would mix the two. Nothing was
    read or written. `recorded` and `configured` name the two spaces; `engram reindex`
    (`Memory.reindex`) re-embeds the database with the configured embedder."""

    def __init__(self, recorded: str, configured: str) -> None:
        super().__init__(
            f"the database's vectors were embedded in space {recorded!r}, the configured "
            f"embedder makes {configured!r}: run `engram reindex` to re-embed the database "
            "with the configured embedder, or configure the embedder it was made with")
        self.recorded = recorded
        self.configured = configured


class ProviderError(EngramError):
    """An embedding or language model provider failed."""


class LLMUnavailable(ProviderError):
    """The LLM endpoint could not be reached, or kept failing, past the retries."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class LLMTimeout(LLMUnavailable):
    """The LLM endpoint gave no answer within the timeout."""


class LLMRejected(ProviderError):
    """The LLM endpoint refused the request (a 4xx): retrying the same request will not help."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class LLMOutputError(ProviderError):
    """The model never produced a reply that validated against the schema.

    `outputs` holds every raw reply and `reasons` why each was refused, so the caller can take
    its no-LLM path and record why.
    """

    def __init__(self, message: str, *, outputs: list[str], reasons: list[str]) -> None:
        super().__init__(message)
        self.outputs = outputs
        self.reasons = reasons

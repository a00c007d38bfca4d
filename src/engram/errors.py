"""Every error engram raises on purpose, under one root, so callers can catch `EngramError`.

    EngramError
    ├── InvalidInput          bad arguments: empty / oversized / non-UTF-8 text, wrong types
    │   ├── InvalidFilter     a malformed `filters` expression
    │   └── InvalidImport     an export file that cannot be read back
    ├── NotFound              an unknown (or erased, or other-scope) memory id
    ├── StoreError            the database failed; the write did not happen
    │   └── StoreBusy         the database stayed locked past the retry budget
    └── ProviderError         an embedder / model could not be loaded or failed

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


class StoreError(EngramError):
    """The storage backend failed; the operation was rolled back."""


class StoreBusy(StoreError):
    """The database stayed locked by another writer longer than the configured timeout."""


class ProviderError(EngramError):
    """An embedding or language model provider failed."""

"""Metadata filters: parsed and validated here (pure), compiled to SQL by each store.

Grammar (all conditions are ANDed)::

    {"topic": "food"}                          equality
    {"topic": {"in": ["food", "travel"]}}      membership ("nin" for the opposite)
    {"score": {"gte": 3, "lt": 10}}            ranges: gt, gte, lt, lte; "ne" for inequality
    {"observed_at": {"gte": "2024-01-01"}}     times: datetime or ISO-8601 string

Keys name metadata fields, except the reserved record fields in `RECORD_FIELDS`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .errors import InvalidFilter
from .model import as_utc

TIME_FIELDS = frozenset({"created_at", "updated_at", "observed_at", "valid_from", "valid_to",
                         "expires_at", "last_accessed_at"})
RECORD_FIELDS = TIME_FIELDS | {"importance", "access_count", "role", "name", "kind", "id"}
OPS = frozenset({"eq", "ne", "in", "nin", "gt", "gte", "lt", "lte"})
MAX_CONDITIONS = 100  # keys of one filter: more is no query anyone means, and SQL has limits
MAX_VALUES = 1000     # values of one in / nin list
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # what the databases compare as integers
_KEY = re.compile(r"^[A-Za-z0-9_\-.:]{1,128}$")

Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class Condition:
    field: str          # a record field, or a metadata key when `metadata` is true
    op: str
    value: Any          # a scalar, a tuple of scalars for in/nin; times become epoch seconds
    metadata: bool


def parse_filters(filters: Mapping[str, Any] | None) -> tuple[Condition, ...]:
    if filters is None:
        return ()
    if not isinstance(filters, Mapping):
        raise InvalidFilter(f"filters must be a mapping, not {type(filters).__name__}")
    if len(filters) > MAX_CONDITIONS:
        raise InvalidFilter(f"filters has {len(filters)} keys; the limit is {MAX_CONDITIONS} conditions")
    out: list[Condition] = []
    for key, spec in filters.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise InvalidFilter(f"filter key {key!r} must be 1-128 characters of [A-Za-z0-9_-.:]")
        ops = spec if isinstance(spec, Mapping) else {"eq": spec}
        if not ops:
            raise InvalidFilter(f"filter on {key!r} has no operator")
        if len(ops) > len(OPS):
            raise InvalidFilter(f"filter on {key!r} has {len(ops)} operators")
        for op, value in ops.items():
            if op not in OPS:
                raise InvalidFilter(f"unknown operator {op!r} on {key!r}; use one of {sorted(OPS)}")
            out.append(Condition(key, op, _value(key, op, value), key not in RECORD_FIELDS))
    return tuple(out)


def _value(key: str, op: str, value: Any) -> Any:
    if op in ("in", "nin"):
        if not isinstance(value, list | tuple) or not value:
            raise InvalidFilter(f"{op!r} on {key!r} needs a non-empty list")
        if len(value) > MAX_VALUES:
            raise InvalidFilter(f"{op!r} on {key!r} lists {len(value)} values; the limit is {MAX_VALUES}")
        return tuple(_scalar(key, v) for v in value)
    v = _scalar(key, value)
    if op in ("gt", "gte", "lt", "lte") and (v is None or isinstance(v, bool)):
        raise InvalidFilter(f"{op!r} on {key!r} needs a number, string or time")
    return v


def _scalar(key: str, value: Any) -> Scalar:
    if key in TIME_FIELDS:
        if isinstance(value, str):
            try:
                value = datetime.fromisoformat(value)
            except ValueError as exc:
                raise InvalidFilter(f"{key!r} needs an ISO-8601 time, got {value!r}") from exc
        if not isinstance(value, datetime):
            raise InvalidFilter(f"{key!r} needs a datetime or ISO-8601 string")
        try:
            return as_utc(value).timestamp()
        except OverflowError:
            raise InvalidFilter(f"{key!r}: {value!r} is outside the supported range") from None
    if isinstance(value, datetime):
        try:
            return as_utc(value).isoformat()
        except OverflowError:
            raise InvalidFilter(f"{key!r}: {value!r} is outside the supported range") from None
    if value is None or isinstance(value, str | int | float | bool):
        if isinstance(value, float) and value != value:
            raise InvalidFilter(f"NaN is not a valid filter value for {key!r}")
        if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
            raise InvalidFilter(f"filter value for {key!r} is an integer outside the 64-bit range")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidFilter(f"filter value for {key!r} is not valid unicode") from None
        return value
    raise InvalidFilter(f"filter value for {key!r} must be a scalar, not {type(value).__name__}")

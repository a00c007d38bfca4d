"""Validation at the boundary: pure functions that turn caller input into clean values or
raise `InvalidInput` before anything is written (ARCHITECTURE rule 9)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from .errors import InvalidInput
from .model import Kind, Message, Scope, as_utc

MAX_ID_CHARS = 256
MAX_LIMIT = 1000
# A role is one word ("user", "assistant", "tool", "document", ...): it is printed before a
# colon and as a chat role, so no newline, bracket or markup may ride in it.
ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


def ident(value: Any, what: str = "id") -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise InvalidInput(f"{what} must be a non-empty string of at most {MAX_ID_CHARS} characters")
    return utf8(value, what)


def ids(value: Any, what: str) -> tuple[str, ...]:
    """None (no ids), one id, or a list of ids: the ids in order, each once."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (ident(value, what),)
    if not isinstance(value, Sequence) or isinstance(value, bytes | bytearray):
        raise InvalidInput(f"{what} must be an id or a list of ids, not {type(value).__name__}")
    if len(value) > MAX_LIMIT:
        raise InvalidInput(f"{what} names {len(value)} ids; the limit is {MAX_LIMIT}")
    return tuple(dict.fromkeys(ident(v, f"an id in {what}") for v in value))


def utf8(value: str, what: str) -> str:
    """Refuse lone surrogates and NUL characters: valid Python strings that not every database
    can take (PostgreSQL refuses NUL in text), so no backend stores what another would refuse."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{what} is not valid unicode: {exc.reason}") from None
    if "\x00" in value:
        raise InvalidInput(f"{what} contains a NUL character")
    return value


def text(value: Any, max_chars: int, what: str = "text") -> str:
    """A memory's text: a non-blank string of at most `max_chars` (Config.max_text_chars)."""
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, not {type(value).__name__}")
    if not value.strip():
        raise InvalidInput(f"{what} is empty")
    if len(value) > max_chars:
        raise InvalidInput(f"{what} has {len(value)} characters; the limit is {max_chars} "
                           "(ENGRAM_MAX_TEXT_CHARS)")
    return utf8(value, what)


MESSAGE_FIELDS = frozenset({"role", "content", "name", "observed_at", "metadata"})


def message(m: Any, max_chars: int) -> Message:
    """One message of `Memory.add`: a string (a user turn) or a mapping of `MESSAGE_FIELDS`."""
    if isinstance(m, str):
        return Message(content=text(m, max_chars))
    if not isinstance(m, Mapping):
        raise InvalidInput(f"a message must be a string or a mapping, not {type(m).__name__}")
    unknown = set(m) - MESSAGE_FIELDS
    if unknown:
        raise InvalidInput(f"unknown message fields: {sorted(unknown)}")
    if "content" not in m:
        raise InvalidInput("a message needs a 'content'")
    role = message_role(m.get("role", "user"))
    name = m.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise InvalidInput("a message 'name' must be a non-empty string")
    if name is not None:
        utf8(name, "a message 'name'")
    return Message(content=text(m["content"], max_chars), role=role, name=name,
                   observed_at=moment(m.get("observed_at"), "observed_at"),
                   metadata=metadata(m.get("metadata")))


def message_role(value: Any) -> str:
    """A message's role: one word of letters, digits, `_`, `.` or `-` (at most 64)."""
    if not isinstance(value, str) or not ROLE.fullmatch(value):
        raise InvalidInput("a message 'role' must be one word of at most 64 letters, digits, "
                           f"'_', '.' or '-' (such as user, assistant, tool), not {value!r:.80}")
    return value


def shown_role(value: str | None) -> str:
    """A stored role as it may be printed: itself when it is a valid role, else "unknown" (a
    record written before roles were checked, or by another tool, stays data)."""
    return value if value is not None and ROLE.fullmatch(value) else "unknown"


def scope(user_id: Any, agent_id: Any, session_id: Any) -> Scope:
    for name, value in (("user_id", user_id), ("agent_id", agent_id), ("session_id", session_id)):
        if value is not None:
            ident(value, name)
    return Scope(user_id, agent_id, session_id)


def pseudonymous(s: Scope) -> Scope:
    """A scope as an erasure's record keeps it: each id replaced by `sha256:` and 16 hex digits
    of its hash, so the record proves which scope went without naming it (an email address
    used as user_id is not kept in clear)."""
    def h(v: str | None) -> str | None:
        return None if v is None else "sha256:" + hashlib.sha256(v.encode()).hexdigest()[:16]
    return Scope(h(s.user_id), h(s.agent_id), h(s.session_id))


def in_scope(rec: Scope, wanted: Scope) -> bool:
    return all(w is None or w == r for w, r in zip(wanted.as_dict().values(), rec.as_dict().values(),
                                                   strict=True))


def kind(value: Any) -> Kind | None:
    if value is None:
        return None
    try:
        return Kind(value)
    except ValueError:
        raise InvalidInput(f"kind must be one of {[k.value for k in Kind]}, not {value!r}") from None


def metadata(meta: Any) -> dict[str, Any]:
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise InvalidInput(f"metadata must be a mapping, not {type(meta).__name__}")
    if not all(isinstance(k, str) for k in meta):
        raise InvalidInput("metadata keys must be strings")
    json_value(meta, "metadata")
    try:
        encoded = json.dumps(dict(meta), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"metadata must be JSON-serialisable: {exc}") from exc
    utf8(encoded, "metadata")  # lone surrogates pass json.dumps, not databases
    decoded: dict[str, Any] = json.loads(encoded)
    if has_nul(decoded):  # PostgreSQL's jsonb refuses \u0000
        raise InvalidInput("metadata contains a NUL character")
    return decoded


MAX_DEPTH = 32  # nesting of metadata and event snapshots (deeper breaks JSON parsers)
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # what every database stores as an integer


def json_value(value: Any, what: str) -> None:
    """Refuse JSON that databases and parsers cannot take: nested deeper than `MAX_DEPTH` or
    holding an integer outside 64 bits. Walked with a stack, not recursion, so a value nested
    thousands deep is refused, never a RecursionError."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, Mapping | list | tuple):
            if depth >= MAX_DEPTH:
                raise InvalidInput(f"{what} is nested deeper than {MAX_DEPTH} levels")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, Mapping) else v))
        elif isinstance(v, int) and not isinstance(v, bool) and not INT_MIN <= v <= INT_MAX:
            raise InvalidInput(f"{what} holds an integer outside the 64-bit range")


def has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any("\x00" in k or has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_nul(v) for v in value)
    return False


def moment(value: Any, name: str) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidInput(f"{name} must be a datetime or ISO-8601 string") from None
    if not isinstance(value, datetime):
        raise InvalidInput(f"{name} must be a datetime or ISO-8601 string")
    try:
        when = as_utc(value)
        # Stores keep times as epoch seconds: refuse what cannot be read back as a datetime.
        datetime.fromtimestamp(when.timestamp(), UTC)
    except (OverflowError, ValueError, OSError):
        raise InvalidInput(f"{name} {value!r} is outside the supported range of times") from None
    return when


def importance(value: Any) -> float:
    if value is None:
        return 0.5
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise InvalidInput("importance must be a number in [0, 1]")
    return float(value)


def flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be a bool")
    return value


def limit(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise InvalidInput(f"limit must be an integer in [1, {MAX_LIMIT}]")
    return value


def as_list(messages: Any) -> list[Any]:
    if isinstance(messages, str | Mapping):
        return [messages]
    if isinstance(messages, Sequence) and not isinstance(messages, bytes | bytearray):
        if not messages:
            raise InvalidInput("messages is empty")
        return list(messages)
    raise InvalidInput(f"messages must be a string, a mapping or a list of them, "
                       f"not {type(messages).__name__}")

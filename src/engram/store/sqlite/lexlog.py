"""The SQLite side of the lexicon's change log: `lex_log` (each memory whose lexical document a
write changed, and whether it was erased, logged by triggers: schema.py), its position and
horizon, the changes past a position (index/follow.py), and its pruning inside a write."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from ..index.follow import LexicalChanges

LOG_KEEP = 100_000   # lex_log entries kept (then the older half goes): `prune_log`

# The log's position (its last id, or the horizon once every entry is pruned), FTS5's row count
# (its `averages` record), the horizon, the erasure count and the token of the trusted file.
STATE = ("SELECT max((SELECT coalesce(max(id), 0) FROM lex_log), h.value), "
         "(SELECT block FROM memory_fts_data WHERE id = 1), h.value, "
         "(SELECT value FROM meta WHERE name = 'erasures'), "
         "(SELECT value FROM meta WHERE name = 'lex_file') "
         "FROM meta h WHERE h.name = 'lex_horizon'")
ENTRIES = "SELECT id, memory_id, erased FROM lex_log WHERE id > ? ORDER BY id"


def changes(since: int, position: int, horizon: int,
            entries: Sequence[Sequence[Any]]) -> LexicalChanges | None:
    """The `ENTRIES` past `since` as changes, without their documents (the store reads them);
    None when the log cannot be followed from `since`: pruned past it, behind it (another
    file in its place), or an erasure among them (its words must leave the process)."""
    if since < 0 or horizon > since or position < since or any(e[2] for e in entries):
        return None
    if not entries:
        return LexicalChanges(since, since)
    return LexicalChanges(since, entries[-1][0], changed=list(dict.fromkeys(e[1] for e in entries)))


def prune_log(conn: sqlite3.Connection, keep: int) -> None:
    """Inside a write: once `lex_log` holds more than `keep` entries, delete the older half
    and move the horizon to the last one deleted (ids are never reused: AUTOINCREMENT, so
    the entries past the horizon are the ones kept)."""
    (top, horizon), = conn.execute(
        "SELECT (SELECT coalesce(max(id), 0) FROM lex_log), value FROM meta "
        "WHERE name = 'lex_horizon'").fetchall()
    if top - horizon > keep:
        cut = top - keep // 2
        conn.execute("DELETE FROM lex_log WHERE id <= ?", (cut,))
        conn.execute("UPDATE meta SET value = ? WHERE name = 'lex_horizon'", (cut,))

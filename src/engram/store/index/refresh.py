"""How a dense cache (`Slab`) follows its database, written once for both stores: from the
slab's `Mark`, the statements that read what changed in a scope's keys (built without I/O by
the backend's `KeyReads`), and how the slab applies their rows.

What changed since a mark: the keys deleted since its last tombstone (or word that tombstones
it had not applied were pruned: the scope is loaded afresh), the keys added since its last seq,
and the keys whose memory's cached columns changed since its rows version (each memory's
`changed` column holds the rows version of its last such change), so another process's update
of one row reloads that row, not the scope."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ...model import Scope
from ..records import Dialect, Stmt
from .slab import Slab

# Changed rows read one by one up to this share of a slab (or this many): past it, reading
# every row's attributes again is as cheap and needs no index walk of the changes.
CHANGED_SHARE = 8
CHANGED_MIN = 256
# New keys are read this many a statement (`rest` reads on until a short one): a large scope's
# first load then holds the slab's arrays and one chunk of rows, not a tuple per key of it.
CHUNK = 20_000


class KeyReads(Protocol):
    """The statements a backend gives the refresh, built without I/O (its sql.py)."""

    dialect: Dialect

    def versions(self) -> Stmt:
        """(name, value) of the `keys_version` and `rows_version` the cache follows (a name
        never bumped may be absent: 0)."""
        ...

    def tombstones(self, after_id: int) -> Stmt:
        """(id, seq) of the keys deleted after tombstone `after_id`, in order, led by
        (-1, horizon) when some of them were pruned; `after_id` -1: one row, (last id, None)."""
        ...

    def new_keys(self, scope: Scope, key_name: str, dim: int, after_seq: int, rich: bool,
                 limit: int) -> Stmt:
        """(seq, memory id, vector, kind, expires_at, valid_from, valid_to[, the
        CANDIDATE_COLUMNS when rich]) of live memories' keys of the scope after `after_seq`,
        the first `limit` by seq."""
        ...

    def changed_keys(self, scope: Scope, key_name: str, dim: int, since: int, upto_seq: int,
                     rich: bool, limit: int) -> Stmt:
        """(seq, ok, kind, times[, CANDIDATE_COLUMNS]) of the keys up to `upto_seq` whose
        memory changed after rows version `since`, in any scope (`ok`: it is live and in this
        one), at most `limit`."""
        ...

    def key_attrs(self, scope: Scope, key_name: str, dim: int, upto_seq: int,
                  rich: bool) -> Stmt:
        """(seq, kind, times[, CANDIDATE_COLUMNS]) of every live key of the scope up to
        `upto_seq`."""
        ...

    def vectors(self, blobs: Sequence[Any], dim: int) -> np.ndarray:
        """The float32 rows of the vectors `new_keys` read."""
        ...


def versions(rows: Sequence[Sequence[Any]]) -> tuple[int, int]:
    """(keys_version, rows_version) from the rows of `KeyReads.versions`."""
    found = {name: value for name, value in rows}
    return int(found.get("keys_version", 0)), int(found.get("rows_version", 0))


@dataclass(frozen=True)
class Mark:
    """Where a slab's refresh starts: the last tombstone it applied (-1: none read yet), the
    last key seq it holds, and the rows version its attributes are exact for (-1: unknown)."""

    tomb: int
    seq: int
    rows: int

    @classmethod
    def of(cls, slab: Slab) -> Mark:
        return cls(slab.tomb_max, slab.max_seq, slab.rows_version)


def changed_limit(slab: Slab) -> int:
    return max(CHANGED_MIN, slab.n // CHANGED_SHARE)


def reads(k: KeyReads, scope: Scope, key_name: str, dim: int, slab: Slab,
          attrs: bool) -> list[Stmt]:
    """The statements of one refresh of `slab`, to run in this order after the versions were
    read (so that what they read is at least as new): its tombstones, its new keys and, with
    `attrs`, its changed rows (every row's when its rows version is unknown; none while it
    holds no row: its new keys come with theirs)."""
    m = Mark.of(slab)
    out = [k.tombstones(m.tomb), k.new_keys(scope, key_name, dim, m.seq, slab.rich, CHUNK)]
    if attrs and m.seq > 0:
        out.append(k.key_attrs(scope, key_name, dim, m.seq, slab.rich) if m.rows < 0 else
                   k.changed_keys(scope, key_name, dim, m.rows, m.seq, slab.rich,
                                  changed_limit(slab) + 1))
    return out


class Applied(enum.Enum):
    DONE = "done"        # the slab holds what the reads saw
    PRUNED = "pruned"    # tombstones it had not applied are gone: load the scope afresh
    RELOAD = "reload"    # too many rows changed: read every row's attributes (`key_attrs`)


def apply(slab: Slab, k: KeyReads, dim: int, results: Sequence[Sequence[Any]]) -> Applied:
    """Apply the rows of `reads(...)` (made from this slab's mark: call with the slab's lock
    held from before `reads` or check its mark is unchanged). The changed rows go before the
    new keys, which come with their own attributes: a full reload would otherwise take the
    new rows for dead ones."""
    m_rows, m_seq = slab.rows_version, slab.max_seq
    dead, added, *rest = results
    if slab.tomb_max < 0:
        slab.tomb_max = int(dead[0][0]) if dead else 0
    elif dead and dead[0][0] < 0:
        return Applied.PRUNED
    elif dead:
        slab.kill([d[1] for d in dead])
        slab.tomb_max = int(dead[-1][0])
    outcome = Applied.DONE
    if rest and m_seq > 0:
        rows = rest[0]
        if m_rows < 0:
            slab.reset_attrs(rows, k.dialect)
        elif len(rows) > changed_limit(slab):
            outcome = Applied.RELOAD
        else:
            slab.update_attrs(rows, k.dialect)
    _append(slab, k, dim, added)
    return outcome


def rest(slab: Slab, k: KeyReads, scope: Scope, key_name: str, dim: int,
         results: Sequence[Sequence[Any]], run: Callable[[Stmt], Sequence[Any]],
         lock: AbstractContextManager[Any] | None = None) -> None:
    """After `apply` took `results`: while the new keys read filled their chunk, read (`run`)
    the next chunk after the slab's last seq and append it (holding `lock`: the slab may be
    searched meanwhile). What these later statements read is newer than the versions the
    slab is marked with, never older: a key they miss was deleted (its tombstone is next),
    and a row they read changed is read again at the next refresh."""
    added = results[1]
    while len(added) >= CHUNK:
        added = run(k.new_keys(scope, key_name, dim, slab.max_seq, slab.rich, CHUNK))
        with lock or nullcontext():
            _append(slab, k, dim, added)


def _append(slab: Slab, k: KeyReads, dim: int, added: Sequence[Sequence[Any]]) -> None:
    if added:
        slab.append([a[0] for a in added], [a[1] for a in added],
                    k.vectors([a[2] for a in added], dim), [a[3:] for a in added], k.dialect)

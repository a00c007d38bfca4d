"""Erasure as a fence: a write begun before an erasure never commits after it into what it took.

Each erasure leaves a numbered mark (its scope, pseudonymous, as in its receipt) in the
transaction that deletes. A write notes the latest number before it reads anything
(`Fence.take`), and its own write transaction checks the marks numbered since (`Fence.hold`):
both run under the store's write turn, so the check and the write it guards see the same
commits, in this process or any other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from .. import validate as valid
from ..errors import Erased
from ..model import Erasure, Job, Scope
from ..store import Store, Tx

# How long a mark is kept: a write that runs longer than this (a job's lease is 5 minutes)
# is no longer fenced by the marks dropped meanwhile.
KEEP = timedelta(days=1)
# Erasures whose scope is exact (None means "none"): a session's, one memory's.
EXACT = frozenset({"session", "memory"})
# Erasures that take a whole scope (a memory's takes one record of it).
WHOLE = frozenset({"scope", "session"})


def mark(scope: Scope, target: str, at: datetime) -> Erasure:
    """The mark an erasure of `target` ("scope", "session", "memory") in `scope` leaves."""
    return Erasure(scope=valid.pseudonymous(scope), target=target, at=at)


def leave(tx: Tx, scope: Scope, target: str, at: datetime) -> None:
    """Record the mark of an erasure, inside the erasing transaction."""
    tx.put_erasure(mark(scope, target, at), forget_before=at - KEEP)


def overlaps(e: Erasure, scope: Scope) -> bool:
    """Whether the erasure `e` took anything a write in `scope` reads or writes. Both scopes
    are pseudonymous. A None field of the write's scope matches anything (a reflection over a
    user reads every session of it); of an erasure's, anything unless the erasure is exact."""
    exact = e.target in EXACT
    return all(w is None or v == w or (v is None and not exact)
               for v, w in zip(e.scope.as_dict().values(), scope.as_dict().values(), strict=True))


def covers(e: Erasure, scope: Scope) -> bool:
    """Whether the erasure `e` took the whole of `scope` (both pseudonymous)."""
    exact = e.target in EXACT
    return e.target in WHOLE and all(
        v == w or (v is None and not exact)
        for v, w in zip(e.scope.as_dict().values(), scope.as_dict().values(), strict=True))


def _check(marks: list[Erasure], scopes: Iterable[Scope], reads: bool) -> None:
    hashed = {valid.pseudonymous(s) for s in scopes}
    hits = [e for e in marks if any(overlaps(e, s) for s in hashed)]
    covered = any(covers(e, s) for e in hits for s in hashed)
    if covered or (reads and hits):
        what = "erased" if covered else "partly erased (a memory or session in it)"
        raise Erased(f"the scope was {what} while this write ran; nothing was written",
                     covered=covered)


@dataclass(frozen=True)
class Fence:
    """What a write in `scope` begins under: the latest erasure mark `seq`, and for a job, the
    claim (`job`) whose row it must still hold when it finishes."""

    scope: Scope
    seq: int
    job: Job | None = None

    @classmethod
    def take(cls, store: Store, scope: Scope, job: Job | None = None) -> Fence:
        """Taken before the write reads anything: what it reads is at least this recent."""
        return cls(scope, store.erasure_seq(), job)

    def hold(self, tx: Tx, *, reads: bool = True) -> None:
        """Raise `Erased` (the caller's transaction then rolls back whole) if an erasure since
        the fence was taken touched this write's scope: with `reads`, any that overlaps it
        (what the write read may be gone, e.g. the recent turns an extraction saw); else only
        one that took the whole scope (the write would bring back a row, e.g. a session's)."""
        _check(tx.erasures(self.seq), [self.scope], reads)

    def hold_all(self, tx: Tx, scopes: Iterable[Scope]) -> None:
        """`hold(tx, reads=False)` for each of `scopes`: a write into many scopes whose rows
        come from the caller (an import), not from what it read."""
        _check(tx.erasures(self.seq), scopes, False)

    def finish(self, tx: Tx, job: Job) -> None:
        """Write the job's final row (done, or queued again): an UPDATE that must find the row
        still running under this fence's claim. Gone: the job was cancelled by an erasure."""
        assert self.job is not None and job.id == self.job.id
        if not tx.finish_job(job):
            raise Erased(f"job {job.id} was cancelled (erased) or taken by another worker; "
                         "nothing was written", covered=True)

"""Crash safety: a writer SIGKILLed at random moments never loses an acknowledged write and
never leaves a half-written one: 1,000 kills on SQLite, 1,000 on an encrypted SQLite
(SQLCipher), 200 on PostgreSQL.

A child process writes through `engram.Memory` (adds, facts, updates, deletes, erases) and
prints each id once `add` has returned; it is killed at a random moment; then the database is
checked. Children are forked from one "zygote" process that has already imported engram, so
hundreds of kills take seconds. The embedder is a tiny deterministic one (the test is about
storage); the databases are real.
"""

from __future__ import annotations

import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from engram.store.sqlite.conn import connect

KILLS = {"sqlite": 1000, "sqlite-encrypted": 1000, "postgres": 200}
INTEGRITY_EVERY = 25  # kills between full `integrity_check`s (and after the last one)
KEY = "crash test key"

CHILD = textwrap.dedent(r'''
    import hashlib, os, random, signal, sys
    import numpy as np
    from engram import Config, Memory
    from engram.errors import EngramError
    from engram.store.sqlite.conn import header, key_literal

    class Tiny:
        """Deterministic bag-of-words vectors: enough for consolidation to find neighbours."""
        name, dim = "tiny", 32

        def embed_batch(self, texts):
            out = np.zeros((len(texts), self.dim), dtype=np.float32)
            for i, text in enumerate(texts):
                for word in text.lower().split():
                    out[i, hashlib.md5(word.encode()).digest()[0] % self.dim] += 1.0
                out[i] /= max(np.linalg.norm(out[i]), 1e-6)
            return out

    WORDS = "tea coffee lisbon porto cat ferry cello garden rain music bike train".split()

    def work(seed, config):
        rng = random.Random(seed)
        parent = os.getppid()
        mem = Memory(config=config, embedder=Tiny())
        mine = []
        while os.getppid() == parent:  # the zygote died: stop
            user = f"u{rng.randrange(3)}"
            words = " ".join(rng.choice(WORDS) for _ in range(4))
            op = rng.random()
            try:
                if op < 0.45:
                    res = mem.add([f"turn about {words}", f"and then {words}"], user_id=user,
                                  session_id=f"s{rng.randrange(2)}")
                elif op < 0.7:
                    res = mem.add(f"{user} likes {words}", user_id=user, kind="semantic")
                elif op < 0.8 and mine:
                    mem.update(rng.choice(mine), text=f"changed to {words}")
                    continue
                elif op < 0.9 and mine:
                    mem.delete(rng.choice(mine))
                    continue
                else:  # added and erased before it is ever acknowledged
                    doomed = mem.add(f"temporary {words}", user_id=user).memories[0]
                    mem.erase(id=doomed.id)
                    continue
            except EngramError:  # e.g. updating what this child deleted
                continue
            for rec in res.memories:
                mine.append(rec.id)
                print(rec.id, flush=True)

    for line in sys.stdin:  # "<seed> <db path> <database url or -> <encryption key or ->"
        seed, path, url, key = line.split()
        key = None if key == "-" else key.replace("+", " ")
        if key is not None:  # derive the file's key once here: every child inherits it
            key_literal(key, header(path))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.dup2(w, 1)  # the child's stdout: one write per acknowledged id (atomic on a pipe)
            sys.stdin.close()
            work(int(seed), Config.from_env(path=path, database_url=None if url == "-" else url,
                                            encryption_key=key))
            os._exit(0)
        os.close(w)
        print("pid", pid, flush=True)
        pending = b""
        while chunk := os.read(r, 65536):  # relay whole lines until the child is gone
            *lines, pending = (pending + chunk).split(b"\n")
            for ack in lines:
                print("ack", ack.decode(), flush=True)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        print("exit", status, flush=True)
''')


class Zygote:
    """Forks writer children on request and relays their output: `pid <n>`, `ack <id>` per
    acknowledged write, and `exit <status>` once the child is dead and reaped."""

    def __init__(self) -> None:
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        assert self.proc.stdout is not None
        self.out = self.proc.stdout.fileno()
        self.buffer = b""

    def _line(self, timeout: float = 60.0) -> tuple[str, str]:
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.out], [], [], timeout)
            assert ready, "the writer child made no progress for a minute"
            chunk = os.read(self.out, 65536)
            assert chunk, "the zygote died"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        tag, _, value = line.decode().partition(" ")
        return tag, value

    def run_and_kill(self, seed: int, path: Path, url: str | None, delay: float,
                     after_first_ack: bool, key: str | None = None) -> set[str]:
        """Start a writer, kill it `delay` seconds in (counted from its first acknowledged
        write, or from its start), and return the ids it acknowledged."""
        assert self.proc.stdin is not None
        wire_key = key.replace(" ", "+") if key else "-"
        self.proc.stdin.write(f"{seed} {path} {url or '-'} {wire_key}\n".encode())
        self.proc.stdin.flush()
        tag, pid = self._line()
        assert tag == "pid"
        acked: set[str] = set()
        if after_first_ack:
            tag, value = self._line()
            assert tag == "ack", f"the writer exited before its first write: {value}"
            acked.add(value)
        time.sleep(delay)  # the random moment of the crash: the experiment, not a synchronisation
        os.kill(int(pid), signal.SIGKILL)
        while (line := self._line())[0] == "ack":
            acked.add(line[1])
        status = int(line[1])
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        return acked

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


# Each backend: the ids in the database, and the rows that should not exist. The queries read
# the store's own tables directly: this is what a crash may have left on disk.
ORPHANS = {
    "keys without a memory":
        "SELECT count(*) FROM memory_keys k WHERE NOT EXISTS "
        "(SELECT 1 FROM memories m WHERE m.id = k.memory_id)",
    "events without a memory (other than ERASE)":
        "SELECT count(*) FROM events e WHERE e.type <> 'ERASE' AND NOT EXISTS "
        "(SELECT 1 FROM memories m WHERE m.id = e.memory_id)",
    "live memories without keys (a half write)":
        "SELECT count(*) FROM memories m WHERE m.deleted_at IS NULL AND NOT EXISTS "
        "(SELECT 1 FROM memory_keys k WHERE k.memory_id = m.id)",
    "memories without their ADD event (a half write)":
        "SELECT count(*) FROM memories m WHERE NOT EXISTS "
        "(SELECT 1 FROM events e WHERE e.memory_id = m.id AND e.type = 'ADD')",
}


def sqlite_check(path: Path, key: str | None = None,
                 integrity: bool = True) -> tuple[set[str], dict[str, int]]:
    opened = connect(path, key) if key else sqlite3.connect(path)
    with closing(opened) as conn:
        if integrity:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'memories'").fetchone():
            return set(), {}  # killed before the first migration committed
        ids = {r[0] for r in conn.execute("SELECT id FROM memories")}
        bad = {name: conn.execute(sql).fetchone()[0] for name, sql in ORPHANS.items()}
        bad["lexical rows without a memory"] = conn.execute(
            "SELECT count(*) FROM memory_fts WHERE rowid NOT IN (SELECT rid FROM memories)").fetchone()[0]
    return ids, bad


def postgres_check(url: str, integrity: bool = True) -> tuple[set[str], dict[str, int]]:
    with psycopg.connect(url) as conn:
        conn.execute("SELECT set_config('engram.tenant', '', true)")
        if conn.execute("SELECT to_regclass('memories')").fetchone() == (None,):
            return set(), {}  # killed before the first migration committed
        ids = {r[0] for r in conn.execute("SELECT id FROM memories")}
        bad = {name: conn.execute(sql).fetchone()[0] for name, sql in ORPHANS.items()}  # type: ignore[index]
        bad["live memories without lexemes"] = conn.execute(
            "SELECT count(*) FROM memories WHERE deleted_at IS NULL AND lex IS NULL").fetchone()[0]  # type: ignore[index]
    return ids, bad


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


@dataclass
class Target:
    name: str
    path: Path
    url: str | None
    key: str | None
    check: Callable[[bool], tuple[set[str], dict[str, int]]]


@pytest.fixture(params=sorted(KILLS))
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    path = tmp_path / "crash.db"
    if request.param.startswith("sqlite"):
        key = KEY if request.param == "sqlite-encrypted" else None
        return Target(request.param, path, None, key,
                      lambda integrity: sqlite_check(path, key, integrity))
    pg = request.getfixturevalue("pg_server")
    url = pg.url(pg.create_database())
    request.addfinalizer(lambda: _drop(pg, url))
    return Target(request.param, path, url, None, lambda integrity: postgres_check(url, integrity))


def _drop(pg: Any, url: str) -> None:
    with pg.admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {url.split('/')[3].split('?')[0]} WITH (FORCE)")


@pytest.mark.slow
def test_sigkill_never_loses_an_acknowledged_write_nor_leaves_half_of_one(
        zygote: Zygote, target: Target) -> None:
    rng = random.Random(20261129)
    acked: set[str] = set()
    kills = KILLS[target.name]
    started = time.monotonic()
    for i in range(kills):
        # Most kills land mid-stream; one in ten during start-up (opening, migrating).
        early = i % 10 == 0
        acked |= zygote.run_and_kill(i, target.path, target.url,
                                     rng.uniform(0.0, 0.01 if early else 0.06),
                                     after_first_ack=not early, key=target.key)
        ids, bad = target.check(i % INTEGRITY_EVERY == 0 or i == kills - 1)
        assert acked <= ids, f"kill {i}: acknowledged but missing: {sorted(acked - ids)[:5]}"
        assert not any(bad.values()), f"kill {i}: {bad}"
    assert len(acked) >= kills * 9 // 10  # nine kills in ten came after a write was acknowledged
    if target.key:  # and the encrypted files never held plaintext: a word every write used
        raw = b"".join(p.read_bytes() for p in target.path.parent.glob("crash.db*"))
        assert b"turn about" not in raw and b"likes" not in raw
    print(f"{target.name}: {kills} kills, {len(acked)} acknowledged writes, all kept, "
          f"{time.monotonic() - started:.0f}s")

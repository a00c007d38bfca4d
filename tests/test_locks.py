"""Several processes on one SQLite file: nothing the process acknowledged is lost when another
process opens and closes the database (a CLI command, `sqlite3`, a backup, `engram keys`).

SQLite marks a WAL in use with POSIX locks, and on POSIX closing *any* descriptor of a file
drops all of the process's locks on it. If engram ever opened the database with a plain
`open()` while its connections held it, the next process to close the database would believe
it was the last one, checkpoint and delete the live WAL, and every later commit would go into
a deleted file: acknowledged, then gone at the next crash. Each test here writes from one
process (threads opening new connections), lets other processes open and close the file, kills
the writer with SIGKILL, and counts what survived; on plain and encrypted (SQLCipher) files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import httpx
import pytest

from engram.store.sqlite.conn import connect

KEY = "lock test key"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

WRITER = textwrap.dedent('''
    import sys, threading, time
    from engram import Memory
    mem = Memory(sys.argv[1])
    mem.add("memory number 0 about the harbour", user_id="u", infer=False)
    # another thread: its own connection, opened after the first write
    t = threading.Thread(target=mem.search, args=("harbour",), kwargs={"user_id": "u"})
    t.start(); t.join()
    print("ready", flush=True)
    sys.stdin.readline()  # the other process has opened and closed the file
    for i in range(1, 6):
        mem.add(f"memory number {i} about the harbour", user_id="u", infer=False)
        print("ack", i, flush=True)
    print("done", flush=True)
    time.sleep(600)  # killed here, before any clean close could checkpoint
''')

# Another program reading the file, as the `sqlite3` shell or a backup tool would.
VISITOR = textwrap.dedent('''
    import sys
    from engram.store.sqlite.conn import connect
    key = sys.argv[2] if len(sys.argv) > 2 else None
    conn = connect(sys.argv[1], key)
    print(conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0])
    conn.close()
''')


def env_for(key: str | None) -> dict[str, str]:
    env = {k: v for k, v in ENV.items() if not k.startswith("ENGRAM_")}
    if key:
        env["ENGRAM_ENCRYPTION_KEY"] = key
    return env


def count(db: Path, key: str | None, table: str = "memories") -> int:
    with closing(connect(db, key)) as conn:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


@pytest.fixture(params=[None, KEY], ids=["plain", "encrypted"])
def key(request: pytest.FixtureRequest) -> str | None:
    return request.param  # type: ignore[no-any-return]


def test_another_process_closing_the_file_costs_no_acknowledged_write(
        tmp_path: Path, key: str | None) -> None:
    db = tmp_path / "engram.db"
    env = env_for(key)
    with subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env) as writer:
        try:
            assert writer.stdin is not None and writer.stdout is not None
            assert writer.stdout.readline().strip() == "ready"
            visitor = [sys.executable, "-c", VISITOR, str(db), *([key] if key else [])]
            subprocess.run(visitor, check=True, env=env, capture_output=True, timeout=120)
            # the visitor was not the last connection: the WAL the writer uses is still there
            wal_kept = Path(f"{db}-wal").exists()
            writer.stdin.write("go\n")
            writer.stdin.flush()
            acked = [line for line in iter(writer.stdout.readline, "done\n")]
            assert len(acked) == 5, acked
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait(timeout=30)
    assert count(db, key) == 6  # the first memory and the five acknowledged after the visit
    assert wal_kept


# ---- the service, with CLI commands run beside it -------------------------------------------


def engram(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engram.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@contextmanager
def serving(db: Path, env: dict[str, str]) -> Iterator[str]:
    """`engram serve` on `db` (keys required) in its own process, killed with SIGKILL."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "engram.cli", "serve", "--db", str(db), "--port", str(port),
           "--rate", "100000", "--burst", "100000"]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True) as proc:
        yield from _until_killed(proc, f"http://127.0.0.1:{port}")


def _until_killed(proc: subprocess.Popen[str], url: str) -> Iterator[str]:
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def test_cli_backup_and_keys_beside_a_writing_service_lose_nothing(
        tmp_path: Path, key: str | None) -> None:
    db = tmp_path / "data" / "engram.db"
    env = env_for(key)
    made = engram("keys", "create", "--tenant", "t", "--role", "admin", "--db", str(db),
                  "--json", env=env)
    assert made.returncode == 0, made.stderr
    token = json.loads(made.stdout)["key"]
    doomed = json.loads(engram("keys", "create", "--tenant", "t", "--db", str(db), "--json",
                               env=env).stdout)
    acked: list[str] = []
    errors: list[str] = []
    stop = threading.Event()

    with serving(db, env) as url:
        def write(worker: int) -> None:  # several clients: several threads of the service
            with httpx.Client(base_url=url, timeout=60,
                              headers={"Authorization": f"Bearer {token}"}) as client:
                i = 0
                while not stop.is_set():
                    text = f"note {worker}-{i} about the harbour"
                    r = client.post("/v1/memories", json={"messages": text, "user_id": "u",
                                                          "infer": False})
                    if r.status_code in (200, 201):
                        acked.append(text)
                    else:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                    i += 1

        threads = [threading.Thread(target=write, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        try:
            while len(acked) < 6:  # every writer thread has its connection open
                assert not errors, errors
                time.sleep(0.1)
            # other processes open and close the service's files while it writes
            tenant_files = list((db.parent / "tenants").glob("*.db"))
            assert len(tenant_files) == 1
            tenant = str(tenant_files[0])
            before_backup = set(acked)
            backup = tmp_path / "backup.db"
            for args in (("check", "--db", tenant),
                         ("keys", "list", "--db", str(db)),
                         ("keys", "revoke", doomed["id"], "--db", str(db)),
                         ("backup", str(backup), "--db", tenant)):
                done = engram(*args, env=env)
                assert done.returncode == 0, (args, done.stdout, done.stderr)
            for visit in ([tenant, *([key] if key else [])], [str(db.parent / "keys.db")]):
                visited = subprocess.run([sys.executable, "-c", VISITOR, *visit], env=env,
                                         capture_output=True)
                assert visited.returncode == 0, visited.stderr
            # the revocation is seen by the running service at once
            for _ in range(3):
                r = httpx.get(f"{url}/v1/memories", params={"user_id": "u"},
                              headers={"Authorization": f"Bearer {doomed['key']}"}, timeout=30)
                assert r.status_code == 401, r.text
            settle = len(acked)
            while len(acked) < settle + 6:  # writes acknowledged after every visit
                assert not errors, errors
                time.sleep(0.1)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
    assert not errors, errors
    # the service was killed with SIGKILL: every acknowledged write is in its tenant's file
    with closing(connect(tenant_files[0], key)) as conn:
        stored = {row[0] for row in conn.execute("SELECT text FROM memories")}
    assert set(acked) <= stored, f"{len(set(acked) - stored)} of {len(acked)} acked writes lost"
    # the online backup holds every write acknowledged before it began
    with closing(connect(backup, key)) as conn:
        backed_up = {row[0] for row in conn.execute("SELECT text FROM memories")}
    assert len(before_backup) >= 6 and before_backup <= backed_up
    with closing(connect(db.parent / "keys.db", None)) as conn:  # digests only: never encrypted
        revoked = conn.execute("SELECT revoked_at FROM api_keys WHERE id = ?",
                               (doomed["id"],)).fetchone()
    assert revoked is not None and revoked[0] is not None

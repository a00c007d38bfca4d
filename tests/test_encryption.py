"""Encryption at rest: with a key, the database, its WAL and its shm hold no plaintext (canary
grep), a wrong or missing key is an `EncryptionError` and never an empty database, and a
database can be encrypted in place, re-keyed, backed up encrypted and checked."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from engram import Config, EncryptionError, InvalidInput, Memory, backup
from engram.store.sqlite.conn import connect

CANARY = "qzvcipher5521"  # lower case and digit-final: the FTS stemmer leaves it alone
KEY = "correct horse battery staple"


def files(db: Path) -> list[Path]:
    return [p for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists()]


def occurrences(paths: list[Path], needle: str) -> int:
    raw = needle.encode()
    return sum(p.read_bytes().lower().count(raw) for p in paths)


def fill(mem: Memory) -> None:
    """The canary in every place a memory's text goes: rows, FTS, metadata, a session, a job."""
    mem.add([f"my locker code is {CANARY}", "and the bike is there"], user_id="A",
            session_id="s1", metadata={"note": CANARY})
    mem.add(f"The locker code is {CANARY}", user_id="A", kind="semantic")
    s = mem.session(user_id="A", session_id="s2")
    s.add(f"again {CANARY}")
    job = mem.add(f"queued {CANARY}", user_id="A", background=True, infer=False).job
    assert job is not None
    mem.wait(job.id, timeout=60)


def encrypted(tmp_path: Path, embedder, key: str = KEY, name: str = "enc.db") -> Memory:
    return Memory(config=Config(path=tmp_path / name, encryption_key=key), embedder=embedder)


def test_the_canary_is_in_no_file_of_an_encrypted_database(tmp_path: Path, embedder) -> None:
    plain_db = tmp_path / "plain.db"
    with Memory(plain_db, embedder=embedder) as plain:
        fill(plain)
        assert occurrences(files(plain_db), CANARY) > 0  # the control: plain files show it
    db = tmp_path / "enc.db"
    with encrypted(tmp_path, embedder) as mem:
        fill(mem)
        # while the database is open: the WAL holds the recent pages, the shm its index
        assert {p.name for p in files(db)} == {"enc.db", "enc.db-wal", "enc.db-shm"}
        assert Path(f"{db}-wal").stat().st_size > 0
        assert occurrences(files(db), CANARY) == 0
        assert not db.read_bytes().startswith(b"SQLite format 3")
        hits = mem.search(f"locker {CANARY}", user_id="A")  # FTS and vectors work as before
        assert any(CANARY in h.memory.text for h in hits)
    assert occurrences(files(db), CANARY) == 0
    with encrypted(tmp_path, embedder) as again:  # reopened with the key: everything is there
        assert again.stats(user_id="A").memories == 5


def test_a_wrong_or_missing_key_is_an_error_not_an_empty_database(tmp_path: Path,
                                                                  embedder) -> None:
    db = tmp_path / "enc.db"
    with encrypted(tmp_path, embedder) as mem:
        mem.add(f"kept {CANARY}", user_id="A")
    before = db.read_bytes()
    with pytest.raises(EncryptionError, match="wrong encryption key"):
        encrypted(tmp_path, embedder, key="not the key")
    with pytest.raises(EncryptionError, match="ENGRAM_ENCRYPTION_KEY"):
        Memory(db, embedder=embedder)
    assert db.read_bytes() == before  # nothing was written by the failed opens
    plain = tmp_path / "plain.db"
    Memory(plain, embedder=embedder).close()
    with pytest.raises(EncryptionError, match="engram encrypt"):
        encrypted(tmp_path, embedder, name="plain.db")
    with encrypted(tmp_path, embedder) as mem:
        assert [m.text for m in mem.list(user_id="A").items] == [f"kept {CANARY}"]


def test_the_key_comes_from_the_environment_or_a_file(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGRAM_ENCRYPTION_KEY", KEY)
    assert Config.from_env().encryption_key == KEY
    assert KEY not in repr(Config.from_env())
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    monkeypatch.setenv("ENGRAM_ENCRYPTION_KEY_FILE", str(key_file))
    with pytest.raises(InvalidInput, match="not both"):
        Config.from_env()
    monkeypatch.delenv("ENGRAM_ENCRYPTION_KEY")
    assert Config.from_env().encryption_key == KEY
    monkeypatch.setenv("ENGRAM_ENCRYPTION_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(InvalidInput, match="cannot be read"):
        Config.from_env()


def test_encrypt_in_place_after_a_backup_then_rekey(tmp_path: Path, embedder) -> None:
    db = tmp_path / "m.db"
    with Memory(db, embedder=embedder) as mem:
        fill(mem)
        ids = [m.id for m in mem.list(user_id="A", limit=100).items]
    config = Config(path=db, encryption_key=KEY)
    saved = backup.encrypt(config)
    assert occurrences([saved], CANARY) > 0  # the plain backup, to delete once verified
    assert occurrences(files(db), CANARY) == 0
    assert backup.check(config) == []
    with Memory(config=config, embedder=embedder) as mem:
        assert [m.id for m in mem.list(user_id="A", limit=100).items] == ids
        assert any(CANARY in h.memory.text for h in mem.search(CANARY, user_id="A"))
        mem.add(f"after {CANARY}", user_id="B")
    with pytest.raises(EncryptionError, match="not a plain"):
        backup.encrypt(config)

    backup.rekey(config, "a new key")
    with pytest.raises(EncryptionError, match="wrong encryption key"):
        Memory(config=config, embedder=embedder)
    new = Config(path=db, encryption_key="a new key")
    with Memory(config=new, embedder=embedder) as mem:
        assert len(mem.list(user_id="A", limit=100).items) == len(ids)
        assert mem.list(user_id="B").items[0].text == f"after {CANARY}"
    assert occurrences(files(db), CANARY) == 0


def test_erase_on_an_encrypted_database_uses_fts5_secure_delete(tmp_path: Path,
                                                                embedder) -> None:
    db = tmp_path / "enc.db"
    with encrypted(tmp_path, embedder) as mem:
        fill(mem)
        assert mem.erase(user_id="A") == 5
    with connect(db, KEY) as conn:
        on = conn.execute("SELECT v FROM memory_fts_config WHERE k = 'secure-delete'").fetchall()
        assert on == [(1,)]
        assert conn.execute("SELECT count(*) FROM memory_fts WHERE memory_fts MATCH ?",
                            [CANARY]).fetchone()[0] == 0
        # nothing of the canary is left in any page, decrypted
        for table in ("memories", "events", "jobs", "sessions", "memory_fts_data"):
            rows = conn.execute(f"SELECT * FROM {table}").fetchall()
            assert CANARY not in repr(rows).lower()


def test_an_encrypted_database_backs_up_encrypted(tmp_path: Path, embedder) -> None:
    with encrypted(tmp_path, embedder) as mem:
        fill(mem)
        config = mem.config
        info = backup.backup(config, tmp_path / "backups" / "b.db")
    assert info.encrypted and info.bytes > 0
    assert occurrences(files(info.path), CANARY) == 0
    assert backup.check(config, info.path) == []
    with pytest.raises(EncryptionError):
        backup.check(Config(path=tmp_path / "x.db"), info.path)
    restored = Config(path=tmp_path / "restored.db", encryption_key=KEY)
    assert backup.restore(restored, info.path) is None
    with Memory(config=restored, embedder=embedder) as mem:
        assert mem.stats(user_id="A").memories == 5
    assert occurrences(files(tmp_path / "restored.db"), CANARY) == 0


def test_the_service_encrypts_every_tenant_and_its_audit_log(tmp_path: Path, embedder) -> None:
    from server_kit import service

    with service(tmp_path, embedder, encryption_key=KEY) as svc:
        for who in ("a-member", "b-member"):
            r = svc.call(who, "POST", "/v1/memories",
                         json={"messages": f"my code is {CANARY}", "user_id": "u1"})
            assert r.status_code == 201
        found = svc.call("a-member", "POST", "/v1/memories/search",
                         json={"query": CANARY, "user_id": "u1"}).json()
        assert found["hits"][0]["memory"]["text"] == f"my code is {CANARY}"
        data = svc.config.path.parent
        tenants = sorted((data / "tenants").glob("*.db"))
        assert len(tenants) == 2
        everything = sorted(p for p in data.rglob("*") if p.is_file())
        assert occurrences(everything, CANARY) == 0
        for db in [*tenants, data / "audit.db"]:
            assert not db.read_bytes().startswith(b"SQLite format 3")
        # keys.db holds only key digests, tenants and names (no memory): plain by design
        assert (data / "keys.db").read_bytes().startswith(b"SQLite format 3")


def test_encrypt_rekey_receipts_and_audit_from_the_shell(tmp_path: Path, embedder,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    from engram.cli import app

    db = tmp_path / "cli.db"
    with Memory(db, embedder=embedder) as mem:
        mem.add(f"kept {CANARY}", user_id="A")
        mem.add("erased soon", user_id="B")
    monkeypatch.setattr("engram.providers.embedders.get_embedder", lambda name: embedder)

    def run(*args: str, key: str | None = KEY, code: int = 0) -> str:
        env = {"ENGRAM_ENCRYPTION_KEY": key} if key else {}
        result = CliRunner(env=env).invoke(app, ["--db", str(db), *args])
        assert result.exit_code == code, result.output
        return result.output

    out = json.loads(run("encrypt", "--json"))
    assert Path(out["plain_backup"]).exists()
    Path(out["plain_backup"]).unlink()
    assert occurrences(files(db), CANARY) == 0
    assert "encrypted (or is not an SQLite database)" in run("stats", key=None, code=3)
    (tmp_path / "new-key").write_text("the new key\n")
    assert "new key" in run("rekey", "--new-key-file", str(tmp_path / "new-key"))
    assert "wrong encryption key" in run("stats", code=3)
    assert json.loads(run("erase", "-u", "B", "--yes", "--json", key="the new key"))["erased"] == 1
    (receipt,) = json.loads(run("receipts", "--json", key="the new key"))
    hashed = "sha256:" + hashlib.sha256(b"B").hexdigest()[:16]  # the erased user is not named
    assert (receipt["target"], receipt["memories"], receipt["scope"]["user_id"]) == ("scope", 1, hashed)
    assert "nothing has outlived" in run("retain", key="the new key")
    assert json.loads(run("audit", "--json", key="the new key")) == []  # no service ran here
    assert "integrity ok" in run("check", key="the new key")

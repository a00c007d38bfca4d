"""Retention: memories older than their kind's policy are removed by the worker (as an erase
removes: no text left), each with a DELETE event that says why, the run with a receipt, and
the count in `stats` (library and service)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from engram import Config, EventType, InvalidInput, Memory, NotFound
from engram.model import utcnow
from engram.pipeline.retention import cutoffs
from pg_server import PG
from server_kit import service

CANARY = "rqzretain6612"


def files(db: Path) -> list[Path]:
    return [p for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists()]


def occurrences(db: Path, needle: str) -> int:
    return sum(p.read_bytes().lower().count(needle.encode()) for p in files(db))


def test_cutoffs_per_kind() -> None:
    now = utcnow()
    cut = cutoffs({"episodes": 90, "messages": 30, "facts": None}, now)
    assert (cut.episodes, cut.messages, cut.facts) == (now - timedelta(days=90),
                                                        now - timedelta(days=30), None)
    assert cut.jobs == now - timedelta(days=30)  # finished jobs hold messages: the shortest
    assert cutoffs({"episodes": None, "messages": None, "facts": None}, now).any() is False


def test_retention_config_per_kind_and_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGRAM_RETENTION_EPISODES", "90")
    monkeypatch.setenv("ENGRAM_RETENTION_FACTS", "keep")
    monkeypatch.setenv("ENGRAM_RETENTION_TENANTS", '{"acme": {"messages": 7}}')
    config = Config.from_env()
    assert config.retention() == {"episodes": 90, "messages": None, "facts": None}
    assert config.retention("acme") == {"episodes": 90, "messages": 7, "facts": None}
    for bad in ('{"acme": {"faxts": 3}}', '{"acme": {"episodes": -1}}', '["acme"]', "{"):
        monkeypatch.setenv("ENGRAM_RETENTION_TENANTS", bad)
        with pytest.raises(InvalidInput):
            Config.from_env()
    monkeypatch.setenv("ENGRAM_RETENTION_TENANTS", "{}")
    monkeypatch.setenv("ENGRAM_RETENTION_MESSAGES", "a month")
    with pytest.raises(InvalidInput, match="number of days"):
        Config.from_env()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_retention_removes_each_kind_after_its_days(tmp_path: Path, embedder, backend: str) -> None:
    db = tmp_path / "r.db"
    url = PG.database_for(tmp_path) if backend == "postgres" else None
    config = Config(path=db, database_url=url, retention_episodes_days=90,
                    retention_messages_days=30)
    with Memory(config=config, embedder=embedder) as mem:
        chat = mem.session(user_id="A", session_id="s1")
        chat.add(f"my locker code is {CANARY}")
        message = chat.messages()[0].id
        episode = mem.add("A walked to the lake", user_id="A").memories[0]
        fact = mem.add("A likes green tea", user_id="A", kind="semantic").memories[0]
        job = mem.add(f"queued {CANARY}", user_id="A", session_id="s2", background=True).job
        assert job is not None
        mem.wait(job.id, timeout=60)
        assert mem.retain() is None  # nothing is old yet

        receipt = mem.retain(now=utcnow() + timedelta(days=31))
        assert receipt is not None
        assert (receipt.target, receipt.memories, receipt.by_kind, receipt.jobs) == (
            "retention", 2, {"episodic": 2}, 1)
        with pytest.raises(NotFound):
            mem.get(message)
        with pytest.raises(NotFound):
            mem.job(job.id)
        (deleted,) = mem.history(message)
        assert deleted.type is EventType.DELETE
        assert deleted.reason == "retention: messages kept 30 days"
        if url is None:
            assert occurrences(db, CANARY) == 0
        assert mem.get(episode.id) and mem.get(fact.id)
        assert mem.stats(user_id="A").retention == {"episodes": 90, "messages": 30, "facts": None,
                                                    "removed": 2}

        later = mem.retain(now=utcnow() + timedelta(days=91))
        assert later is not None and later.memories == 1
        with pytest.raises(NotFound):
            mem.get(episode.id)
        assert mem.get(fact.id).text == "A likes green tea"  # facts are kept
        assert [r.target for r in mem.receipts()] == ["retention", "retention"]


def test_the_worker_enforces_retention(tmp_path: Path, embedder) -> None:
    config = Config(path=tmp_path / "w.db", retention_episodes_days=1.5 / 86400, worker="off")
    with Memory(config=config, embedder=embedder) as mem:
        old = mem.add("soon forgotten", user_id="A").memories[0]
        time.sleep(2)
        fresh = mem.add("just said", user_id="A").memories[0]
        assert mem.work(until_idle=True) == 0  # no job ran; retention did
        with pytest.raises(NotFound):
            mem.get(old.id)
        assert mem.get(fresh.id).text == "just said"


def test_the_service_stats_show_retention(tmp_path: Path, embedder) -> None:
    with service(tmp_path, embedder, retention_facts_days=365,
                 retention_tenants={"a": {"episodes": 30}}) as svc:
        a = svc.call("a-member", "GET", "/v1/stats").json()["retention"]
        b = svc.call("b-member", "GET", "/v1/stats").json()["retention"]
    assert a == {"episodes": 30, "messages": None, "facts": 365, "removed": 0}
    assert b == {"episodes": None, "messages": None, "facts": 365, "removed": 0}

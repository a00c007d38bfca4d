"""Shared fixtures: the real MiniLM embedder once per session, real SQLite files per test.

Storage backends are listed in `STORES` (name -> factory); the conformance suite runs once per
entry. A factory called twice with the same directory must open the same database.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from engram import Config, Memory  # noqa: E402
from engram.providers.embedders import MiniLM  # noqa: E402
from engram.providers.llms import LLM, ScriptedLLM  # noqa: E402
from engram.store import SQLiteStore, Store  # noqa: E402
from pg_server import PG  # noqa: E402

StoreFactory = Callable[[Path], Store]

STORES: dict[str, StoreFactory] = {
    "sqlite": lambda directory: SQLiteStore(directory / "store.db"),
    # one PostgreSQL server per session (started on first use), a fresh database per directory
    "postgres": lambda directory: _postgres_store(directory),
}


def _postgres_store(directory: Path) -> Store:
    from engram.store.postgres import PostgresStore

    return PostgresStore(PG.database_for(directory))


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Any]:
    """The session's PostgreSQL (pgvector; see tests/pg_server.py), for tests that need it
    directly: `pg_server.create_database()`, `pg_server.url(name)`, `pg_server.admin()`."""
    yield PG.start()


@pytest.fixture(scope="session", autouse=True)
def _pg_stop() -> Iterator[None]:
    yield
    PG.stop()


@pytest.fixture(autouse=True)
def _pg_drop_databases() -> Iterator[None]:
    """Drop the databases a test's store factories made (a no-op for SQLite-only tests)."""
    yield
    PG.drop_databases()


@pytest.fixture(scope="session", autouse=True)
def _clean_env() -> Iterator[None]:
    """Tests never read the developer's ENGRAM_* settings (session-wide, so that module-scoped
    fixtures are built without them too)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith("ENGRAM_"):
                mp.delenv(name)
        yield


@pytest.fixture(scope="session")
def embedder() -> MiniLM:
    """The real local model as a new database gets it by default (`auto`: int8), loaded once:
    loading takes seconds, embedding milliseconds."""
    # Tests embed a few short texts at a time: one intra-op thread keeps the suite's time
    # steady when other processes on the machine are busy.
    model = MiniLM(threads=1, int8=True)
    model.embed_batch(["warm up"])
    return model


@pytest.fixture(scope="session")
def fp32() -> MiniLM:
    """The same model in fp32 (`minilm`): sentence-transformers' vectors, and the space of
    every database made before int8 was the default."""
    model = MiniLM(threads=1)
    model.embed_batch(["warm up"])
    return model


@pytest.fixture
def mem(tmp_path: Path, embedder: MiniLM) -> Iterator[Memory]:
    m = Memory(tmp_path / "m.db", embedder=embedder)
    yield m
    m.close()


@pytest.fixture
def script() -> ScriptedLLM:
    """The deterministic LLM of decision tests: push replies, read `requests`."""
    return ScriptedLLM()


@pytest.fixture
def smart(tmp_path: Path, embedder: MiniLM, script: ScriptedLLM) -> Iterator[Memory]:
    """A Memory with the scripted LLM: no transport retries, one retry on invalid output."""
    m = Memory(tmp_path / "m.db", embedder=embedder, llm=LLM(script, retries=0, output_retries=1))
    yield m
    m.close()


@pytest.fixture(params=sorted(STORES))
def store_factory(request: pytest.FixtureRequest) -> StoreFactory:
    return STORES[request.param]


@pytest.fixture
def store(store_factory: StoreFactory, tmp_path: Path) -> Iterator[Store]:
    s = store_factory(tmp_path)
    yield s
    s.close()


def _rows(path: Path) -> dict[str, Any]:
    with closing(sqlite3.connect(path)) as conn:
        return {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
            for table in ("memories", "memory_keys", "events", "memory_fts", "meta")
        }


@pytest.fixture
def snapshot() -> Callable[[Path], dict[str, Any]]:
    """Every row engram keeps in a SQLite file, for "the database is unchanged" checks."""
    return _rows


@pytest.fixture(params=sorted(STORES))
def gmem(request: pytest.FixtureRequest, tmp_path: Path, embedder: MiniLM) -> Iterator[Memory]:
    """A Memory without an LLM on each store (the graph's tests)."""
    m = Memory(store=STORES[request.param](tmp_path), embedder=embedder, llm=None,
               config=Config(path=tmp_path / "unused.db"))
    yield m
    m.close()

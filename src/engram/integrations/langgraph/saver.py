"""`EngramSaver`: LangGraph checkpoints (threads, checkpoints, pending writes) in the database
an engram `Memory` uses — its own two tables beside engram's, in the SQLite file or on the
PostgreSQL server of `Memory.config`.

The SQL is built here without I/O (one text per statement, `?` placeholders; PostgreSQL gets
`%s`); `_SQLite` and `_Postgres` only execute it. A checkpoint is stored whole (channel values
included) with LangGraph's serializer, so a row is everything `get_tuple` needs. Sync methods
hold the logic; the async ones run them in a worker thread, as `AsyncMemory` does.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engram import AsyncMemory, InvalidInput, Memory

from .. import missing, sync_memory

try:
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.base import (
        WRITES_IDX_MAP,
        BaseCheckpointSaver,
        ChannelVersions,
        Checkpoint,
        CheckpointMetadata,
        CheckpointTuple,
        get_checkpoint_id,
        get_serializable_checkpoint_metadata,
    )
    from langgraph.checkpoint.serde.base import SerializerProtocol
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("langgraph", exc) from exc

CHECKPOINTS = "langgraph_checkpoints"
WRITES = "langgraph_writes"

# -- SQL, built without I/O ----------------------------------------------------------------------


def schema(dialect: str) -> list[str]:
    """The two tables, for `sqlite` or `postgres` (BLOB vs BYTEA). Every row carries the
    engram tenant (`""` for none), like every engram record."""
    blob = "BYTEA" if dialect == "postgres" else "BLOB"
    return [
        f"""CREATE TABLE IF NOT EXISTS {CHECKPOINTS} (
            tenant TEXT NOT NULL, thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL,
            checkpoint_id TEXT NOT NULL, parent_checkpoint_id TEXT, run_id TEXT,
            checkpoint_type TEXT NOT NULL, checkpoint {blob} NOT NULL,
            metadata_type TEXT NOT NULL, metadata {blob} NOT NULL,
            PRIMARY KEY (tenant, thread_id, checkpoint_ns, checkpoint_id))""",
        f"""CREATE INDEX IF NOT EXISTS {CHECKPOINTS}_run ON {CHECKPOINTS} (tenant, run_id)""",
        f"""CREATE TABLE IF NOT EXISTS {WRITES} (
            tenant TEXT NOT NULL, thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL,
            checkpoint_id TEXT NOT NULL, task_id TEXT NOT NULL, idx INTEGER NOT NULL,
            task_path TEXT NOT NULL, channel TEXT NOT NULL, value_type TEXT NOT NULL,
            value {blob} NOT NULL,
            PRIMARY KEY (tenant, thread_id, checkpoint_ns, checkpoint_id, task_id, idx))""",
    ]


COLUMNS = ("thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, checkpoint_type, "
           "checkpoint, metadata_type, metadata")
PUT_CHECKPOINT = (
    f"INSERT INTO {CHECKPOINTS} (tenant, thread_id, checkpoint_ns, checkpoint_id, "
    "parent_checkpoint_id, run_id, checkpoint_type, checkpoint, metadata_type, metadata) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, thread_id, checkpoint_ns, "
    "checkpoint_id) DO UPDATE SET parent_checkpoint_id = excluded.parent_checkpoint_id, "
    "run_id = excluded.run_id, checkpoint_type = excluded.checkpoint_type, "
    "checkpoint = excluded.checkpoint, metadata_type = excluded.metadata_type, "
    "metadata = excluded.metadata")
_WRITE_INSERT = (
    f"INSERT INTO {WRITES} (tenant, thread_id, checkpoint_ns, checkpoint_id, task_id, idx, "
    "task_path, channel, value_type, value) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (tenant, thread_id, checkpoint_ns, checkpoint_id, task_id, idx) ")
# A regular write is kept once (a retried task writes the same again); a special one (error,
# interrupt, ...: a negative idx) is the latest state of its kind and replaces the last.
PUT_WRITE_ONCE = _WRITE_INSERT + "DO NOTHING"
PUT_WRITE_LATEST = _WRITE_INSERT + (
    "DO UPDATE SET task_path = excluded.task_path, channel = excluded.channel, "
    "value_type = excluded.value_type, value = excluded.value")
GET_WRITES = (f"SELECT task_id, channel, value_type, value FROM {WRITES} WHERE tenant = ? AND "
              "thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ? "
              "ORDER BY task_path, task_id, idx")


def select_checkpoints(*, thread_id: str | None, checkpoint_ns: str | None,
                       checkpoint_id: str | None, before: str | None,
                       limit: int | None) -> tuple[str, list[Any]]:
    """The checkpoints matching a `list` / `get_tuple` call, newest first (the tenant is the
    first parameter, filled in by the caller)."""
    where, params = ["tenant = ?"], []
    for column, value in (("thread_id", thread_id), ("checkpoint_ns", checkpoint_ns),
                          ("checkpoint_id", checkpoint_id)):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if before is not None:
        where.append("checkpoint_id < ?")
        params.append(before)
    sql = (f"SELECT {COLUMNS} FROM {CHECKPOINTS} WHERE {' AND '.join(where)} "
           "ORDER BY checkpoint_id DESC, thread_id, checkpoint_ns")
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    return sql, params


def delete_where(table: str, condition: str) -> str:
    return f"DELETE FROM {table} WHERE tenant = ? AND {condition}"


# checkpoints of the given threads that are not the newest of their namespace
NOT_LATEST = (f"checkpoint_id < (SELECT MAX(c.checkpoint_id) FROM {CHECKPOINTS} c "
              f"WHERE c.tenant = {{t}}.tenant AND c.thread_id = {{t}}.thread_id "
              f"AND c.checkpoint_ns = {{t}}.checkpoint_ns)")


def copy_rows(table: str, columns: str) -> str:
    """Copy a thread's rows to another thread id (the new id replaces `thread_id`)."""
    return (f"INSERT INTO {table} (tenant, thread_id, {columns}) SELECT tenant, ?, {columns} "
            f"FROM {table} WHERE tenant = ? AND thread_id = ? ON CONFLICT DO NOTHING")


CHECKPOINT_COPY = ("checkpoint_ns, checkpoint_id, parent_checkpoint_id, run_id, checkpoint_type, "
                   "checkpoint, metadata_type, metadata")
WRITE_COPY = "checkpoint_ns, checkpoint_id, task_id, idx, task_path, channel, value_type, value"


# -- the two databases -------------------------------------------------------------------------

class _Database:
    """One connection, used by one thread at a time; `transaction()` around each call."""

    dialect = "sqlite"

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def transaction(self) -> Any:
        raise NotImplementedError

    def run(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def create(self, statements: list[str]) -> None:
        for statement in statements:
            self.run(statement)

    def close(self) -> None:
        raise NotImplementedError


class _SQLite(_Database):
    def __init__(self, path: Path, busy_timeout_s: float) -> None:
        super().__init__()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None,
                                    check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def run(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.conn.execute(sql, tuple(params)).fetchall()

    def close(self) -> None:
        self.conn.close()


class _Postgres(_Database):
    dialect = "postgres"

    def __init__(self, url: str, connect_timeout_s: float) -> None:
        super().__init__()
        try:
            import psycopg
        except ImportError as exc:
            raise missing("postgres", exc) from exc
        self.conn = psycopg.connect(url, autocommit=True,
                                    connect_timeout=max(1, int(connect_timeout_s)))

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self.lock, self.conn.transaction():
            yield

    def create(self, statements: list[str]) -> None:
        # One creator at a time: racing `CREATE TABLE IF NOT EXISTS` collide in pg_type.
        self.run("SELECT pg_advisory_xact_lock(hashtext('engram.langgraph'))")
        super().create(statements)

    def run(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cur = self.conn.execute(sql.replace("?", "%s"), tuple(params))
        return [tuple(r) for r in cur.fetchall()] if cur.description else []

    def close(self) -> None:
        self.conn.close()


# -- the saver ---------------------------------------------------------------------------------

class EngramSaver(BaseCheckpointSaver[str]):
    """LangGraph's checkpointer in engram's database: `create_agent(..., checkpointer=
    EngramSaver(mem))`. SQLite (the `Memory`'s file) or PostgreSQL (its `database_url`);
    checkpoints of a service tenant carry the tenant. Call `close()` when done."""

    def __init__(self, memory: Memory | AsyncMemory, *, serde: SerializerProtocol | None = None) -> None:
        super().__init__(serde=serde)
        mem = sync_memory(memory)
        cfg = mem.config
        self.tenant = mem.tenant or ""
        self.db: _Database = (_Postgres(cfg.database_url, cfg.pg_connect_timeout_s)
                              if cfg.database_url else _SQLite(cfg.path, cfg.busy_timeout_s))
        with self.db.transaction():
            self.db.create(schema(self.db.dialect))

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> EngramSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # reading -----------------------------------------------------------------------------------

    def _tuple(self, row: tuple[Any, ...]) -> CheckpointTuple:
        thread_id, ns, checkpoint_id, parent, ctype, cblob, mtype, mblob = row
        writes = self.db.run(GET_WRITES, (self.tenant, thread_id, ns, checkpoint_id))

        def config(cid: str) -> RunnableConfig:
            return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": cid}}

        return CheckpointTuple(
            config=config(checkpoint_id),
            checkpoint=self.serde.loads_typed((ctype, bytes(cblob))),
            metadata=self.serde.loads_typed((mtype, bytes(mblob))),
            parent_config=config(parent) if parent else None,
            pending_writes=[(task, channel, self.serde.loads_typed((vtype, bytes(value))))
                            for task, channel, vtype, value in writes])

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        conf = config["configurable"]
        sql, params = select_checkpoints(
            thread_id=conf["thread_id"], checkpoint_ns=conf.get("checkpoint_ns", ""),
            checkpoint_id=get_checkpoint_id(config), before=None, limit=1)
        with self.db.transaction():
            rows = self.db.run(sql, [self.tenant, *params])
            return self._tuple(rows[0]) if rows else None

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None, limit: int | None = None) -> Iterator[CheckpointTuple]:
        conf = (config or {}).get("configurable", {})
        sql, params = select_checkpoints(
            thread_id=conf.get("thread_id"), checkpoint_ns=conf.get("checkpoint_ns"),
            checkpoint_id=conf.get("checkpoint_id"),
            before=get_checkpoint_id(before) if before else None,
            limit=None if filter else limit)  # a metadata filter is applied after decoding
        with self.db.transaction():
            tuples = [self._tuple(r) for r in self.db.run(sql, [self.tenant, *params])]
        if filter:
            tuples = [t for t in tuples if all(t.metadata.get(k) == v for k, v in filter.items())]
        if limit is not None:
            tuples = tuples[:limit]
        yield from tuples

    # writing -----------------------------------------------------------------------------------

    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:
        conf = config["configurable"]
        thread_id, ns = conf["thread_id"], conf.get("checkpoint_ns", "")
        meta = get_serializable_checkpoint_metadata(config, metadata)
        run_id = meta.get("run_id")
        ctype, cblob = self.serde.dumps_typed(checkpoint)
        mtype, mblob = self.serde.dumps_typed(meta)
        with self.db.transaction():
            self.db.run(PUT_CHECKPOINT, (self.tenant, thread_id, ns, checkpoint["id"],
                                         conf.get("checkpoint_id"),
                                         str(run_id) if run_id is not None else None,
                                         ctype, cblob, mtype, mblob))
        return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns,
                                 "checkpoint_id": checkpoint["id"]}}

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                   task_path: str = "") -> None:
        conf = config["configurable"]
        key = (self.tenant, conf["thread_id"], conf.get("checkpoint_ns", ""), conf["checkpoint_id"])
        with self.db.transaction():
            for i, (channel, value) in enumerate(writes):
                idx = WRITES_IDX_MAP.get(channel, i)
                vtype, vblob = self.serde.dumps_typed(value)
                self.db.run(PUT_WRITE_LATEST if idx < 0 else PUT_WRITE_ONCE,
                            (*key, task_id, idx, task_path, channel, vtype, vblob))

    def delete_thread(self, thread_id: str) -> None:
        with self.db.transaction():
            for table in (WRITES, CHECKPOINTS):
                self.db.run(delete_where(table, "thread_id = ?"), (self.tenant, thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        runs = [str(r) for r in run_ids]
        if not runs:
            return
        marks = ", ".join("?" for _ in runs)
        of_runs = (f"(thread_id, checkpoint_ns, checkpoint_id) IN (SELECT thread_id, checkpoint_ns, "
                   f"checkpoint_id FROM {CHECKPOINTS} WHERE tenant = ? AND run_id IN ({marks}))")
        with self.db.transaction():
            self.db.run(delete_where(WRITES, of_runs), (self.tenant, self.tenant, *runs))
            self.db.run(delete_where(CHECKPOINTS, f"run_id IN ({marks})"), (self.tenant, *runs))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        with self.db.transaction():
            self.db.run(copy_rows(CHECKPOINTS, CHECKPOINT_COPY),
                        (target_thread_id, self.tenant, source_thread_id))
            self.db.run(copy_rows(WRITES, WRITE_COPY),
                        (target_thread_id, self.tenant, source_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """`keep_latest` keeps the newest checkpoint of each namespace (and its writes);
        `delete` removes the threads' checkpoints. Not for graphs with `DeltaChannel`s, whose
        state is rebuilt from the pruned ancestors (see `BaseCheckpointSaver.prune`)."""
        if strategy not in ("keep_latest", "delete"):
            raise InvalidInput(f"unknown prune strategy {strategy!r}: keep_latest or delete")
        threads = [str(t) for t in thread_ids]
        if not threads:
            return
        marks = ", ".join("?" for _ in threads)
        with self.db.transaction():
            for table in (WRITES, CHECKPOINTS):
                condition = f"thread_id IN ({marks})"
                if strategy == "keep_latest":
                    condition += " AND " + NOT_LATEST.format(t=table)
                self.db.run(delete_where(table, condition), (self.tenant, *threads))

    # async: the same code in a worker thread ---------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None,
                    limit: int | None = None) -> AsyncIterator[CheckpointTuple]:
        found = await asyncio.to_thread(
            lambda: [*self.list(config, filter=filter, before=before, limit=limit)])
        for item in found:
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint,
                   metadata: CheckpointMetadata, new_versions: ChannelVersions) -> RunnableConfig:
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                          task_id: str, task_path: str = "") -> None:
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await asyncio.to_thread(self.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await asyncio.to_thread(self.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await asyncio.to_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await asyncio.to_thread(self.prune, thread_ids, strategy=strategy)

    def get_next_version(self, current: str | None, channel: None) -> str:
        """Versions as zero-padded strings that sort as text (the counter first), with a random
        fraction so that two forks of one thread never make the same version."""
        if current is None:
            n = 0
        elif isinstance(current, int):
            n = current
        else:
            n = int(str(current).split(".")[0])
        return f"{n + 1:032}.{random.random():016}"

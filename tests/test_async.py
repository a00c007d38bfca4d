"""`AsyncMemory`: the same behaviour as `Memory`, as coroutines."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest

from engram import AsyncMemory, EventType, InvalidInput, Memory, NotFound
from engram.aio import AsyncSessionHandle
from engram.working.session import SessionHandle


def test_every_method_works_under_asyncio_run(tmp_path: Path, embedder) -> None:
    async def main() -> None:
        async with AsyncMemory(tmp_path / "a.db", embedder=embedder) as mem:
            res = await mem.add("Ana moved to Lisbon in May", user_id="ana")
            rec = res.memories[0]
            assert (await mem.get(rec.id)) == rec
            hits = await mem.search("where does Ana live", user_id="ana")
            assert hits[0].memory.id == rec.id
            page = await mem.list(user_id="ana")
            assert [r.id for r in page.items] == [rec.id]
            updated = await mem.update(rec.id, text="Ana moved to Porto in June")
            assert updated.text == "Ana moved to Porto in June"
            assert [e.type for e in await mem.history(rec.id)] == [EventType.ADD,
                                                                   EventType.UPDATE]
            assert (await mem.stats(user_id="ana")).memories == 1
            assert await mem.export(tmp_path / "out.jsonl", user_id="ana") == 1
            await mem.delete(rec.id)
            with pytest.raises(NotFound):
                await mem.get(rec.id)
            assert await mem.erase(user_id="ana") == 1
            assert await mem.import_(tmp_path / "out.jsonl") == 1
            assert (await mem.get(rec.id)).text == "Ana moved to Porto in June"
            with pytest.raises(InvalidInput):
                await mem.add("")

    asyncio.run(main())


def test_concurrent_adds_lose_nothing(tmp_path: Path, embedder) -> None:
    async def main() -> tuple[int, int, set[str]]:
        mem = AsyncMemory(tmp_path / "g.db", embedder=embedder)
        try:
            results = await asyncio.gather(
                *(mem.add(f"note {i}", user_id=f"u{i % 3}") for i in range(24)),
                *(mem.add([f"batch {i} a", f"batch {i} b"], user_id="u0") for i in range(6)),
                *(mem.search("note", limit=3) for _ in range(4)),
            )
            ids = {r.id for res in results[:30] for r in res.memories}
            st = await mem.stats()
            return st.memories, st.events, ids
        finally:
            await mem.close()

    memories, events, ids = asyncio.run(main())
    assert memories == events == len(ids) == 24 + 12


def _public(cls: type) -> dict[str, Any]:
    return {n: v for n, v in vars(cls).items()
            if (not n.startswith("_") or n == "__init__") and callable(v)}


def _parameters(fn: Any) -> list[tuple[str, Any, Any, Any]]:
    """Name, kind, default and (resolved) annotation of each parameter."""
    sig = inspect.signature(fn, eval_str=True)
    return [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]


@pytest.mark.parametrize(("sync", "aio"), [(Memory, AsyncMemory), (SessionHandle, AsyncSessionHandle)],
                         ids=["Memory", "SessionHandle"])
def test_the_async_face_has_every_method_with_the_same_signature(sync: type, aio: type) -> None:
    """Every public method, the same parameters: names, kinds, defaults and types (no
    `**kwargs: Any` standing in for them); coroutines where the sync method does work."""
    methods = _public(sync)
    assert len(methods) > 8  # the check means something
    theirs = _public(aio)
    assert set(methods) - {"__init__"} <= set(theirs), sorted(set(methods) - set(theirs))
    for name, fn in methods.items():
        if name == "__init__" and sync is SessionHandle:
            continue  # made by `session()`, from the sync handle
        assert _parameters(theirs[name]) == _parameters(fn), name
        if name != "__init__":
            assert inspect.iscoroutinefunction(theirs[name]), name
    for name, value in vars(sync).items():  # properties too
        if isinstance(value, property) and not name.startswith("_"):
            assert sync is Memory or isinstance(vars(aio).get(name), property), name


def test_async_memory_returns_the_async_session_handle(tmp_path: Path, embedder) -> None:
    async def main() -> None:
        async with AsyncMemory(tmp_path / "s.db", embedder=embedder) as mem:
            s = await mem.session(user_id="ana", session_id="s", policy="window")
            assert isinstance(s, AsyncSessionHandle) and s.id == "s"
            await s.add("hello there")
            assert [m.content for m in await s.messages()] == ["hello there"]
            assert (await s.info()).scope.session_id == "s"
            assert await s.refresh() == 0 and await s.wait(timeout=5)
            assert await s.delete() == 1
            assert await mem.sessions(user_id="ana") == []

    asyncio.run(main())

"""`AsyncMemory`: the same behaviour as `Memory`, as coroutines."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engram import AsyncMemory, EventType, InvalidInput, NotFound


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

"""`EngramSaver` passes the whole langgraph-checkpoint-conformance suite (base and extended
capabilities) on SQLite and on a real PostgreSQL, and keeps a LangGraph agent's thread across a
restart."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES

from engram import Config, Memory
from engram.integrations.langgraph import EngramSaver
from pg_server import PG

BACKENDS = ["sqlite", "postgres"]


@pytest.fixture(params=BACKENDS)
def open_memory(request: pytest.FixtureRequest, tmp_path: Path,
                embedder: Any) -> Iterator[Callable[[], Memory]]:
    """Opens Memories over one fresh database of the backend (each call: a new Memory, the
    same database, as after a restart)."""
    opened: list[Memory] = []
    url = PG.database_for(tmp_path) if request.param == "postgres" else None

    def open_() -> Memory:
        config = Config.from_env(path=tmp_path / "m.db", database_url=url)
        opened.append(Memory(config=config, embedder=embedder))
        return opened[-1]

    yield open_
    for m in opened:
        m.close()


def test_the_whole_conformance_suite_passes(open_memory: Callable[[], Memory]) -> None:
    names = itertools.count()

    async def factory() -> AsyncIterator[EngramSaver]:
        with EngramSaver(open_memory()) as saver:
            yield saver

    registered = checkpointer_test(name=f"EngramSaver-{next(names)}")(factory)
    report = asyncio.run(validate(registered))
    failures = {cap: r.failures for cap, r in report.results.items() if r.failures}
    assert failures == {}
    assert {cap for cap, r in report.results.items() if r.detected} == {c.value for c in ALL_CAPABILITIES}
    assert report.passed_all() and report.conformance_level() == "FULL"
    assert sum(r.tests_passed for r in report.results.values()) == 81


class ToolCallingFake(GenericFakeChatModel):
    def bind_tools(self, tools: Any, **kwargs: Any) -> ToolCallingFake:  # type: ignore[override]
        return self


def test_an_agent_thread_survives_a_restart(open_memory: Callable[[], Memory]) -> None:
    thread = {"configurable": {"thread_id": "t1"}}
    with EngramSaver(open_memory()) as saver:
        agent = create_agent(ToolCallingFake(messages=iter([AIMessage(content="Hello Ana.")])),
                             checkpointer=saver)
        agent.invoke({"messages": [{"role": "user", "content": "I am Ana."}]}, thread)
    with EngramSaver(open_memory()) as saver:  # a new Memory and saver over the same database
        agent = create_agent(ToolCallingFake(messages=iter([AIMessage(content="You are Ana.")])),
                             checkpointer=saver)
        out = agent.invoke({"messages": [{"role": "user", "content": "Who am I?"}]}, thread)
        assert [m.content for m in out["messages"]] == ["I am Ana.", "Hello Ana.", "Who am I?",
                                                        "You are Ana."]
        history = list(saver.list(thread))
        assert len(history) >= 4 and history[0].config["configurable"]["thread_id"] == "t1"
        saver.delete_thread("t1")
        assert saver.get_tuple(thread) is None

"""engram for LangChain: the chat message history over an engram session, and the agent
middleware driven by a real `create_agent` run with langchain-core's scripted chat model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatResult
from langgraph.checkpoint.memory import InMemorySaver

from engram import Memory
from engram.integrations.langchain import EngramChatMessageHistory, EngramMiddleware, to_engram

PROMPTS: list[list[BaseMessage]] = []


class ScriptedModel(GenericFakeChatModel):
    """langchain-core's scripted chat model, recording every prompt; binding tools changes
    nothing about its script."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        PROMPTS.append(list(messages))
        return super()._generate(messages, *args, **kwargs)


def test_chat_history_is_a_session_and_survives_a_restart(tmp_path: Path, embedder: Any) -> None:
    with Memory(tmp_path / "h.db", embedder=embedder) as mem:
        history = EngramChatMessageHistory(mem, user_id="ana", session_id="s1")
        history.add_messages([
            HumanMessage("What's the weather in Porto?"),
            AIMessage("", tool_calls=[{"name": "weather", "args": {"city": "Porto"}, "id": "w1"}]),
            ToolMessage("Sunny, 24°C", tool_call_id="w1"),
            AIMessage("It is sunny and 24°C in Porto."),
        ])
        history.add_user_message("Thanks!")
    with Memory(tmp_path / "h.db", embedder=embedder) as mem:  # a restart
        history = EngramChatMessageHistory(mem, user_id="ana", session_id="s1")
        got = history.messages
        assert [m.type for m in got] == ["human", "ai", "tool", "ai", "human"]
        assert isinstance(got[1], AIMessage) and got[1].tool_calls[0]["args"] == {"city": "Porto"}
        assert got[1].tool_calls[0]["id"] == "w1"
        assert isinstance(got[2], ToolMessage) and got[2].tool_call_id == "w1"
        assert got[3].content == "It is sunny and 24°C in Porto."
        assert mem.search("weather Porto", user_id="ana")  # the messages are episodes
        assert asyncio.run(history.aget_messages()) == got
        history.clear()
        assert history.messages == []
        assert EngramChatMessageHistory(mem, user_id="ana", session_id="s1").messages == []


def test_the_middleware_recalls_for_the_user_and_writes_the_turn(mem: Memory) -> None:
    mem.add("I am allergic to peanuts.", user_id="ana", infer=False)
    PROMPTS.clear()

    def menu(dish: str) -> str:
        """Look up a dish's ingredients."""
        return "satay: chicken, peanut sauce"

    model = ScriptedModel(messages=iter([
        AIMessage("", tool_calls=[{"name": "menu", "args": {"dish": "satay"}, "id": "m1"}]),
        AIMessage("Better not: satay comes with peanut sauce."),
        AIMessage("You told me about satay and peanuts."),
    ]))
    agent = create_agent(model, tools=[menu], system_prompt="You are a careful waiter.",
                         middleware=[EngramMiddleware(mem, budget_tokens=300)],
                         checkpointer=InMemorySaver())
    run = {"configurable": {"user_id": "ana", "thread_id": "t1"}}
    out = agent.invoke({"messages": [{"role": "user", "content": "Can I eat the satay?"}]}, run)

    first = PROMPTS[0]
    assert isinstance(first[0], SystemMessage)
    assert first[0].text.startswith("You are a careful waiter.")
    assert "allergic to peanuts" in first[0].text and "<memory>" in first[0].text
    assert len(PROMPTS[1]) == 4  # system, question, tool call, result: the memory is not state
    assert not any(isinstance(m, SystemMessage) for m in out["messages"])

    # the turn is in engram, in order, the tool call written together with its result
    stored = mem.list(user_id="ana", session_id="t1").items
    assert [r.role for r in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1].text == 'called menu({"dish": "satay"})'
    assert stored[2].text == "satay: chicken, peanut sauce"
    assert len({r.created_at for r in stored[1:3]}) == 1  # one write

    # another thread of the same user recalls the first one; nothing is written twice
    again = {"configurable": {"user_id": "ana", "thread_id": "t2"}}
    agent.invoke({"messages": [{"role": "user", "content": "What did I ask about satay?"}]}, again)
    assert "Can I eat the satay?" in PROMPTS[-1][0].text
    assert len(mem.list(user_id="ana", session_id="t1").items) == 4
    assert [r.role for r in mem.list(user_id="ana", session_id="t2").items] == ["user", "assistant"]


def test_no_user_no_memory(mem: Memory) -> None:
    PROMPTS.clear()
    agent = create_agent(ScriptedModel(messages=iter([AIMessage("Hi.")])),
                         middleware=[EngramMiddleware(mem)])
    agent.invoke({"messages": [{"role": "user", "content": "Hello"}]})
    assert not any(isinstance(m, SystemMessage) for m in PROMPTS[0])
    assert mem.list(agent_id=None, user_id=None).items == []


def test_message_conversion() -> None:
    call = AIMessage("", tool_calls=[{"name": "f", "args": {"x": 1}, "id": "c"}], id="a1")
    assert to_engram(call) == {"role": "assistant", "content": "", "metadata": {"lc_id": "a1"},
                               "tool_calls": [{"type": "function", "id": "c",
                                               "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    assert to_engram(ToolMessage("", tool_call_id="c")) == {
        "role": "tool", "content": "(no output)", "tool_call_id": "c"}
    assert to_engram(HumanMessage("  ")) is None

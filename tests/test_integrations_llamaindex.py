"""engram as LlamaIndex's memory, driven by a real `FunctionAgent` (llama-index-core 0.14) with
LlamaIndex's own scripted tool-calling model, `MockFunctionCallingLLM`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage, TextBlock, ToolCallBlock
from llama_index.core.llms.mock import MockFunctionCallingLLM
from llama_index.core.memory import Memory as LlamaMemory
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from engram import InvalidInput, Memory
from engram.integrations.llamaindex import (
    EngramMemory,
    EngramMemoryBlock,
    shrink,
    to_engram,
    to_llama,
)

# Not ours: the framework's deprecation warnings (pydantic v1-style access inside
# llama-index-workflows).
pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecationWarning")

SRC = Path(__file__).resolve().parents[1] / "src"

# One agent run per process: the model calls `note` on the first message of a session, then
# answers; it prints what it was shown (every prompt) as JSON.
AGENT = textwrap.dedent('''
    import asyncio, json, sys
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
    from llama_index.core.llms.mock import MockFunctionCallingLLM
    from engram import Memory
    from engram.integrations.llamaindex import EngramMemory

    db, session, text = sys.argv[1:4]
    prompts = []

    def model(messages, **kwargs):
        prompts.append([{"role": str(m.role.value), "content": m.content or ""} for m in messages])
        if messages[-1].role.value == "user":
            return ChatMessage(role="assistant", blocks=[ToolCallBlock(
                tool_call_id="call-1", tool_name="note", tool_kwargs={"text": "noted"})])
        return ChatMessage(role="assistant", content="Got it.")

    def note(text: str) -> str:
        """Take a note."""
        return "ok: " + text

    async def main():
        with Memory(db) as mem:
            memory = EngramMemory(mem, user_id="ana", session_id=session)
            agent = FunctionAgent(tools=[note], llm=MockFunctionCallingLLM(response_generator=model),
                                  system_prompt="You are Ana's assistant.")
            answer = await agent.run(text, memory=memory)
            stored = [m.to_chat() for m in mem.session(user_id="ana", session_id=session).messages()]
        print(json.dumps({"answer": str(answer), "prompts": prompts, "stored": stored}))

    asyncio.run(main())
''')


def _run_agent(tmp_path: Path, session: str, text: str) -> dict[str, Any]:
    script = tmp_path / "agent.py"
    script.write_text(AGENT, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "agent.db"), session, text],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_fact_told_in_one_session_is_in_the_prompt_of_the_next_after_a_restart(
        tmp_path: Path) -> None:
    first = _run_agent(tmp_path, "s1", "My sister Zoe lives in Trondheim and loves kayaking.")
    assert first["answer"] == "Got it."
    # session 1 holds the turn with the tool call and its result, in order, linked by id
    roles = [m["role"] for m in first["stored"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert first["stored"][1]["tool_calls"][0]["id"] == "call-1"
    assert first["stored"][2]["tool_call_id"] == "call-1"
    assert "Trondheim" not in json.dumps(first["prompts"][0][:-1])  # nothing known yet

    second = _run_agent(tmp_path, "s2", "Where does my sister live?")  # a new process
    shown = second["prompts"][0]
    memory = [m for m in shown if m["role"] == "system" and "<memory>" in m["content"]]
    assert memory, shown
    assert "Zoe lives in Trondheim" in memory[0]["content"]      # recalled from session 1
    assert shown[-1] == {"role": "user", "content": "Where does my sister live?"}
    assert sum(m["content"] == "Where does my sister live?" for m in shown) == 1
    assert not any("Trondheim" in m["content"] for m in shown if m["role"] == "user")
    assert [m["role"] for m in second["stored"]] == ["user", "assistant", "tool", "assistant"]


def test_engram_memory_in_process(mem: Memory) -> None:
    seen: list[list[ChatMessage]] = []

    def model(messages: list[ChatMessage], **kwargs: Any) -> ChatMessage:
        seen.append(list(messages))
        return ChatMessage(role="assistant", content="Noted.")

    async def run(memory: EngramMemory, text: str) -> None:
        agent = FunctionAgent(tools=[], llm=MockFunctionCallingLLM(response_generator=model))
        await agent.run(text, memory=memory)

    first = EngramMemory(mem, user_id="bo", session_id="a")
    asyncio.run(run(first, "I parked the car on level 3, spot 42."))
    assert [m.role.value for m in first.get_all()] == ["user", "assistant"]
    second = EngramMemory(mem, user_id="bo", session_id="b", budget_tokens=800)
    asyncio.run(run(second, "Where did I park?"))
    system = seen[-1][0]
    assert system.role.value == "system" and "spot 42" in (system.content or "")
    # another user's memory does not see it
    other = EngramMemory(mem, user_id="cy", session_id="c")
    asyncio.run(run(other, "Where did I park?"))
    assert not any("spot 42" in (m.content or "") for m in seen[-1])
    # reset erases the session; set replaces it
    first.set([ChatMessage(role="user", content="Start over.")])
    assert [m.content for m in first.get_all()] == ["Start over."]
    first.reset()
    assert first.get_all() == []
    with pytest.raises(InvalidInput):
        EngramMemory(mem)  # no user, no agent: nothing to scope the memory by


def _chat_engine(tmp_path: Path, name: str) -> AsyncEngine:
    """LlamaIndex's chat store on a file we dispose of (its default in-memory store leaves its
    aiosqlite connections to the garbage collector)."""
    return create_async_engine(f"sqlite+aiosqlite:///{tmp_path / name}")


def test_the_block_stores_what_is_flushed_and_recalls_it_in_another_session(
        mem: Memory, tmp_path: Path) -> None:
    turns = ["My passport number ends in 7731 and expires in March 2031.", "Noted, thanks.",
             "I am allergic to peanuts, please remember it.", "I will remember that.",
             "What is the weather like?", "Sunny."]

    async def main() -> list[ChatMessage]:
        old, new = _chat_engine(tmp_path, "old.db"), _chat_engine(tmp_path, "new.db")
        block = EngramMemoryBlock(mem, user_id="ana", budget_tokens=300)
        short = LlamaMemory.from_defaults(session_id="old", token_limit=60, token_flush_size=20,
                                          chat_history_token_ratio=0.5, memory_blocks=[block],
                                          async_engine=old)
        for i, text in enumerate(turns):
            await short.aput(ChatMessage(role="user" if i % 2 == 0 else "assistant", content=text))
        fresh = LlamaMemory.from_defaults(session_id="new", token_limit=4000, async_engine=new,
                                          memory_blocks=[EngramMemoryBlock(mem, user_id="ana")])
        await fresh.aput(ChatMessage(role="user", content="When does my passport expire?"))
        messages = await fresh.aget()
        await old.dispose()
        await new.dispose()
        return messages

    messages = asyncio.run(main())
    stored = mem.list(user_id="ana").items
    assert {m.text for m in stored} >= {turns[0], turns[1]}  # flushed out of the short memory
    assert all(m.scope.session_id == "old" for m in stored)
    assert messages[0].role.value == "system"
    text = messages[0].content or ""
    assert "<engram>" in text and "7731" in text
    assert '"My passport number ends in 7731' in text  # quoted data with its date
    assert messages[-1].content == "When does my passport expire?"


def test_truncation_shrinks_the_block_instead_of_dropping_it(mem: Memory, tmp_path: Path) -> None:
    for i in range(12):
        mem.add(f"Fact number {i}: the hiking trail {i} in Madeira is {i + 3} km long.",
                user_id="ana", infer=False)
    block = EngramMemoryBlock(mem, user_id="ana", budget_tokens=400)
    question = ChatMessage(role="user", content="hiking trails in Madeira")

    async def main() -> tuple[str, str]:
        full = await block.aget([question])
        # the whole memory allows far less than the block's 400 tokens: LlamaIndex asks it to shrink
        engine = _chat_engine(tmp_path, "chat.db")
        small = LlamaMemory.from_defaults(session_id="x", token_limit=150, memory_blocks=[block],
                                          async_engine=engine)
        await small.aput(question)
        text = (await small.aget())[0].content or ""
        await engine.dispose()
        return full, text

    full, text = asyncio.run(main())
    assert full.count("\n- ") >= 8
    assert "<engram>" in text
    kept = text.count("\n- ")
    assert 1 <= kept < full.count("\n- ")


def test_shrink_drops_the_last_lines_and_empty_headings() -> None:
    text = "<memory>\nintro\n\n## Facts (current)\n- a\n- b\n## Relevant past messages\n- c\n</memory>"
    words = len  # one "token" per character keeps the arithmetic visible
    assert shrink(text, 1, words) == text.replace("\n## Relevant past messages\n- c", "")
    assert shrink(text, 31, words) == "<memory>\nintro\n\n## Facts (current)\n- a\n</memory>"
    assert shrink(text, 10_000, words) is None


def test_messages_round_trip_with_tool_calls() -> None:
    call = ChatMessage(role="assistant", blocks=[ToolCallBlock(
        tool_call_id="c1", tool_name="lookup", tool_kwargs={"q": "Porto"})])
    result = ChatMessage(role="tool", blocks=[TextBlock(text="sunny")],
                         additional_kwargs={"tool_call_id": "c1"})
    wire_call, wire_result = to_engram(call), to_engram(result)
    assert wire_call == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "Porto"}'}}]}
    assert wire_result == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    back = to_llama(wire_call)
    assert isinstance(back.blocks[0], ToolCallBlock) and back.blocks[0].tool_kwargs == {"q": "Porto"}
    assert to_llama(wire_result).additional_kwargs == {"tool_call_id": "c1"}
    assert to_engram(ChatMessage(role="user", content="  ")) is None
    named = to_engram(ChatMessage(role="user", content="hi", additional_kwargs={
        "name": "Ana", "observed_at": "2024-05-01T10:00:00+00:00"}))
    assert named == {"role": "user", "content": "hi", "name": "Ana",
                     "observed_at": "2024-05-01T10:00:00+00:00"}

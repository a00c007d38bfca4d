"""A LlamaIndex `FunctionAgent` whose long-term memory is engram, as a memory block.

`EngramMemoryBlock` goes into LlamaIndex's own `Memory` next to its short-term chat history:
before each model call it brings what engram recalls for the latest message (facts, lessons,
earlier sessions, relevant past messages) within its token budget, and messages that LlamaIndex
flushes out of its short-term memory are stored in engram.

    python examples/llamaindex_agent.py

The model here is LlamaIndex's scripted `MockFunctionCallingLLM`, which shows what it was sent;
use any LlamaIndex LLM with function calling instead (`OpenAI(...)`, `Ollama(...)`).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.llms import ChatMessage
from llama_index.core.llms.mock import MockFunctionCallingLLM
from llama_index.core.memory import Memory as LlamaMemory

from engram import Memory
from engram.integrations.llamaindex import EngramMemoryBlock


def model(messages: list[ChatMessage], **kwargs: Any) -> ChatMessage:
    """Stands in for an LLM: shows the memory it was given, and answers."""
    print("the model is shown:")
    for message in messages:
        print(f"  {message.role.value}: {message.content}")
    return ChatMessage(role="assistant", content="Better not: the satay sauce is made of peanuts.")


async def run(mem: Memory) -> str:
    block = EngramMemoryBlock(mem, user_id="ana", budget_tokens=500)
    memory = LlamaMemory.from_defaults(session_id="tuesday", memory_blocks=[block])
    agent = FunctionAgent(tools=[], llm=MockFunctionCallingLLM(response_generator=model),
                          system_prompt="You are Ana's assistant.")
    return str(await agent.run("Can I have the satay?", memory=memory))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, help="database file (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, Memory(args.db or Path(folder) / "agent.db") as mem:
        # What an earlier conversation left in engram (any face could have written it).
        mem.add("I'm allergic to peanuts.", user_id="ana", session_id="monday")
        print(f"answer: {asyncio.run(run(mem))}")


if __name__ == "__main__":
    main()

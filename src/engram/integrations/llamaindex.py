"""engram as the memory of LlamaIndex agents (llama-index-core 0.14): `EngramMemoryBlock`, a
long-term block for `llama_index.core.memory.Memory`, and `EngramMemory`, a whole agent memory.

    from llama_index.core.memory import Memory as LlamaMemory
    block = EngramMemoryBlock(mem, user_id="ana", budget_tokens=500)
    memory = LlamaMemory.from_defaults(session_id="s1", memory_blocks=[block])
    agent.run("...", memory=memory)                      # or, the whole memory in engram:
    agent.run("...", memory=EngramMemory(mem, user_id="ana", session_id="s1"))

Priority (read `Memory._truncate_memory_blocks` in llama-index-core 0.14): when the blocks and
the chat history exceed `token_limit`, LlamaIndex truncates blocks in *ascending* priority order
(the smallest number first) and never truncates priority 0 — despite the field's description,
a larger number is kept longer. The engram block defaults to priority 1 (shrunk first); give it
a larger number than other blocks to keep it longer, 0 to never shrink it. Either way it already
keeps to its own `budget_tokens`, and `atruncate` drops its least relevant lines rather than the
whole block. See docs/integrations.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from engram import AsyncMemory, InvalidInput, Memory, NotFound, SessionHandle
from engram.working import Policy, SessionMessage

from . import as_episode, missing, recall, sync_memory

try:
    from llama_index.core.base.llms.types import ChatMessage, TextBlock, ToolCallBlock
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.core.memory import BaseMemory
    from llama_index.core.memory.memory import BaseMemoryBlock
    from llama_index.core.utils import get_tokenizer
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("llamaindex", exc) from exc

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "tool": "tool",
         "function": "tool", "chatbot": "assistant", "model": "assistant", "developer": "system"}
EMPTY_RESULT = "(no output)"  # a tool result with no text: engram stores no empty message


# -- messages: LlamaIndex <-> engram (pure) ----------------------------------------------------

def _call(block: Any) -> dict[str, Any]:
    """A tool call (ToolCallBlock, OpenAI object or dict) in the OpenAI wire shape."""
    if isinstance(block, ToolCallBlock):
        args = block.tool_kwargs
        return {"id": block.tool_call_id or "", "type": "function",
                "function": {"name": block.tool_name,
                             "arguments": args if isinstance(args, str) else json.dumps(args)}}
    if hasattr(block, "model_dump"):
        block = block.model_dump()
    if not isinstance(block, Mapping):
        raise InvalidInput(f"cannot read a tool call of type {type(block).__name__}")
    return dict(block)


def to_engram(message: ChatMessage) -> dict[str, Any] | None:
    """A LlamaIndex message as an engram message (OpenAI shape, with `name`, `observed_at`
    and the tool call links); None for a message with nothing to keep."""
    role = ROLES.get(str(getattr(message.role, "value", message.role)), "user")
    extra = message.additional_kwargs or {}
    calls = [_call(b) for b in message.blocks if isinstance(b, ToolCallBlock)]
    calls += [_call(c) for c in extra.get("tool_calls") or ()]
    content = "".join(b.text for b in message.blocks if isinstance(b, TextBlock))
    out: dict[str, Any] = {"role": role, "content": content}
    if calls and role == "assistant":
        out["tool_calls"] = calls
    if role == "tool":
        out["content"] = content or EMPTY_RESULT
        if isinstance(extra.get("tool_call_id"), str) and extra["tool_call_id"]:
            out["tool_call_id"] = extra["tool_call_id"]
    elif not content.strip() and "tool_calls" not in out:
        return None
    name = extra.get("name")
    if isinstance(name, str) and name.strip():
        out["name"] = name
    observed = extra.get("observed_at")
    if isinstance(observed, datetime | str):
        out["observed_at"] = observed
    return out


def to_llama(message: Mapping[str, Any] | SessionMessage) -> ChatMessage:
    """An engram message (a context or session message) as a LlamaIndex message; tool calls
    become `ToolCallBlock`s, a tool result keeps its `tool_call_id`."""
    wire = message.to_chat() if isinstance(message, SessionMessage) else dict(message)
    blocks: list[Any] = []
    if wire.get("content"):
        blocks.append(TextBlock(text=wire["content"]))
    for call in wire.get("tool_calls") or ():
        fn = call.get("function") or {}
        args = fn.get("arguments", "")
        try:
            kwargs: dict[str, Any] | str = json.loads(args) if isinstance(args, str) else dict(args)
        except ValueError:
            kwargs = args
        blocks.append(ToolCallBlock(tool_call_id=call.get("id"), tool_name=fn.get("name", ""),
                                    tool_kwargs=kwargs))
    extra: dict[str, Any] = {}
    if wire.get("tool_call_id"):
        extra["tool_call_id"] = wire["tool_call_id"]
    if wire.get("name"):
        extra["name"] = wire["name"]
    return ChatMessage(role=wire["role"], blocks=blocks, additional_kwargs=extra)


def latest_user_text(messages: Sequence[ChatMessage] | None) -> str | None:
    """The text of the latest user message with text: what to recall memories for."""
    for m in reversed(messages or ()):
        if str(getattr(m.role, "value", m.role)) == "user":
            text = "".join(b.text for b in m.blocks if isinstance(b, TextBlock)).strip()
            if text:
                return text
    return None


def shrink(text: str, tokens: int, count: Callable[[str], int]) -> str | None:
    """`text` (a rendered memory section) with its last item lines dropped until at least
    `tokens` tokens are saved; the last items are the least relevant of the lowest-priority
    section. A heading left with no items goes too; None when no item is left."""
    lines = text.split("\n")
    before = count(text)
    while True:
        items = [i for i, line in enumerate(lines) if line.startswith("- ")]
        if not items:
            return None
        del lines[items[-1]]
        # a heading followed by another heading or the end of the section has lost its items
        lines = [line for i, line in enumerate(lines) if not (
            line.startswith("## ") and (i + 1 == len(lines) or not lines[i + 1].startswith("- ")))]
        shrunk = "\n".join(lines)
        if before - count(shrunk) >= tokens:
            return shrunk if any(line.startswith("- ") for line in lines) else None


# -- the memory block ------------------------------------------------------------------------

class EngramMemoryBlock(BaseMemoryBlock[str]):
    """Long-term memory from engram for `llama_index.core.memory.Memory`.

    `aget` recalls, for the latest user message, what engram knows of the user (pinned
    memories, current facts, lessons, earlier sessions' summaries, relevant past messages:
    hybrid search) within `budget_tokens`, rendered as dated, quoted data. `aput` receives the
    messages LlamaIndex flushes out of its short-term memory and stores them as episodes of the
    user's scope (with their `session_id`, `name` and `observed_at` from `additional_kwargs`);
    with an LLM configured engram also extracts facts from them.
    """

    name: str = Field(default="engram", description="The name of the memory block.")
    priority: int = Field(default=1, description="Truncation order: smaller numbers are cut "
                          "first, 0 is never cut (see the module docstring).")
    budget_tokens: int = Field(default=1000, description="At most this many cl100k tokens.")
    user_id: str | None = None
    agent_id: str | None = None
    _memory: Memory = PrivateAttr()

    def __init__(self, memory: Memory | AsyncMemory, *, user_id: str | None = None,
                 agent_id: str | None = None, budget_tokens: int = 1000, **fields: Any) -> None:
        if user_id is None and agent_id is None:
            raise InvalidInput("EngramMemoryBlock needs a user_id or an agent_id")
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 1:
            raise InvalidInput("budget_tokens must be a positive integer")
        fields.update(user_id=user_id, agent_id=agent_id, budget_tokens=budget_tokens)
        super().__init__(**fields)
        self._memory = sync_memory(memory)

    def recall(self, query: str) -> str:
        """The rendered memories for `query` within `budget_tokens` ("" when none)."""
        return recall(self._memory, query, user_id=self.user_id, agent_id=self.agent_id,
                      budget_tokens=self.budget_tokens)

    async def _aget(self, messages: list[ChatMessage] | None = None, **block_kwargs: Any) -> str:
        query = latest_user_text(messages)
        if query is None:
            return ""
        return await asyncio.to_thread(self.recall, query)

    def remember(self, messages: Sequence[ChatMessage]) -> int:
        """Write messages as episodes, one `Memory.add` per LlamaIndex session; returns how
        many were stored."""
        by_session: dict[str | None, list[dict[str, Any]]] = {}
        for m in messages:
            wire = to_engram(m)
            if wire is None:
                continue
            wire = as_episode(wire)
            session = (m.additional_kwargs or {}).get("session_id")
            by_session.setdefault(session if isinstance(session, str) else None, []).append(wire)
        n = 0
        for session, wires in by_session.items():
            n += len(self._memory.add(wires, user_id=self.user_id, agent_id=self.agent_id,
                                      session_id=session).memories)
        return n

    async def _aput(self, messages: list[ChatMessage]) -> None:
        await asyncio.to_thread(self.remember, messages)

    async def atruncate(self, content: str, tokens_to_truncate: int) -> str | None:
        """Drop the least relevant lines until `tokens_to_truncate` tokens are saved."""
        tokenizer = get_tokenizer()
        return shrink(content, tokens_to_truncate, lambda s: len(tokenizer(s)))


# -- the whole memory ------------------------------------------------------------------------

class EngramMemory(BaseMemory):
    """A LlamaIndex agent's whole memory in engram: the chat history is an engram session
    (persisted, resumed after a restart, trimmed and summarised by its policy) and every
    `get` adds what engram recalls for the latest user message, within `budget_tokens`.

    `FunctionAgent.run(msg, memory=EngramMemory(mem, user_id="ana", session_id="s1"))`.
    A tool call and its results are stored together and never separated by trimming.
    `reset`/`set` erase the session (its messages and what was derived from them).
    """

    user_id: str | None = None
    agent_id: str | None = None
    session_id: str = ""
    budget_tokens: int = 4000
    instructions: str | None = None
    _memory: Memory = PrivateAttr()
    _handle: SessionHandle = PrivateAttr()

    def __init__(self, memory: Memory | AsyncMemory, *, user_id: str | None = None,
                 agent_id: str | None = None, session_id: str | None = None,
                 budget_tokens: int = 4000, policy: Policy | str | None = None,
                 instructions: str | None = None) -> None:
        if user_id is None and agent_id is None:
            raise InvalidInput("EngramMemory needs a user_id or an agent_id")
        mem = sync_memory(memory)
        handle = mem.session(user_id=user_id, agent_id=agent_id, session_id=session_id,
                             policy=policy)
        fields: dict[str, Any] = {"user_id": user_id, "agent_id": agent_id, "session_id": handle.id,
                                  "budget_tokens": budget_tokens, "instructions": instructions}
        super().__init__(**fields)
        self._memory = mem
        self._handle = handle

    @classmethod
    def class_name(cls) -> str:
        return "EngramMemory"

    @classmethod
    def from_defaults(cls, memory: Memory | AsyncMemory | None = None,
                      **kwargs: Any) -> EngramMemory:
        if memory is None:
            raise InvalidInput("EngramMemory.from_defaults needs an engram Memory")
        return cls(memory, **kwargs)

    def _session(self) -> SessionHandle:
        return self._handle

    # sync --------------------------------------------------------------------------------------

    def get(self, input: str | None = None, **kwargs: Any) -> list[ChatMessage]:
        """The messages for the next model call: a system message with the recalled memories
        (and the session's summary, if its policy keeps one), then the session as its policy
        shows it. `input` (not stored) is the query when given; otherwise the latest user
        message of the session."""
        session = self._session()
        shown = session.view().chat()
        query = input if isinstance(input, str) and input.strip() else next(
            (m["content"] for m in reversed(shown) if m["role"] == "user" and m.get("content")),
            None)
        if query is None:
            return [to_llama(m) for m in shown]
        ctx = self._memory.context(query, user_id=self.user_id, agent_id=self.agent_id,
                                   session_id=self.session_id, budget_tokens=self.budget_tokens,
                                   instructions=self.instructions)
        return [to_llama(m) for m in ctx.messages[:-1]]  # the last one is the query itself

    def get_all(self) -> list[ChatMessage]:
        return [to_llama(m) for m in self._session().messages()]

    def put(self, message: ChatMessage) -> None:
        self.put_messages([message])

    def put_messages(self, messages: list[ChatMessage]) -> None:
        # one add: a tool call and its results land together, in one transaction
        wires = [w for w in (to_engram(m) for m in messages) if w is not None]
        if wires:
            self._session().add(wires)

    def set(self, messages: list[ChatMessage]) -> None:
        self.reset()
        self.put_messages(messages)

    def reset(self) -> None:
        with contextlib.suppress(NotFound):  # nothing stored yet
            self._session().delete()

    # async: the same code in a worker thread --------------------------------------------------

    async def aget(self, input: str | None = None, **kwargs: Any) -> list[ChatMessage]:
        return await asyncio.to_thread(self.get, input, **kwargs)

    async def aget_all(self) -> list[ChatMessage]:
        return await asyncio.to_thread(self.get_all)

    async def aput(self, message: ChatMessage) -> None:
        await asyncio.to_thread(self.put, message)

    async def aput_messages(self, messages: list[ChatMessage]) -> None:
        await asyncio.to_thread(self.put_messages, messages)

    async def aset(self, messages: list[ChatMessage]) -> None:
        await asyncio.to_thread(self.set, messages)

    async def areset(self) -> None:
        await asyncio.to_thread(self.reset)


__all__ = ["EngramMemory", "EngramMemoryBlock", "latest_user_text", "shrink", "to_engram",
           "to_llama"]

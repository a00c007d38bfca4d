"""engram for LangChain (langchain-core 1.8, langchain 1.x): `EngramChatMessageHistory`, a chat
history that is an engram session, and `EngramMiddleware`, agent middleware that gives the model
what engram recalls for the user and writes each turn back.

    agent = create_agent(model, tools, middleware=[EngramMiddleware(mem, budget_tokens=1000)])
    agent.invoke({"messages": [...]}, {"configurable": {"user_id": "ana", "thread_id": "t1"}})
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NotRequired

from engram import AsyncMemory, InvalidInput, Memory, NotFound, SessionHandle
from engram.working import SessionMessage

from . import as_episode, missing, recall, sync_memory

try:
    from langchain.agents.middleware import AgentMiddleware, AgentState, ModelRequest, ModelResponse
    from langchain_core.chat_history import BaseChatMessageHistory
    from langchain_core.messages import (
        AnyMessage,
        BaseMessage,
        SystemMessage,
        convert_to_messages,
        convert_to_openai_messages,
    )
    from langgraph.config import get_config
    from langgraph.runtime import Runtime
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("langchain", exc) from exc

ROLES = ("user", "assistant", "system", "tool")
EMPTY_RESULT = "(no output)"


# -- messages: LangChain <-> engram (pure) -----------------------------------------------------

def to_engram(message: BaseMessage) -> dict[str, Any] | None:
    """A LangChain message as an engram session message (OpenAI shape: tool calls and the
    `tool_call_id` of a result included); None for a message with nothing to keep."""
    wire = convert_to_openai_messages(message, text_format="string")
    role = wire.get("role")
    if role not in ROLES:
        return None
    content = wire.get("content") or ""
    out: dict[str, Any] = {"role": role, "content": content if isinstance(content, str) else str(content)}
    if role == "assistant" and wire.get("tool_calls"):
        out["tool_calls"] = wire["tool_calls"]
    if role == "tool":
        out["content"] = out["content"] or EMPTY_RESULT
        if wire.get("tool_call_id"):
            out["tool_call_id"] = wire["tool_call_id"]
    elif not out["content"].strip() and "tool_calls" not in out:
        return None
    if isinstance(wire.get("name"), str) and wire["name"].strip():
        out["name"] = wire["name"]
    if message.id:
        out["metadata"] = {"lc_id": message.id}
    return out


def to_langchain(message: SessionMessage) -> BaseMessage:
    return convert_to_messages([message.to_chat()])[0]


# -- the chat history --------------------------------------------------------------------------

class EngramChatMessageHistory(BaseChatMessageHistory):
    """A LangChain chat history that is an engram session (`user_id`, `agent_id`,
    `session_id`): persisted, resumed after a restart, its messages episodes that
    `Memory.search` and `Memory.context` find. `clear()` erases the session."""

    def __init__(self, memory: Memory | AsyncMemory, *, session_id: str,
                 user_id: str | None = None, agent_id: str | None = None,
                 policy: Any = None) -> None:
        self.memory = sync_memory(memory)
        self.session: SessionHandle = self.memory.session(
            session_id=session_id, user_id=user_id, agent_id=agent_id, policy=policy)

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        return [to_langchain(m) for m in self.session.messages()]

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        wires = [w for w in (to_engram(m) for m in messages) if w is not None]
        if wires:
            self.session.add(wires)  # one add: a tool call and its results land together

    def clear(self) -> None:
        with contextlib.suppress(NotFound):  # nothing stored yet
            self.session.delete()

    async def aget_messages(self) -> list[BaseMessage]:
        return await asyncio.to_thread(lambda: self.messages)

    async def aadd_messages(self, messages: Sequence[BaseMessage]) -> None:
        await asyncio.to_thread(self.add_messages, messages)

    async def aclear(self) -> None:
        await asyncio.to_thread(self.clear)


# -- the agent middleware ------------------------------------------------------------------------

class EngramState(AgentState[Any]):
    """What the middleware keeps in the agent's state: the recalled text for the next model
    call and the ids of the messages already written to engram (so a thread resumed from its
    checkpoint writes nothing twice)."""

    engram_context: NotRequired[str]
    engram_written: NotRequired[list[str]]


def _pending_call(messages: Sequence[AnyMessage]) -> int:
    """How many messages may be written now: up to, not including, an assistant tool call whose
    results are not all in yet (a call and its results are written together)."""
    answered: set[str] = set()
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.type == "tool":
            answered.add(str(getattr(m, "tool_call_id", "")))
        calls = getattr(m, "tool_calls", None) or []
        if m.type == "ai" and any(c.get("id") not in answered for c in calls):
            return i
    return len(messages)


class EngramMiddleware(AgentMiddleware[EngramState, Any, Any]):
    """langchain v1 agent middleware: engram as the agent's long-term memory.

    - `before_model` recalls, for the latest user message, what engram knows of the user
      (within `budget_tokens`) and `wrap_model_call` adds it to the system message of that one
      model call (it is never stored in the thread's messages).
    - `after_model` and `after_agent` write the turn's new messages to engram as episodes of
      the user (session = the thread id), never a tool call without its results; with an LLM
      configured the write is a background job that also extracts facts.

    The user is `user_id`, else `runtime.context.user_id` / `["user_id"]`, else the run's
    `configurable["user_id"]`. A run with no user is left alone.
    """

    state_schema = EngramState

    def __init__(self, memory: Memory | AsyncMemory, *, user_id: str | None = None,
                 agent_id: str | None = None, budget_tokens: int = 1000,
                 background: bool | None = None) -> None:
        super().__init__()
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 1:
            raise InvalidInput("budget_tokens must be a positive integer")
        self.memory = sync_memory(memory)
        self.user_id = user_id
        self.agent_id = agent_id
        self.budget_tokens = budget_tokens
        self.background = background

    # who and where -----------------------------------------------------------------------------

    def _user(self, runtime: Runtime[Any] | None) -> str | None:
        if self.user_id is not None:
            return self.user_id
        context = getattr(runtime, "context", None)
        found = context.get("user_id") if isinstance(context, dict) else getattr(context, "user_id", None)
        if found is None:
            with contextlib.suppress(RuntimeError):  # outside a runnable context
                found = get_config().get("configurable", {}).get("user_id")
        return str(found) if found is not None else None

    @staticmethod
    def _thread() -> str | None:
        with contextlib.suppress(RuntimeError):
            thread = get_config().get("configurable", {}).get("thread_id")
            return str(thread) if thread is not None else None
        return None

    # recall ------------------------------------------------------------------------------------

    def before_model(self, state: EngramState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        user = self._user(runtime)
        query = next((m.text for m in reversed(state["messages"]) if m.type == "human" and m.text.strip()),
                     None)
        if user is None or query is None:
            return None
        return {"engram_context": recall(self.memory, query, user_id=user, agent_id=self.agent_id,
                                         budget_tokens=self.budget_tokens)}

    def _with_memory(self, request: ModelRequest[Any]) -> ModelRequest[Any]:
        text = request.state.get("engram_context")
        if not text:
            return request
        system = request.system_message.text if request.system_message is not None else ""
        return request.override(system_message=SystemMessage(
            content=f"{system}\n\n{text}" if system else str(text)))

    def wrap_model_call(self, request: ModelRequest[Any],
                        handler: Callable[[ModelRequest[Any]], ModelResponse[Any]]) -> ModelResponse[Any]:
        return handler(self._with_memory(request))

    async def awrap_model_call(
            self, request: ModelRequest[Any],
            handler: Callable[[ModelRequest[Any]], Awaitable[ModelResponse[Any]]]) -> ModelResponse[Any]:
        return await handler(self._with_memory(request))

    # write -------------------------------------------------------------------------------------

    def _write(self, state: EngramState, runtime: Runtime[Any],
               upto: int | None = None) -> dict[str, Any] | None:
        user = self._user(runtime)
        if user is None:
            return None
        messages = state["messages"]
        end = _pending_call(messages) if upto is None else upto
        done = set(state.get("engram_written") or ())
        new = [m for m in messages[:end] if m.id not in done and m.type != "system"]
        wires = [as_episode(w) for w in (to_engram(m) for m in new) if w is not None]
        if wires:
            background = self.memory.llm is not None if self.background is None else self.background
            self.memory.add(wires, user_id=user, agent_id=self.agent_id, session_id=self._thread(),
                            background=background)
        if not new:
            return None
        return {"engram_written": [*done, *(str(m.id) for m in new if m.id)]}

    def after_model(self, state: EngramState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        return self._write(state, runtime)

    def after_agent(self, state: EngramState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        return self._write(state, runtime, upto=len(state["messages"]))


__all__ = ["EngramChatMessageHistory", "EngramMiddleware", "EngramState", "to_engram",
           "to_langchain"]

"""Adapters that make engram the memory of agent frameworks: `engram.integrations.llamaindex`,
`.langgraph` (store and checkpointer) and `.langchain` (chat history and agent middleware).

Each is an optional extra, imported only when its module is; a missing framework raises
`MissingExtra` naming the extra to install. Every adapter takes an engram `Memory` (or
`AsyncMemory`) first, so one database serves them all. See docs/integrations.md.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from engram import AsyncMemory, InvalidInput, Memory
from engram.extras import install_hint
from engram.working import SessionMessage


class MissingExtra(ImportError):
    """A framework adapter was imported without its framework installed."""


def missing(extra: str, exc: ImportError) -> MissingExtra:
    """The error for an adapter whose framework is not installed: it names the extra."""
    return MissingExtra(f"engram.integrations.{extra} needs {exc.name or 'its framework'}, "
                        f"which is not installed: {install_hint(extra)}")


def require(module: str, extra: str) -> ModuleType:
    """Import a framework module, or fail with the `pip install` line that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing(extra, exc) from exc


def sync_memory(memory: Memory | AsyncMemory) -> Memory:
    """The one implementation: an `AsyncMemory` runs the same `Memory` in a worker thread."""
    if isinstance(memory, AsyncMemory):
        return memory.sync
    if not isinstance(memory, Memory):
        raise InvalidInput(f"an adapter takes an engram Memory or AsyncMemory first, "
                           f"not {type(memory).__name__}")
    return memory


def as_episode(wire: dict[str, Any]) -> dict[str, Any]:
    """A session message (OpenAI shape) as a plain `Memory.add` message: a tool call becomes
    its readable text ("called f(...)"), the tool links go (the long-term log is text)."""
    out = dict(wire)
    calls = out.pop("tool_calls", None)
    out.pop("tool_call_id", None)
    if calls:
        said = SessionMessage("assistant", None, tool_calls=calls).text
        out["content"] = f"{out.get('content') or ''}\n{said}".strip()
    return out


def recall(memory: Memory, query: str, *, user_id: str | None, agent_id: str | None,
           budget_tokens: int) -> str:
    """What engram recalls for `query` (pinned memories, current facts, lessons, earlier
    sessions' summaries, relevant past messages: `Memory.context`'s blocks) as one text of
    dated, quoted data within `budget_tokens` cl100k tokens; "" when nothing is recalled."""
    # Memory.context counts the query message and the framing as its fixed cost: measure them
    # first (no blocks: no search), then give the memories exactly `budget_tokens`.
    fixed = memory.context(query, user_id=user_id, agent_id=agent_id, budget_tokens=1_000_000,
                           blocks=[]).fixed_tokens
    ctx = memory.context(query, user_id=user_id, agent_id=agent_id,
                         budget_tokens=fixed + budget_tokens)
    first = ctx.messages[0] if ctx.messages else {}
    return str(first.get("content") or "") if first.get("role") == "system" else ""


__all__ = ["MissingExtra", "as_episode", "missing", "recall", "require", "sync_memory"]

"""A LangGraph agent whose long-term memory is engram, through LangMem's memory tools.

`EngramStore` is a LangGraph `BaseStore`: LangMem's `manage_memory` and `search_memory` tools
work on it unchanged, and what they store are engram memories of the user, which
`Memory.search`, `Memory.context`, the CLI and the service see too.

    python examples/langgraph_agent.py

The model here is langchain-core's scripted `GenericFakeChatModel`, so the example runs offline;
use any LangChain chat model with tool calling instead (`ChatOpenAI(...)`, `ChatOllama(...)`).
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, ToolMessage

from engram import Memory
from engram.integrations.langgraph import EngramStore

with warnings.catch_warnings():  # langmem's dependency trustcall imports a name LangGraph 1.0 moved
    warnings.simplefilter("ignore", DeprecationWarning)
    from langmem import create_manage_memory_tool, create_search_memory_tool


class ScriptedModel(GenericFakeChatModel):
    """The scripted model, with tools bound: `create_agent` binds them, the script ignores them."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        return self


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, help="database file (default: a temporary one)")
    args = parser.parse_args()
    model = ScriptedModel(messages=iter([
        AIMessage(content="", tool_calls=[{"name": "manage_memory", "id": "c1", "args": {
            "content": "The user's daughter Mia starts school in Ghent in September."}}]),
        AIMessage(content="", tool_calls=[{"name": "search_memory", "id": "c2", "args": {
            "query": "when does Mia start school?"}}]),
        AIMessage(content="Mia starts school in Ghent in September."),
    ]))
    namespace = ("memories", "{langgraph_user_id}")  # one namespace per user: engram's user_id
    with tempfile.TemporaryDirectory() as folder, Memory(args.db or Path(folder) / "agent.db") as mem:
        store = EngramStore(mem, user_at=1)
        agent = create_agent(model, tools=[create_manage_memory_tool(namespace=namespace),
                                           create_search_memory_tool(namespace=namespace)],
                             store=store)
        out = agent.invoke({"messages": [{"role": "user", "content": "Remember Mia's school start."}]},
                           config={"configurable": {"langgraph_user_id": "ana"}})
        for message in out["messages"]:
            kind = "tool" if isinstance(message, ToolMessage) else message.type
            print(f"{kind}: {message.content or message.tool_calls}")
        hit = mem.search("Mia school", user_id="ana")[0]  # the same memory, seen by engram
        print(f"engram: {hit.memory.text}")


if __name__ == "__main__":
    main()

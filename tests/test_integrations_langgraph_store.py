"""`EngramStore`: LangGraph's BaseStore over engram, with LangMem's memory tools driven by a real
`create_agent` run (a scripted tool-calling chat model from langchain-core)."""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.store.base import GetOp, Item, ListNamespacesOp, MatchCondition, PutOp

from engram import InvalidInput, Memory
from engram.integrations.langgraph import EngramStore
from engram.integrations.langgraph.store import list_namespaces, matches, text_of

with warnings.catch_warnings():  # langmem's dependency trustcall imports a deprecated name
    warnings.simplefilter("ignore", DeprecationWarning)
    from langmem import create_manage_memory_tool, create_search_memory_tool


class ToolCallingFake(GenericFakeChatModel):
    """langchain-core's scripted chat model; binding tools changes nothing about its script."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ToolCallingFake:  # type: ignore[override]
        return self


def test_put_get_update_delete(mem: Memory) -> None:
    store = EngramStore(mem)
    store.put(("docs", "ana"), "a1", {"content": "Ana's cat is called Miso.", "topic": "pets"})
    item = store.get(("docs", "ana"), "a1")
    assert item is not None and item.value == {"content": "Ana's cat is called Miso.", "topic": "pets"}
    assert item.namespace == ("docs", "ana") and item.key == "a1"
    created = item.created_at
    store.put(("docs", "ana"), "a1", {"content": "Ana's cat is called Tofu.", "topic": "pets"})
    again = store.get(("docs", "ana"), "a1")
    assert again is not None and again.value["content"] == "Ana's cat is called Tofu."
    assert again.created_at == created and again.updated_at > created
    assert store.get(("docs", "bo"), "a1") is None  # another namespace, the same key
    # a near-duplicate under another key is its own item (a key-value store never merges)
    store.put(("docs", "ana"), "a2", {"content": "Ana's cat is called Tofu.", "topic": "pets"})
    assert {i.key for i in store.search(("docs",))} == {"a1", "a2"}
    store.delete(("docs", "ana"), "a1")
    assert store.get(("docs", "ana"), "a1") is None
    assert [e.type.value for e in mem.history(again_id(mem, "a2"))] == ["ADD"]


def again_id(mem: Memory, key: str) -> str:
    return next(r.id for r in mem.list(agent_id="langgraph").items if r.metadata["lg_key"] == key)


def test_search_filters_queries_and_pages(mem: Memory) -> None:
    store = EngramStore(mem)
    facts = {"t1": ("Ana prefers window seats on trains.", "travel", 3),
             "t2": ("Ana is vegetarian and avoids fish.", "food", 5),
             "t3": ("Ana's flight to Lisbon leaves on 12 May.", "travel", 8),
             "t4": ("Bo likes spicy ramen.", "food", 2)}
    for key, (text, topic, score) in facts.items():
        owner = "bo" if key == "t4" else "ana"
        store.put(("users", owner, "facts"), key, {"content": text, "topic": topic, "score": score})
    hits = store.search(("users", "ana"), query="what does Ana eat?")
    assert hits[0].key == "t2" and hits[0].score is not None
    assert {h.key for h in hits} == {"t1", "t2", "t3"}  # the prefix keeps Bo's item out
    travel = store.search(("users",), filter={"topic": "travel"})
    assert {h.key for h in travel} == {"t1", "t3"}
    high = store.search(("users",), filter={"score": {"$gte": 5}}, query="travel plans")
    assert {h.key for h in high} == {"t2", "t3"}
    assert len(store.search(("users",), limit=2)) == 2
    assert len(store.search(("users",), limit=2, offset=3)) == 1
    assert store.search(("nobody",), query="anything") == []
    with pytest.raises(InvalidInput):
        store.search(("users",), filter={"score": {"$regex": "x"}})


def test_index_fields_and_index_false(mem: Memory) -> None:
    store = EngramStore(mem, index={"dims": 384, "embed": "engram", "fields": ["summary"]})
    store.put(("n",), "k1", {"summary": "Kayaking in Norway", "body": "ignored words zebra"})
    store.put(("n",), "k2", {"summary": "Hidden", "body": "kayak"}, index=False)
    rec = next(r for r in mem.list(agent_id="langgraph").items if r.metadata["lg_key"] == "k1")
    assert rec.text == "Kayaking in Norway"
    assert [h.key for h in store.search(("n",), query="kayak trip")] == ["k1"]
    assert {h.key for h in store.search(("n",))} == {"k1", "k2"}  # listing still shows it
    assert text_of({"content": {"a": "x", "b": ["y", 3]}}, None) == "x\ny\n3"
    assert text_of({"a": {"b": "deep"}, "c": "no"}, ["a.b"]) == "deep"


def test_ttl_expires_and_refreshes_on_read(mem: Memory) -> None:
    store = EngramStore(mem)
    store.put(("t",), "short", {"v": "gone soon"}, ttl=0.002)  # minutes: 120 ms
    store.put(("t",), "long", {"v": "stays"}, ttl=60)
    rec = next(r for r in mem.list(agent_id="langgraph").items if r.metadata["lg_key"] == "long")
    assert rec.expires_at is not None
    first = rec.expires_at
    time.sleep(0.3)
    assert store.get(("t",), "short") is None
    assert store.get(("t",), "long") is not None  # refresh_ttl: the clock restarts
    later = next(r for r in mem.list(agent_id="langgraph").items if r.metadata["lg_key"] == "long")
    assert later.expires_at is not None and later.expires_at > first
    assert store.supports_ttl


def test_list_namespaces(mem: Memory) -> None:
    store = EngramStore(mem)
    for ns in [("a", "b", "c"), ("a", "b", "d"), ("a", "e"), ("x", "b", "c")]:
        store.put(ns, "k", {"v": 1})
    assert store.list_namespaces() == [("a", "b", "c"), ("a", "b", "d"), ("a", "e"), ("x", "b", "c")]
    assert store.list_namespaces(prefix=("a",)) == [("a", "b", "c"), ("a", "b", "d"), ("a", "e")]
    assert store.list_namespaces(suffix=("c",)) == [("a", "b", "c"), ("x", "b", "c")]
    assert store.list_namespaces(prefix=("*", "b")) == [("a", "b", "c"), ("a", "b", "d"), ("x", "b", "c")]
    assert store.list_namespaces(max_depth=2) == [("a", "b"), ("a", "e"), ("x", "b")]
    assert store.list_namespaces(limit=1, offset=1) == [("a", "b", "d")]
    op = ListNamespacesOp(match_conditions=(MatchCondition("prefix", ("a",)),
                                            MatchCondition("suffix", ("d",))))
    assert list_namespaces([("a", "b", "d"), ("a", "c")], op) == [("a", "b", "d")]
    assert matches({"a": {"b": 1}}, {"a": {"b": 1}}) and not matches({"a": 2}, {"a": {"$lt": 2}})


def test_async_batch(mem: Memory) -> None:
    store = EngramStore(mem)

    async def main() -> Any:
        await store.aput(("x",), "1", {"content": "async works"})
        return await store.asearch(("x",), query="async")

    assert [i.key for i in asyncio.run(main())] == ["1"]


def test_langmem_tools_in_an_agent_and_engram_sees_the_memory(mem: Memory) -> None:
    namespace = ("memories", "{langgraph_user_id}")
    store = EngramStore(mem, user_at=1)
    model = ToolCallingFake(messages=iter([
        AIMessage(content="", tool_calls=[{"name": "manage_memory", "id": "c1", "args": {
            "content": "The user's daughter Mia starts school in Ghent in September."}}]),
        AIMessage(content="", tool_calls=[{"name": "search_memory", "id": "c2", "args": {
            "query": "when does Mia start school?"}}]),
        AIMessage(content="Mia starts school in September."),
    ]))
    agent = create_agent(model, tools=[create_manage_memory_tool(namespace=namespace),
                                       create_search_memory_tool(namespace=namespace)], store=store)
    out = agent.invoke({"messages": [{"role": "user", "content": "Remember Mia's school start."}]},
                       config={"configurable": {"langgraph_user_id": "ana"}})
    tools = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert tools[0].content.startswith("created memory ")
    found = json.loads(tools[1].content)
    assert found[0]["value"] == {"content": "The user's daughter Mia starts school in Ghent in September."}
    assert found[0]["namespace"] == ["memories", "ana"]
    assert out["messages"][-1].content == "Mia starts school in September."
    # the same memory is Ana's in engram: search and context find it
    hits = mem.search("Mia school", user_id="ana")
    assert hits and "Ghent" in hits[0].memory.text
    assert "Ghent" in mem.context("Where will Mia go to school?", user_id="ana").messages[0]["content"]
    assert mem.search("Mia school", user_id="bo") == []


def test_a_batch_of_new_keys_is_one_add_and_reads_see_it(mem: Memory) -> None:
    store = EngramStore(mem)
    ns = ("b",)
    out = store.batch([PutOp(ns, "k1", {"content": "one"}), PutOp(ns, "k2", {"content": "two"}),
                       GetOp(ns, "k1"), PutOp(ns, "k3", {"content": "three"}),
                       PutOp(ns, "k3", {"content": "three, again"}), GetOp(ns, "k3")])
    first, last = out[2], out[5]
    assert isinstance(first, Item) and first.value == {"content": "one"}
    assert isinstance(last, Item) and last.value == {"content": "three, again"}
    recs = {r.metadata["lg_key"]: r for r in mem.list(agent_id="langgraph").items}
    assert recs["k1"].created_at == recs["k2"].created_at  # one add, one transaction
    assert len(recs) == 3

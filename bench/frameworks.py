"""engram inside the frameworks, on the context-evidence benchmark (LoCoMo dev): recall of the
gold evidence turns in what the model is shown, at 500 / 1,000 / 2,000 tokens.

Two comparisons, each with the same MiniLM embedder on both sides:

- LlamaIndex `Memory(token_limit=B)` with one memory block: `EngramMemoryBlock` versus
  LlamaIndex's `VectorMemoryBlock` over a local exact (brute-force cosine) vector store. Both
  blocks get up to 100 candidates and are shrunk to the budget by LlamaIndex's own truncation
  (the vector block is given the same drop-the-last-results `atruncate` as engram's, instead of
  the default that drops the whole block). What is measured is the prompt `Memory.aget` builds.
- LangMem's `search_memory` tool over `EngramStore` versus LangGraph's `InMemoryStore`
  (`index={"embed": MiniLM}`): the tool's JSON output, cut to the budget at whole items.

Every turn is one memory / node / item, written as "[date] speaker: text" for the frameworks'
stores; engram keeps the date and speaker as fields and renders them itself.

    python bench/frameworks.py [--data ../shared/bench/locomo_dev.json] [--questions N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engram import Memory  # noqa: E402
from engram.integrations.langgraph import EngramStore  # noqa: E402
from engram.integrations.llamaindex import EngramMemoryBlock  # noqa: E402
from engram.providers.tokens import get_tokenizer  # noqa: E402
from locomo import CATEGORIES, DEFAULT_DATA, evidence_ids, session_time, turn_text  # noqa: E402

with warnings.catch_warnings():  # langmem's dependency trustcall imports a deprecated name
    warnings.simplefilter("ignore", DeprecationWarning)
    from langgraph.store.base import PutOp
    from langgraph.store.memory import InMemoryStore
    from langmem import create_search_memory_tool
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.bridge.pydantic import PrivateAttr
    from llama_index.core.memory import Memory as LlamaMemory
    from llama_index.core.memory.memory_blocks import VectorMemoryBlock
    from llama_index.core.schema import BaseNode
    from llama_index.core.utils import get_tokenizer as llama_tokenizer
    from llama_index.core.vector_stores.types import (
        BasePydanticVectorStore,
        VectorStoreQuery,
        VectorStoreQueryResult,
    )

BUDGETS = (500, 1000, 2000)
CANDIDATES = 100
NAMESPACE = ("memories", "{langgraph_user_id}")


# -- the same embedder for everyone --------------------------------------------------------------

class MiniLMEmbedding(BaseEmbedding):
    """engram's MiniLM as a LlamaIndex embedding model."""

    _embed: Any = PrivateAttr()

    def __init__(self, embed: Any) -> None:
        super().__init__(model_name="all-MiniLM-L6-v2")
        self._embed = embed

    def _get_query_embedding(self, query: str) -> list[float]:
        return [float(x) for x in self._embed([query])[0]]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_query_embedding(text)


class ExactVectorStore(BasePydanticVectorStore):
    """A local vector store that keeps the text: exact cosine top-k over every node (what a
    local ANN index approximates), with LlamaIndex's equality metadata filters."""

    stores_text: bool = True
    _nodes: list[BaseNode] = PrivateAttr(default_factory=list)

    @property
    def client(self) -> Any:
        return None

    def add(self, nodes: list[BaseNode], **kwargs: Any) -> list[str]:
        self._nodes.extend(nodes)
        return [n.node_id for n in nodes]

    def delete(self, ref_doc_id: str, **kwargs: Any) -> None:
        self._nodes = [n for n in self._nodes if n.ref_doc_id != ref_doc_id]

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        wanted = {f.key: f.value for f in (query.filters.filters if query.filters else [])}
        nodes = [n for n in self._nodes if all(n.metadata.get(k) == v for k, v in wanted.items())]
        if not nodes:
            return VectorStoreQueryResult(nodes=[], similarities=[], ids=[])
        m = np.array([n.embedding for n in nodes], dtype=np.float32)
        q = np.array(query.query_embedding, dtype=np.float32)
        sims = m @ q / (np.linalg.norm(m, axis=1) * np.linalg.norm(q) + 1e-9)
        top = np.argsort(-sims)[: query.similarity_top_k]
        return VectorStoreQueryResult(nodes=[nodes[i] for i in top],
                                      similarities=[float(sims[i]) for i in top],
                                      ids=[nodes[i].node_id for i in top])


class ShrinkingVectorMemoryBlock(VectorMemoryBlock):
    """VectorMemoryBlock that drops its last results to fit, as engram's block does (the
    default `atruncate` drops the whole block)."""

    async def atruncate(self, content: str, tokens_to_truncate: int) -> str | None:
        tok = llama_tokenizer()
        parts = content.split("\n\n")
        before = len(tok(content))
        while parts:
            parts.pop()
            if before - len(tok("\n\n".join(parts))) >= tokens_to_truncate:
                return "\n\n".join(parts) or None
        return None


# -- data ----------------------------------------------------------------------------------------

def turns(conv: dict) -> list[dict]:
    c = conv["conversation"]
    out = []
    for key in sorted((k for k in c if re.fullmatch(r"session_\d+", k)), key=lambda k: int(k[8:])):
        when = session_time(c[f"{key}_date_time"])
        for t in c[key]:
            out.append({"dia_id": t["dia_id"], "speaker": t["speaker"], "text": turn_text(t),
                        "when": when, "session": key,
                        "line": f"[{when.date().isoformat()}] {t['speaker']}: {turn_text(t)}"})
    return out


def quoted(text: str) -> str:
    """A turn's text as engram renders it inside a quoted memory line."""
    return json.dumps(text, ensure_ascii=False)[1:-1].replace("<", "&lt;").replace(">", "&gt;")


def found_in(prompt: str, gold: list[str], text: dict[str, str]) -> float:
    hits = sum(1 for d in gold if text[d] in prompt or quoted(text[d]) in prompt)
    return hits / len(gold)


# -- the runs ------------------------------------------------------------------------------------

async def llama_prompt(block: Any, session: str, question: str, budget: int, tmp: Path) -> str:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp / 'chat.db'}")
    memory = LlamaMemory.from_defaults(session_id=session, token_limit=budget, memory_blocks=[block],
                                       async_engine=engine)
    await memory.aput(ChatMessage(role="user", content=question))
    messages = await memory.aget()
    await memory.areset()
    await engine.dispose()
    return "\n".join(m.content or "" for m in messages)


def run(data: Path, budgets: list[int], max_questions: int | None,
        conversations: int | None = None) -> dict:
    convs = json.loads(data.read_text())[:conversations]
    tok = get_tokenizer()
    systems = ("llamaindex+engram", "llamaindex+vector", "langmem+EngramStore", "langmem+InMemoryStore")
    recall: dict[str, dict[int, dict[str, list[float]]]] = {
        s: {b: defaultdict(list) for b in budgets} for s in systems}
    tokens: dict[str, dict[int, list[int]]] = {s: {b: [] for b in budgets} for s in systems}
    latency: dict[str, list[float]] = defaultdict(list)
    asked = 0
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        mem = Memory(tmp / "frameworks.db")
        torch.set_num_threads(1)  # one-text embeddings; threads only contend on a shared machine
        embed = mem.embedder.embed_batch
        embed(["warm up"])
        minilm = MiniLMEmbedding(embed)
        in_memory = InMemoryStore(index={
            "dims": 384, "embed": lambda xs: [list(map(float, v)) for v in embed(xs)],
            "fields": ["content"]})
        engram_store = EngramStore(mem, agent_id="langmem", user_at=1)
        search = {"langmem+EngramStore": create_search_memory_tool(namespace=NAMESPACE, store=engram_store),
                  "langmem+InMemoryStore": create_search_memory_tool(namespace=NAMESPACE, store=in_memory)}
        for conv in convs:
            uid = conv["sample_id"]
            ts = turns(conv)
            text = {t["dia_id"]: t["text"] for t in ts}
            by_line = {t["line"]: t["dia_id"] for t in ts}
            # engram: one episode per turn, with its speaker and date (as bench/locomo.py)
            for s in sorted({t["session"] for t in ts}, key=lambda k: int(k[8:])):
                mem.add([{"role": "user", "name": t["speaker"], "content": t["text"],
                          "observed_at": t["when"], "metadata": {"dia_id": t["dia_id"]}}
                         for t in ts if t["session"] == s], user_id=uid, session_id=s, infer=False)
            vector = ShrinkingVectorMemoryBlock(vector_store=ExactVectorStore(), embed_model=minilm,
                                                similarity_top_k=CANDIDATES, priority=1)
            for t in ts:  # one node per turn, in the conversation's session (the block filters on it)
                asyncio.run(vector.aput([ChatMessage(role="user", content=t["line"])], session_id=uid))
            for store in (engram_store, in_memory):  # one batch: one embedding call per store
                store.batch([PutOp(("memories", uid), t["dia_id"], {"content": t["line"]})
                             for t in ts])
            print(f"{uid}: {len(ts)} turns stored in every system", file=sys.stderr, flush=True)
            blocks = {b: EngramMemoryBlock(mem, user_id=uid, budget_tokens=b, priority=1) for b in budgets}
            known = set(text)
            for qa in conv["qa"]:
                if qa["category"] not in CATEGORIES:
                    continue
                gold = evidence_ids(qa.get("evidence", []), known)
                if not gold or (max_questions is not None and asked >= max_questions):
                    continue
                asked += 1
                if asked % 25 == 0:
                    print(f"{asked} questions", file=sys.stderr, flush=True)
                cat = str(qa["category"])
                for name in ("llamaindex+engram", "llamaindex+vector"):
                    for b in budgets:
                        blk = blocks[b] if name == "llamaindex+engram" else vector
                        t0 = time.perf_counter()
                        prompt = asyncio.run(llama_prompt(blk, uid, qa["question"], b, tmp))
                        latency[name].append(time.perf_counter() - t0)
                        r = found_in(prompt, gold, text)
                        recall[name][b][cat].append(r)
                        recall[name][b]["all"].append(r)
                        tokens[name][b].append(tok.count(prompt))
                for name, tool in search.items():
                    t0 = time.perf_counter()
                    out = tool.invoke({"query": qa["question"], "limit": CANDIDATES},
                                      config={"configurable": {"langgraph_user_id": uid}})
                    latency[name].append(time.perf_counter() - t0)
                    items = json.loads(out)
                    for b in budgets:
                        kept: list[dict] = []
                        for item in items:  # whole items, best first, while the output fits
                            if tok.count(json.dumps([*kept, item])) > b:
                                break
                            kept.append(item)
                        shown = {by_line.get(i["value"]["content"]) for i in kept}
                        r = len(shown & set(gold)) / len(gold)
                        recall[name][b][cat].append(r)
                        recall[name][b]["all"].append(r)
                        tokens[name][b].append(tok.count(json.dumps(kept)))
        mem.close()
    return {"questions": asked, "systems": {s: {
        "latency_p50_ms": 1000 * statistics.median(latency[s]),
        "budgets": {b: {"tokens_mean": statistics.mean(tokens[s][b]),
                        "recall": {c: statistics.mean(v) for c, v in recall[s][b].items()}}
                    for b in budgets}} for s in systems}}


def report(res: dict) -> str:
    lines = [f"LoCoMo dev, {res['questions']} questions (categories 1-4): recall of the gold "
             "evidence in what the model is shown",
             f"{'system':<24}{'budget':>7}{'tokens':>8}"
             + "".join(f"{CATEGORIES[int(c)][:11]:>12}" for c in "1234") + f"{'all':>8}{'p50 ms':>9}"]
    for name, s in res["systems"].items():
        for b, r in s["budgets"].items():
            rec = r["recall"]
            lines.append(f"{name:<24}{b:>7}{r['tokens_mean']:>8.0f}"
                         + "".join(f"{rec.get(c, float('nan')):>12.3f}" for c in "1234")
                         + f"{rec['all']:>8.3f}{s['latency_p50_ms']:>9.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    ap.add_argument("--questions", type=int, default=None, help="stop after this many questions")
    ap.add_argument("--conversations", type=int, default=None, help="only the first N conversations")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.data.exists():
        sys.exit(f"LoCoMo data not found at {args.data}; pass --data")
    res = run(args.data, args.budgets, args.questions, args.conversations)
    print(json.dumps(res, indent=2) if args.json else report(res))


if __name__ == "__main__":
    main()

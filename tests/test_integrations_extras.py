"""Each framework adapter is an optional extra: importing one without its framework fails with
the `pip install` line that provides it, and the core package imports none of them."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engram import AsyncMemory, Memory
from engram.integrations import MissingExtra, sync_memory

ADAPTERS = [("engram.integrations.llamaindex", "llama_index.core.base.llms.types", "llamaindex"),
            ("engram.integrations.langgraph", "langgraph.checkpoint.base", "langgraph"),
            ("engram.integrations.langchain", "langchain.agents.middleware", "langchain")]


@pytest.mark.parametrize(("module", "framework", "extra"), ADAPTERS)
def test_a_missing_framework_names_its_extra(monkeypatch: pytest.MonkeyPatch, module: str,
                                             framework: str, extra: str) -> None:
    monkeypatch.setitem(sys.modules, framework, None)  # as if it were not installed
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(MissingExtra, match=rf"pip install 'mnemotrace\[{extra}\]'"):
        importlib.import_module(module)


def test_the_core_imports_no_framework() -> None:
    code = ("import sys, engram, engram.integrations; "
            "print(sorted(m for m in ('llama_index', 'langgraph', 'langchain', 'langchain_core', "
            "'langmem') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_adapters_take_an_engram_memory(mem: Memory, tmp_path: Path, embedder: Any) -> None:
    assert sync_memory(mem) is mem
    amem = AsyncMemory(tmp_path / "a.db", embedder=embedder)
    assert sync_memory(amem) is amem.sync  # the one implementation, in a worker thread
    asyncio.run(amem.close())
    with pytest.raises(ValueError, match="engram Memory or AsyncMemory"):
        sync_memory("engram.db")  # type: ignore[arg-type]


def test_the_embedded_default_works_without_the_optional_extras(tmp_path: Path) -> None:
    """`pip install mnemotrace` has no psycopg, FastAPI or MCP SDK: adding and searching on SQLite
    (with the in-memory lexical index forced on) must not import them."""
    code = f"""
import sys
for name in ("psycopg", "fastapi", "mcp", "usearch", "sqlcipher3"):
    sys.modules[name] = None  # as if it were not installed
from engram import Config, Memory
config = Config.from_env(path={str(tmp_path / "m.db")!r}, lexicon_threshold=0)
with Memory(config=config) as mem:
    mem.add(["Ana moved to Lisbon in May.", "Ben plays the cello."], user_id="u", infer=False)
    print(mem.search("where does Ana live?", user_id="u")[0].memory.text)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("Ana moved to Lisbon in May.")

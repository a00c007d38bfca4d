"""The import graph of `engram`, read from the source with `ast`: no import cycles, and faces
(CLI, REST service, MCP server, integrations) that use only the public API.

Layers (ARCHITECTURE.md): imports point down. A face may import the package root (names in
`engram.__all__`), `engram.errors`, `engram.config`, `engram.model`, `engram.working`
(policies), the provider registries (`engram.providers.embedders` / `.llms`: the documented
extension point where embedders and LLMs are registered and built by name) and the reference
MCP memory server's graph kept on the real one (`engram.graph.reference`: its tools and
`engram mcp import` translate to it as others translate to `Memory`). The service may
also open tenants' stores through the store's package roots (`engram.store`,
`engram.store.sqlite`, `engram.store.postgres`).
Faces use each other only downward: the CLI starts the service and the MCP server, the service
mounts the MCP server.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import engram

SRC = Path(engram.__file__).resolve().parent

PUBLIC = {"engram.errors", "engram.config", "engram.model", "engram.working", "engram.backup",
          "engram.working.policies", "engram.providers.embedders", "engram.providers.llms",
          "engram.graph.reference", "engram.extras"}
FACES: dict[str, set[str]] = {  # face -> what it may import besides PUBLIC and itself
    "engram.cli": {"engram.server", "engram.mcp", "engram.store"},  # store: its file paths
    "engram.server": {"engram.mcp", "engram.store"},
    "engram.mcp": set(),
    "engram.integrations": set(),
}


@dataclass(frozen=True)
class Import:
    module: str       # the engram module imported from
    name: str | None  # the name imported from it, when it is not itself a module
    line: int
    top_level: bool   # runs when the module is imported (not in a function, not TYPE_CHECKING)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(body: list[ast.stmt], top_level: bool) -> Iterator[tuple[ast.stmt, bool]]:
    """Every statement with whether it runs at import time."""
    for node in body:
        yield node, top_level
        if isinstance(node, ast.If):
            yield from _statements(node.body, top_level and not _is_type_checking(node))
            yield from _statements(node.orelse, top_level)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _statements(block, top_level)
        elif isinstance(node, ast.With):
            yield from _statements(node.body, top_level)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            # a class body runs at import time; a function body does not
            yield from _statements(node.body, top_level and isinstance(node, ast.ClassDef))
        elif isinstance(node, ast.For | ast.While):
            yield from _statements(node.body + node.orelse, top_level)


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node, top_level in _statements(tree.body, True):
        if isinstance(node, ast.Import):
            found += [Import(a.name, None, node.lineno, top_level) for a in node.names
                      if a.name.split(".")[0] == "engram"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "engram":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:
                    found.append(Import(sub, None, node.lineno, top_level))
                else:
                    found.append(Import(source, alias.name, node.lineno, top_level))
    return found


def _face(module: str) -> str | None:
    return next((f for f in FACES if module == f or module.startswith(f + ".")), None)


def _allowed(face: str, imp: Import) -> bool:
    target = imp.module
    if target == "engram":
        return imp.name is None or imp.name in engram.__all__
    if target in PUBLIC:
        return True
    if target == "engram.store" or target.startswith("engram.store."):
        # the service opens tenants' stores (and keeps its API keys) through the store's package
        # roots: engram.store and its backend packages, never a module inside them
        path = MODULES.get(target)
        root = target == "engram.store" or (path is not None and path.name == "__init__.py")
        return root and "engram.store" in FACES[face]
    return any(target == f or target.startswith(f + ".")
               for f in (face, *(g for g in FACES[face] if g != "engram.store")))


# -- no cycles -------------------------------------------------------------------------------------

def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_package() -> None:
    assert {"engram", "engram.memory", "engram.cli", "engram.server.app", "engram.mcp.server"} <= set(
        MODULES)
    base = imports_of("engram.cli.base")
    assert any(i.module == "engram" and i.name == "Memory" and i.top_level for i in base)
    assert any(i.module == "engram.errors" and i.name == "NotFound" for i in base)
    served = [i for i in imports_of("engram.cli.service") if i.module == "engram.server"]
    assert served and not any(i.top_level for i in served)  # imported inside `serve`


def test_no_import_cycles() -> None:
    graph = {m: {i.module for i in imports_of(m) if i.top_level and i.module != m} for m in MODULES}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# -- faces use the public API ------------------------------------------------------------------------

def test_faces_import_only_the_public_api() -> None:
    wrong = [f"{m}:{i.line} imports {i.module}" + (f".{i.name}" if i.name else "")
             for m in MODULES if (face := _face(m)) is not None
             for i in imports_of(m) if not _allowed(face, i)]
    assert wrong == [], "\n".join(wrong)


def test_faces_reach_into_no_store_and_no_private_attribute() -> None:
    # `mem.store` and another object's `_private` are the engine's insides, whatever the import.
    wrong = []
    for m, path in MODULES.items():
        if _face(m) is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Attribute):
                continue
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if node.attr == "store" or (private and not own):
                wrong.append(f"{m}:{node.lineno} .{node.attr}")
    assert wrong == [], "\n".join(wrong)


def test_the_mcp_package_does_not_shadow_the_sdk() -> None:
    # Inside engram/mcp/, `from mcp.server...` is absolute: it must reach the SDK, not engram.mcp.
    server = importlib.import_module("engram.mcp.server")
    assert server.MCPServer.__module__.startswith("mcp.server")
    sdk = importlib.import_module("mcp")
    assert Path(sdk.__file__ or "").resolve().parent != SRC / "mcp"

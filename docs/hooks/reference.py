"""MkDocs hooks: the pages that are generated when the site is built, from what they describe.

The home page is README.md (its links rewritten for the site), the examples page lists
examples/, and the CLI, REST and MCP references are read from the `engram` command's parser, the
service's OpenAPI document and the MCP server's tool list, so they cannot fall behind the code.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
REPO_LINK = re.compile(r"\]\((?!https?:|#)([^)\s]+)\)")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    pages = {"index.md": home(), "examples.md": examples(), "reference/cli.md": cli_reference(),
             "reference/rest.md": rest_reference(), "reference/mcp.md": mcp_reference()}
    for uri, content in pages.items():
        files.append(File.generated(config, uri, content=content))
    return files


# -- README and examples ------------------------------------------------------------------------

def _site_link(match: re.Match[str]) -> str:
    """A link of README (relative to the repository) as a link of the site (relative to docs/)."""
    target = match.group(1)
    if target.startswith("docs/"):
        target = target.removeprefix("docs/")
    elif target.rstrip("/") == "examples":
        target = "examples.md"
    return f"]({target})"


def home() -> str:
    return REPO_LINK.sub(_site_link, (ROOT / "README.md").read_text(encoding="utf-8"))


LANGUAGES = {".py": "python", ".sh": "bash", ".json": "json"}


def examples() -> str:
    folder = ROOT / "examples"
    intro = (folder / "README.md").read_text(encoding="utf-8")
    out = [REPO_LINK.sub(lambda m: f"](#{_anchor(m.group(1))})", intro).rstrip(), ""]
    for path in sorted(p for p in folder.rglob("*") if p.suffix in LANGUAGES):
        out += [f"## {path.relative_to(folder)}", "", f"```{LANGUAGES[path.suffix]}",
                path.read_text(encoding="utf-8").rstrip(), "```", ""]
    return "\n".join(out)


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "", name.lower().replace(".", ""))


# -- the CLI, from its parser ---------------------------------------------------------------------

def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


# typer carries its own copy of click, so commands and parameters are read by their attributes.

def _option_row(param: Any) -> str:
    if param.param_type_name == "argument":
        name = f"`{(param.metavar or param.name or '').upper()}`"
        default = "" if param.required else "optional"
        return f"| {name} | argument | {_cell(getattr(param, 'help', ''))} | {default} |"
    names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
    annotation = param.type_descriptor.annotation
    kind = "flag" if param.is_flag else (param.metavar or getattr(annotation, "__name__", annotation))
    if param.multiple:
        kind = f"{kind}, repeatable"
    default = param.default
    shown = "" if default in (None, False, ()) or callable(default) else f"`{default}`"
    return f"| {names} | {_cell(str(kind))} | {_cell(param.help)} | {shown} |"


def _command(path: str, command: Any, out: list[str]) -> None:
    import typer

    if hasattr(command, "commands"):
        out += [f"## `{path}`", "", _cell(command.help), ""]
        for name, sub in command.commands.items():
            _command(f"{path} {name}", sub, out)
        return
    ctx = typer.Context(command, info_name=path)
    out += [f"### `{path}`" if path.count(" ") > 1 else f"## `{path}`", "",
            (command.help or "").strip(), "", "```text", _usage(command.get_usage(ctx)), "```", ""]
    params = [p for p in command.params if not getattr(p, "hidden", False)]
    if params:
        out += ["| parameter | type | meaning | default |", "| --- | --- | --- | --- |"]
        out += [_option_row(p) for p in params]
        out.append("")


def _usage(text: str) -> str:
    """typer writes arguments as `{name}`; the help and the docs say `NAME`."""
    return re.sub(r"\{(\w+)\}", lambda m: m.group(1).upper(), text.strip())


def cli_reference() -> str:
    import typer

    from engram.cli import app

    group: Any = typer.main.get_command(app)
    out = ["# CLI reference", "",
           "Generated from the `engram` command's own parser when this site is built. A guide to",
           "the commands, with examples and exit codes: [the command line](../cli.md).", "",
           "```text", group.get_usage(typer.Context(group, info_name="engram")).strip(), "```", "",
           "| global option | type | meaning | default |", "| --- | --- | --- | --- |"]
    out += [_option_row(p) for p in group.params if not getattr(p, "hidden", False)]
    out.append("")
    for name, command in group.commands.items():
        _command(f"engram {name}", command, out)
    return "\n".join(out)


# -- the REST API, from the OpenAPI document ------------------------------------------------------

def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#{name.lower()})"
    if schema.get("type") == "array":
        return f"array of {_schema_name(schema.get('items', {}))}"
    if "anyOf" in schema:
        return " or ".join(_schema_name(s) for s in schema["anyOf"])
    return f"`{schema.get('type', 'any')}`"


def rest_reference() -> str:
    from engram.config import Config
    from engram.server import create_app

    with tempfile.TemporaryDirectory() as folder:
        spec = create_app(Config(path=Path(folder) / "engram.db"), auth=False, mcp=False).openapi()
    out = ["# REST reference", "",
           f"Generated from the service's OpenAPI document ({spec['info']['title']} "
           f"{spec['info']['version']}) when this site is built; a running service serves the",
           "same document at `/openapi.json` and Swagger UI at `/docs`. Keys, limits, errors and",
           "examples with curl: [the service](../service.md).", "",
           _cell(spec["info"].get("description")), ""]
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            out += [f"## `{method.upper()} {path}`", ""]
            if op.get("summary"):
                out += [f"**{op['summary']}**", ""]
            if op.get("description"):
                out += [op["description"].strip(), ""]
            params = op.get("parameters", [])
            if params:
                out += ["| parameter | in | type | meaning |", "| --- | --- | --- | --- |"]
                out += [f"| `{p['name']}`{'' if not p.get('required') else ' (required)'} | {p['in']} | "
                        f"{_schema_name(p.get('schema', {}))} | {_cell(p.get('description'))} |"
                        for p in params]
                out.append("")
            body = op.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                out += [f"Body (`{media}`): {_schema_name(content.get('schema', {}))}", ""]
            out += ["| status | meaning | body |", "| --- | --- | --- |"]
            for status, response in op.get("responses", {}).items():
                media_types: list[dict[str, Any]] = list(response.get("content", {}).values())
                schema = media_types[0].get("schema") if media_types else None
                out.append(f"| {status} | {_cell(response.get('description'))} | "
                           f"{_schema_name(schema) if schema else ''} |")
            out.append("")
    out += ["## Schemas", ""]
    for name, schema in spec.get("components", {}).get("schemas", {}).items():
        out += [f"### {name}", "", _cell(schema.get("description")), ""]
        fields = schema.get("properties", {})
        if fields:
            required = set(schema.get("required", []))
            out += ["| field | type | meaning |", "| --- | --- | --- |"]
            out += [f"| `{f}`{' (required)' if f in required else ''} | {_schema_name(s)} | "
                    f"{_cell(s.get('description'))} |" for f, s in fields.items()]
            out.append("")
    return "\n".join(out)


# -- MCP, from the server's tool list -----------------------------------------------------------

def mcp_reference() -> str:
    from engram.mcp import build_server

    tools = asyncio.run(build_server(lambda: None).list_tools())  # type: ignore[arg-type, return-value]
    out = ["# MCP tools", "",
           "Generated from the tool list of `engram mcp` when this site is built: the names,",
           "descriptions and argument schemas an MCP client sees. Clients, transports and the",
           "knowledge-graph mapping: [MCP](../mcp.md).", ""]
    for tool in tools:
        schema = tool.input_schema
        required = set(schema.get("required", []))
        hints = tool.annotations.model_dump(exclude_none=True) if tool.annotations else {}
        out += [f"## `{tool.name}`", "", inspect.cleandoc(tool.description or ""), ""]
        if hints:
            out += ["Hints: " + ", ".join(f"`{k}={json.dumps(v)}`" for k, v in hints.items()), ""]
        props = schema.get("properties", {})
        if props:
            out += ["| argument | type | meaning | default |", "| --- | --- | --- | --- |"]
            for name, prop in props.items():
                kind = prop.get("type") or " or ".join(
                    str(s.get("type", "object")) for s in prop.get("anyOf", []))
                if "enum" in prop:
                    kind = " | ".join(f"`{v}`" for v in prop["enum"])
                default = "" if name in required else f"`{json.dumps(prop.get('default'))}`"
                mark = " (required)" if name in required else ""
                out.append(f"| `{name}`{mark} | {_cell(kind)} | {_cell(prop.get('description'))} "
                           f"| {default} |")
            out.append("")
    return "\n".join(out)

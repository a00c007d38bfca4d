"""The serving commands of `engram`: `serve` (the REST service), `keys` (its API keys) and `mcp`
(the MCP server over stdio or streamable HTTP). Servers are imported only when one is started.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import InvalidInput
from . import output
from .base import DbOpt, JsonOpt, State, config, guard, open_memory, print_json, state

if TYPE_CHECKING:
    from ..config import Config
    from ..server import ServiceLimits
    from ..server.keys import KeyStore

keys_app = typer.Typer(help="Manage the REST service's API keys (stored hashed, shown once).",
                       no_args_is_help=True)


@contextmanager
def _key_store(st: State) -> Iterator[KeyStore]:
    from ..server.keys import open_key_store

    with guard():
        keys = open_key_store(config(st))
        try:
            yield keys
        finally:
            keys.close()


@keys_app.command("create")
def keys_create(ctx: typer.Context,
                tenant: Annotated[str, typer.Option("--tenant", "-t", help="The tenant the key acts for.")],
                role: Annotated[str, typer.Option(
                    "--role", "-r", help="member (read and write), admin (also erase, export, import) "
                                         "or reader (read only).")]
                = "member",
                name: Annotated[str, typer.Option("--name", help="A label, e.g. who holds it.")] = "",
                db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Create an API key; the key is printed once and only its hash is stored."""
    st = state(ctx, db, as_json)
    with _key_store(st) as keys, guard():
        key, secret = keys.create(tenant, role, name)
    if st.json:
        print_json({**key.to_dict(), "key": secret})
        return
    typer.echo(secret)
    typer.echo(f"created {key.role.value} key {key.id} for tenant {key.tenant!r}; store it now, "
               "it is not shown again", err=True)


@keys_app.command("list")
def keys_list(ctx: typer.Context,
              tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="Only this tenant.")]
              = None,
              db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """API keys (ids, tenants, roles; never the keys themselves)."""
    st = state(ctx, db, as_json)
    with _key_store(st) as keys, guard():
        found = keys.list(tenant)
    if st.json:
        print_json([k.to_dict() for k in found])
        return
    if not found:
        typer.echo("no API keys", err=True)
        return
    from rich.table import Table

    table = Table()
    for col in ("id", "tenant", "role", "name", "created", "revoked"):
        table.add_column(col)
    for k in found:
        table.add_row(k.id, output.text(k.tenant), k.role.value, output.text(k.name),
                      output.date(k.created_at), output.date(k.revoked_at) if k.revoked_at else "")
    output.console().print(table)


@keys_app.command("revoke")
def keys_revoke(ctx: typer.Context, id: Annotated[str, typer.Argument(help="A key id (from keys list).")],
                db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Revoke an API key: requests with it answer 401 from now on."""
    st = state(ctx, db, as_json)
    with _key_store(st) as keys, guard():
        key = keys.revoke(id)
    if st.json:
        print_json(key.to_dict())
    else:
        typer.echo(f"revoked key {key.id} of tenant {key.tenant!r}")


def serve(ctx: typer.Context,
          host: Annotated[str, typer.Option("--host", help="Interface to bind.")] = "127.0.0.1",
          port: Annotated[int, typer.Option("--port", "-p", help="TCP port.")] = 8000,
          workers: Annotated[int, typer.Option(
              "--workers", "-w", min=1,
              help="Worker processes serving the one database; their rate limits are shared.")]
          = 1,
          no_auth: Annotated[bool, typer.Option(
              "--no-auth", help="No API keys: anyone who reaches the port is the admin of the "
                                "single-user database. For local use only.")] = False,
          allow_remote_no_auth: Annotated[bool, typer.Option(
              "--allow-remote-no-auth", help="With --no-auth, serve a non-loopback --host anyway "
                                             "(any Host header is then answered).")] = False,
          rate: Annotated[float, typer.Option("--rate", help="Requests per second per tenant.")] = 50.0,
          burst: Annotated[int, typer.Option("--burst", help="Requests a tenant may make at once.")] = 100,
          max_body: Annotated[int, typer.Option("--max-body", help="Largest request body, bytes.")]
          = 1_048_576,
          db: DbOpt = None) -> None:
    """Run the REST service (OpenAPI at /openapi.json, docs at /docs)."""
    st = state(ctx, db, False)
    with guard():
        from ..server import ServiceLimits
        from ..server.local import is_loopback

        cfg = config(st)
        try:
            # The buckets live in the database, so every process (these workers, or other
            # `engram serve` processes over the same database) spends the same tokens.
            limits = ServiceLimits(max_body_bytes=max_body, rate=rate, burst=burst, shared=True)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        remote = not is_loopback(host)
        if no_auth and remote and not allow_remote_no_auth:
            raise InvalidInput(f"--no-auth on {host}, which is not a loopback address, would give "
                               "every memory to anyone on the network; bind 127.0.0.1, use API "
                               "keys, or pass --allow-remote-no-auth")
        if no_auth:
            warn = output.console(stderr=True)
            warn.print("[bold red]" + "!" * 78)
            warn.print("[bold red]!! engram serve --no-auth: NO AUTHENTICATION. Anyone who can reach "
                       f"{host}:{port} can read,\n!! change and erase every memory in "
                       f"{cfg.database_url and 'the PostgreSQL database' or cfg.path}.")
            if remote:
                warn.print(f"[bold red]!! and {host} is not a loopback address (--allow-remote-no-auth).")
            warn.print("[bold red]" + "!" * 78)
        shown = f"[{host}]" if ":" in host else host
        typer.echo(f"engram serving on http://{shown}:{port}  (API docs: http://{shown}:{port}/docs, "
                   f"memory console: http://{shown}:{port}/ui)"
                   + (f", {workers} workers" if workers > 1 else ""), err=True)
        if workers > 1 and cfg.embed_threads is None:
            # Each worker runs its own embedder: with the default threads (one per core) each,
            # N workers oversubscribe the cores and the slowest requests wait for the others
            # (bench/load.py --workers 2 measures it: lower p95 / p99 with the cores shared out).
            cfg = replace(cfg, embed_threads=max(1, (os.cpu_count() or 1) // workers))
        factory = AppFactory(cfg, not no_auth, limits, local_only=no_auth and not remote)
        if workers == 1:
            application = factory()
    if workers == 1:
        import uvicorn

        uvicorn.run(application, host=host, port=port, log_level="info", access_log=False)
        return
    run_workers(factory, host, port, workers)


class AppFactory:
    """Builds the service app in a worker process: the workers are spawned, not forked, so
    each imports engram afresh and opens its own connections and embedder (a picklable
    value: the parent hands it to every worker)."""

    def __init__(self, cfg: Config, auth: bool, limits: ServiceLimits, *, local_only: bool) -> None:
        self.cfg = cfg
        self.auth = auth
        self.limits = limits
        self.local_only = local_only

    def __call__(self) -> Any:
        from ..server import create_app

        return create_app(self.cfg, auth=self.auth, limits=self.limits, local_only=self.local_only)


def run_workers(factory: AppFactory, host: str, port: int, workers: int) -> None:
    """`workers` uvicorn processes accepting on one socket, bound here before they start;
    uvicorn's supervisor restarts a worker that dies and stops them all on SIGINT / SIGTERM."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    # uvicorn.run insists on an import string for several workers; the factory is the same
    # thing as a value (it carries the config the command line built).
    ucfg = uvicorn.Config(factory, host=host, port=port, workers=workers, factory=True,
                          log_level="info", access_log=False)
    sock = ucfg.bind_socket()
    try:
        Multiprocess(ucfg, sockets=[sock]).run()
    finally:
        sock.close()


mcp_app = typer.Typer(help="Serve engram over MCP (stdio or streamable HTTP); `mcp import` migrates a "
                             "reference memory server's file.")


@mcp_app.callback(invoke_without_command=True)
def mcp(ctx: typer.Context,
        transport: Annotated[str, typer.Option(
            "--transport", "-t", metavar="stdio|http",
            help="stdio (for a local MCP client) or http (streamable HTTP at /mcp).")] = "stdio",
        host: Annotated[str, typer.Option("--host", help="HTTP: address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", help="HTTP: port (0 picks a free one).")] = 8000,
        user_id: Annotated[str, typer.Option(
            "--user-id", metavar="ID",
            help="Scope of every tool call: user id (over HTTP an X-Engram-User header overrides it).")]
        = "default",
        db: DbOpt = None) -> None:
    """Serve engram's memory and knowledge-graph tools over MCP (stdio or streamable HTTP)."""
    if ctx.invoked_subcommand is not None:
        return
    st = state(ctx, db, False)
    with guard():
        from ..mcp import serve as serve_mcp

        serve_mcp(transport=transport, host=host, port=port, user_id=user_id, config=config(st))


@mcp_app.command("import")
def mcp_import(ctx: typer.Context,
               path: Annotated[Path, typer.Argument(
                   dir_okay=False, metavar="MEMORY.JSONL",
                   help="The reference server's memory file (its MEMORY_FILE_PATH).")],
               user_id: Annotated[str, typer.Option(
                   "--user-id", metavar="ID", help="The user whose graph it becomes.")] = "default",
               db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Import the knowledge graph of a reference memory server (@modelcontextprotocol/server-memory):
    entities whose name exists are skipped, relations already stored too; a bad line imports nothing."""
    st = state(ctx, db, as_json)
    with guard():
        from .. import Scope
        from ..graph import reference as graph

        parsed = graph.read_reference_file(path)
        with open_memory(st, create=True) as mem:
            done = graph.import_graph(mem, parsed, Scope(user_id=user_id))
    if st.json:
        print_json({"entities": len(done.entities), "observations": done.observations,
                    "relations": len(done.relations), "skipped": done.skipped})
        return
    typer.echo(f"imported {len(done.entities)} entities ({done.observations} observations) and "
               f"{len(done.relations)} relations for user {user_id!r}")
    if done.skipped:
        typer.echo(f"skipped {len(done.skipped)} entities that exist: {', '.join(done.skipped[:20])}"
                   + (" ..." if len(done.skipped) > 20 else ""), err=True)

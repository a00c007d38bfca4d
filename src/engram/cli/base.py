"""What every `engram` command shares: the global state (--db, --json), the option types, the
exit codes, the guard that turns engram errors into one line and a code, and opening `Memory`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperOption

from .. import Memory
from ..config import Config
from ..errors import EngramError, InvalidInput, NotFound
from ..extras import install_hint
from ..model import Kind

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_INVALID = 2
EXIT_ERROR = 3

# -- shared options ------------------------------------------------------------------------------

DbOpt = Annotated[Path | None, typer.Option(
    "--db", dir_okay=False, metavar="PATH",
    help="Database file (default: $ENGRAM_DB, else ~/.engram/engram.db).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
TenantOpt = Annotated[str | None, typer.Option(
    "--tenant", metavar="NAME",
    help="Read and write a service tenant's memories (what a keyed `engram serve` stored "
         "for the tenant of an API key).")]
UserOpt = Annotated[str | None, typer.Option(
    "--user", "-u", metavar="ID", help="Scope: user id.")]
AgentOpt = Annotated[str | None, typer.Option(
    "--agent", "-a", metavar="ID", help="Scope: agent id.")]
SessionOpt = Annotated[str | None, typer.Option(
    "--session", "-s", metavar="ID", help="Scope: session id.")]
KindsOpt = Annotated[list[Kind] | None, typer.Option(
    "--kind", "-k", case_sensitive=False, metavar="KIND",
    help="Only this kind (repeatable).")]
FilterOpt = Annotated[str | None, typer.Option(
    "--filter", "-f", metavar="JSON", help='Metadata filter, e.g. \'{"topic": "food"}\'.')]
LimitOpt = Annotated[int, typer.Option(
    "--limit", "-n", metavar="N", help="How many results (1-1000).")]


@dataclass(frozen=True)
class State:
    db: Path | None = None
    json: bool = False
    tenant: str | None = None


def state(ctx: typer.Context, db: Path | None, as_json: bool) -> State:
    """Command-level --db / --json win over the global ones."""
    base = ctx.obj if isinstance(ctx.obj, State) else State()
    return State(db or base.db, as_json or base.json, base.tenant)


def _flag_type(self: TyperOption, ctx: Any) -> str | None:
    """A flag takes no value, so --help shows no type for it (typer 0.29 shows `<bool>`)."""
    if self.is_flag and self.metavar is None:
        return None
    return _value_type(self, ctx)


_value_type = TyperOption.display_type_rich
TyperOption.display_type_rich = _flag_type  # type: ignore[method-assign]


# -- errors --------------------------------------------------------------------------------------

def fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def exit_code(exc: EngramError) -> int:
    if isinstance(exc, NotFound):
        return EXIT_NOT_FOUND
    if isinstance(exc, InvalidInput):
        return EXIT_INVALID
    return EXIT_ERROR


# The top-level modules of engram's optional extras (pyproject.toml): a command that needs a
# missing one names the extra to install instead of failing with a traceback.
EXTRAS = {"fastapi": "server", "starlette": "server", "uvicorn": "server",
          "prometheus_client": "server", "mcp": "mcp", "mcp_types": "mcp", "psycopg": "postgres"}


@contextmanager
def guard() -> Iterator[None]:
    """Turn engram errors into a one-line message and an exit code, never a traceback."""
    try:
        yield
    except EngramError as exc:
        fail(str(exc), exit_code(exc))
    except OSError as exc:  # e.g. an export path in a missing directory
        fail(str(exc), EXIT_ERROR)
    except ModuleNotFoundError as exc:
        module = (exc.name or "").partition(".")[0]
        if module not in EXTRAS:
            raise
        extra = EXTRAS[module]
        fail(f"this needs engram's {extra} extra (no module {module!r}): {install_hint(extra)}",
             EXIT_ERROR)


def config(st: State) -> Config:
    return Config.from_env(path=st.db)


def database(cfg: Config, tenant: str | None = None) -> str:
    """The database a config names, as shown to a user: the SQLite file (the tenant's own, for
    a tenant), or the PostgreSQL URL without its password."""
    from ..store import tenant_path

    if cfg.database_url is None:
        return str(tenant_path(cfg.path, tenant))
    from urllib.parse import urlsplit, urlunsplit

    url = urlsplit(cfg.database_url)
    if url.password is None:
        return cfg.database_url
    netloc = f"{url.username}:***@{url.hostname}" + (f":{url.port}" if url.port else "")
    return urlunsplit((url.scheme, netloc, url.path, url.query, url.fragment))


def existing(st: State) -> Config:
    """The config of a database that must exist already (a command that only reads or changes
    what is there): a typo in --db is then an error, not a new empty database and its folders."""
    cfg = config(st)
    if cfg.database_url is None and not Path(database(cfg, st.tenant)).exists():
        whose = f" for tenant {st.tenant!r}" if st.tenant else ""
        raise NotFound(f"no database at {database(cfg, st.tenant)}{whose} (engram add "
                       "creates one; is --db or ENGRAM_DB misspelt?)")
    return cfg


@contextmanager
def open_memory(st: State, *, create: bool = False) -> Iterator[Memory]:
    """`Memory` over the database the options name, which must exist (`existing`) unless
    `create`: the commands that add (add, import, relate, demo, worker) create it."""
    with guard():
        cfg = config(st) if create else existing(st)
        mem = Memory(config=cfg, tenant=st.tenant)
        try:
            yield mem
        finally:
            mem.close()


# -- parsing options and printing JSON -------------------------------------------------------------

def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, ensure_ascii=False, indent=2))


def parse_time(value: str | None, option: str) -> datetime | None:
    if value is None:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise InvalidInput(f"{option} must be an ISO-8601 date or time such as 2024-05-10 or "
                           f"2024-05-10T14:30:00+00:00, not {value!r}") from None


def parse_json(value: str | None, option: str, error: type[InvalidInput] = InvalidInput) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise error(f"{option} is not valid JSON: {exc}") from None

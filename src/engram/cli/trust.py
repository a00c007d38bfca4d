"""`engram backup`, `restore`, `check`, `encrypt`, `rekey`, `receipts`, `retain` and `audit`:
the operations of docs/security.md (backups, encryption at rest, erasure receipts,
retention, the service's audit trail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import backup as backups
from ..errors import InvalidInput
from .base import (
    EXIT_ERROR,
    AgentOpt,
    DbOpt,
    JsonOpt,
    LimitOpt,
    SessionOpt,
    UserOpt,
    config,
    fail,
    guard,
    open_memory,
    print_json,
    state,
)


def backup(ctx: typer.Context,
           path: Annotated[Path, typer.Argument(dir_okay=False, help="The new backup file.")],
           db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Copy the live database to PATH (consistent while writers run; encrypted if it is)."""
    st = state(ctx, db, as_json)
    with guard():
        info = backups.backup(config(st), path)
    if st.json:
        print_json(info.to_dict())
    else:
        typer.echo(f"backed up to {info.path} ({info.bytes} bytes"
                   f"{', encrypted' if info.encrypted else ''}; integrity ok)")


def restore(ctx: typer.Context,
            path: Annotated[Path, typer.Argument(exists=True, dir_okay=False,
                                                 help="A backup made by `engram backup`.")],
            yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
            db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Replace the database by a backup (checked first; the current one is saved beside it).
    Stop the service and workers first."""
    st = state(ctx, db, as_json)
    cfg = config(st)
    if not yes and not typer.confirm(f"replace {cfg.path} by {path}?"):
        raise typer.Exit(1)
    with guard():
        saved = backups.restore(cfg, path)
    if st.json:
        print_json({"restored": str(cfg.path), "saved": str(saved) if saved else None})
    else:
        typer.echo(f"restored {cfg.path} from {path}"
                   + (f"; the database it replaced is saved at {saved}" if saved else ""))


def check(ctx: typer.Context,
          path: Annotated[Path | None, typer.Argument(dir_okay=False,
                                                      help="A backup (default: the database).")] = None,
          db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Run SQLite's integrity check on the database or a backup."""
    st = state(ctx, db, as_json)
    with guard():
        problems = backups.check(config(st), path)
    if st.json:
        print_json({"ok": not problems, "problems": problems})
    elif problems:
        fail("; ".join(problems[:5]), EXIT_ERROR)
    else:
        typer.echo("integrity ok")
    if problems:
        raise typer.Exit(EXIT_ERROR)


def encrypt(ctx: typer.Context, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Encrypt the plain database in place with ENGRAM_ENCRYPTION_KEY (or _FILE), after a
    plain backup beside it (delete that once the encrypted database is verified). Stop the
    service and workers first."""
    st = state(ctx, db, as_json)
    with guard():
        cfg = config(st)
        saved = backups.encrypt(cfg)
    if st.json:
        print_json({"encrypted": str(cfg.path), "plain_backup": str(saved)})
    else:
        typer.echo(f"encrypted {cfg.path}; the plain backup {saved} still holds everything "
                   "in clear: delete it (or keep it somewhere safe) once you have checked")


def rekey(ctx: typer.Context,
          new_key_file: Annotated[Path | None, typer.Option(
              "--new-key-file", exists=True, dir_okay=False,
              help="A file whose first line is the new key (else it is asked for).")] = None,
          db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Change the encryption key (the current one from ENGRAM_ENCRYPTION_KEY or _FILE) of the
    database and of every file the service keeps beside it under that key (each tenant's
    database, the audit log); says what it left as it is. Stop the service and workers first."""
    st = state(ctx, db, as_json)
    with guard():
        cfg = config(st)
        if new_key_file is not None:
            lines = new_key_file.read_text(encoding="utf-8").splitlines()
            new = lines[0] if lines else ""
        else:
            new = typer.prompt("new key", hide_input=True, confirmation_prompt=True)
        if not new.strip():
            raise InvalidInput("the new key must not be empty")
        done = backups.rekey(cfg, new)
    if st.json:
        print_json(done.to_dict())
        return
    for path in done.rotated:
        typer.echo(f"rekeyed {path}")
    for path, why in done.left.items():
        typer.echo(f"left {path}: {why}")
    typer.echo("every encrypted database now opens with the new key: set ENGRAM_ENCRYPTION_KEY to it")


def receipts(ctx: typer.Context, user: UserOpt = None, agent: AgentOpt = None,
             session: SessionOpt = None, limit: LimitOpt = 20,
             db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Receipts of past erasures and retention runs, newest first (counts, never content)."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem, guard():
        found = mem.receipts(user_id=user, agent_id=agent, session_id=session, limit=limit)
    if st.json:
        print_json([r.to_dict() for r in found])
        return
    if not found:
        typer.echo("no erasures", err=True)
    for r in found:
        scope = " ".join(f"{k}={v}" for k, v in r.scope.as_dict().items() if v is not None)
        kinds = ", ".join(f"{n} {k}" for k, n in r.by_kind.items()) or "no memories"
        typer.echo(f"{r.at:%Y-%m-%d %H:%M:%S} {r.target:9} {scope or 'all'}: {kinds}, "
                   f"{r.sessions} sessions, {r.jobs} jobs  ids sha256 {r.ids_sha256[:16]}")


def retain(ctx: typer.Context, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Enforce the retention policy now (ENGRAM_RETENTION_*; the worker does it hourly)."""
    st = state(ctx, db, as_json)
    with open_memory(st) as mem, guard():
        receipt = mem.retain()
    if st.json:
        print_json(receipt.to_dict() if receipt else None)
    else:
        typer.echo(f"removed {receipt.memories} memories and {receipt.jobs} jobs" if receipt
                   else "nothing has outlived the retention policy")


def audit(ctx: typer.Context,
          tenant: Annotated[str | None, typer.Option(
              "--tenant", "-t", help="Only this tenant (default: every tenant).")] = None,
          key_id: Annotated[str | None, typer.Option("--key", help="Only this API key id.")] = None,
          route: Annotated[str | None, typer.Option("--route", help="Only this route template.")] = None,
          limit: LimitOpt = 50, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """The service's audit trail, newest first: key id, tenant, route, scope, status, size."""
    from ..server.audit import open_audit_log

    st = state(ctx, db, as_json)
    with guard():
        log = open_audit_log(config(st))
        try:
            found = log.entries(tenant=tenant, all_tenants=tenant is None, key_id=key_id,
                                route=route, limit=max(1, min(limit, 1000)))
        finally:
            log.close()
    if st.json:
        print_json([e.to_dict() for e in found])
        return
    if not found:
        typer.echo("no audited calls", err=True)
    for e in found:
        scope = " ".join(f"{k}={v}" for k, v in (("user_id", e.user_id), ("agent_id", e.agent_id),
                                                 ("session_id", e.session_id)) if v is not None)
        typer.echo(f"{e.at:%Y-%m-%d %H:%M:%S} {e.key_id or '-':24} {e.tenant or '-':12} "
                   f"{e.method:6} {e.route} {e.status} {e.result_bytes}B {scope}")

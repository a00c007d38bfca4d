"""Backups and the encryption of the embedded database, over a `Config`: `engram backup`,
`restore`, `encrypt`, `rekey` and `check` call these (docs/security.md).

SQLite only: a PostgreSQL deployment backs up with `pg_dump` or continuous archiving (PITR),
and encrypts its disks; these functions say so instead of half-working.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .config import Config
from .errors import EncryptionError, InvalidInput
from .store import tenant_path
from .store.sqlite import files


@dataclass(frozen=True)
class BackupInfo:
    path: Path
    bytes: int
    encrypted: bool

    def to_dict(self) -> dict[str, object]:
        return {"path": str(self.path), "bytes": self.bytes, "encrypted": self.encrypted}


def _sqlite(config: Config, what: str) -> Path:
    if config.database_url:
        raise InvalidInput(f"{what} is for the embedded SQLite database; on PostgreSQL use "
                           f"pg_dump / pg_restore or continuous archiving (docs/security.md)")
    return config.path


def backup(config: Config, dest: str | Path) -> BackupInfo:
    """A consistent copy of the live database at `dest` (a new file), taken while writers
    run; encrypted with the same key when the database is."""
    src = _sqlite(config, "backup")
    dest = Path(dest).expanduser()
    size = files.backup(src, dest, config.encryption_key)
    return BackupInfo(dest, size, config.encryption_key is not None)


def restore(config: Config, src: str | Path) -> Path | None:
    """Replace the database by the backup `src` (checked first); the database it replaces is
    saved beside it (returned). Stop the service and workers first."""
    return files.restore(Path(src).expanduser(), _sqlite(config, "restore"), config.encryption_key)


def check(config: Config, path: str | Path | None = None) -> list[str]:
    """The problems `integrity_check` finds in the database (or a backup): [] when sound."""
    return files.integrity(Path(path).expanduser() if path else _sqlite(config, "check"),
                           config.encryption_key)


def encrypt(config: Config) -> Path:
    """Encrypt the plain database in place with the configured key; a plain backup is taken
    first and returned (delete it once the encrypted database is verified)."""
    if config.encryption_key is None:
        raise EncryptionError("set ENGRAM_ENCRYPTION_KEY or ENGRAM_ENCRYPTION_KEY_FILE to the new key")
    return files.encrypt(_sqlite(config, "encrypt"), config.encryption_key)


# The service's files beside its databases that no key encrypts, and why (`rekey` names them).
AUDIT_FILE = "audit.db"  # server/audit.py: encrypted with the databases' key
PLAIN_FILES = {"keys.db": "API key digests, tenants and key names, never memory content",
               "ratelimit.db": "request counts per tenant, never memory content"}


@dataclass(frozen=True)
class Rekeyed:
    """What `rekey` did: the databases now under the new key, and the files beside them it
    left as they are, with why."""

    rotated: list[Path]
    left: dict[Path, str]

    def to_dict(self) -> dict[str, object]:
        return {"rotated": [str(p) for p in self.rotated],
                "not_rotated": {str(p): why for p, why in self.left.items()}}


def databases(config: Config) -> list[Path]:
    """Every database the configured key encrypts: the database, each tenant's (the service
    keeps one file per tenant beside it) and the service's audit log, those that exist."""
    path = _sqlite(config, "rekey")
    found = [path] if path.exists() else []
    found += sorted(p for p in tenant_path(path, "-").parent.glob("*.db")
                    if re.fullmatch(r"[0-9a-f]{32}\.db", p.name))
    audit = path.parent / AUDIT_FILE
    return [*found, audit] if found and audit.exists() else found


def rekey(config: Config, new_key: str) -> Rekeyed:
    """Change the key of every database the configured key opens (`databases`: the service's
    tenants and audit log too) from it to `new_key`; none changes unless each opens with one
    of the two keys. A missing database is an error, and nothing is created. Stop the service
    and workers first."""
    if config.encryption_key is None:
        raise EncryptionError("set ENGRAM_ENCRYPTION_KEY (or _FILE) to the current key")
    found = databases(config)
    if not found:
        raise InvalidInput(f"there is no database at {config.path}")
    rotated = files.rekey_all(found, config.encryption_key, new_key)
    left = {p: "already under the new key" for p in found if p not in rotated}
    left |= {config.path.parent / name: f"not encrypted: {why}"
             for name, why in PLAIN_FILES.items() if (config.path.parent / name).exists()}
    return Rekeyed(rotated, left)

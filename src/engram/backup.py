"""Backups and the encryption of the embedded database, over a `Config`: `engram backup`,
`restore`, `encrypt`, `rekey` and `check` call these (docs/security.md).

SQLite only: a PostgreSQL deployment backs up with `pg_dump` or continuous archiving (PITR),
and encrypts its disks; these functions say so instead of half-working.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import Config
from .errors import EncryptionError, InvalidInput
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


def rekey(config: Config, new_key: str) -> None:
    """Change the key of the encrypted database from the configured key to `new_key`."""
    if config.encryption_key is None:
        raise EncryptionError("set ENGRAM_ENCRYPTION_KEY (or _FILE) to the current key")
    files.rekey(_sqlite(config, "rekey"), config.encryption_key, new_key)

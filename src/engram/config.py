"""Configuration: one frozen object built once from arguments, environment and defaults.

Every knob is listed in README.md's Configuration table; `Config.from_env()` is the only reader
of `os.environ`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import InvalidInput


def default_db_path() -> Path:
    env = os.environ.get("ENGRAM_DB")
    return Path(env) if env else Path.home() / ".engram" / "engram.db"


@dataclass(frozen=True)
class Config:
    path: Path = field(default_factory=default_db_path)
    embedder: str = "minilm"                # name of a registered embedder
    retrieval: str = "hybrid"               # name of a retrieval preset (pipeline.retrieve)
    dedupe_threshold: float = 0.90          # cosine above which two facts may be one
    dedupe_min_overlap: float = 0.5         # ... and their word sets overlap at least this much
    max_text_chars: int = 32_000            # longer texts are refused, not truncated
    max_memories_per_scope: int | None = None  # capacity; None means unbounded
    busy_timeout_s: float = 30.0            # how long a writer waits for another's lock
    log_level: str | None = None            # None leaves `engram` logging unconfigured

    @classmethod
    def from_env(cls, **overrides: Any) -> Config:
        env = os.environ
        values: dict[str, Any] = {}
        if "ENGRAM_EMBEDDER" in env:
            values["embedder"] = env["ENGRAM_EMBEDDER"]
        if "ENGRAM_RETRIEVAL" in env:
            values["retrieval"] = env["ENGRAM_RETRIEVAL"]
        for name, key, conv in (
            ("dedupe_threshold", "ENGRAM_DEDUPE_THRESHOLD", float),
            ("dedupe_min_overlap", "ENGRAM_DEDUPE_MIN_OVERLAP", float),
            ("max_text_chars", "ENGRAM_MAX_TEXT_CHARS", int),
            ("max_memories_per_scope", "ENGRAM_MAX_MEMORIES_PER_SCOPE", int),
            ("busy_timeout_s", "ENGRAM_BUSY_TIMEOUT", float),
        ):
            if env.get(key):
                try:
                    values[name] = conv(env[key])
                except ValueError as exc:
                    raise InvalidInput(f"{key}={env[key]!r} is not a valid {conv.__name__}") from exc
        if env.get("ENGRAM_LOG_LEVEL"):
            values["log_level"] = env["ENGRAM_LOG_LEVEL"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "path" in values:
            values["path"] = Path(values["path"]).expanduser()
        return cls(**values).validated()

    def validated(self) -> Config:
        if not 0.0 < self.dedupe_threshold <= 1.0:
            raise InvalidInput("dedupe_threshold must be in (0, 1]")
        if not 0.0 <= self.dedupe_min_overlap <= 1.0:
            raise InvalidInput("dedupe_min_overlap must be in [0, 1]")
        if self.max_text_chars < 1:
            raise InvalidInput("max_text_chars must be positive")
        if self.max_memories_per_scope is not None and self.max_memories_per_scope < 1:
            raise InvalidInput("max_memories_per_scope must be positive")
        return self

    def with_(self, **changes: Any) -> Config:
        return replace(self, **changes).validated()

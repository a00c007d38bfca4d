"""Logging set-up: engram logs under `engram.*` and is quiet unless asked (ENGRAM_LOG_LEVEL).

A library must not configure logging behind its caller's back; `configure` runs only when
`Config.log_level` is set, and adds one stderr handler however often it runs.
"""

from __future__ import annotations

import logging

from .errors import InvalidInput


def configure(level: str) -> None:
    """Send engram's logs at `level` and above to stderr."""
    logger = logging.getLogger("engram")
    try:
        logger.setLevel(level.upper())
    except ValueError:
        raise InvalidInput(f"ENGRAM_LOG_LEVEL={level!r} is not a logging level") from None
    if not any(getattr(h, "engram", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        handler.engram = True  # type: ignore[attr-defined]
        logger.addHandler(handler)

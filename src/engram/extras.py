"""The name engram is published under on PyPI and the `pip install` line of each extra.

The import name is `engram`; the distribution is `mnemotrace` ("memory trace", what an engram
is), because `engram` on PyPI is another project's. Errors that need an optional extra name the
line that installs it.
"""

from __future__ import annotations

DISTRIBUTION = "mnemotrace"


def install_hint(extra: str) -> str:
    """The command that installs engram's optional `extra` (e.g. "server")."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"

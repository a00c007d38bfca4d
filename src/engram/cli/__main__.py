"""`python -m engram.cli`: the `engram` command, for when the script is not on PATH."""

from . import app

app()

"""Times may be given as ISO-8601 strings wherever the API takes a time, and the signatures say
so (in Memory and AsyncMemory alike), so that code written as the README writes it type-checks."""

from __future__ import annotations

import typing
from datetime import datetime
from pathlib import Path

import pytest

from engram import AsyncMemory, Memory
from engram.providers.embedders import MiniLM

TIMES = {"add": ["observed_at", "expires_at"], "update": ["valid_from", "expires_at"],
         "search": ["as_of"], "list": ["as_of"], "relate": ["valid_from", "valid_to"],
         "unrelate": ["at"], "relations": ["as_of"], "neighbours": ["as_of"], "path": ["as_of"]}


@pytest.mark.parametrize("cls", [Memory, AsyncMemory])
@pytest.mark.parametrize("method", sorted(TIMES))
def test_every_time_parameter_takes_a_datetime_or_an_iso_string(cls: type, method: str) -> None:
    hints = typing.get_type_hints(getattr(cls, method))
    for name in TIMES[method]:
        allowed = set(typing.get_args(hints[name]))
        assert {datetime, str} <= allowed, f"{cls.__name__}.{method}({name}=...): {hints[name]}"


def test_iso_strings_are_read_as_the_times_they_name(tmp_path: Path, embedder: MiniLM) -> None:
    with Memory(path=tmp_path / "m.db", embedder=embedder) as mem:
        old = mem.add("Ana is vegetarian", user_id="ana", kind="semantic",
                      observed_at="2024-04-02T00:00:00+00:00", infer=False).memories[0]
        new = mem.add("Ana is pescatarian", user_id="ana", kind="semantic", infer=False,
                      observed_at="2024-05-01", supersedes=old.id).memories[0]
        assert old.valid_from == datetime.fromisoformat("2024-04-02T00:00:00+00:00")
        then = mem.search("What does Ana eat?", user_id="ana", as_of="2024-04-20")
        assert [h.memory.id for h in then] == [old.id]
        assert mem.search("What does Ana eat?", user_id="ana")[0].memory.id == new.id

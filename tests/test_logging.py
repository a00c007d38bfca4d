"""Observability: memory operations log under `engram.*`, structured enough to debug recall."""

from __future__ import annotations

import logging

import pytest

from engram import Memory


def test_writes_and_searches_are_logged_with_their_reasons(
        mem: Memory, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="engram"):
        mem.add("Ana likes green tea", user_id="ana", kind="semantic")
        mem.add("ana likes green tea.", user_id="ana", kind="semantic")
        mem.search("what tea does Ana drink?", user_id="ana")  # "Ana" is no lexical word in her scope
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("engram.")]
    assert any(m.startswith("added semantic") for m in messages)
    assert any("exact duplicate" in m for m in messages)
    search = [m for m in messages if m.startswith("search ")]
    assert search and "'dense'" in search[0] and "'lexical'" in search[0]


def test_the_library_is_quiet_by_default(mem: Memory, capsys: pytest.CaptureFixture[str]) -> None:
    mem.add("nothing to see", user_id="ana")
    mem.search("see", user_id="ana")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""

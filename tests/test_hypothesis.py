"""Round trips: whatever `add` accepts, `get` and `list` give back unchanged.

One Memory per module (embedding is the slow part); each example writes to its own scope.
"""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Iterator
from dataclasses import asdict
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engram import Config, InvalidInput, Memory

MAX = Config().max_text_chars
SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_scopes = itertools.count()


@pytest.fixture(scope="module")
def hmem(tmp_path_factory: pytest.TempPathFactory, embedder) -> Iterator[Memory]:
    # redaction off: these are round trips of what is given, and a generated metadata key may
    # name a secret ("Passphrase"), whose value the default policy replaces (test_redact.py)
    path = tmp_path_factory.mktemp("hyp") / "h.db"
    with Memory(config=Config(path=path, redact="off"), embedder=embedder) as m:
        yield m


def scope() -> str:
    return f"user-{next(_scopes)}"


def rows(mem: Memory) -> tuple[int, int]:
    st_ = mem.stats()
    return st_.memories + st_.deleted, st_.events


no_surrogates = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")  # both refused
texts = st.text(no_surrogates, min_size=1, max_size=300).filter(lambda s: s.strip())


@SETTINGS
@given(text=texts, kind=st.sampled_from(["episodic", "semantic", "procedural"]))
def test_any_unicode_text_round_trips(hmem: Memory, text: str, kind: str) -> None:
    uid = scope()
    rec = hmem.add(text, user_id=uid, kind=kind).memories[0]
    assert rec.text == text
    assert hmem.get(rec.id).text == text
    assert [r.text for r in hmem.list(user_id=uid).items] == [text]
    hmem.search(text, user_id=uid)  # any text is a valid query too


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.data_too_large])
@given(size=st.integers(MAX - 50, MAX), fill=st.text(no_surrogates, min_size=1, max_size=20)
       .filter(lambda s: s.strip()))
def test_long_text_up_to_the_limit_round_trips(hmem: Memory, size: int, fill: str) -> None:
    text = (fill * (size // len(fill) + 1))[:size]
    if not text.strip():
        return
    rec = hmem.add(text, user_id=scope()).memories[0]
    assert hmem.get(rec.id).text == text
    assert len(hmem.get(rec.id).text) == size


def test_text_one_past_the_limit_is_refused(hmem: Memory) -> None:
    before = rows(hmem)
    with pytest.raises(InvalidInput, match="limit"):
        hmem.add("x" * (MAX + 1))
    assert rows(hmem) == before


@SETTINGS
@given(text=st.text(st.sampled_from(" \t\n\r\x0b\x0c\u00a0\u2003\u3000"), max_size=20))
def test_empty_and_whitespace_text_is_refused(hmem: Memory, text: str) -> None:
    before = rows(hmem)
    with pytest.raises(InvalidInput):
        hmem.add(text)
    assert rows(hmem) == before


@SETTINGS
@given(head=st.text(no_surrogates, max_size=20),
       bad=st.characters(categories=("Cs",)), tail=st.text(max_size=20))
def test_surrogates_are_refused(hmem: Memory, head: str, bad: str, tail: str) -> None:
    text = "ok " + head + bad + tail
    before = rows(hmem)
    for call in (lambda: hmem.add(text), lambda: hmem.add(text, kind="semantic"),
                 lambda: hmem.add({"content": "fine", "name": bad}),
                 lambda: hmem.add("fine", metadata={"k": bad}),
                 lambda: hmem.add("fine", metadata={bad: 1}),
                 lambda: hmem.add("fine", user_id="u" + bad)):
        with pytest.raises(InvalidInput):
            call()
    assert rows(hmem) == before


json_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(no_surrogates))
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(no_surrogates, max_size=10), children, max_size=4),
    max_leaves=12)
metadata = st.dictionaries(st.text(no_surrogates, max_size=15), json_values, max_size=6)


@SETTINGS
@given(meta=metadata)
def test_metadata_round_trips(hmem: Memory, meta: dict[str, Any]) -> None:
    uid = scope()
    rec = hmem.add("a note", user_id=uid, metadata=meta).memories[0]
    got = hmem.get(rec.id).metadata
    assert got == meta
    # equal as JSON too: no int/float or list/tuple drift
    assert json.dumps(got, sort_keys=True) == json.dumps(meta, sort_keys=True)
    assert hmem.list(user_id=uid).items[0].metadata == meta


@SETTINGS
@given(meta=metadata)
@example(meta={"": {"Passphrase": 0}})  # found by hypothesis: a secret's name, kept as given
def test_a_records_dict_is_the_records_json_and_a_copy(hmem: Memory, meta: dict[str, Any]) -> None:
    rec = hmem.add("a note", user_id=scope(), metadata=meta).memories[0]
    out = rec.to_dict()
    # what `dataclasses.asdict` made of it (before `json_ready`): the same dict
    reference = {**asdict(rec), "scope": rec.scope.as_dict(), "kind": rec.kind.value,
                 "provenance": list(rec.provenance)}
    reference = {k: v.isoformat() if isinstance(v, datetime) else v for k, v in reference.items()}
    assert out == reference
    assert json.loads(json.dumps(out)) == out
    out["metadata"]["added"] = [1]
    for value in out["metadata"].values():
        if isinstance(value, list | dict):
            value.clear()
    assert rec.metadata == meta  # the record is not changed through its dict


offsets = st.integers(-(23 * 60 + 59), 23 * 60 + 59).map(lambda m: timezone(timedelta(minutes=m)))
moments = st.datetimes(min_value=datetime(1800, 1, 1), max_value=datetime(2200, 1, 1),
                       timezones=st.none() | offsets)


@SETTINGS
@given(when=moments)
def test_observed_at_round_trips_and_naive_means_utc(hmem: Memory, when: datetime) -> None:
    expected = when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    uid = scope()
    rec = hmem.add("it happened", user_id=uid, observed_at=when).memories[0]
    got = hmem.get(rec.id)
    assert got.observed_at == expected
    assert got.observed_at.tzinfo is not None and got.observed_at.utcoffset() == timedelta(0)
    assert got.valid_from == expected
    iso = hmem.add("it happened (iso)", user_id=uid, observed_at=when.isoformat()).memories[0]
    assert hmem.get(iso.id).observed_at == expected
    assert hmem.list(user_id=uid, filters={"observed_at": {"gte": when}}).items != []


@SETTINGS
@given(when=st.datetimes(timezones=st.none() | offsets))
@example(when=datetime.max)
@example(when=datetime.min)
@example(when=datetime.max.replace(tzinfo=UTC))
@example(when=datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5))))
@example(when=datetime(1, 1, 1, 1, tzinfo=timezone(timedelta(hours=5))))
@example(when=datetime(2262, 4, 11, 23, 47, 16, 854775))
def test_any_datetime_is_stored_or_refused_never_broken(hmem: Memory, when: datetime) -> None:
    """Far past and future times either round trip (to the millisecond: stores may keep epoch
    seconds as a double) or get a clear error; none may leave a row that cannot be read."""
    uid = scope()
    try:
        rec = hmem.add("edge of time", user_id=uid, observed_at=when).memories[0]
    except InvalidInput:
        assert hmem.list(user_id=uid).items == []
        return
    expected = when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    got = hmem.get(rec.id).observed_at
    assert got is not None and abs(got - expected) < timedelta(milliseconds=1)
    assert [r.id for r in hmem.list(user_id=uid).items] == [rec.id]


@SETTINGS
@given(ids=st.fixed_dictionaries({}, optional={
    "user_id": st.text(no_surrogates, min_size=1, max_size=40),
    "agent_id": st.text(string.printable, min_size=1, max_size=40),
    "session_id": st.text(no_surrogates, min_size=1, max_size=40)}))
def test_scope_ids_round_trip(hmem: Memory, ids: dict[str, str]) -> None:
    mark = scope()
    rec = hmem.add("scoped", metadata={"mark": mark}, **ids).memories[0]
    got = hmem.get(rec.id).scope
    assert got.as_dict() == {"user_id": None, "agent_id": None, "session_id": None, **ids}
    assert [r.id for r in hmem.list(filters={"mark": mark}, **ids).items] == [rec.id]

"""`filters.parse_filters`: the filter grammar, as a pure function."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from engram import InvalidFilter, InvalidInput
from engram.filters import RECORD_FIELDS, TIME_FIELDS, Condition, parse_filters


def test_no_filters() -> None:
    assert parse_filters(None) == ()
    assert parse_filters({}) == ()


def test_equality_shorthand_and_explicit_ops() -> None:
    assert parse_filters({"topic": "food"}) == (Condition("topic", "eq", "food", True),)
    assert parse_filters({"topic": {"eq": "food"}}) == parse_filters({"topic": "food"})
    got = parse_filters({"score": {"gte": 3, "lt": 10}, "topic": {"ne": "x"}})
    assert got == (Condition("score", "gte", 3, True), Condition("score", "lt", 10, True),
                   Condition("topic", "ne", "x", True))


def test_membership_values_become_tuples() -> None:
    assert parse_filters({"t": {"in": ["a", "b"]}}) == (Condition("t", "in", ("a", "b"), True),)
    assert parse_filters({"t": {"nin": ("a",)}}) == (Condition("t", "nin", ("a",), True),)


def test_scalars_pass_through() -> None:
    for value in (None, True, False, 0, -3, 2.5, "", "é ü"):
        assert parse_filters({"k": value}) == (Condition("k", "eq", value, True),)


def test_record_fields_are_not_metadata() -> None:
    for field in sorted(RECORD_FIELDS - TIME_FIELDS):
        value = 0.5 if field in ("importance", "access_count") else "x"
        (cond,) = parse_filters({field: value})
        assert cond.metadata is False
    (cond,) = parse_filters({"anything_else": 1})
    assert cond.metadata is True


def test_time_fields_become_epoch_seconds() -> None:
    t = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    expected = t.timestamp()
    for value in (t, t.isoformat(), "2024-01-02T03:04:05", datetime(2024, 1, 2, 3, 4, 5),
                  t.astimezone(timezone(timedelta(hours=9)))):
        (cond,) = parse_filters({"observed_at": {"gte": value}})
        assert cond == Condition("observed_at", "gte", expected, False)
    (cond,) = parse_filters({"created_at": {"in": ["2024-01-02T03:04:05+00:00", t]}})
    assert cond.value == (expected, expected)
    for field in TIME_FIELDS:
        assert parse_filters({field: {"lt": t}})[0].value == expected


def test_datetimes_on_metadata_become_iso_strings() -> None:
    t = datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=1)))
    (cond,) = parse_filters({"due": {"gt": t}})
    assert cond.value == "2024-01-02T02:04:05+00:00" and cond.metadata


@pytest.mark.parametrize("filters", [
    "topic=food",
    ["topic", "food"],
    {"": 1},
    {"a b": 1},
    {"a\"b": 1},
    {"x" * 129: 1},
    {1: "a"},
    {"topic": {}},
    {"topic": {"like": "f%"}},
    {"topic": {"EQ": "food"}},
    {"topic": {"in": []}},
    {"topic": {"in": "food"}},
    {"topic": {"nin": None}},
    {"topic": {"in": [["nested"]]}},
    {"topic": ["a", "b"]},
    {"topic": {"eq": {"a": 1}}},
    {"topic": object()},
    {"n": {"gt": None}},
    {"n": {"lte": True}},
    {"n": float("nan")},
    {"n": {"in": [1, float("nan")]}},
    {"observed_at": "yesterday"},
    {"observed_at": {"gt": 1700000000}},
    {"created_at": {"in": ["2024-01-01", "soon"]}},
    {"valid_to": None},
    {"observed_at": {"gt": datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5)))}},
    {"due": {"gt": datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))}},
    {"topic": "bad \ud800 unicode"},
])
def test_malformed_filters_raise(filters: Any) -> None:
    with pytest.raises(InvalidFilter) as info:
        parse_filters(filters)
    assert isinstance(info.value, InvalidInput)
    assert str(info.value)


def test_keys_allow_a_useful_alphabet() -> None:
    for key in ("a", "A-b_c.d:e", "x" * 128, "0"):
        assert parse_filters({key: 1})[0].field == key

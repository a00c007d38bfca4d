"""A question naming a day, month or year ranks the memories said then higher (`dates.py`):
the memory's time is evidence its text seldom repeats."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from engram import Memory
from engram.pipeline.dates import Span, asked_dates, said_on


def test_the_days_months_and_years_a_question_names() -> None:
    assert asked_dates("What painting did Melanie show on October 13, 2023?") == [Span(2023, 10, 13)]
    assert asked_dates("What did Gina find on 1 February, 2023?") == [Span(2023, 2, 1)]
    assert asked_dates("What happened on the 3rd of June 2023?") == [Span(2023, 6, 3)]
    assert asked_dates("Any news from 2023-10-13?") == [Span(2023, 10, 13)]
    assert asked_dates("What happened to John's job in August 2023?") == [Span(2023, 8)]
    assert asked_dates("When did Melanie go camping in June?") == [Span(None, 6)]
    assert asked_dates("What did we eat on June 3?") == [Span(None, 6, 3)]
    assert asked_dates("How often did I swim in 2023?") == [Span(2023)]
    assert asked_dates("Between May 3, 2023 and in July?") == [Span(2023, 5, 3), Span(None, 7)]


def test_what_is_no_date() -> None:
    assert asked_dates("Where does Ana live?") == []
    assert asked_dates("I may go to the beach") == []          # the verb
    assert asked_dates("Which of the 3 may I take in 2 may?") == []
    assert asked_dates("What have I learnt since 2023?") == []  # a span to now
    assert asked_dates("What did I do last week?") == []        # relative: no anchor
    assert asked_dates("Plans for 30 February 2023?") == []     # no such day
    assert asked_dates("Is 2023 a year of 12 months?") == []    # a number, not "in 2023"


def test_said_on_reads_each_time_as_its_day_in_utc() -> None:
    times = [datetime(2023, 6, 3, 23, 59, tzinfo=UTC).timestamp(),
             datetime(2023, 6, 4, 0, 0, tzinfo=UTC).timestamp(),
             datetime(2022, 6, 3, 12, 0, tzinfo=UTC).timestamp()]
    assert said_on([Span(2023, 6, 3)], times).tolist() == [True, False, False]
    assert said_on([Span(None, 6, 3)], times).tolist() == [True, False, True]
    assert said_on([Span(2023)], times).tolist() == [True, True, False]
    assert said_on([Span(2022, 6), Span(None, None, 4)], times).tolist() == [False, True, True]
    assert said_on([], times).tolist() == [False, False, False]
    # every day of four years, leap day included, as the calendar has it
    start = datetime(2023, 1, 1, 12, tzinfo=UTC)
    days = [start + timedelta(days=i) for i in range(4 * 366)]
    for span in (Span(2024, 2, 29), Span(None, 12, 31), Span(2025, 3), Span(None, None, 1)):
        assert said_on([span], [d.timestamp() for d in days]).tolist() == [
            span.holds(d.date()) for d in days]


def test_what_was_said_on_the_day_asked_comes_first(mem: Memory) -> None:
    # Outings alike in meaning, one a day, none repeating its date: only the memory's time
    # says which day it was said. (Before, the date's words matched nothing and the beach,
    # closest in meaning, came first.)
    days = [(datetime(2023, 6, 1, 10, tzinfo=UTC), "We went to the beach with the kids."),
            (datetime(2023, 6, 2, 10, tzinfo=UTC), "We went to the museum with the kids."),
            (datetime(2023, 6, 3, 10, tzinfo=UTC), "We went to the zoo with the kids."),
            (datetime(2023, 6, 4, 10, tzinfo=UTC), "We went to the cinema with the kids.")]
    for at, text in days:
        mem.add([{"role": "user", "content": text}], user_id="mel",
                session_id=f"day-{at.day}", observed_at=at)
    hits = mem.search("Where did we go on 3 June, 2023?", user_id="mel", limit=4)
    assert hits[0].memory.text == "We went to the zoo with the kids."
    assert hits[0].explain["date"] > 0
    assert all("date" not in h.explain for h in hits[1:])
    # no date named: no date evidence
    assert all("date" not in h.explain
               for h in mem.search("Where did we go?", user_id="mel", limit=4))

"""The dates a question names, and which memories were said on them.

"What did Gina find for her store on 1 February, 2023?" asks about what was said that day, and
a memory's time (`observed_at`, else `created_at`) says when it was said, though its text
seldom repeats the date ("I found the perfect spot yesterday!"). The lexical side cannot see
that: the date's words are in no memory, and the dense side reads them as any other words. So
ranking reads the date from the question and gives the memories said within it the same
evidence it gives a "when" question's memories that name a time (`RetrievalConfig.when_boost`).

A date is a day, a month or a year, written out: "October 13, 2023", "13 October 2023",
"1 February, 2023", "2023-10-13", "October 2023", "in June" (June of any year), "June 3"
(that day of any year), "in 2023" ("since 2023" is no date: it is a span to now). Relative
dates ("last week") need an anchor the question does not have and are left to the other
signals. "May" is a month only capitalised and where a day or a year stands by it, after "in"
("in May"), or in a list of months ("April and May"): elsewhere it is the verb, or a name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date

import numpy as np

MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september",
          "october", "november", "december")


@dataclass(frozen=True)
class Span:
    """A day, a month or a year; a part left None holds for any value ("June": any year)."""

    year: int | None
    month: int | None = None
    day: int | None = None

    def holds(self, day: date) -> bool:
        return ((self.year is None or day.year == self.year)
                and (self.month is None or day.month == self.month)
                and (self.day is None or day.day == self.day))


# "may" is a month only as "May" (capitalised), and then only where a form below reads it
_M = "(" + "|".join("(?-i:May)" if m == "may" else m for m in MONTHS) + ")"
_Y = r"((?:19|20)\d\d)"
_D = r"(\d{1,2})(?:st|nd|rd|th)?"
# the longest forms first: each match's text is taken out before the shorter forms are read
_MONTH = re.compile(_M, re.IGNORECASE)
_FORMS: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), parts) for pattern, parts in (
        (rf"\b{_Y}-(\d\d)-(\d\d)\b", ("year", "month", "day")),
        (rf"\b{_M}\s+{_D},?\s+{_Y}\b", ("month", "day", "year")),
        (rf"\b{_D}(?:\s+of)?\s+{_M},?\s+{_Y}\b", ("day", "month", "year")),
        (rf"\b{_M},?\s+{_Y}\b", ("month", "year")),
        (rf"\b{_M}\s+{_D}\b", ("month", "day")),
        (rf"\b{_D}(?:\s+of)?\s+{_M}\b", ("day", "month")),
        (rf"\b{_M}(?:(?:,\s*|,?\s+(?:and|or)\s+){_M})+\b", ("months",)),
        (rf"\bin\s+{_M}\b", ("month",)),
        (rf"\b(?:in|of|during)\s+{_Y}\b", ("year",)),
    ))


def asked_dates(query: str) -> list[Span]:
    """The days, months and years `query` names (see the module's docstring), in the order
    found; [] when it names none. A day that does not exist (30 February) is no date."""
    text = query
    found: list[tuple[int, Span]] = []
    for pattern, parts in _FORMS:
        for m in pattern.finditer(text):
            if parts == ("months",):  # "April and May", "June, July or August": each month
                found.extend((m.start(), Span(None, MONTHS.index(name.casefold()) + 1))
                             for name in _MONTH.findall(m[0]))
                continue
            values = dict(zip(parts, m.groups(), strict=True))
            month = values.get("month")
            span = Span(int(values["year"]) if "year" in values else None,
                        None if month is None else (int(month) if month.isdigit()
                                                    else MONTHS.index(month.casefold()) + 1),
                        int(values["day"]) if "day" in values else None)
            if _exists(span):
                found.append((m.start(), span))
        text = pattern.sub(lambda m: " " * len(m[0]), text)
    return list(dict.fromkeys(span for _, span in sorted(found, key=lambda f: f[0])))


def _exists(span: Span) -> bool:
    if span.month is not None and not 1 <= span.month <= 12:
        return False
    if span.day is None:
        return True
    try:  # a leap year, when the year is not given: 29 February is a day
        date(span.year or 2000, span.month or 1, span.day)
    except ValueError:
        return False
    return True


def said_on(spans: Sequence[Span], times: Sequence[float] | np.ndarray) -> np.ndarray:
    """Per time (epoch seconds, UTC): does it fall within one of `spans`? As a bool array,
    by numpy's calendar (a search may rank thousands of candidates)."""
    out = np.zeros(len(times), dtype=bool)
    if not spans or not len(times):
        return out
    days = np.floor(np.asarray(times, dtype=float) / 86400.0).astype("datetime64[D]")
    month_of = days.astype("datetime64[M]")
    year = month_of.astype("datetime64[Y]").astype(np.int64) + 1970
    month = month_of.astype(np.int64) % 12 + 1
    day = (days - month_of).astype(np.int64) + 1
    for span in spans:
        holds = np.ones(len(times), dtype=bool)
        for part, values in ((span.year, year), (span.month, month), (span.day, day)):
            if part is not None:
                holds &= values == part
        out |= holds
    return out

"""Revisions: where a newer statement revises an older one, the newer ranks first.

A revision is a later statement by the same speaker about the same thing that replaces what an
earlier one said ("I'm vegetarian", later "I've started eating fish again"; "We live in Leeds",
later "We moved to Lisbon"). For a question about the present, `newest_wins` lifts such a newer
statement on the first page to just above the older ones it revises; the older stay findable
just below. Questions about the past (`asks_past`) or about a span of events (`asks_span`) are
about each statement at its own time, and get no lift.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import lru_cache
from itertools import accumulate, count
from operator import add, attrgetter

import numpy as np

from ..store.base import Candidate
from .text import non_ascii, terms

_PAST_QUESTION = re.compile(
    r"\b(did|didn't|was|wasn't|were|weren't|had|used to|before|previous(ly)?|original(ly)?|"
    r"former(ly)?|at first|initially|first|earlier|ago|back then|last (year|month|week|time|"
    r"summer|winter|spring|autumn|fall)|in (19|20)\d\d)\b", re.IGNORECASE)
_CHANGE_WORDS = re.compile(
    # "now" as opposed to before; not "right now", "for now", "just now" (at this moment)
    r"\b((?<!right )(?<!for )(?<!just )(?<!until )(?<!by )(?<!while )now(?! and then)|nowadays|"
    r"these days|"
    r"anymore|no longer|instead|actually|correction|corrected|"
    r"changed|switched|moved|cancel+ed|postponed|rescheduled|delayed|quit|stopped|gave up|"
    # a value that changed, with its new value: "decreased to 120ms", "raised the rent to
    # 1,050" (not "raised money", "updated infrastructure")
    r"((in|de)creased|raised|reduced|lowered|extended|shortened|expanded|updated|revised)"
    r"( \S+){0,5} to(?= \$?\d)|"
    r"given up|dropped|replaced|from now on|as of|turn(s|ed) out|misheard|mistaken|"
    r"got (it|that) wrong|"
    # separable phrasal verbs: "called it off", "pushed the wedding back"
    r"(called|put) (\S+ ){0,3}off|(pushed|put) (\S+ ){0,3}back|brought (\S+ ){0,3}forward)\b",
    re.IGNORECASE)
_SUFFIXES = ("'s", "ing", "es", "ed", "s")


def asks_past(query: str) -> bool:
    """Does the question ask about an earlier state or a past event ("Where did Tom live
    before?", "What was the original date?", "When did...")? Newest-wins does not apply then."""
    return bool(_PAST_QUESTION.search(query))


_SPAN_QUESTION = re.compile(
    r"\b(between|order in which|in (what|which) order|from when|how many (days|weeks|months|"
    r"years)\b.*\b(until|till|since|from|before|after|by))\b", re.IGNORECASE)


def asks_span(query: str) -> bool:
    """Does the question ask about the span or the order of several events ("How many days
    between the deadline and the review?", "In what order did I mention...")? It is about
    each of their statements, told at its own time: a newer one revises none of them, and
    newest-wins does not apply."""
    return bool(_SPAN_QUESTION.search(query))


@lru_cache(maxsize=100_000)
def announces_change(text: str) -> bool:
    """Does the text say that something changed ("now", "instead", "actually", "moved",
    "cancelled", "no longer", ...)? Such a statement revises what came before it. (Cached:
    the first page of one scope's searches holds the same statements again and again.)"""
    return bool(_CHANGE_WORDS.search(text))


@lru_cache(maxsize=100_000)
def topic_words(text: str) -> frozenset[str]:
    """The content words of a text, lightly stemmed, for telling whether two texts share a topic.
    (Cached: a scope's candidates come back search after search.)"""
    out = set()
    for w in terms(text):
        for suffix in _SUFFIXES:
            if w.endswith(suffix) and len(w) - len(suffix) >= 3:
                w = w[: -len(suffix)]
                break
        out.add(w[:-1] if w.endswith("e") and len(w) > 3 else w)  # live, lives, lived: liv
    return frozenset(out)


def newest_wins(score: Mapping[str, float], recs: Mapping[str, Candidate], page: int,
                about: Collection[str] | None = None,
                asked: frozenset[str] = frozenset(),
                same: Callable[[str, str, bool, bool], bool] | None = None,
                question: frozenset[str] = frozenset()) -> dict[str, float]:
    """Topic-level newest-wins: how much each candidate on the first `page` results is lifted
    to rank just above the older ones it revises (ids of unlifted candidates are left out).

    A newer candidate may revise an older one on the page when both were said by the same
    speaker: the same name and the same role (a user's statement is revised by the user, and
    an assistant's reply restating it revises nothing). A revision is proposed when the two
    share a word that no other candidate uses (the topic: "Spanish" in "learning Spanish" and
    "I dropped Spanish") or the newer says that something changed ("we moved to Leeds",
    "instead", "no longer", "increased to"). Newer is later in time; of two statements told
    at one time (the messages of one dated session), the one told later (`created_at`, then
    the id, which sorts by creation), and then only when it says that something changed: in
    one sitting a speaker mostly goes on about what she just said. Near-equal means "both on
    the first page": a score margin would mean one thing among ten
    memories and another among a thousand, while the page is where a reader looks either
    way, and a candidate from deeper in the pool is never brought onto it. Candidates are
    visited oldest first, so of several revisions the newest comes first; the older keep their
    scores and stay findable just below. The word "no other candidate uses" is counted over
    the whole pool. Only candidates in `about` (default: all) may be lifted: in a scope of a
    few memories the page holds everything, and a revision must itself be about the question.
    Words of the question's subject (`asked`: the names it mentions) never link two
    statements: the candidates were retrieved because they share them, so "Ana" links "Ana is
    allergic to peanuts" to "Ana moved to Lisbon" only by construction when the question is
    "Where does Ana live?".

    With `same` (a test of two ids: are they about the same thing, by meaning; `same_thing`),
    a proposed pair must also pass it: a shared word or a change word says that a revision
    may be there, not that these two are its statements. Its third argument says whether the
    two answer the question in its own words (`question`: its topic words): a word they share
    as their topic is one of the question's, and both hold the same ones of them ("drive" in
    "I drive an old Toyota Corolla", "I drive an electric Renault Zoe", asked "What car do I
    drive?"); then they are one answer given twice. "My sister is called Ines" holds "sister"
    of "What's my sister called?" and the newer "My partner is called Miguel" does not: they
    answer it differently. A question word counts as a topic word does: when no more than two
    candidates use it ("take", "user" are no such word). Its fourth says whether the newer
    says that something changed.
    """
    top = sorted(score, key=lambda m: (-score[m], m))[:page]
    when = {m: (recs[m].observed_at or recs[m].created_at, recs[m].created_at, m) for m in top}
    speaker = {m: (recs[m].name, recs[m].role) for m in top}
    words = {m: topic_words(recs[m].text) - asked for m in top}
    # how many candidates use each word that two statements of one speaker share: a word
    # much of the pool uses ("great", a name) is no topic
    shared = {w for a in top for b in top if when[a] < when[b] and speaker[a] == speaker[b]
              for w in words[a] & words[b]}
    df = _counts(shared, list(map(_text, recs.values()))) if shared else {}
    # the question's own words that are as rare in the pool as a topic ("user" in "the user's
    # ...", said of every memory, is none)
    held = ({w for w, k in _counts(question - asked, list(map(_text, recs.values()))).items()
             if k <= 2} if shared else set())
    answers = {m: words[m] & held for m in top}
    lifted = {m: score[m] for m in top}
    for b in sorted(top, key=when.__getitem__):
        if about is not None and b not in about:
            continue
        # "the same person says something changed" needs someone to say it (a name or the
        # role of a message): a fact with neither is revised only by one sharing its topic word
        changed = ((recs[b].name is not None or recs[b].role is not None)
                   and announces_change(recs[b].text))
        older = []
        for a in top:
            if not (when[a] < when[b] and speaker[a] == speaker[b] and lifted[a] >= lifted[b]):
                continue
            # told in the same sitting (one time for both): the later one may only go on
            # about the same thing, unless it says that something changed
            if when[a][0] == when[b][0] and not changed:
                continue
            topic = {w for w in words[a] & words[b] if df[w] <= 2}
            if (changed or topic) and (same is None or same(
                    a, b, bool(topic & held) and answers[a] == answers[b], changed)):
                older.append(a)
        if older:
            lifted[b] = max(lifted[a] for a in older) + 1e-3
    return {m: lifted[m] - score[m] for m in top if lifted[m] > score[m]}


def same_thing(vectors: Mapping[str, np.ndarray], query: np.ndarray
               ) -> Callable[[str, str, bool, bool], bool]:
    """Are two statements about the same thing, by their (unit) `text` vectors (`vectors`: the
    page's)? Yes when they are closer to each other than either is to the question: two
    statements that only answer the same question ("My sister is called Ines", "My partner
    is called Miguel", asked "What's my sister called?") are each closer to it than to each
    other; an original and its revision ("I'm vegetarian", "I've started eating fish again,
    so I'm pescatarian") share their subject and what is said of it, which the question
    does not. An original and a revision worded like the question ("I drive an old Toyota
    Corolla", "I drive an electric Renault Zoe", asked "What car do I drive?") are each as
    close to the question as to each other; what makes them a pair is that on the page each
    is the other's closest statement. That is enough when they answer the question alike
    (`alike`: see `newest_wins`), or when the newer says that something changed (`changed`)
    and they are closer to each other than one of them is to the question. With no other
    statement on the page there is nothing to be closest among: the first test alone. A
    statement without a vector is about nothing else."""
    def same(a: str, b: str, alike: bool, changed: bool) -> bool:
        va, vb = vectors.get(a), vectors.get(b)
        if va is None or vb is None:
            return False
        ab = float(va @ vb)
        to_query = (float(va @ query), float(vb @ query))
        if ab >= max(to_query):
            return True
        others = [v for m, v in vectors.items() if m not in (a, b)]
        if not others or not (alike or (changed and ab >= min(to_query))):
            return False
        rest = np.stack(others)
        return ab >= float((rest @ va).max()) and ab >= float((rest @ vb).max())
    return same


def _on_demand(vectors: Callable[[list[str]], Mapping[str, np.ndarray]], ids: list[str],
               query: np.ndarray) -> Callable[[str, str, bool, bool], bool]:
    """`same_thing` over the vectors of `ids`, read when it is first asked: most pages hold no
    pair that a word or a change proposes as a revision, and their search reads no vector (on
    PostgreSQL, no third round trip)."""
    test: list[Callable[[str, str, bool, bool], bool]] = []

    def same(a: str, b: str, alike: bool, changed: bool) -> bool:
        if not test:
            test.append(same_thing(vectors(ids), query))
        return test[0](a, b, alike, changed)
    return same


def _counts(words: Collection[str], texts: Sequence[str], cap: int = 3) -> dict[str, int]:
    """How many of `texts` have each of `words` among their `topic_words`, counted up to `cap`
    (only whether a word is rare matters).

    Only the texts that may hold the word are read. A topic word is the start of one of the
    text's terms, and in an ASCII text a term is a piece of the lower-cased text not preceded
    by a letter or a digit: so an ASCII text holding the word has it there, which one C-level
    `find` over all of them finds. Other texts (NFKC, case folding and curly apostrophes may
    change their letters) are always read. A common word stops counting at its `cap`-th text."""
    hay = "\n".join(texts)
    other = [] if hay.isascii() else non_ascii(texts)
    pieces = list(texts)
    for i in other:
        pieces[i] = ""
    if other:
        hay = "\n".join(pieces)
    hay = hay.lower()  # which keeps an ASCII text's length (and a word has no "\n")
    ends = list(map(add, accumulate(map(len, pieces)), count()))  # where each text ends in it
    out: dict[str, int] = {}
    for w in words:
        found = sum(w in topic_words(texts[i]) for i in other)
        at = hay.find(w)
        while found < cap and at >= 0:
            i = bisect_right(ends, at)
            if at and hay[at - 1].isalnum():  # within a term: look further in this text
                at = hay.find(w, at + 1)
                continue
            found += w in topic_words(texts[i])
            at = hay.find(w, ends[i])
        out[w] = min(found, cap)
    return out


_text = attrgetter("text")

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
from .dates import MONTHS
from .text import non_ascii, terms

# a question put in the past tense ("What was ...", "When did ...")
_PAST_TENSE = re.compile(r"\b(did|didn't|was|wasn't|were|weren't|had)\b", re.IGNORECASE)
# a question about an earlier state, whatever its tense ("What was my job before the current one?")
_EARLIER = re.compile(
    r"\b(used to|before|previous(ly)?|original(ly)?|former(ly)?|at first|initially|first|earlier|"
    r"ago|back then|last (year|month|week|time|summer|winter|spring|autumn|fall)|"
    r"in (19|20)\d\d)\b", re.IGNORECASE)
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
    # a state resumed: "I've started eating fish again"
    r"(started|began|begun) (\S+ ){0,3}again|"
    # separable phrasal verbs: "called it off", "pushed the wedding back"
    r"(called|put) (\S+ ){0,3}off|(pushed|put) (\S+ ){0,3}back|brought (\S+ ){0,3}forward)\b",
    re.IGNORECASE)
_SUFFIXES = ("'s", "ing", "es", "ed", "s")


# words that ask for the latest state whatever the tense: "What score did Scott get on his
# most recent test?" is a question about now
_LATEST = re.compile(r"\b(most recent(ly)?|latest|current(ly)?|so far|these days|at the moment)\b",
                     re.IGNORECASE)


def asks_past(query: str) -> bool:
    """Does the question ask about an earlier state or a past event ("Where did Tom live
    before?", "What was the original date?", "When did...")? Newest-wins does not apply then.
    A question put in the past tense that asks for the latest ("What score did Scott get on
    his most recent test?", "so far", "currently") is about the present; one that names an
    earlier state ("before the current one") is about the past all the same."""
    return bool(_EARLIER.search(query)
                or (_PAST_TENSE.search(query) and not _LATEST.search(query)))


_SPAN_QUESTION = re.compile(
    r"\b(between|order in which|in (what|which) order|from when|how many (days|weeks|months|"
    r"years)\b.*\b(until|till|since|from|before|after|by)|"
    # several statements gathered: "how many in total across my sessions", "compare the
    # prices I mentioned", "have I ever", "how has my score changed"
    r"across|in total|combined|altogether|compar(e|ed|es|ing)|ever|how (has|have)\b.*\bchanged)\b",
    re.IGNORECASE)


def asks_span(query: str) -> bool:
    """Does the question ask about the span or the order of several events ("How many days
    between the deadline and the review?", "In what order did I mention...") or gather
    several statements ("How many problems have I completed in total across my sessions?",
    "Have I ever met Raymond?", "How has my quiz score changed?")? It is about each of their
    statements, told at its own time: a newer one revises none of them, and newest-wins does
    not apply."""
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


# a number, or a run of letters: "180ms" is 180 and "ms", "5-page" is 5 and "page"
_TOKEN = re.compile(r"\d+(?:[.,]\d+)*|[^\W\d_]+(?:'[^\W\d_]+)?")


@lru_cache(maxsize=100_000)
def quantities(text: str) -> frozenset[tuple[str, str]]:
    """The quantities a text states: each number with what it counts, the first content word
    after it, or else before it, within three words (lightly stemmed, as `topic_words`; "3
    sketches": ("sketch", "3"), "$150 as an emergency fund": ("emergency", "150"), "180ms":
    ("ms", "180"), "a test score of 68%": ("scor", "68")). Another number in between ends the
    search; a date counts nothing ("the June 15 dinner" is no 15 dinners). (Cached like
    `topic_words`.)"""
    tokens = _TOKEN.findall(text.lower())
    out = set()
    for i, tok in enumerate(tokens):
        if tok[0].isdigit() and not _in_date(tokens, i):
            unit = _counted(tokens[i + 1:i + 4]) or _counted(tokens[max(i - 3, 0):i][::-1])
            if unit:
                out.add((unit, tok))
    return frozenset(out)


_MONTHS = frozenset(MONTHS).union("jan feb mar apr jun jul aug sep sept oct nov dec".split())


def _in_date(tokens: Sequence[str], i: int) -> bool:
    """Is the number at `i` part of a date ("March 14", "14 March", "March 14, 2024")? A date
    says when, and counts nothing."""
    before = tokens[i - 2:i][::-1] if i else []
    return (bool(before) and (before[0] in _MONTHS or (before[0][0].isdigit() and len(before) > 1
                                                        and before[1] in _MONTHS))
            or (i + 1 < len(tokens) and tokens[i + 1] in _MONTHS))


def _counted(near: Sequence[str]) -> str | None:
    """The first content word of `near` (words next to a number, nearest first) before any
    other number or a month (a date's)."""
    for tok in near:
        if tok[0].isdigit() or tok in _MONTHS:
            return None
        unit = topic_words(tok)
        if unit:
            return next(iter(unit))
    return None


def gives_new_value(older: str, newer: str, asked: Collection[str]) -> bool:
    """Does the newer text give what the question asks about (`asked`: its topic words) a
    number the older one does not, where the older one counts it too ("How many sketches have
    I completed?": "I've completed 3 sketches by March 14", then "I've completed 5 sketches by
    March 15")? If the two are about the same thing, the newer gives it a new value: a change
    told without a change word. A number of something the question does not ask about is no
    answer to it (long messages hold many dates and counts, and a different one in each); nor
    is the number of someone else's: when each text names someone the other does not ("chili
    powder by 30% for Sara", "by 50% for Crystal"), they tell two people's values. Nor is a
    number the question states itself: it names the older statement ("What does fact number 7
    say?", "Where is room 12?"), and the asker wants that one, not another number of the
    same thing."""
    before: dict[str, set[str]] = {}
    for unit, number in quantities(older):
        if unit in asked and number not in asked:
            before.setdefault(unit, set()).add(number)
    if not any(unit in before and number not in before[unit]
               for unit, number in quantities(newer)):
        return False
    named, naming = names(older), names(newer)
    return not (named - naming and naming - named)


# a capitalised word within a sentence: a name ("for Sara", "with Katherine, who")
_NAME = re.compile(r"(?<=[a-z,;] )[A-Z][a-z]+")


@lru_cache(maxsize=100_000)
def names(text: str) -> frozenset[str]:
    """The names a text mentions within its sentences (months aside). (Cached like
    `topic_words`.)"""
    return frozenset(w for w in _NAME.findall(text) if w.lower() not in _MONTHS)


Same = Callable[[str, str, bool, bool, Collection[str]], bool]
"""Are two statements (ids: the older, the newer) about the same thing? Told whether they
answer the question alike, whether the newer says that something changed, and the other
statements of their speaker on the page (see `same_thing`)."""


def newest_wins(score: Mapping[str, float], recs: Mapping[str, Candidate], page: int,
                about: Collection[str] | None = None,
                asked: frozenset[str] = frozenset(),
                same: Same | None = None,
                question: frozenset[str] = frozenset(),
                below: Mapping[str, float] | None = None) -> dict[str, float]:
    """Topic-level newest-wins: how much each candidate on the first `page` results is lifted
    to rank just above the older ones it revises (ids of unlifted candidates are left out).

    A newer candidate may revise an older one on the page when both were said by the same
    speaker: the same name and the same role (a user's statement is revised by the user, and
    an assistant's reply restating it revises nothing). A revision is proposed when the two
    share a word that no other candidate uses (the topic: "Spanish" in "learning Spanish" and
    "I dropped Spanish"), or the newer says that something changed ("we moved to Leeds",
    "instead", "no longer", "increased to"), or it gives a new value: the older states a
    number and the newer one the older does not ("3 sketches by March 14", "5 sketches by
    March 15"; `gives_new_value`), which is a change told without a change word. Newer is
    later in time; of two statements told at one time (the messages of one dated session),
    the one told later (`created_at`, then the id, which sorts by creation), and then only
    when it says that something changed or gives a new value: in one sitting a speaker mostly
    goes on about what she just said. Near-equal means "both on the first page": a score
    margin would mean one thing among ten memories and another among a thousand, while the
    page is where a reader looks either way. Candidates are visited oldest first, so of
    several revisions the newest comes first; the older keep their scores and stay findable
    just below. The word "no other candidate uses" is counted over the whole pool. Only
    candidates in `about` (default: all) may be lifted: in a scope of a few memories the page
    holds everything, and a revision must itself be about the question. Words of the
    question's subject (`asked`: the names it mentions) never link two statements: the
    candidates were retrieved because they share them, so "Ana" links "Ana is allergic to
    peanuts" to "Ana moved to Lisbon" only by construction when the question is "Where does
    Ana live?".

    A candidate from `below` the page (the next page's, with their scores) may revise a
    statement on the page only on the strongest proposals: it says that something changed
    *and* shares their topic word ("I left the hospital, I'm a paramedic now" below "I work as
    a nurse at the hospital"), or it gives a new value of what the question asks. A revision
    is often worded as the change, not as the question, and ranks below the original it
    revises; a candidate from deeper in the pool is never brought up.

    With `same` (a test of two ids: are they about the same thing, by meaning; `same_thing`),
    a proposed pair must also pass it: a shared word, a change word or a new value says that a
    revision may be there, not that these two are its statements. Its third argument says
    whether the two answer the question in its own words (`question`: its topic words): a
    word they share as their topic is one of the question's, and both hold the same ones of
    them ("drive" in "I drive an old Toyota Corolla", "I drive an electric Renault Zoe", asked
    "What car do I drive?"); then they are one answer given twice. "My sister is called Ines"
    holds "sister" of "What's my sister called?" and the newer "My partner is called Miguel"
    does not: they answer it differently. A question word counts as a topic word does: when no
    more than two candidates use it ("take", "user" are no such word). Its fourth says whether
    the newer says that something changed (or gives a new value); its fifth, the other
    statements of the speaker on the page.
    """
    top = sorted(score, key=lambda m: (-score[m], m))[:page]
    # below the page, only what someone says is a change, or a number of what is asked, may
    # be a revision
    under = [m for m in below or () if m not in score and (about is None or m in about)
             and (recs[m].name is not None or recs[m].role is not None)
             and (announces_change(recs[m].text)
                  or any(unit in question for unit, _ in quantities(recs[m].text)))]
    seen = [*top, *under]
    when = {m: (recs[m].observed_at or recs[m].created_at, recs[m].created_at, m) for m in seen}
    speaker = {m: (recs[m].name, recs[m].role) for m in seen}
    words = {m: topic_words(recs[m].text) - asked for m in seen}
    # how many candidates use each word that two statements of one speaker share: a word
    # much of the pool uses ("great", a name) is no topic
    shared = {w for a in top for b in seen if when[a] < when[b] and speaker[a] == speaker[b]
              for w in words[a] & words[b]}
    df = _counts(shared, list(map(_text, recs.values()))) if shared else {}
    # the question's own words that are as rare in the pool as a topic ("user" in "the user's
    # ...", said of every memory, is none)
    held = ({w for w, k in _counts(question - asked, list(map(_text, recs.values()))).items()
             if k <= 2} if shared else set())
    answers = {m: words[m] & held for m in seen}
    base = {**(below or {}), **score}
    lifted = {m: base[m] for m in seen}
    for b in sorted(seen, key=when.__getitem__):
        if about is not None and b not in about:
            continue
        # "the same person says something changed" needs someone to say it (a name or the
        # role of a message): a fact with neither is revised only by one sharing its topic word
        said = recs[b].name is not None or recs[b].role is not None
        changed = said and announces_change(recs[b].text)
        older = []
        for a in top:
            if not (when[a] < when[b] and speaker[a] == speaker[b] and lifted[a] >= lifted[b]):
                continue
            topic = {w for w in words[a] & words[b] if df[w] <= 2}
            # a value is told by the one it belongs to: an assistant's numbers are echoes
            # and suggestions
            value = (said and recs[b].role != "assistant"
                     and gives_new_value(recs[a].text, recs[b].text, question))
            new = changed or value
            if b in score:
                # told in the same sitting (one time for both): the later one may only go on
                # about the same thing, unless it says that something changed or gives a new
                # value
                if not (new or (topic and when[a][0] != when[b][0])):
                    continue
            elif not (value or (changed and topic)):
                continue
            peers = [m for m in top if m not in (a, b) and speaker[m] == speaker[a]]
            if same is None or same(a, b, bool(topic & held) and answers[a] == answers[b],
                                    new, peers):
                older.append(a)
        if older:
            lifted[b] = max(lifted[a] for a in older) + 1e-3
    return {m: lifted[m] - base[m] for m in seen if lifted[m] > base[m]}


def same_thing(vectors: Mapping[str, np.ndarray], query: np.ndarray) -> Same:
    """Are two statements about the same thing, by their (unit) `text` vectors (`vectors`: the
    page's)? Yes when they are closer to each other than either is to the question: two
    statements that only answer the same question ("My sister is called Ines", "My partner
    is called Miguel", asked "What's my sister called?") are each closer to it than to each
    other; an original and its revision ("I'm vegetarian", "I've started eating fish again,
    so I'm pescatarian") share their subject and what is said of it, which the question
    does not. An original and a revision worded like the question ("I drive an old Toyota
    Corolla", "I drive an electric Renault Zoe", asked "What car do I drive?") are each as
    close to the question as to each other; what makes them a pair is that each is the
    other's closest among what their speaker said on the page (`peers`: another speaker
    restating one of them, as an assistant echoing the user, is closest to it by being its
    echo, and tells nothing of the two). That is enough when they answer the question alike
    (`alike`: see `newest_wins`), or when the newer says that something changed (`changed`)
    and they are closer to each other than one of them is to the question. With no other
    statement of the speaker on the page there is nothing to be closest among: the first
    test alone. A statement without a vector is about nothing else."""
    def same(a: str, b: str, alike: bool, changed: bool, peers: Collection[str]) -> bool:
        va, vb = vectors.get(a), vectors.get(b)
        if va is None or vb is None:
            return False
        ab = float(va @ vb)
        to_query = (float(va @ query), float(vb @ query))
        if ab >= max(to_query):
            return True
        others = [vectors[m] for m in peers if m in vectors]
        if not others or not (alike or (changed and ab >= min(to_query))):
            return False
        rest = np.stack(others)
        return ab >= float((rest @ va).max()) and ab >= float((rest @ vb).max())
    return same


def _on_demand(vectors: Callable[[list[str]], Mapping[str, np.ndarray]], ids: list[str],
               query: np.ndarray) -> Same:
    """`same_thing` over the vectors of `ids`, read when it is first asked: most pages hold no
    pair that a word or a change proposes as a revision, and their search reads no vector (on
    PostgreSQL, no third round trip)."""
    test: list[Same] = []

    def same(a: str, b: str, alike: bool, changed: bool, peers: Collection[str]) -> bool:
        if not test:
            test.append(same_thing(vectors(ids), query))
        return test[0](a, b, alike, changed, peers)
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

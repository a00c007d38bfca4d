"""Retrieval as data: a frozen `RetrievalConfig` (with named presets) and pure ranking functions.

The read path: candidates from the store (dense over the text, window and fact keys, lexical BM25) -> `fuse`
(score-normalised, weighted) -> `rank` (speaker, time-question, recency within the scope's own time
span, importance, session adjustments, then topic-level newest-wins for questions about the
present) -> hits. Each stage's contribution is kept in `Hit.explain` under its own name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, partial
from itertools import chain, repeat
from operator import attrgetter, is_, itemgetter, not_
from typing import Literal, TypeVar, cast

import numpy as np

from ..errors import InvalidInput
from ..store.base import Candidate
from .dates import asked_dates, said_on
from .revisions import (
    _on_demand,
    announces_change,
    asks_past,
    asks_span,
    names,
    newest_wins,
    quantities,
    topic_words,
)
from .text import STOP_WORDS, non_ascii, terms


@dataclass(frozen=True)
class RetrievalConfig:
    """A retrieval strategy, as a value you can print, compare and benchmark."""

    name: str
    dense_weight: float = 0.5      # cosine of the query to the memory's own text
    window_weight: float = 0.0     # cosine to the episode's window (itself + 2 turns before)
    fact_weight: float = 0.0       # cosine to the facts extracted from the episode (with an LLM)
    lexical_weight: float = 0.5    # BM25 over text (+ previous turn at `previous_weight`)
    previous_weight: float = 0.5
    fusion: Literal["weighted", "rrf"] = "weighted"
    rrf_k: int = 60
    candidates: int = 100          # per retriever, before fusion
    speaker_boost: float = 0.0     # added when the query names the memory's speaker
    when_boost: float = 0.0        # for "when ..." questions, memories that mention a time;
    #                                for a question naming a date, memories said on it (dates.py)
    session_weight: float = 0.0    # share of the memory's session's best score
    recency_weight: float = 0.0    # the memory's place in the candidates' own time span (0 to 1)
    importance_weight: float = 0.0
    # The knowledge graph (graph_retrieve.py): memories mentioning the entities the query names
    # and their neighbours up to `graph_depth` hops.
    graph_weight: float = 0.0
    graph_depth: int = 1
    # Topic-level newest-wins on the first `newer_page` results of a question about the present:
    # a newer statement that revises an older one ranks just above it (see `newest_wins`).
    newer_page: int = 0
    # Normalisation: min-max stretches a retriever's scores to [0, 1]. Over a whole conversation
    # the cosines of the dense keys spread over 0.44-0.95 (text) and 0.33-0.85 (window); in a
    # scope of a few memories they may spread over 0.05, and min-max would turn that into the
    # whole weight. So a spread smaller than these is not stretched further (in the scores'
    # units); the best candidate still gets 1.
    min_cosine_range: float = 0.4
    min_session_range: float = 0.5
    # The window key stands for a turn with the turns before it: evidence about the turn in
    # the measure that the turn needs them. A short reply ("Yes, since 2019!") is understood
    # only in its context; a message of `context_chars` characters or more says what it is
    # about by itself, and its window's match is its neighbours' (the reply after a question
    # would inherit the question's match). So the window's contribution is scaled by
    # 1 - length / context_chars (0 at that length and past it); 0 turns the scaling off.
    context_chars: int = 0
    # The same for the lexical side: the store's BM25 counts the previous turn in a turn's
    # match (at `previous_weight`) and in its length (a short reply needs it: docs/lexicon.md,
    # "The score"), so a message after a long one is measured with it. A message of
    # `previous_chars` characters or more is matched by its own words alone: BM25 over the
    # distinct content words of the candidates' texts (`own_words`), mixed with the store's
    # score as 1 - length / previous_chars; 0: off.
    previous_chars: int = 0

    def __post_init__(self) -> None:
        if self.fusion not in ("weighted", "rrf"):
            raise InvalidInput(f"unknown fusion {self.fusion!r}")
        if self.candidates < 1:
            raise InvalidInput("candidates must be positive")
        if self.newer_page < 0:
            raise InvalidInput("newer_page must be 0 (off) or positive")
        if self.context_chars < 0 or self.previous_chars < 0:
            raise InvalidInput("context_chars and previous_chars must be 0 (off) or positive")
        if not 0 <= self.graph_depth <= 2:
            raise InvalidInput("graph_depth must be 0, 1 or 2")


# About two of MiniLM's windows of 256 tokens (at some four characters a token): a message
# this long is no reply that needs the turns before it to be understood. A message past a
# short paragraph (some 120 tokens) is matched by its own words. Measured on LoCoMo, BEAM and
# the profile set: rerun bench/retrieval.py after changing either.
CONTEXT_CHARS = 2000
PREVIOUS_CHARS = 500

PRESETS: dict[str, RetrievalConfig] = {
    p.name: p
    for p in (
        # The default, tuned on the LoCoMo dev split: rerun bench/locomo.py after changing a weight.
        RetrievalConfig("hybrid", candidates=1000, window_weight=0.3, fact_weight=0.3,
                        speaker_boost=0.2, when_boost=0.15,
                        session_weight=0.3, recency_weight=0.01, importance_weight=0.01,
                        newer_page=10, context_chars=CONTEXT_CHARS,
                        previous_chars=PREVIOUS_CHARS),
        # The same signals over a tenth of the candidate pool: faster, a little less recall.
        RetrievalConfig("fast", candidates=100, window_weight=0.3, fact_weight=0.3, speaker_boost=0.2,
                        when_boost=0.15, session_weight=0.3, recency_weight=0.01,
                        importance_weight=0.01, newer_page=10, context_chars=CONTEXT_CHARS,
                        previous_chars=PREVIOUS_CHARS),
        # Plain baselines, for comparison.
        RetrievalConfig("rrf", fusion="rrf", previous_weight=0.0),
        RetrievalConfig("dense", dense_weight=1.0, lexical_weight=0.0),
        RetrievalConfig("lexical", dense_weight=0.0, lexical_weight=1.0, previous_weight=0.0),
    )
}


def get_preset(name: str) -> RetrievalConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidInput(f"unknown retrieval preset {name!r}; presets: {sorted(PRESETS)}") from None


K = TypeVar("K")


def _minmax(scores: Mapping[K, float], floor: float | None = None,
            min_range: float = 0.0) -> dict[K, float]:
    """Scores scaled to [0, 1]: the best gets 1; the others lose their gap to the best divided
    by the spread (from the lowest score, or from `floor`), the spread being at least `min_range`
    so that tiny gaps in a small pool are not exaggerated."""
    keys = list(scores)
    return dict(zip(keys, _stretch(np.fromiter(scores.values(), float, len(keys)), floor,
                                   min_range).tolist(), strict=True))


def _stretch(values: np.ndarray, floor: float | None = None, min_range: float = 0.0) -> np.ndarray:
    """`_minmax` over an array (the same arithmetic, element by element)."""
    if not len(values):
        return values
    return _scale(values, float(values.min()) if floor is None else floor,
                  float(values.max()), min_range)


def _scale(values: np.ndarray, lo: float, hi: float, min_range: float) -> np.ndarray:
    """`_stretch` with its lowest and highest value given: element by element, so a part of an
    array scales to exactly what it would within the whole (and rises with its values)."""
    spread = max(hi - lo, min_range)
    if spread < 1e-12:
        return np.ones(len(values))
    return np.maximum(0.0, 1.0 - (hi - values) / spread)


@dataclass(frozen=True)
class Fused:
    """The fused candidate pool as arrays over `ids`: per retriever (in the order they were
    given) its weighted, normalised contribution and whether it found the id at all (a
    retriever that did not find an id contributes 0 and is left out of its explanation), and
    their sum."""

    ids: list[str]
    parts: dict[str, np.ndarray]
    found: dict[str, np.ndarray]
    total: np.ndarray

    def as_dicts(self) -> dict[str, dict[str, float]]:
        """Per id: each finding retriever's contribution, summed as `fused`."""
        cols = {label: (self.parts[label].tolist(), self.found[label].tolist())
                for label in self.parts}
        out: dict[str, dict[str, float]] = {}
        for i, (mid, total) in enumerate(zip(self.ids, self.total.tolist(), strict=True)):
            row = {label: part[i] for label, (part, found) in cols.items() if found[i]}
            row["fused"] = total
            out[mid] = row
        return out

    @classmethod
    def of(cls, fused: Mapping[str, Mapping[str, float]]) -> Fused:
        """From the per-id dicts `fuse` returns (or a test writes by hand)."""
        ids = list(fused)
        labels = list(dict.fromkeys(k for parts in fused.values() for k in parts if k != "fused"))
        parts = {lb: np.array([fused[m].get(lb, 0.0) for m in ids], dtype=float) for lb in labels}
        found = {lb: np.array([lb in fused[m] for m in ids], dtype=bool) for lb in labels}
        return cls(ids, parts, found, np.array([fused[m]["fused"] for m in ids], dtype=float))


def fuse_arrays(ranked: Mapping[str, Sequence[tuple[str, float]]], weights: Mapping[str, float],
                cfg: RetrievalConfig) -> Fused:
    """Each retriever's scores normalised and weighted (see `fuse`), over the union of the ids
    they found (the ids of one retriever are distinct), as arrays. The ids are numbered in
    the order first found, with C-level maps rather than a Python step per hit."""
    lists: dict[str, tuple[float, list[str], Sequence[tuple[str, float]]]] = {}
    for label, hits in ranked.items():
        w = weights.get(label, 0.0)
        if w and hits:  # not zip(*hits): an iterator per hit, for the garbage collector to see
            lists[label] = (w, list(map(_first, hits)), hits)
    first = dict.fromkeys(chain.from_iterable(mids for _, mids, _ in lists.values()))
    index = dict(zip(first, range(len(first)), strict=True))
    n = len(index)
    parts: dict[str, np.ndarray] = {}
    found: dict[str, np.ndarray] = {}
    total = np.zeros(n)
    for label, (w, mids, hits) in lists.items():
        pos = np.fromiter(map(index.__getitem__, mids), np.intp, len(mids))
        if cfg.fusion == "rrf":
            norm = 1.0 / (cfg.rrf_k + np.arange(len(mids)) + 1.0)
        else:
            values = np.fromiter(map(_second, hits), float, len(hits))
            norm = (_stretch(values, floor=0.0) if label == "lexical"
                    else _stretch(values, min_range=cfg.min_cosine_range))
        parts[label] = np.zeros(n)
        parts[label][pos] = w * norm
        found[label] = np.zeros(n, dtype=bool)
        found[label][pos] = True
        total = total + parts[label]  # in retriever order: the same sums as adding floats
    return Fused(list(index), parts, found, total)


def fuse(ranked: Mapping[str, Sequence[tuple[str, float]]], weights: Mapping[str, float],
         cfg: RetrievalConfig) -> dict[str, dict[str, float]]:
    """Per candidate id: each retriever's weighted, normalised contribution, summed as `fused`.

    Scores are min-max normalised per retriever; BM25 uses 0 as its floor (a memory with none
    of the words scores 0), which keeps one weak lexical match from looking like a perfect one.
    Cosines are stretched over at least `cfg.min_cosine_range`, so in a small scope a small gap
    stays small.
    """
    return fuse_arrays(ranked, weights, cfg).as_dicts()


_WHEN_QUESTION = re.compile(
    r"^\s*(when|how long|what (year|month|date|day|time))\b|\bwhen\b", re.IGNORECASE)
_TIME_WORDS = re.compile(
    r"\b(yesterday|today|tonight|tomorrow|ago|last|next|recently|lately|earlier|weekends?|"
    r"weeks?|months?|years?|since|monday|tuesday|wednesday|thursday|friday|saturday|sunday|"
    r"january|february|march|april|may|june|july|august|september|october|november|december|"
    r"(19|20)\d\d)\b", re.IGNORECASE)


def lexical_terms(query: str, user_id: str | None = None) -> list[str]:
    """The lexical query: the question's content words (a noun's possessive as the noun, see
    `as_nouns`), but for the scope's own user named in it. Within a user's scope every memory
    is about that user, and their own messages say "I": the name ("Ana" in "Where does Ana
    live?", scoped to user "ana"; "Ana's" too) discriminates nothing, yet BM25 would reward
    the memories that happen to spell it (third-person facts) over the user's own statements.
    A user id of one word is taken as their name; a question that is nothing but the name
    keeps it."""
    asked = terms(as_nouns(query))
    own = terms(user_id) if user_id else []
    if len(own) != 1:
        return asked
    rest = [w for w in asked if w not in (own[0], f"{own[0]}'s")]
    return rest or asked


_POSSESSIVE = re.compile(r"(?<![^\W_])([^\W_]+)['’]s(?![^\W_])")


def as_nouns(query: str) -> str:
    """The question with each common noun's possessive as the noun: "What's my partner's
    name?" asks about "my partner", which is what a memory says, while the index reads
    "partner's" as the phrase `partner s`, held only by texts that spell the possessive. A
    name's possessive ("Melanie's family", capitalised) stays as written: a turn's lexical
    document begins with its speaker's name, so the name as a word would match every turn she
    speaks (the speaker adjustment reads the name already), where the possessive matches the
    texts that speak of what is hers. Contractions that are stop words ("it's", "let's") stay
    as they are (and are left out)."""
    def noun(m: re.Match[str]) -> str:
        whole = m[0].replace("’", "'").casefold()
        return m[1] if m[1].islower() and whole not in STOP_WORDS else m[0]
    return _POSSESSIVE.sub(noun, query)


def asks_when(query: str) -> bool:
    """Does the question ask for a time ("When did...", "How long...", "What year...")?"""
    return bool(_WHEN_QUESTION.search(query))


@lru_cache(maxsize=100_000)
def mentions_time(text: str) -> bool:
    """Does the text name a time? (Cached: a scope's candidates come back search after search.)"""
    return bool(_TIME_WORDS.search(text))


# The words `_TIME_WORDS` matches, every form: each of its alternatives is made of word
# characters between two \b, so it matches exactly a whole run of word characters.
_TIME_TOKENS = frozenset(
    w.encode() for w in (
        "yesterday today tonight tomorrow ago last next recently lately earlier weekend weekends "
        "week weeks month months year years since monday tuesday wednesday thursday friday "
        "saturday sunday january february march april may june july august september october "
        "november december").split()
) | {f"{century}{year:02d}".encode() for century in (19, 20) for year in range(100)}
# An ASCII text's runs of word characters (\w: letters, digits, "_"), lower-cased, split by spaces
_RUNS = bytes(c if chr(c).isalnum() or c == ord("_") else 32
              for c in range(128)).lower() + b" " * 128


def _runs(texts: Sequence[str]) -> list[list[bytes]]:
    """Each text's runs of word characters, lower-cased, with C-level string methods rather
    than a regex: for an ASCII text, exactly the words a case-insensitive regex of one word
    between word boundaries can match (an ASCII text has no case folding beyond `lower`);
    for any other, nothing to rely on (see `non_ascii`)."""
    ascii_ = map(str.encode, texts, repeat("ascii"), repeat("replace"))  # never raises
    return list(map(bytes.split, map(bytes.translate, ascii_, repeat(_RUNS))))


def mention_times(texts: Sequence[str]) -> list[bool]:
    """`mentions_time` of each text: a set lookup per word of an ASCII text (the regex is
    slow, and a search over a large pool may read thousands), the regex for any other."""
    out = list(map(not_, map(_TIME_TOKENS.isdisjoint, _runs(texts))))
    for i in non_ascii(texts):
        out[i] = mentions_time(texts[i])
    return out


def named_speakers(query: str, names: set[str]) -> set[str]:
    """The speakers a query names, matched by first name as a whole word."""
    return {n for n in names
            if n.split() and re.search(rf"\b{re.escape(n.split()[0])}\b", query, re.IGNORECASE)}


_ASCII_WORD = re.compile(r"[A-Za-z0-9_]+")


def _speakers(query: str, names: set[str]) -> set[str]:
    """`named_speakers`: a first name of ASCII word characters is looked up among the words
    of an ASCII query (see `_runs`), without a regex per name."""
    if not query.isascii():
        return named_speakers(query, names)
    words = set(_runs([query])[0])
    out = set()
    for name in names:
        first = name.split()[:1]
        if first and (first[0].lower().encode() in words if _ASCII_WORD.fullmatch(first[0])
                      else named_speakers(query, {name})):
            out.add(name)
    return out


def span_positions(times: Mapping[K, datetime], now: datetime) -> dict[K, float]:
    """Each time's place in the span of all of them: 0 for the earliest, 1 for the latest.

    Recency relative to what the scope holds rather than to the wall clock: a conversation of
    2024 read in 2026 still has its latest turns, and wall-clock decay would give every turn
    the same 0. Times after `now` count as `now` (clock skew); equal times all get 0.
    """
    if not times:
        return {}
    secs = {k: min(t, now).timestamp() for k, t in times.items()}
    lo, hi = min(secs.values()), max(secs.values())
    if hi - lo <= 0:
        return {k: 0.0 for k in secs}
    return {k: (v - lo) / (hi - lo) for k, v in secs.items()}


Ranked = tuple[str, float, dict[str, float]]  # memory id, score, explanation


def rank(fused: Mapping[str, dict[str, float]], candidates: Mapping[str, Candidate], query: str,
         cfg: RetrievalConfig, now: datetime) -> list[Ranked]:
    """Final scores: fused score plus the adjustments the preset turns on, best first."""
    return rank_arrays(Fused.of(fused), candidates, query, cfg, now)


def rank_arrays(fused: Fused, candidates: Mapping[str, Candidate], query: str,
                cfg: RetrievalConfig, now: datetime, limit: int | None = None,
                vectors: Callable[[list[str]], Mapping[str, np.ndarray]] | None = None,
                query_vector: np.ndarray | None = None,
                asked: Sequence[str] | None = None) -> list[Ranked]:
    """`rank` over the arrays of `fuse_arrays`: the best `limit` (default all), explained.
    `asked`: the lexical query's words (`lexical_terms`; default all of the query's).

    Every adjustment is an array added to the score in a fixed order (speaker, when, date,
    recency, importance, session, newer), 0 where it does not apply: the same sums, in the same
    order, as adding each to each candidate's score. The candidates' fields are read into columns
    with C-level maps (their time and session unit were derived when they were built), and an
    adjustment whose weight is 0 reads nothing. What a regex reads from a candidate's text
    (does a fact name the speaker asked about, does the text name a time) is read only for
    the candidates that may reach the results (see `_settle`).
    """
    got = list(map(candidates.get, fused.ids))  # None where the store no longer holds the id
    keep = None if all(got) else np.flatnonzero(np.fromiter(map(bool, got), bool, len(got)))
    ids = fused.ids if keep is None else list(map(fused.ids.__getitem__, keep.tolist()))
    rows = cast(list[Candidate], got if keep is None else list(map(got.__getitem__, keep.tolist())))
    n = len(rows)
    sel = slice(None) if keep is None else keep
    if cfg.context_chars and "window" in fused.parts:
        fused = _in_context(fused, rows, sel, cfg.context_chars)
    if cfg.previous_chars and "lexical" in fused.parts:
        fused = own_words(fused, rows, sel, query, cfg, asked)
    base = fused.total[sel].copy()
    steps: list[tuple[str, np.ndarray | _Flag, bool]] = []  # (label, values, shown where 0 too)

    # A question naming exactly one speaker is about what that speaker said (or, for a fact
    # with no speaker, about what the fact says of them).
    names = list(map(_name, rows))
    named = _speakers(query, {name for name in set(names) if name})
    first = next(iter(named)).split()[0] if len(named) == 1 else None
    when = asks_when(query)
    # A question about the past gets no preference for what is newer.
    present = not asks_past(query)
    if cfg.speaker_boost and first:
        said = np.fromiter(map(named.__contains__, names), bool, n)
        # a fact with no speaker: does it name them?
        unnamed = np.fromiter(map(is_, names, repeat(None)), bool, n)
        steps.append(("speaker", _Flag(cfg.speaker_boost, _naming(first), said, unnamed),
                      False))
    if cfg.when_boost and when:
        steps.append(("when", _Flag(cfg.when_boost, mention_times, np.zeros(n, bool),
                                    np.ones(n, bool)), False))
    # A question naming a day, month or year asks what was said then: a memory's time is
    # evidence its text seldom repeats (the same evidence as a time named for "when").
    spans = asked_dates(query) if cfg.when_boost else []
    if spans and n:
        steps.append(("date", cfg.when_boost * said_on(
            spans, np.fromiter(map(_at, rows), float, n)), False))
    if cfg.recency_weight and present and n:
        # shown at 0 too: the oldest candidate is 0 by definition, not by omission
        steps.append(("recency", cfg.recency_weight * _span(rows, now), True))
    if cfg.importance_weight:
        steps.append(("importance",
                      cfg.importance_weight * np.fromiter(map(_importance, rows), float, n), False))

    # Session-level evidence: a turn in the session that best matches the query gains.
    # A memory outside any session (a fact) is a session of its own.
    unit = None
    if cfg.session_weight and n:
        units = list(map(_unit, rows))
        codes = dict(zip(dict.fromkeys(units), range(n), strict=False))  # n or fewer
        unit = np.fromiter(map(codes.__getitem__, units), np.intp, n)

    # ordered as far as anything reads: the two pages newest-wins looks at, the `limit` explained
    upto = None if limit is None else max(limit, 2 * cfg.newer_page if present else 0)
    _settle(rows, base, steps, unit, cfg, upto)
    added: dict[str, tuple[np.ndarray, bool]] = {}
    score = base
    for label, values, shown in steps:
        column = values.weight * values.value if isinstance(values, _Flag) else values
        added[label] = (column, shown)
        score = score + column
    if unit is not None:
        best = np.zeros(int(unit.max()) + 1)
        np.maximum.at(best, unit, score)
        added["session"] = (cfg.session_weight * _stretch(best, min_range=cfg.min_session_range)[unit],
                            False)
        score = score + added["session"][0]

    order = _order(ids, score, upto)
    if cfg.newer_page and present and n and not asks_span(query):
        # the page, and the next page's candidates that may revise a statement on it
        seen = order[:2 * cfg.newer_page]
        near = [ids[i] for i in seen]
        top = near[:cfg.newer_page]
        on_page = dict(zip(top, score[seen[:cfg.newer_page]].tolist(), strict=True))
        below = dict(zip(near[cfg.newer_page:], score[seen[cfg.newer_page:]].tolist(), strict=True))
        # about the question: not the farthest in meaning (dense 0 is the pool's least similar,
        # or `min_cosine_range` of cosine or more below the best)
        about = None
        if cfg.dense_weight:
            dense = fused.parts.get("dense")
            close = dense[sel][seen] > 0.0 if dense is not None else [False] * len(near)
            about = {m for m, c in zip(near, close, strict=True) if c}
        # the names the question is about ("Ana" in "Where does Ana live?") are shared by every
        # statement about her: they are the subject, never the topic that links a revision
        subject = topic_words(" ".join(re.findall(r"(?<!^)(?<![.?!] )\b[A-Z][\w'-]*", query.strip())))
        same = (None if vectors is None or query_vector is None
                else _on_demand(vectors, near, query_vector))
        lifts = newest_wins(on_page, dict(zip(ids, rows, strict=True)), cfg.newer_page, about, subject,
                            same, topic_words(query), below)
        if lifts:
            at = {mid: i for i, mid in enumerate(near)}
            lift = np.zeros(n)
            for mid, v in lifts.items():
                lift[order[at[mid]]] = v
            added["newer"] = (lift, False)
            score = score + lift
            order = _order(ids, score, upto)

    # only the rows returned are explained
    shown_rows = order if limit is None else order[:limit]
    at_rows = shown_rows if keep is None else keep[shown_rows]
    parts = [(label, values[at_rows].tolist(), fused.found[label][at_rows].tolist())
             for label, values in fused.parts.items()]
    total = fused.total[at_rows].tolist()
    extra = [(label, values[shown_rows].tolist(), shown) for label, (values, shown) in added.items()]
    final = score[shown_rows].tolist()
    out: list[Ranked] = []
    for j, i in enumerate(shown_rows.tolist()):
        explain = {label: v[j] for label, v, f in parts if f[j]}
        explain["fused"] = total[j]
        for label, v, shown in extra:
            if v[j] or shown:
                explain[label] = v[j]
        explain["score"] = final[j]
        out.append((ids[i], final[j], explain))
    return out


def _in_context(fused: Fused, rows: Sequence[Candidate], sel: slice | np.ndarray,
                context_chars: int) -> Fused:
    """The window key's contribution scaled by how much each candidate (`rows`, at `sel` of
    the fused ids) needs the turns before it: 1 - its length / `context_chars`, at least 0
    (see `RetrievalConfig.context_chars`)."""
    window = fused.parts["window"]
    lengths = np.fromiter(map(len, map(_text, rows)), float, len(rows))
    scaled = window.copy()
    scaled[sel] = window[sel] * np.clip(1.0 - lengths / context_chars, 0.0, 1.0)
    return Fused(fused.ids, {**fused.parts, "window": scaled}, fused.found,
                 fused.total - window + scaled)


def own_words(fused: Fused, rows: Sequence[Candidate], sel: slice | np.ndarray, query: str,
              cfg: RetrievalConfig, asked: Sequence[str] | None = None) -> Fused:
    """The lexical contribution of long messages from their own words (see
    `RetrievalConfig.previous_chars`): BM25 over the candidates (`rows`, at `sel` of the fused
    ids), each text's distinct content words its document, normalised as the store's BM25 is
    (the best 1, no match 0) and weighted alike; mixed with the store's by 1 - length /
    previous_chars. A candidate it matches counts as found by the lexical retriever."""
    words = sorted(set(terms(query) if asked is None else asked))
    n = len(rows)
    if not words or not n:
        return fused
    docs = [_word_set(r.text) for r in rows]
    lengths = np.fromiter(map(len, docs), float, n)
    norm = _K1 * (1.0 - _B + _B * lengths / max(float(lengths.mean()), 1.0))
    score = np.zeros(n)
    for word in words:
        has = np.fromiter((word in d for d in docs), bool, n)
        df = int(has.sum())
        if df:
            idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
            score = score + has * (idf * (_K1 + 1.0) / (1.0 + norm))
    own = cfg.lexical_weight * _stretch(score, floor=0.0)
    share = np.clip(1.0 - np.fromiter(map(len, map(_text, rows)), float, n) / cfg.previous_chars,
                    0.0, 1.0)
    before = fused.parts["lexical"]
    lexical = before.copy()
    lexical[sel] = share * before[sel] + (1.0 - share) * own
    found = fused.found["lexical"].copy()
    found[sel] = found[sel] | (score > 0)
    return Fused(fused.ids, {**fused.parts, "lexical": lexical},
                 {**fused.found, "lexical": found}, fused.total - before + lexical)


_K1, _B = 1.2, 0.75  # BM25's usual constants (FTS5's too)


@lru_cache(maxsize=100_000)
def _word_set(text: str) -> frozenset[str]:
    """A text's distinct content words. (Cached like `topic_words`.)"""
    return frozenset(terms(text))


@dataclass(eq=False)
class _Flag:
    """An adjustment read from candidates' texts by `test` (what a regex says of each text:
    the costly part of ranking a large pool), `weight` where it holds; read only where
    `_settle` asks, and elsewhere `value` False and `unread` True."""

    weight: float
    test: Callable[[Sequence[str]], list[bool]]
    value: np.ndarray
    unread: np.ndarray

    def read(self, rows: Sequence[Candidate], at: np.ndarray) -> None:
        at = at[self.unread[at]]
        if len(at):
            self.value[at] = self.test(list(map(_text, map(rows.__getitem__, at.tolist()))))
            self.unread[at] = False

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Each candidate's value if read, else the lower and the higher of 0 and `weight`."""
        low = self.weight * self.value
        if not self.unread.any():
            return low, low
        high = self.weight * (self.value | self.unread)
        return np.minimum(low, high), np.maximum(low, high)


def _settle(rows: Sequence[Candidate], base: np.ndarray,
            steps: Sequence[tuple[str, np.ndarray | _Flag, bool]], unit: np.ndarray | None,
            cfg: RetrievalConfig, upto: int | None) -> None:
    """Read the text adjustments (the `_Flag`s among `steps`) of every candidate that may
    reach the first `upto` (None: all) and of every one those depend on: the first `upto`
    then score, in order, exactly as if every candidate had been read.

    An unread candidate's score lies between its scores with every flag at its lower and at
    its higher value: the same sums in the same order, and rounding never reverses an order.
    One whose highest score is below the `upto`-th best lowest score cannot reach the first
    `upto`. The session adjustment stretches the best score of the candidate's session
    between the lowest and the highest best of all sessions: so first the sessions that may
    hold the lowest best are read until it is known. A session's best is known once no unread
    candidate's highest score in it is above the best lowest one. Then the highest best is
    taken to be the best lowest one: the stretch is fixed, and rises with a session's best.
    Were the highest best not known, a candidate that may score above it would get more than
    the whole session weight, more than any lowest score: it may reach the page, and is read.
    So once every candidate that may reach the page is read, the highest best is known, and
    so is the best of their sessions (another candidate of one that could score above it
    gets the same session adjustment: it may reach the page too). Weights that could reverse
    an order (a negative session weight, a score that is not finite) read everything."""
    flags = [values for _, values, _ in steps if isinstance(values, _Flag)]
    if not flags:
        return
    n = len(rows)
    if (upto is None or upto >= n or (unit is not None and not cfg.session_weight >= 0)
            or not np.isfinite(base).all() or not all(np.isfinite(f.weight) for f in flags)
            or not all(np.isfinite(v).all() for _, v, _ in steps if not isinstance(v, _Flag))):
        for f in flags:
            f.read(rows, np.arange(n))
        return
    while upto > 0:
        low, high = base, base
        for _, values, _ in steps:
            lo, hi = values.bounds() if isinstance(values, _Flag) else (values, values)
            low, high = low + lo, high + hi
        unread = np.logical_or.reduce([f.unread for f in flags])
        if unit is not None:
            best_low = np.zeros(int(unit.max()) + 1)
            np.maximum.at(best_low, unit, low)
            best_high = np.zeros(len(best_low))
            np.maximum.at(best_high, unit, high)
            bottom, top = float(best_high.min()), float(best_low.max())
            # the sessions that may hold the lowest best, not known yet
            lowest = (best_low != best_high) & (best_low <= bottom)
            if lowest.any():
                want = unread & lowest[unit] & (high > best_low[unit])
                for f in flags:
                    f.read(rows, np.flatnonzero(want))
                continue
            # the lowest best is `bottom`; the highest is taken to be `top` (see above)
            stretch = partial(_scale, lo=bottom, hi=top, min_range=cfg.min_session_range)
            low = low + cfg.session_weight * stretch(best_low)[unit]
            high = high + cfg.session_weight * stretch(best_high)[unit]
        bar = np.partition(low, n - upto)[n - upto]  # the `upto`-th best lowest score
        want = unread & (high >= bar)
        if not want.any():
            return
        for f in flags:
            f.read(rows, np.flatnonzero(want))


def _order(ids: Sequence[str], score: np.ndarray, upto: int | None = None) -> np.ndarray:
    """Positions best first: by score, then by id; all of them, or (at least) the first `upto`.

    The first `upto` of a large pool are found without sorting it: every position scoring at
    least the `upto`-th best (ties at that score included, for the id to decide) is sorted
    alone, and the rest are left out: the same first `upto` as a full sort gives."""
    n = len(ids)
    if upto is None or upto >= n:
        order: np.ndarray = np.lexsort((np.array(ids), -score)) if n else np.zeros(0, np.intp)
        return order
    if upto <= 0:
        return np.zeros(0, np.intp)
    neg = -score
    near = np.flatnonzero(neg <= np.partition(neg, upto - 1)[upto - 1])
    near_order: np.ndarray = near[np.lexsort((np.array([ids[i] for i in near.tolist()]), neg[near]))]
    return near_order


def _span(rows: Sequence[Candidate], now: datetime) -> np.ndarray:
    """`span_positions` of the candidates' times (observed, else created), as an array: times
    after `now` count as `now` (the same as taking the earlier datetime, as time only grows)."""
    secs = np.minimum(np.fromiter(map(_at, rows), float, len(rows)), now.timestamp())
    lo, hi = secs.min(), secs.max()
    if hi - lo <= 0:
        return np.zeros(len(rows))
    pos: np.ndarray = (secs - lo) / (hi - lo)
    return pos


_first = itemgetter(0)
_second = itemgetter(1)
_name = attrgetter("name")
_text = attrgetter("text")
_at = attrgetter("at")
_unit = attrgetter("unit")
_importance = attrgetter("importance")


def _naming(first_name: str) -> Callable[[Sequence[str]], list[bool]]:
    """`_names(first_name, text)` of many texts: for a name of ASCII word characters, is it
    one of an ASCII text's words (see `_runs`); the regex otherwise."""
    if not (first_name.isascii() and re.fullmatch(r"\w+", first_name)):
        return lambda texts: [_names(first_name, text) for text in texts]
    word = first_name.lower().encode()

    def names(texts: Sequence[str]) -> list[bool]:
        out = list(map(list.__contains__, _runs(texts), repeat(word)))
        for i in non_ascii(texts):
            out[i] = _names(first_name, texts[i])
        return out
    return names


@lru_cache(maxsize=100_000)
def _names(first_name: str, text: str) -> bool:
    """Does the text name `first_name` as a whole word? (Cached like `mentions_time`: a fact
    without a speaker comes back search after search, and so do the names asked about.)"""
    return bool(re.search(rf"\b{re.escape(first_name)}\b", text, re.IGNORECASE))


def forget_texts() -> None:
    """Drop the texts the ranking caches above hold (they are keyed by candidates' texts): an
    erased memory's text must not outlive its erasure in the process's memory."""
    for cached in (mentions_time, topic_words, announces_change, quantities, names, _names, _word_set):
        cached.cache_clear()

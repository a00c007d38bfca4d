"""Retrieval as data: a frozen `RetrievalConfig` (with named presets) and pure ranking functions.

The read path: candidates from the store (dense over the text, window and fact keys, lexical BM25) -> `fuse`
(score-normalised, weighted) -> `rank` (speaker, time-question, recency within the scope's own time
span, importance, session adjustments, then topic-level newest-wins for questions about the
present) -> hits. Each stage's contribution is kept in `Hit.explain` under its own name.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Literal, TypeVar

import numpy as np

from ..errors import InvalidInput
from ..store.base import Candidate
from .text import terms


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
    when_boost: float = 0.0        # for "when ..." questions, memories that mention a time
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

    def __post_init__(self) -> None:
        if self.fusion not in ("weighted", "rrf"):
            raise InvalidInput(f"unknown fusion {self.fusion!r}")
        if self.candidates < 1:
            raise InvalidInput("candidates must be positive")
        if self.newer_page < 0:
            raise InvalidInput("newer_page must be 0 (off) or positive")
        if not 0 <= self.graph_depth <= 2:
            raise InvalidInput("graph_depth must be 0, 1 or 2")


PRESETS: dict[str, RetrievalConfig] = {
    p.name: p
    for p in (
        # The default, tuned on the LoCoMo dev split (see bench/locomo.py and README).
        RetrievalConfig("hybrid", candidates=1000, window_weight=0.3, fact_weight=0.3,
                        speaker_boost=0.2, when_boost=0.15,
                        session_weight=0.3, recency_weight=0.01, importance_weight=0.01,
                        newer_page=10),
        # The same signals over a tenth of the candidate pool: faster, a little less recall.
        RetrievalConfig("fast", candidates=100, window_weight=0.3, fact_weight=0.3, speaker_boost=0.2,
                        when_boost=0.15, session_weight=0.3, recency_weight=0.01,
                        importance_weight=0.01, newer_page=10),
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
    lo = float(values.min()) if floor is None else floor
    hi = float(values.max())
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
    they found (the ids of one retriever are distinct), as arrays."""
    index: dict[str, int] = {}
    where: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for label, hits in ranked.items():
        w = weights.get(label, 0.0)
        if not w or not hits:
            continue
        pos = np.fromiter((index.setdefault(mid, len(index)) for mid, _ in hits), np.intp, len(hits))
        if cfg.fusion == "rrf":
            norm = 1.0 / (cfg.rrf_k + np.arange(len(hits)) + 1.0)
        else:
            scores = np.fromiter((s for _, s in hits), float, len(hits))
            norm = (_stretch(scores, floor=0.0) if label == "lexical"
                    else _stretch(scores, min_range=cfg.min_cosine_range))
        where[label] = (pos, w * norm)
    n = len(index)
    parts: dict[str, np.ndarray] = {}
    found: dict[str, np.ndarray] = {}
    total = np.zeros(n)
    for label, (pos, values) in where.items():
        parts[label] = np.zeros(n)
        parts[label][pos] = values
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


def asks_when(query: str) -> bool:
    """Does the question ask for a time ("When did...", "How long...", "What year...")?"""
    return bool(_WHEN_QUESTION.search(query))


@lru_cache(maxsize=100_000)
def mentions_time(text: str) -> bool:
    """Does the text name a time? (Cached: a scope's candidates come back search after search.)"""
    return bool(_TIME_WORDS.search(text))


def named_speakers(query: str, names: set[str]) -> set[str]:
    """The speakers a query names, matched by first name as a whole word."""
    return {n for n in names
            if n.split() and re.search(rf"\b{re.escape(n.split()[0])}\b", query, re.IGNORECASE)}


_PAST_QUESTION = re.compile(
    r"\b(did|didn't|was|wasn't|were|weren't|had|used to|before|previous(ly)?|original(ly)?|"
    r"former(ly)?|at first|initially|first|earlier|ago|back then|last (year|month|week|time|"
    r"summer|winter|spring|autumn|fall)|in (19|20)\d\d)\b", re.IGNORECASE)
_CHANGE_WORDS = re.compile(
    # "now" as opposed to before; not "right now", "for now", "just now" (at this moment)
    r"\b((?<!right )(?<!for )(?<!just )(?<!until )(?<!by )now(?! and then)|nowadays|these days|"
    r"anymore|no longer|instead|actually|correction|corrected|"
    r"changed?|switched|moved|cancel+ed|postponed|rescheduled|delayed|quit|stopped|gave up|"
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


def announces_change(text: str) -> bool:
    """Does the text say that something changed ("now", "instead", "actually", "moved",
    "cancelled", "no longer", ...)? Such a statement revises what came before it."""
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


def newest_wins(score: Mapping[str, float], recs: Mapping[str, Candidate], page: int,
                about: Collection[str] | None = None,
                asked: frozenset[str] = frozenset()) -> dict[str, float]:
    """Topic-level newest-wins: how much each candidate on the first `page` results is lifted
    to rank just above the older ones it revises (ids of unlifted candidates are left out).

    A newer candidate revises an older one on the page when both come from the same speaker
    (or neither has one) and either they share a word that no other candidate uses (the topic:
    "Spanish" in "learning Spanish" and "I dropped Spanish") or the newer, said by a person,
    says that something changed ("we moved to Leeds", "instead", "no longer"). Near-equal
    means "both on the first page": a score margin would mean one thing among ten memories and
    another among a thousand, while the page is where a reader looks either way, and a
    candidate from deeper in the pool is never brought onto it. Candidates are visited oldest
    first, so of several revisions the newest comes first; the older keep their scores and stay
    findable just below. The word "no other candidate uses" is counted over the whole pool.
    Only candidates in `about` (default: all) may be lifted: in a scope of a few memories the
    page holds everything, and a revision must itself be about the question. Words of the
    question's subject (`asked`: the names it mentions) never link two statements: the candidates
    were retrieved because they share them, so "Ana" links "Ana is allergic to peanuts" to
    "Ana moved to Lisbon" only by construction when the question is "Where does Ana live?".
    """
    top = sorted(score, key=lambda m: (-score[m], m))[:page]
    when = {m: recs[m].observed_at or recs[m].created_at for m in top}
    words = {m: topic_words(recs[m].text) - asked for m in top}
    # how many candidates use each word that two statements of one speaker share: a word
    # much of the pool uses ("great", a name) is no topic
    shared = {w for a in top for b in top if when[a] < when[b] and recs[a].name == recs[b].name
              for w in words[a] & words[b]}
    df = dict.fromkeys(shared, 0)
    if shared:
        for rec in recs.values():
            for w in shared.intersection(topic_words(rec.text)):
                df[w] += 1
    lifted = {m: score[m] for m in top}
    for b in sorted(top, key=lambda m: (when[m], m)):
        if about is not None and b not in about:
            continue
        # "the same person says something changed" needs a person: a fact (no speaker) is
        # revised only by a fact sharing its topic word
        changed = recs[b].name is not None and announces_change(recs[b].text)
        older = [a for a in top if when[a] < when[b] and recs[a].name == recs[b].name
                 and lifted[a] >= lifted[b]
                 and (changed or any(df[w] <= 2 for w in words[a] & words[b]))]
        if older:
            lifted[b] = max(lifted[a] for a in older) + 1e-3
    return {m: lifted[m] - score[m] for m in top if lifted[m] > score[m]}


Ranked = tuple[str, float, dict[str, float]]  # memory id, score, explanation


def rank(fused: Mapping[str, dict[str, float]], candidates: Mapping[str, Candidate], query: str,
         cfg: RetrievalConfig, now: datetime) -> list[Ranked]:
    """Final scores: fused score plus the adjustments the preset turns on, best first."""
    return rank_arrays(Fused.of(fused), candidates, query, cfg, now)


def rank_arrays(fused: Fused, candidates: Mapping[str, Candidate], query: str,
                cfg: RetrievalConfig, now: datetime, limit: int | None = None) -> list[Ranked]:
    """`rank` over the arrays of `fuse_arrays`: the best `limit` (default all), explained.

    Every adjustment is an array added to the score in a fixed order (speaker, when, recency,
    importance, session, newer), 0 where it does not apply: the same sums, in the same order,
    as adding each to each candidate's score.
    """
    keep = [i for i, mid in enumerate(fused.ids) if mid in candidates]
    ids = [fused.ids[i] for i in keep]
    recs = {mid: candidates[mid] for mid in ids}
    rows = list(recs.values())
    n = len(rows)
    whole = len(keep) == len(fused.ids)
    sel = slice(None) if whole else np.array(keep, dtype=np.intp)
    score = fused.total[sel].copy()
    added: dict[str, tuple[np.ndarray, bool]] = {}  # label -> (values, shown where 0 too)

    def add(label: str, values: np.ndarray, shown: bool = False) -> None:
        nonlocal score
        added[label] = (values, shown)
        score = score + values

    # A question naming exactly one speaker is about what that speaker said (or, for a fact
    # with no speaker, about what the fact says of them).
    named = named_speakers(query, {r.name for r in rows if r.name})
    first = next(iter(named)).split()[0] if len(named) == 1 else None
    when = asks_when(query)
    # A question about the past gets no preference for what is newer.
    present = not asks_past(query)
    if cfg.speaker_boost and first:
        add("speaker", cfg.speaker_boost * np.fromiter(
            (r.name in named or (r.name is None and _names(first, r.text)) for r in rows),
            bool, n))
    if cfg.when_boost and when:
        add("when", cfg.when_boost * np.fromiter((mentions_time(r.text) for r in rows), bool, n))
    if cfg.recency_weight and present and n:
        # shown at 0 too: the oldest candidate is 0 by definition, not by omission
        add("recency", cfg.recency_weight * _span(rows, now), shown=True)
    if cfg.importance_weight:
        add("importance", cfg.importance_weight * np.fromiter(
            (r.importance for r in rows), float, n))

    # Session-level evidence: a turn in the session that best matches the query gains.
    # A memory outside any session (a fact) is a session of its own.
    if cfg.session_weight and n:
        units: dict[object, int] = {}
        unit = np.fromiter((units.setdefault(
            (s.user_id, s.agent_id, s.session_id) if (s := r.scope).session_id is not None
            else r.id, len(units)) for r in rows), np.intp, n)
        best = np.zeros(len(units))
        np.maximum.at(best, unit, score)
        add("session", cfg.session_weight * _stretch(best, min_range=cfg.min_session_range)[unit])

    order = _order(ids, score)
    if cfg.newer_page and present and n:
        top = [ids[i] for i in order[:cfg.newer_page]]
        on_page = dict(zip(top, score[order[:cfg.newer_page]].tolist(), strict=True))
        # about the question: not the farthest in meaning (dense 0 is the pool's least similar,
        # or `min_cosine_range` of cosine or more below the best)
        about = None
        if cfg.dense_weight:
            dense = fused.parts.get("dense")
            close = dense[sel][order[:cfg.newer_page]] > 0.0 if dense is not None else [False] * len(top)
            about = {m for m, c in zip(top, close, strict=True) if c}
        # the names the question is about ("Ana" in "Where does Ana live?") are shared by every
        # statement about her: they are the subject, never the topic that links a revision
        subject = topic_words(" ".join(re.findall(r"(?<!^)(?<![.?!] )\b[A-Z][\w'-]*", query.strip())))
        lifts = newest_wins(on_page, recs, cfg.newer_page, about, subject)
        if lifts:
            at = {mid: i for i, mid in enumerate(ids)}
            lift = np.zeros(n)
            for mid, v in lifts.items():
                lift[at[mid]] = v
            add("newer", lift)
            order = _order(ids, score)

    out: list[Ranked] = []
    parts = [(label, values[sel].tolist(), fused.found[label][sel].tolist())
             for label, values in fused.parts.items()]
    total = fused.total[sel].tolist()
    extra = [(label, values.tolist(), shown) for label, (values, shown) in added.items()]
    final = score.tolist()
    for i in (order if limit is None else order[:limit]).tolist():
        explain = {label: v[i] for label, v, f in parts if f[i]}
        explain["fused"] = total[i]
        for label, v, shown in extra:
            if v[i] or shown:
                explain[label] = v[i]
        explain["score"] = final[i]
        out.append((ids[i], final[i], explain))
    return out


def _order(ids: Sequence[str], score: np.ndarray) -> np.ndarray:
    """Positions best first: by score, then by id."""
    if not len(ids):
        return np.zeros(0, np.intp)
    order: np.ndarray = np.lexsort((np.array(ids), -score))
    return order


def _span(rows: Sequence[Candidate], now: datetime) -> np.ndarray:
    """`span_positions` of the candidates' times (observed, else created), as an array."""
    secs = np.fromiter((min(r.observed_at or r.created_at, now).timestamp() for r in rows),
                       float, len(rows))
    lo, hi = secs.min(), secs.max()
    if hi - lo <= 0:
        return np.zeros(len(rows))
    pos: np.ndarray = (secs - lo) / (hi - lo)
    return pos


def _names(first_name: str, text: str) -> bool:
    return bool(re.search(rf"\b{re.escape(first_name)}\b", text, re.IGNORECASE))

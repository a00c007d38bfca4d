"""The ranking as it was before it was made fast (issue 13): a frozen copy of `fuse_arrays`,
`newest_wins` and `rank_arrays` over `Candidate` objects, one row at a time. The reference that
tests/test_ranking_fast.py holds the fast path to: the same hits, scores and explanations.
Since issue 31 it also scales the window key by a turn's need of context (`context_chars`) and
asks a revision to be about the same thing by meaning when the statements' vectors are given
(`same_thing`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime

import numpy as np

from engram.pipeline.retrieve import (
    Fused,
    RetrievalConfig,
    _stretch,
    asks_when,
    mentions_time,
    named_speakers,
    own_words,
)
from engram.pipeline.revisions import (
    Same,
    announces_change,
    asks_past,
    asks_span,
    gives_new_value,
    quantities,
    same_thing,
    topic_words,
)
from engram.store.base import Candidate


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



def newest_wins(score: Mapping[str, float], recs: Mapping[str, Candidate], page: int,
                about: Collection[str] | None = None,
                asked: frozenset[str] = frozenset(),
                same: Same | None = None,
                question: frozenset[str] = frozenset(),
                below: Mapping[str, float] | None = None) -> dict[str, float]:
    """Topic-level newest-wins: how much each candidate on the first `page` results is lifted
    to rank just above the older ones it revises (ids of unlifted candidates are left out).

    A newer candidate revises an older one on the page when both come from the same speaker
    (the same name and role) and either they share a word that no other candidate uses (the
    topic: "Spanish" in "learning Spanish" and "I dropped Spanish"), or the newer says that
    something changed ("we moved to Leeds", "instead", "no longer"), or it gives a new value
    of what the question asks about (not an assistant's). Near-equal means "both on the first
    page"; a candidate of the next page (`below`) is brought onto it only when it gives a new
    value, or says that something changed and shares a topic word. Candidates are visited
    oldest first, so of several revisions the newest comes first; the older keep their scores
    and stay findable just below. The word "no other candidate uses" is counted over the
    whole pool. Only candidates in `about` (default: all) may be lifted. Words of the
    question's subject (`asked`: the names it mentions) never link two statements. Newer is
    later in time, or at the same time told later (then only a change or a new value
    revises). `same` is told whether the two answer the question (`question`: its topic
    words) alike, whether the newer brings a change, and the speaker's other statements on
    the page.
    """
    top = sorted(score, key=lambda m: (-score[m], m))[:page]
    said = {m: recs[m].name is not None or recs[m].role is not None for m in recs}
    under = [m for m in sorted(below or {}, key=lambda m: (-(below or {})[m], m))
             if m not in score and (about is None or m in about) and said[m]
             and (announces_change(recs[m].text)
                  or any(unit in question for unit, _ in quantities(recs[m].text)))]
    seen = top + under
    when = {m: (recs[m].observed_at or recs[m].created_at, recs[m].created_at, m) for m in seen}
    speaker = {m: (recs[m].name, recs[m].role) for m in seen}
    words = {m: topic_words(recs[m].text) - asked for m in seen}
    # how many candidates use each word that two statements of one speaker share: a word
    # much of the pool uses ("great", a name) is no topic
    shared = {w for a in top for b in seen if when[a] < when[b] and speaker[a] == speaker[b]
              for w in words[a] & words[b]}
    df = dict.fromkeys(shared, 0)
    held: set[str] = set()
    if shared:
        asking = dict.fromkeys(question - asked, 0)
        for rec in recs.values():
            have = topic_words(rec.text)
            for w in shared.intersection(have):
                df[w] += 1
            for w in asking.keys() & have:
                asking[w] += 1
        held = {w for w, k in asking.items() if k <= 2}
    answers = {m: words[m] & held for m in seen}
    base = {**(below or {}), **score}
    lifted = {m: base[m] for m in seen}
    for b in sorted(seen, key=lambda m: when[m]):
        if about is not None and b not in about:
            continue
        changed = said[b] and announces_change(recs[b].text)
        older = []
        for a in top:
            if not (when[a] < when[b] and speaker[a] == speaker[b] and lifted[a] >= lifted[b]):
                continue
            topic = {w for w in words[a] & words[b] if df[w] <= 2}
            value = (said[b] and recs[b].role != "assistant"
                     and gives_new_value(recs[a].text, recs[b].text, question))
            if b in score:
                if not (changed or value or (topic and when[a][0] != when[b][0])):
                    continue
            elif not (value or (changed and topic)):
                continue
            peers = [m for m in top if m not in (a, b) and speaker[m] == speaker[a]]
            if same is None or same(a, b, bool(topic & held) and answers[a] == answers[b],
                                    changed or value, peers):
                older.append(a)
        if older:
            lifted[b] = max(lifted[a] for a in older) + 1e-3
    return {m: lifted[m] - base[m] for m in seen if lifted[m] > base[m]}


Ranked = tuple[str, float, dict[str, float]]  # memory id, score, explanation


def rank_arrays(fused: Fused, candidates: Mapping[str, Candidate], query: str,
                cfg: RetrievalConfig, now: datetime, limit: int | None = None,
                vectors: Callable[[list[str]], Mapping[str, np.ndarray]] | None = None,
                query_vector: np.ndarray | None = None) -> list[Ranked]:
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
    if cfg.context_chars and "window" in fused.parts:
        # the window's share of each kept row: 1 - its length / context_chars, at least 0
        window = fused.parts["window"].copy()
        total = fused.total.copy()
        for i, r in zip(keep, rows, strict=True):
            scaled = window[i] * max(0.0, 1.0 - len(r.text) / cfg.context_chars)
            total[i] = total[i] - window[i] + scaled
            window[i] = scaled
        fused = Fused(fused.ids, {**fused.parts, "window": window}, fused.found, total)
    if cfg.previous_chars and "lexical" in fused.parts:
        fused = own_words(fused, rows, sel, query, cfg)  # not a fast path: the same code
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
    if cfg.newer_page and present and n and not asks_span(query):
        top = [ids[i] for i in order[:cfg.newer_page]]
        on_page = dict(zip(top, score[order[:cfg.newer_page]].tolist(), strict=True))
        nxt = order[cfg.newer_page:2 * cfg.newer_page]
        below = dict(zip([ids[i] for i in nxt], score[nxt].tolist(), strict=True))
        # about the question: not the farthest in meaning (dense 0 is the pool's least similar,
        # or `min_cosine_range` of cosine or more below the best)
        about = None
        if cfg.dense_weight:
            dense = fused.parts.get("dense")
            near = order[:2 * cfg.newer_page]
            close = dense[sel][near] > 0.0 if dense is not None else [False] * len(near)
            about = {ids[i] for i, c in zip(near.tolist(), close, strict=True) if c}
        # the names the question is about ("Ana" in "Where does Ana live?") are shared by every
        # statement about her: they are the subject, never the topic that links a revision
        subject = topic_words(" ".join(re.findall(r"(?<!^)(?<![.?!] )\b[A-Z][\w'-]*", query.strip())))
        same = (None if vectors is None or query_vector is None
                else same_thing(vectors(top + list(below)), query_vector))
        lifts = newest_wins(on_page, recs, cfg.newer_page, about, subject, same, topic_words(query),
                            below)
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

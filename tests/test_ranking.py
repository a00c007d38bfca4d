"""Ranking signals as pure functions (no database), and "current beats stale" end to end.

The pure tests build `Candidate`s and fused scores by hand; the end-to-end tests store short
conversations through `Memory.add` (real MiniLM, real SQLite) and ask about them.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from engram import Memory
from engram.errors import InvalidInput
from engram.model import Scope
from engram.pipeline.retrieve import (
    RetrievalConfig,
    fuse,
    get_preset,
    rank,
    span_positions,
)
from engram.pipeline.revisions import announces_change, asks_past, newest_wins, topic_words
from engram.store.base import Candidate

NOW = datetime(2026, 1, 15, tzinfo=UTC)  # read long after the conversation took place
FEB, MAR, MAY = (datetime(2024, m, 3, 9, 0, tzinfo=UTC) for m in (2, 3, 5))
HYBRID = get_preset("hybrid")


def cand(mid: str, text: str, at: datetime, name: str | None = "Tom",
         session: str | None = "s1") -> Candidate:
    return Candidate(mid, Scope("u", None, session), name, text, at, at, 0.5)


def fused_of(scores: dict[str, float]) -> dict[str, dict[str, float]]:
    return {mid: {"dense": s, "fused": s} for mid, s in scores.items()}


def order(fused: dict[str, dict[str, float]], cands: list[Candidate], query: str,
          cfg: RetrievalConfig = HYBRID) -> list[str]:
    return [mid for mid, _, _ in rank(fused, {c.id: c for c in cands}, query, cfg, NOW)]


# -- normalisation ------------------------------------------------------------------------------

def test_a_small_cosine_gap_in_a_small_scope_stays_small() -> None:
    # issue 15: raw cosines 0.497 vs 0.293 in a two-memory scope became 1.615 vs 0.005
    fused = fuse({"dense": [("a", 0.497), ("b", 0.293)]}, {"dense": 0.5}, HYBRID)
    assert fused["a"]["dense"] == pytest.approx(0.5)
    assert fused["b"]["dense"] == pytest.approx(0.5 * (1 - 0.204 / HYBRID.min_cosine_range))
    # plain min-max would have given b nothing
    plain = fuse({"dense": [("a", 0.497), ("b", 0.293)]}, {"dense": 0.5},
                 replace(HYBRID, min_cosine_range=0.0))
    assert plain["b"]["dense"] == 0.0


def test_a_wide_spread_is_min_max_as_before() -> None:
    hits = [("a", 0.7), ("b", 0.4), ("c", -0.1)]
    fused = fuse({"dense": hits}, {"dense": 1.0}, HYBRID)
    assert [fused[m]["dense"] for m in "abc"] == pytest.approx([1.0, 0.625, 0.0])


def test_lexical_keeps_zero_as_its_floor() -> None:
    fused = fuse({"lexical": [("a", 4.0), ("b", 1.0)]}, {"lexical": 0.5}, HYBRID)
    assert fused["b"]["lexical"] == pytest.approx(0.125)


def test_two_sessions_of_near_equal_evidence_are_not_all_or_nothing() -> None:
    cands = [cand("a", "first", FEB, session="s1"), cand("b", "second", MAY, session="s2")]
    cfg = replace(HYBRID, recency_weight=0.0, newer_page=0)
    ranked = {mid: why for mid, _, why in
              rank(fused_of({"a": 1.0, "b": 0.9}), {c.id: c for c in cands}, "anything", cfg, NOW)}
    assert ranked["a"]["session"] == pytest.approx(0.3)
    assert ranked["b"]["session"] == pytest.approx(0.3 * (1 - 0.1 / cfg.min_session_range))


# -- recency within the scope's own time span ----------------------------------------------------

def test_span_positions_are_relative_to_the_candidates_not_the_clock() -> None:
    pos = span_positions({"a": FEB, "b": MAR, "c": MAY}, NOW)
    assert pos["a"] == 0.0 and pos["c"] == 1.0 and 0.0 < pos["b"] < 1.0
    assert span_positions({"a": FEB, "b": FEB}, NOW) == {"a": 0.0, "b": 0.0}
    # a time after `now` (clock skew) counts as now
    late = span_positions({"a": FEB, "b": NOW + timedelta(days=30), "c": NOW}, NOW)
    assert late["b"] == late["c"] == 1.0


def test_a_2024_conversation_read_in_2026_still_has_recency() -> None:
    # issue 15: `explain` showed recency 0.000 for every 2024 memory
    cands = [cand("old", "one", FEB), cand("new", "two", MAY)]
    ranked = {mid: why for mid, _, why in
              rank(fused_of({"old": 0.5, "new": 0.5}), {c.id: c for c in cands}, "what is it?",
                   HYBRID, NOW)}
    assert ranked["new"]["recency"] == pytest.approx(HYBRID.recency_weight)
    assert ranked["old"]["recency"] == 0.0  # shown: the oldest, not a missing signal


def test_questions_about_the_past_get_no_recency() -> None:
    cands = [cand("old", "one", FEB), cand("new", "two", MAY)]
    ranked = rank(fused_of({"old": 0.5, "new": 0.5}), {c.id: c for c in cands},
                  "What was it before?", HYBRID, NOW)
    assert all("recency" not in why for _, _, why in ranked)


# -- the words that decide ------------------------------------------------------------------------

@pytest.mark.parametrize("query", [
    "Where did Tom live before he moved?", "What was the original date?",
    "Which language was Tom learning first?", "What car did Sam use to drive?",
    "Who was his manager previously?", "Where did she work in 2023?",
    "What did Ana plan last year?"])
def test_asks_past(query: str) -> None:
    assert asks_past(query)


@pytest.mark.parametrize("query", [
    "Where does Tom live?", "When is Ana's trip to Japan?", "What is Priya's job?",
    "Is Jin going to the concert?", "How much rent does Mia pay?"])
def test_asks_about_the_present(query: str) -> None:
    assert not asks_past(query)


@pytest.mark.parametrize(("text", "changed"), [
    ("We moved to Leeds last month.", True),
    ("I changed my mind: October instead.", True),
    ("I live in Leeds now.", True),
    ("Actually it's the 16th, not the 14th.", True),
    ("The concert is off, they called it off.", True),
    ("We pushed the wedding back to September.", True),
    ("I no longer eat meat.", True),
    ("Right now I'm planning a trip to Japan.", False),
    ("That's fine for now.", False),
    ("I live in Manchester.", False),
    ("Any more paintings coming up?", False),
])
def test_announces_change(text: str, changed: bool) -> None:
    assert announces_change(text) is changed


def test_topic_words_are_lightly_stemmed() -> None:
    assert topic_words("Tom lives here") & topic_words("I live in Leeds") == {"liv"}
    assert "hotel" in topic_words("Switched hotels")
    assert "sister" in topic_words("My sister's birthday")
    assert not topic_words("I am in the")


# -- topic-level newest-wins ----------------------------------------------------------------------

SPANISH = [cand("old", "I've started learning Spanish on Duolingo.", FEB),
           cand("new", "I dropped Spanish, I'm taking Italian classes.", MAY),
           cand("hi", "Hi, I'm Tom.", FEB)]


def test_the_newer_statement_on_the_same_topic_ranks_first() -> None:
    fused = fused_of({"old": 1.2, "new": 0.7, "hi": 0.9})
    ranked = rank(fused, {c.id: c for c in SPANISH}, "Which language is Tom learning?", HYBRID, NOW)
    assert [m for m, _, _ in ranked][:2] == ["new", "old"]
    why = dict((m, w) for m, _, w in ranked)
    assert why["new"]["newer"] > 0 and "newer" not in why["old"]
    # the older one keeps its own score: it is right below, not buried
    assert why["old"]["score"] == pytest.approx(max(w["score"] for m, w in why.items() if m != "new"))


def test_a_question_about_the_past_keeps_the_older_first() -> None:
    fused = fused_of({"old": 1.2, "new": 0.7, "hi": 0.9})
    assert order(fused, SPANISH, "Which language was Tom learning first?")[0] == "old"


def test_newest_wins_can_be_turned_off() -> None:
    fused = fused_of({"old": 1.2, "new": 0.7, "hi": 0.9})
    assert order(fused, SPANISH, "Which language is Tom learning?",
                 replace(HYBRID, newer_page=0))[0] == "old"


def test_another_speaker_does_not_revise_what_tom_said() -> None:
    cands = [SPANISH[0], replace(SPANISH[1], name="Ana")]
    assert newest_wins({"old": 1.2, "new": 0.7}, {c.id: c for c in cands}, 10) == {}


def test_a_word_many_candidates_use_is_no_topic() -> None:
    cands = [cand("old", "Great day at the park with the kids.", FEB),
             cand("new", "Great news about the concert tickets.", MAY),
             *(cand(f"x{i}", f"Great idea number {i}.", MAR) for i in range(3))]
    assert newest_wins({"old": 1.2, "new": 0.7, **{f"x{i}": 0.1 for i in range(3)}},
                       {c.id: c for c in cands}, 10) == {}


def test_a_change_needs_no_shared_word() -> None:
    cands = [cand("old", "I live in Manchester, near Piccadilly.", FEB),
             cand("new", "Big news: we moved to Leeds last month.", MAY)]
    lift = newest_wins({"old": 1.5, "new": 0.6}, {c.id: c for c in cands}, 10)
    assert lift["new"] == pytest.approx(0.9, abs=0.01)


def test_a_candidate_below_the_page_is_never_brought_onto_it() -> None:
    cands = [SPANISH[0], SPANISH[1], *(cand(f"x{i}", f"filler {i}", MAR) for i in range(3))]
    scores = {"old": 1.2, "new": 0.1, **{f"x{i}": 1.0 - i / 10 for i in range(3)}}
    assert newest_wins(scores, {c.id: c for c in cands}, 3) == {}
    assert "new" in newest_wins(scores, {c.id: c for c in cands}, 5)


def test_of_several_revisions_the_newest_comes_first() -> None:
    cands = [cand("a", "My dentist appointment is on 5 May.", FEB),
             cand("b", "The dentist moved it to 12 May.", MAR),
             cand("c", "Rescheduled again: the dentist is on 20 May.", MAY)]
    fused = fused_of({"a": 1.3, "b": 0.8, "c": 0.5})
    assert order(fused, cands, "When is the dentist appointment?") == ["c", "b", "a"]


def test_at_equal_times_only_a_change_told_later_revises() -> None:
    # one sitting: the later turn mostly goes on about the earlier one, unless it says that
    # something changed ("now"); told later is `created_at`, then the id
    cands = [cand("a", "I play violin in a quartet.", FEB), cand("b", "The violin is lovely.", FEB)]
    assert newest_wins({"a": 1.0, "b": 0.5}, {c.id: c for c in cands}, 10) == {}
    cands = [cand("a", "I play violin.", FEB), cand("b", "I now play violin and cello.", FEB)]
    assert set(newest_wins({"a": 1.0, "b": 0.5}, {c.id: c for c in cands}, 10)) == {"b"}
    assert newest_wins({"b": 1.0, "a": 0.5}, {c.id: c for c in cands}, 10) == {}


def test_newer_page_must_not_be_negative() -> None:
    with pytest.raises(InvalidInput):
        RetrievalConfig("x", newer_page=-1)


# -- end to end: real embedder, real SQLite -------------------------------------------------------

def _say(mem: Memory, user: str, session: str, at: datetime, turns: list[tuple[str, str]]) -> None:
    mem.add([{"role": "user" if who != "assistant" else "assistant", "content": text,
              "observed_at": at + timedelta(minutes=i), **({"name": who} if who != "assistant" else {})}
             for i, (who, text) in enumerate(turns)],
            user_id=user, session_id=session, infer=False)


def _texts(mem: Memory, query: str, user: str, **kw: object) -> list[str]:
    return [h.memory.text for h in mem.search(query, user_id=user, limit=5, **kw)]  # type: ignore[arg-type]


def test_tom_moved_from_manchester_to_leeds(mem: Memory) -> None:
    manchester = "I live in Manchester, in a flat near Piccadilly station."
    leeds = "Big news: we moved to Leeds last month, the new house is lovely."
    _say(mem, "tom", "s1", FEB, [("Tom", "Hi, I'm Tom."), ("assistant", "Nice to meet you Tom."),
                                 ("Tom", manchester), ("assistant", "Got it, thanks for telling me.")])
    _say(mem, "tom", "s2", MAY, [("Tom", "Hello again!"), ("assistant", "Welcome back, Tom."),
                                 ("Tom", leeds), ("assistant", "Thanks for letting me know.")])
    hits = mem.search("Where does Tom live?", user_id="tom", limit=5)
    assert hits[0].memory.text == leeds
    assert hits[0].explain["newer"] > 0 and hits[0].explain["recency"] > 0
    assert manchester in [h.memory.text for h in hits[:3]]
    # before the move, and when asked about the past, Manchester is first
    assert _texts(mem, "Where does Tom live?", "tom", as_of=MAR)[0] == manchester
    assert _texts(mem, "Where did Tom live before he moved?", "tom")[0] == manchester


def test_ana_moved_her_trip_to_japan_to_october(mem: Memory) -> None:
    may = "I'm planning a trip to Japan: Tokyo and Kyoto, from May 10 to May 24."
    october = ("I changed my mind: I'm moving the Japan trip to autumn, October 3 to October 17, "
               "and I cancelled the May flights.")
    _say(mem, "ana", "s1", FEB, [("Ana", may), ("assistant", "Sounds wonderful!")])
    _say(mem, "ana", "s2", MAR, [("Ana", "Miso the cat has been sick, poor thing."),
                                 ("assistant", "I'm sorry to hear that.")])
    _say(mem, "ana", "s3", MAY, [("Ana", october), ("assistant", "Noted.")])
    assert _texts(mem, "When is Ana's trip to Japan?", "ana")[0] == october
    assert _texts(mem, "When is Ana's trip to Japan?", "ana", as_of=MAR)[0] == may
    assert _texts(mem, "What were Ana's original dates for Japan?", "ana")[0] == may


def test_a_fact_needs_a_shared_topic_word_to_revise_another() -> None:
    # facts (no speaker): "moved" alone does not make the Lisbon fact revise the job fact
    facts = [cand("job", "Ana works as an engineer at Clinica+.", FEB, name=None, session=None),
             cand("home", "Ana lives in Lisbon; she moved there from Porto.", MAY, name=None,
                  session=None),
             *(cand(f"f{i}", f"Ana likes hobby number {i}.", MAR, name=None, session=None)
               for i in range(3))]
    scores = {"job": 1.0, "home": 0.8, "f0": 0.3, "f1": 0.2, "f2": 0.1}
    assert newest_wins(scores, {c.id: c for c in facts}, 10) == {}
    facts.append(cand("job2", "Ana is a manager at Clinica+ now.", MAY, name=None, session=None))
    assert set(newest_wins({**scores, "job2": 0.7}, {c.id: c for c in facts}, 10)) == {"job2"}


def test_in_a_tiny_scope_an_unrelated_newer_memory_stays_below() -> None:
    # two memories: the page holds both, and "B" is a word only they share; chess is not about
    # coffee (its cosine is the pool's lowest), so it is no revision of the coffee memory
    cands = [cand("coffee", "B likes coffee", FEB, name=None, session=None),
             cand("chess", "B plays chess", MAY, name=None, session=None)]
    fused = {"coffee": {"dense": 0.5, "lexical": 0.5, "fused": 1.0},
             "chess": {"dense": 0.0, "lexical": 0.25, "fused": 0.25}}
    assert order(fused, cands, "coffee") == ["coffee", "chess"]
    assert newest_wins({"coffee": 1.0, "chess": 0.25}, {c.id: c for c in cands}, 10) == \
        {"chess": pytest.approx(0.751)}  # what it would do without the guard


def test_the_name_a_question_asks_about_links_no_revision() -> None:
    # a tiny scope: every fact about Ana shares "Ana", the subject of the question, which is why
    # both were found; it is not the topic of a change (the MCP face's first recall hit this)
    cands = [cand("home", "Ana moved to Lisbon in May 2024", FEB, name=None, session=None),
             cand("food", "Ana is allergic to peanuts", MAY, name=None, session=None),
             cand("pizza", "I ordered a pizza", MAY, name=None, session=None)]
    scores = {"home": 1.25, "food": 1.24, "pizza": 0.0}
    recs = {c.id: c for c in cands}
    assert newest_wins(scores, recs, 10) == {"food": pytest.approx(0.011)}  # without the rule
    assert newest_wins(scores, recs, 10, asked=topic_words("Ana")) == {}
    fused = {"home": {"dense": 0.5, "window": 0.3, "lexical": 0.443, "fused": 1.243},  # as measured
             "food": {"dense": 0.446, "window": 0.268, "lexical": 0.5, "fused": 1.214},
             "pizza": {"dense": 0.0, "fused": 0.0}}
    assert order(fused, cands, "Where does Ana live?")[0] == "home"

"""Newest-wins only where one statement revises another (issue 31), and the first hit of the
examples a new user runs: the demo's questions and the issue's own cases, with the real
embedder, through `Memory.search` and the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from engram import PRESETS, Memory
from engram.cli import app
from engram.pipeline.revisions import asks_past, gives_new_value, same_thing, topic_words
from engram.providers.embedders import MiniLM

JAN, MAR, MAY = (datetime(2025, m, 1, 9, tzinfo=UTC) for m in (1, 3, 5))


def first(mem: Memory, question: str, user: str) -> str:
    return mem.search(question, user_id=user, limit=3)[0].memory.text


def test_an_unrelated_newer_fact_never_takes_the_place_of_the_answer(mem: Memory) -> None:
    """The issue's case: the sister's name is newer than the allergy, and close enough in
    meaning for a page of two, but it revises nothing."""
    mem.add("The user is allergic to peanuts", user_id="u", kind="semantic", observed_at=JAN)
    mem.add("The user's sister is called Ines", user_id="u", kind="semantic", observed_at=MAR)
    assert first(mem, "what food is dangerous for the user?", "u") == "The user is allergic to peanuts"


def test_two_answers_to_one_question_do_not_revise_each_other(mem: Memory) -> None:
    """'called' links the two statements only through the question: the partner's name,
    newer, stays below the sister's."""
    mem.add([{"role": "user", "content": "My sister is called Ines."}], user_id="u",
            session_id="a", observed_at=JAN, infer=False)
    mem.add([{"role": "user", "content": "My partner is called Miguel."}], user_id="u",
            session_id="b", observed_at=MAR, infer=False)
    assert first(mem, "What's my sister called?", "u") == "My sister is called Ines."


def test_a_revision_said_as_a_change_comes_first(mem: Memory) -> None:
    """'I left the hospital ... now': a change word and a shared word, and the two statements
    are closer to each other than the newer is to the question."""
    old = "I work as a nurse at Santa Maria hospital."
    new = "I left the hospital, I'm a paramedic with the fire brigade now."
    mem.add([{"role": "user", "name": "Tom", "content": old}], user_id="u", session_id="a",
            observed_at=JAN, infer=False)
    mem.add([{"role": "user", "name": "Tom", "content": new}], user_id="u", session_id="b",
            observed_at=MAY, infer=False)
    hits = mem.search("What do I do for work?", user_id="u", limit=2)
    assert [h.memory.text for h in hits] == [new, old]
    assert hits[0].explain["newer"] > 0  # the lift shows


def test_the_demo_answers_each_question_first(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["--db", str(tmp_path / "demo.db"), "demo", "--json"])
    assert out.exit_code == 0, out.output
    top = {q["query"]: q["hits"][0]["memory"]["text"] for q in json.loads(out.stdout)["queries"]}
    # her message from Lisbon or the fact: either says where she lives now (not Porto)
    assert "Lisbon" in top["Where does Ana live?"]
    assert "machine learning engineer at Clínica+" in top["What is Ana's job?"]
    assert "Miso" in top["What is the name of Ana's dog?"]
    assert "October" in top["When is Ana's trip to Japan?"]
    assert "cilantro" in top["What food should I avoid suggesting to Ana?"]


def chat(mem: Memory, user: str, *turns: tuple[str, str, datetime], session: str = "s") -> None:
    mem.add([{"role": role, "content": text, "observed_at": at} for role, text, at in turns],
            user_id=user, session_id=session, infer=False)


def test_a_user_with_no_name_who_says_something_changed_revises_what_she_said(mem: Memory) -> None:
    """Her messages carry no name, only their role: the change ('moved') is hers all the same."""
    chat(mem, "u", ("user", "I live in Porto, near the river.", JAN),
         ("user", "My mom lives in Coimbra.", JAN), ("user", "I grew up in Braga.", MAR),
         ("user", "I moved to Lisbon last week.", MAY))
    hits = mem.search("Where do I live?", user_id="u", limit=4)
    assert hits[0].memory.text == "I moved to Lisbon last week."
    assert hits[0].explain["newer"] > 0


def test_an_assistant_reply_revises_nothing_the_user_said(mem: Memory) -> None:
    """The assistant's later words about the same thing, even with a change word, are no
    revision of the user's statement: only the same speaker in the same role revises."""
    chat(mem, "u", ("user", "I'm allergic to peanuts.", JAN),
         ("assistant", "Got it, from now on no peanuts in anything I suggest.", MAR))
    assert first(mem, "What food is dangerous for me?", "u") == "I'm allergic to peanuts."


def test_two_answers_in_the_question_own_words_are_one_answer_given_twice(mem: Memory) -> None:
    """'drive', the question's word, is what the two share and no one else says: they answer
    it alike, and each is the other's closest statement; the newer comes first although each
    is closer to the question than to the other."""
    for text, at in (("I drive an old Toyota Corolla.", JAN), ("I have a cat named Luna.", JAN),
                     ("I cycle to work every day.", MAR), ("I drive an electric Renault Zoe.", MAY)):
        chat(mem, "u", ("user", text, at), session=text)
    hits = mem.search("What car do I drive?", user_id="u", limit=4)
    assert hits[0].memory.text == "I drive an electric Renault Zoe."
    assert hits[1].memory.text == "I drive an old Toyota Corolla."


def test_a_value_changed_later_in_the_same_session_comes_first(mem: Memory) -> None:
    """One dated session, so one time for all its messages: the one told later says the value
    changed ('extended ... to 20 minutes'), and is the newer."""
    chat(mem, "u", ("user", "My daily vocal warm-ups are 15 minutes long.", MAR),
         ("assistant", "Good to know.", MAR), ("user", "I'm terrified of heights.", MAR),
         ("user", "I've extended my daily vocal warm-ups to 20 minutes.", MAR))
    hits = mem.search("How long are my daily vocal warm-ups?", user_id="u", limit=4)
    assert hits[0].memory.text == "I've extended my daily vocal warm-ups to 20 minutes."
    assert hits[0].explain["newer"] > 0


def test_a_question_about_a_span_between_events_lifts_no_newer_statement(mem: Memory) -> None:
    """'How many days between ...' is about each event as told at its time: a newer statement
    revises none of them, so none is lifted (asks_span)."""
    for text, at in (("My dentist appointment is on June 3.", JAN),
                     ("The dentist moved my appointment to June 10.", MAY)):
        mem.add([{"role": "user", "name": "Tom", "content": text}], user_id="u", session_id=text,
                observed_at=at, infer=False)
    hits = mem.search("When is my dentist appointment?", user_id="u", limit=2)
    assert hits[0].explain.get("newer", 0) > 0  # a question about now: the move comes first
    hits = mem.search("How many days are there between my dentist appointment and my birthday?",
                      user_id="u", limit=2)
    assert not any("newer" in h.explain for h in hits)


def test_a_count_told_again_later_in_the_same_session_comes_first(mem: Memory) -> None:
    """No change word: the later message of the sitting gives the sketches the question asks
    about a new number (`gives_new_value`), and is the newer."""
    chat(mem, "u", ("user", "I've completed 3 mechanical sketches by March 14, mostly gears.", MAR),
         ("assistant", "That's a great start.", MAR),
         ("user", "I'm terrified of heights.", MAR),
         ("user", "I've completed 5 mechanical sketches by March 15.", MAR))
    hits = mem.search("How many mechanical sketches have I completed?", user_id="u", limit=4)
    assert hits[0].memory.text == "I've completed 5 mechanical sketches by March 15."
    assert hits[0].explain["newer"] > 0


def test_another_persons_number_is_no_new_value(mem: Memory) -> None:
    """Sara's chili powder is no new value of Crystal's: each statement names someone the
    other does not, so the newer is not lifted over the older."""
    chat(mem, "u", ("user", "For Crystal, who likes mild food, I use less chili powder, by 50%.",
                    JAN), session="a")
    # the words the two share are common here: only the new value could propose a revision
    chat(mem, "u", ("user", "My pantry has chili powder and cumin, and I like food with heat.",
                    MAR), session="c")
    chat(mem, "u", ("user", "I use a cast iron pan.", MAR), session="d")
    chat(mem, "u", ("user", "For Sara, who likes spicy food, I use more chili powder, by 30%.",
                    MAY), session="b")
    hits = mem.search("How much chili powder do I use for Crystal?", user_id="u", limit=3)
    assert hits[0].memory.text.startswith("For Crystal")
    assert not any("newer" in h.explain for h in hits)


def test_a_state_resumed_again_revises_the_state_before(mem: Memory) -> None:
    """'I've started eating fish again' says that the diet changed, without a word shared
    with 'I'm vegetarian'; the two are closer to each other than to the question."""
    for text, at in (("I'm vegetarian.", JAN), ("Thai food is my favourite.", JAN),
                     ("I take my coffee black, no sugar.", MAR),
                     ("I've started eating fish again, so I'm pescatarian.", MAY)):
        chat(mem, "u", ("user", text, at), session=text)
    hits = mem.search("What diet do I follow?", user_id="u", limit=4)
    assert hits[0].memory.text == "I've started eating fish again, so I'm pescatarian."
    assert hits[0].explain["newer"] > 0


def test_meaning_alone_proposes_no_revision(mem: Memory) -> None:
    """'I'm vegetarian', newer, is closer to 'I'm allergic to peanuts' than either is to the
    question, and each is the other's closest: yet nothing says the allergy changed, and a
    revision by meaning alone would lift the diet above the allergy for what is dangerous
    to eat."""
    for text, at in (("I'm allergic to peanuts.", JAN), ("Thai food is my favourite.", MAR),
                     ("I'm vegetarian.", MAY)):
        chat(mem, "u", ("user", text, at), session=text)
    hits = mem.search("What food is dangerous for me?", user_id="u", limit=3)
    assert not any("newer" in h.explain for h in hits)


def test_a_question_about_the_latest_in_the_past_tense_is_about_now(mem: Memory) -> None:
    """'did' asks about the past, but 'most recent' asks for the latest: the newer score is
    a new value of what is asked, and comes first."""
    chat(mem, "u", ("user", "Scott scored 68% on his math test.", JAN), session="a")
    chat(mem, "u", ("user", "Scott scored 72% on his math test.", MAY), session="b")
    hits = mem.search("What score did Scott get on his most recent math test?", user_id="u",
                      limit=2)
    assert hits[0].memory.text == "Scott scored 72% on his math test."
    assert hits[0].explain["newer"] > 0


def test_a_question_gathering_several_statements_lifts_no_newer_one(mem: Memory) -> None:
    """'across our chats', 'have I ever': about each statement as told, none revised."""
    for text, at in (("My dentist appointment is on June 3.", JAN),
                     ("The dentist moved my appointment to June 10.", MAY)):
        mem.add([{"role": "user", "name": "Tom", "content": text}], user_id="u", session_id=text,
                observed_at=at, infer=False)
    for question in ("What dates have I given for my dentist appointment across our chats?",
                     "Have I ever had my dentist appointment moved?"):
        hits = mem.search(question, user_id="u", limit=2)
        assert not any("newer" in h.explain for h in hits), question


def test_an_echo_by_another_speaker_does_not_hide_a_revision() -> None:
    """Each the other's closest is asked among what their speaker said: an assistant restating
    the older value is closest to it by being its echo, and tells nothing of the two."""
    def unit(*v: float) -> np.ndarray:
        a = np.array(v)
        return a / np.linalg.norm(a)
    old, new, query = unit(1.0, 0.35, 0.0), unit(0.75, 1.0, 0.0), unit(1.0, 0.1, 0.0)
    echo, other = unit(1.0, 0.3, 0.05), unit(0.0, 0.2, 1.0)
    vectors = {"old": old, "new": new, "echo": echo, "other": other}
    ab, aq, bq = old @ new, old @ query, new @ query
    assert min(aq, bq) <= ab < max(aq, bq) and echo @ old > ab  # the mutual test decides
    same = same_thing(vectors, query)
    assert same("old", "new", False, True, ["other"])  # the user's own other statement
    assert not same("old", "new", False, True, ["other", "echo"])  # were the echo a peer


def test_a_revision_just_below_the_page_is_brought_onto_it(tmp_path: Path, embedder: MiniLM) -> None:
    """'I left the hospital ... now' is worded as the change, not as the question, and ranks
    below the first page (of two here); it says that something changed and shares 'hospital',
    a word no other memory uses, with the statement it revises: it comes first. A change that
    shares no topic stays where it was."""
    page = replace(PRESETS["hybrid"], newer_page=2)
    with Memory(tmp_path / "p.db", embedder=embedder, retrieval=page) as m:
        for text, at in (("I work as a nurse at Santa Maria hospital.", JAN),
                         ("I cycle to work every day.", JAN),
                         ("On weekends I go hiking in the mountains.", JAN),
                         ("I cancelled my gym membership and joined a climbing club.", MAY),
                         ("I left the hospital, I'm a paramedic with the fire brigade now.", MAY)):
            chat(m, "u", ("user", text, at), session=text)
        hits = m.search("What do I do for work?", user_id="u", limit=5)
        texts = [h.memory.text for h in hits]
        at = texts.index("I left the hospital, I'm a paramedic with the fire brigade now.")
        assert at < 2 and texts[at + 1] == "I work as a nurse at Santa Maria hospital."
        assert hits[at].explain["newer"] > 0
        assert "newer" not in hits[texts.index(
            "I cancelled my gym membership and joined a climbing club.")].explain
    # without newest-wins the revision is below the page of two
    with Memory(tmp_path / "p.db", embedder=embedder,
                retrieval=replace(page, newer_page=0)) as m:
        plain = [h.memory.text for h in m.search("What do I do for work?", user_id="u", limit=5)]
        assert plain.index("I left the hospital, I'm a paramedic with the fire brigade now.") >= 2


def test_a_new_value_is_a_number_of_what_the_question_asks_about() -> None:
    asked = topic_words("How many sketches have I completed?")
    assert gives_new_value("I've completed 3 sketches by March 14.",
                           "I've completed 5 sketches by March 15.", asked)
    # the same count again, a count of something else, a date: no new value
    assert not gives_new_value("I've completed 3 sketches.", "All 3 sketches are framed.", asked)
    assert not gives_new_value("I've completed 3 sketches.", "I bought 5 pencils for sketches.",
                               asked)
    assert not gives_new_value("I finished the sketches by March 14.",
                               "I framed the sketches by March 15.", asked)
    # a number the question states names the statement it asks about: another is no update
    asked = topic_words("child 1 remembers fact number 7")
    assert not gives_new_value("child 1 remembers fact number 7",
                               "child 0 remembers fact number 8", asked)


def test_the_latest_asked_in_the_past_tense_is_now_but_an_earlier_state_stays_past() -> None:
    assert not asks_past("What score did Scott get on his most recent math test?")
    assert not asks_past("How many sketches did I complete so far?")
    assert asks_past("What was my job before the current one?")
    assert asks_past("What did Scott score on his first test?")

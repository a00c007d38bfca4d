"""A noun's possessive in a question is asked as the noun ("my partner's name" is about "my
partner"); a name's possessive stays as written (the name as a word would match every turn its
owner speaks). See `retrieve.as_nouns`."""

from __future__ import annotations

from engram import Memory
from engram.pipeline.retrieve import as_nouns, lexical_terms


def test_a_nouns_possessive_is_asked_as_the_noun() -> None:
    assert lexical_terms("What's my partner's name?") == ["partner", "name"]
    assert lexical_terms("Where is the dog’s bowl?") == ["dog", "bowl"]
    assert lexical_terms("What is the name of the user's sister?") == ["name", "user", "sister"]


def test_a_names_possessive_stays_as_written() -> None:
    assert lexical_terms("When did Melanie's family go on a roadtrip?") == [
        "melanie's", "family", "go", "roadtrip"]
    assert as_nouns("Where is O'Neil's bike?") == "Where is O'Neil's bike?"


def test_contractions_that_are_stop_words_stay_out() -> None:
    assert lexical_terms("Let's plan the team's offsite, it's due") == ["plan", "team", "offsite", "due"]


def test_the_scope_users_possessive_is_left_out_like_her_name() -> None:
    assert lexical_terms("What is Ana's job?", "ana") == ["job"]
    assert lexical_terms("What is Ana's job?", "tom") == ["ana's", "job"]


def test_my_partners_name_finds_my_partner_not_a_pet_named_luna(mem: Memory) -> None:
    # Before, the question's words were the phrase `partner s` (held by no memory) and "name",
    # which stems like "named": the cat came first on that one word. One message a day.
    for day, text in enumerate(("I have a cat named Luna.", "My partner is called Miguel.",
                                "My sister is called Ines.",
                                "I work as a nurse at Santa Maria hospital.",
                                "I drive an old Toyota Corolla.")):
        mem.add([{"role": "user", "content": text}], user_id="tom", session_id=f"day-{day}")
    hits = mem.search("What's my partner's name?", user_id="tom", limit=3)
    assert hits[0].memory.text == "My partner is called Miguel."
    assert hits[0].explain["lexical"] > 0

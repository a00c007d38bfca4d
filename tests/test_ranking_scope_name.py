"""The scope's own user named in a question is not a lexical word within that scope: every memory
of user "ana" is about Ana, and her own messages say "I" where a third-person fact says "Ana"."""

from __future__ import annotations

from engram import Memory
from engram.pipeline.retrieve import lexical_terms


def test_the_scope_users_name_is_left_out_of_the_lexical_query() -> None:
    assert lexical_terms("Where does Ana live?", "ana") == ["live"]
    assert lexical_terms("Where does Ana live?", None) == ["ana", "live"]


def test_another_persons_name_stays() -> None:
    assert lexical_terms("Where does Tom live?", "ana") == ["tom", "live"]


def test_a_user_id_of_several_words_names_no_one() -> None:
    # "conv-26", "beam-chat-3": an identifier, not a name
    assert lexical_terms("What did conv say?", "conv-26") == ["conv", "say"]


def test_a_question_that_is_only_the_name_keeps_it() -> None:
    assert lexical_terms("Ana", "ana") == ["ana"]


def test_her_own_statement_outranks_a_fact_that_only_spells_her_name(gmem: Memory) -> None:
    # docs/service.md's example: before, "Ana is vegetarian" came first on the word "Ana"
    gmem.add([{"role": "user", "name": "Ana", "content": "I just moved to Lisbon."}],
             user_id="ana", session_id="s1")
    gmem.add("Ana is vegetarian", user_id="ana", kind="semantic", importance=0.8)
    hits = gmem.search("Where does Ana live?", user_id="ana", limit=2)
    assert [h.memory.text for h in hits] == ["I just moved to Lisbon.", "Ana is vegetarian"]
    assert "lexical" not in hits[0].explain and "lexical" not in hits[1].explain


def test_outside_a_users_scope_the_name_still_counts(gmem: Memory) -> None:
    gmem.add("Ana moved to Lisbon", agent_id="travel")
    gmem.add("Tom moved to Porto", agent_id="travel")
    hits = gmem.search("Where did Ana move?", agent_id="travel", limit=2)
    assert hits[0].memory.text == "Ana moved to Lisbon" and hits[0].explain["lexical"] > 0

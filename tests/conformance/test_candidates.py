"""The ranking fields of a memory (`Candidate`) read back alike on every store: from the table
and from a search's dense cache, the message's role among them (newest-wins asks who said a
statement: a user's message need not carry her name)."""

from __future__ import annotations

from engram.store import Store

from .test_store import U1, put, q, rec, vec


def test_a_candidate_carries_its_speaker_and_role(store: Store) -> None:
    said = rec("I moved to Lisbon.", role="user")
    reply = rec("Noted, Lisbon it is.", role="assistant", name="bot")
    fact = rec("Ana lives in Lisbon.")
    put(store, said, reply, fact)
    ids = [said.id, reply.id, fact.id]
    store.dense(q(U1), vec(1.0), 10)  # a search: the scope's dense cache now holds them
    for got in (store.candidates(ids), store.candidates(ids, q(U1))):
        assert {m: (c.name, c.role, c.text) for m, c in got.items()} == {
            said.id: (None, "user", said.text), reply.id: ("bot", "assistant", reply.text),
            fact.id: (None, None, fact.text)}

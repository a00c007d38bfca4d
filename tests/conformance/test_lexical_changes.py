"""What changed in the lexical documents since a position (`lexical_changes`, the primitive a
`LexicalFollower` is kept exact by: store/index/follow.py): every document from -1; past a
position, the memories changed and their current documents; every document again after an
erasure. A second store on the same database stands for another process."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engram.store import Key, Lexical, Store
from engram.store.bm25 import Tokenizer, scope_tokens
from engram.store.index.follow import LexicalChanges, LexicalDocument, LexicalFollower
from engram.store.index.lexicon import Lexicon

from .test_store import ANY, NOW, U1, put, q, rec, vec

StoreFactory = Any


@pytest.fixture
def tokenizer() -> Iterator[Tokenizer]:
    t = Tokenizer()
    yield t
    t.close()


@pytest.fixture
def other(store_factory: StoreFactory, tmp_path: Path, store: Store) -> Iterator[Store]:
    """Another store on the same database (another process)."""
    second = store_factory(tmp_path)
    yield second
    second.close()


def changes(store: Store, since: int) -> LexicalChanges:
    return store.lexical_changes(since)


def tokens(doc: Any, tokenizer: Tokenizer) -> tuple[list[str], list[str], list[str]]:
    """A document's tokens by column, whichever form its store gives it in (tokens, or texts
    the lexicon tokenises as FTS5 does)."""
    if isinstance(doc, LexicalDocument):
        return list(doc.body), list(doc.context), list(doc.scope)
    body, context = tokenizer.tokens(doc.body, doc.context)
    return body, context, [t for o in doc.owner.split() for t in tokenizer.phrase(o)]


def test_every_document_then_what_changed_since_a_position(store: Store, other: Store,
                                                           tokenizer: Tokenizer) -> None:
    a, b, c = rec("Ana moved to Lisbon"), rec("Ben plays the cello"), rec("the ferry was late")
    put(store, a, b, c)
    first = changes(store, -1)
    assert first.whole and first.position >= 0
    docs = {d.id: d for d in first.documents}
    assert set(docs) == {a.id, b.id, c.id}
    assert tokens(docs[a.id], tokenizer) == (["ana", "move", "to", "lisbon"], [],
                                             [t for o in scope_tokens(U1)
                                              for t in tokenizer.phrase(o)])
    none = changes(store, first.position)
    assert (none.whole, none.position, list(none.changed)) == (False, first.position, [])
    d = rec("a kayak on the Tagus")
    with other.write() as tx:  # another process writes
        tx.insert(d, [Key("text", vec(1, 0))], Lexical(d.text, "Ben plays the cello"))
        tx.update(replace(a, text="Ana lives in Porto"), None, Lexical("Ana lives in Porto"))
        tx.soft_delete([b.id], NOW)
    ch = changes(store, first.position)
    assert not ch.whole and ch.since == first.position and ch.position > first.position
    assert set(ch.changed) == {a.id, b.id, d.id}
    docs = {x.id: x for x in ch.documents}
    assert set(docs) == {a.id, d.id}  # the deleted one has none
    assert tokens(docs[a.id], tokenizer)[0] == ["ana", "live", "in", "porto"]
    assert tokens(docs[d.id], tokenizer)[:2] == (["a", "kayak", "on", "the", "tagu"],
                                                 ["ben", "plai", "the", "cello"])
    again = changes(store, ch.position)
    assert (again.position, list(again.changed), list(again.documents)) == (ch.position, [], [])
    with other.write() as tx:
        tx.erase([d.id])
    after = changes(store, ch.position)  # an erasure: its words leave a follower's process
    assert after.whole and after.position > ch.position
    assert {x.id for x in after.documents} == {a.id, c.id}


def test_a_follower_fed_by_it_holds_what_the_store_holds(store: Store, other: Store) -> None:
    """A `LexicalFollower` applying `lexical_changes` ranks as the store's own lexical search,
    through another process's writes and an erasure of the newest memory followed by a new
    one (on SQLite the new row takes the erased row's rowid: the log names memories)."""
    follower = LexicalFollower()
    words = ["ana", "lisbon", "cello", "ferry", "porto", "kayak"]

    def follow() -> Lexicon:
        with follower.lock:
            lex = follower.apply(changes(store, follower.position))
        assert lex is not None
        return lex

    def same() -> None:
        lex = follow()
        found = 0
        for w in words:
            with follower.lock:
                ours = lex.search([w], [], 20, 0.5, lambda ids: set(ids))
            assert ours is not None
            theirs = store.lexical(q(ANY), [w], 20)
            ours, theirs = (sorted(h, key=lambda h: (-h[1], h[0])) for h in (ours, theirs))
            assert [m for m, _ in ours] == [m for m, _ in theirs]
            assert [s for _, s in ours] == pytest.approx([s for _, s in theirs], abs=1e-9)
            found += len(ours)
        assert found >= 5

    texts = ["Ana moved to Lisbon", "Ben plays the cello", "the ferry to Lisbon was late",
             "Ana likes the cello", "a kayak on the Tagus"]
    records = [rec(t) for t in texts]
    put(store, *records)
    same()
    with other.write() as tx:
        tx.update(replace(records[0], text="Ana lives in Porto"), None,
                  Lexical("Ana lives in Porto"))
        tx.soft_delete([records[1].id], NOW)
    same()
    with other.write() as tx:
        tx.erase([records[-1].id])  # the newest row
    new = rec("a kayak from Porto to the ferry")
    put(other, new)
    same()
    lex = follow()
    live = {lex.ids[i] for i in range(lex.n) if lex.alive[i]}
    assert live == {r.id for r in records[:4] if r is not records[1]} | {new.id}
    with follower.lock:
        follower.drop()

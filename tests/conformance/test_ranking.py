"""Both stores rank alike, not only find the same rows.

The lexical scores are FTS5's BM25 on every store (the embedded store computes them, the
PostgreSQL store computes the same from the same tokens and statistics: store/postgres/bm25.py),
so a fixed corpus has fixed scores, written here.
"""

from __future__ import annotations

import pytest

from conformance.test_store import NOW, q, rec, vec
from engram.model import Scope
from engram.pipeline.text import terms
from engram.store import Key, Lexical, Store

# -- the lexical scores themselves -------------------------------------------------------------

# name -> (scope, body, previous turn)
DOCS: dict[str, tuple[Scope, str, str]] = {
    "runs": (Scope("ana", None, "s1"), "Ana: I started running again, three miles a day.", ""),
    "since": (Scope("ana", None, "s1"), "Ben: Yes, since 2019!", "Ana: Do you still run?"),
    "possessive": (Scope("ana", None, "s1"), "Ana: Marta's dog runs with Marta's cat.",
                   "Ben: Yes, since 2019!"),
    "marta": (Scope("ana", None, "s2"), "Ben: Marta and the dog ran at 3:30, a co-worker too.",
              ""),
    "cafe": (Scope("ana", None, "s2"), "Ana: A naïve novel in a café, the CAFÉ by the sea.",
             "Ben: Marta's run?"),
    "overlap": (Scope("ana"), "s's s's s ss", ""),
    "long": (Scope("ana"), "Marta " + "and then we talked about the weather for hours " * 6, ""),
    "other user": (Scope("ben", None, "s1"), "Ben: Marta's dog and Marta's run", ""),
    "twin a": (Scope("ana", None, "s3"), "Ana: Yes, the ferry was late.", "Ben: The ferry?"),
    "twin b": (Scope("ana", None, "s4"), "Ana: Yes, the ferry was late.", "Ben: The ferry?"),
    "deleted": (Scope("ana", None, "s1"), "Ana: Marta's dog is called Rex.", ""),
    "edited": (Scope("ana", None, "s2"), "Ana: the ferry, the ferry, the dog", ""),
}

# (query text, scope, previous_weight) -> [(name, score)], best first: the embedded store's
# FTS5 bm25() on this corpus, after "deleted" is deleted and "edited" re-indexed.
ANA, ALL = Scope("ana"), Scope()
EXPECTED: list[tuple[str, Scope, float, list[tuple[str, float]]]] = [
    ('running', ANA, 0.5, [
        ('runs', 1.1507493388186896e-06),
        ('possessive', 1.0307975783100817e-06),
        ('since', 7.791484281734979e-07),
        ('edited', 7.222427148653635e-07),
        ('cafe', 6.107298814722397e-07),
    ]),
    ("Marta's dog", ANA, 0.5, [
        ('possessive', 1.631745289407925),
        ('marta', 0.9146299846337288),
        ('edited', 0.3689400853315419),
        ('cafe', 0.3119764726555864),
    ]),
    ("Marta's dog", ALL, 0.5, [
        ('other user', 1.8385951074634805),
        ('possessive', 1.631745289407925),
        ('marta', 0.9146299846337288),
        ('edited', 0.3689400853315419),
        ('cafe', 0.3119764726555864),
    ]),
    ('since 2019', ANA, 0.5, [
        ('since', 3.072503189728971),
        ('possessive', 1.7971344714073028),
    ]),
    ('since 2019', ANA, 0.0, [
        ('since', 3.072503189728971),
        ('possessive', 0.0),
    ]),
    ("s's", ANA, 0.5, [
        ('overlap', 3.651699601629619),
    ]),
    ('cafe naive novels', ANA, 0.5, [
        ('cafe', 6.314456804641503),
    ]),
    ('co-worker at 3:30', ANA, 0.5, [
        ('marta', 8.023357877020908),
    ]),
    ('ferry', ANA, 0.5, [
        ('edited', 1.291462297574256),
        ('twin a', 1.2140738335512005),
        ('twin b', 1.2140738335512005),
    ]),
    ('ferry', ANA, 2.0, [
        ('twin a', 1.4970613147882532),
        ('twin b', 1.4970613147882532),
        ('edited', 1.291462297574256),
    ]),
    ('run runs running', ANA, 0.5, [
        ('runs', 3.452248016456069e-06),
        ('possessive', 3.092392734930245e-06),
        ('since', 2.3374452845204935e-06),
        ('edited', 2.1667281445960905e-06),
        ('cafe', 1.8321896444167192e-06),
    ]),
    ('Rex', ANA, 0.5, []),
    ('weather with Marta', ANA, 0.5, [
        ('long', 2.7283156231936867),
        ('possessive', 1.4038358128696901e-06),
        ('marta', 1.0307975783100817e-06),
        ('edited', 7.222427148653635e-07),
        ('cafe', 6.107298814722397e-07),
    ]),
    ('the cat', ALL, 0.5, [
        ('edited', 1.4517812211396401),
        ('possessive', 1.376115866629072),
    ]),
]


@pytest.fixture
def corpus(store: Store) -> dict[str, str]:
    """The corpus in `store`; name -> memory id."""
    ids = {}
    with store.write() as tx:
        for i, (name, (scope, body, previous)) in enumerate(DOCS.items()):
            r = rec(body, scope=scope)
            ids[name] = r.id
            tx.insert(r, [Key("text", vec(1.0, 0.1 * i))], Lexical(body, previous))
    with store.write() as tx:
        tx.soft_delete([ids["deleted"]], NOW)
        edited = store.get([ids["edited"]])[ids["edited"]]
        tx.update(edited, None, Lexical("Ana: the ferry, the ferry, the cat", "Ben: Marta's run?"))
    return ids


def _scored(store: Store, ids: dict[str, str], text: str, scope: Scope,
            weight: float) -> list[tuple[str, float]]:
    names = {v: k for k, v in ids.items()}
    hits = store.lexical(q(scope), terms(text), 100, previous_weight=weight)
    return sorted(((names[m], s) for m, s in hits), key=lambda h: (-h[1], ids[h[0]]))


@pytest.mark.parametrize(("text", "scope", "weight", "expected"), EXPECTED,
                         ids=[f"{t}-{'all' if s == ALL else s.user_id}-{w}" for t, s, w, _ in EXPECTED])
def test_lexical_scores_are_fts5_bm25(store: Store, corpus: dict[str, str], text: str,
                                      scope: Scope, weight: float,
                                      expected: list[tuple[str, float]]) -> None:
    """Stemming (running / runs / ran), possessives (`Marta's`: the phrase `marta s`), a phrase
    that overlaps itself (`s's` in `s's s's s`), numbers and hyphens (`3:30`, `co-worker`),
    diacritics, stop words that count in a row's length, the previous turn weighted, a word
    found in most rows (IDF floored at 1e-6), one stem given thrice, deleted and re-indexed
    rows leaving the statistics, and two rows scoring exactly alike."""
    got = _scored(store, corpus, text, scope, weight)
    assert [name for name, _ in got] == [name for name, _ in expected]
    assert [s for _, s in got] == pytest.approx([s for _, s in expected], rel=1e-12, abs=1e-300)

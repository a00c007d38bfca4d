"""The I/O-free parts of the lifecycle: consolidation decisions, forgetting order, text helpers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from engram.model import Kind, MemoryRecord, Scope, new_id
from engram.pipeline import consolidate, forget
from engram.pipeline.text import STOP_WORDS, content_hash, normalize, overlap, terms, words

NOW = datetime(2025, 6, 1, tzinfo=UTC)
U = Scope("u")


def rec(text: str, *, kind: Kind = Kind.SEMANTIC, scope: Scope = U,
        **fields: object) -> MemoryRecord:
    base: dict[str, object] = dict(id=new_id(), scope=scope, kind=kind, text=text, metadata={},
                                   importance=0.5, created_at=NOW, updated_at=NOW,
                                   content_hash=content_hash(text))
    base.update(fields)
    return MemoryRecord(**base)  # type: ignore[arg-type]


def decide(candidate: MemoryRecord, *neighbours: tuple[MemoryRecord, float],
           threshold: float = 0.9, min_overlap: float = 0.5) -> consolidate.Decision:
    return consolidate.decide(candidate, neighbours, threshold=threshold, min_overlap=min_overlap)


# -- consolidate.decide ------------------------------------------------------------------------

def test_episodes_are_always_added() -> None:
    old = rec("same words", kind=Kind.EPISODIC)
    d = decide(rec("same words", kind=Kind.EPISODIC), (old, 1.0))
    assert d.action == "ADD" and d.target is None


def test_exact_duplicate_is_a_noop() -> None:
    old = rec("Ana likes tea")
    d = decide(rec("ana likes TEA."), (old, 0.2))  # the hash decides, not the cosine
    assert (d.action, d.target, d.similarity) == ("NOOP", old, 1.0)


def test_near_duplicate_needs_cosine_and_overlap() -> None:
    old = rec("Ana lives in Lisbon")
    new = rec("Ana lives in Lisbon, Portugal")
    assert decide(new, (old, 0.95)).action == "MERGE"
    assert decide(new, (old, 0.95)).target == old
    assert decide(new, (old, 0.89)).action == "ADD"                    # cosine too low
    assert decide(new, (old, 0.95), min_overlap=0.9).action == "ADD"  # words differ too much
    assert decide(new, (old, 0.90)).action == "MERGE"                 # threshold is inclusive
    assert "cosine" in decide(new, (old, 0.95)).reason


def test_close_embeddings_with_different_words_stay_apart() -> None:
    d = decide(rec("The user likes coffee and cake"), (rec("The user likes tea"), 0.97))
    assert d.action == "ADD"


@pytest.mark.parametrize(("old", "new"), [
    ("The user likes tea", "The user likes coffee"),
    ("My room number is 101", "My room number is 102"),
    ("Ana takes the 7 bus to work", "Ana takes the 8 bus to work"),
])
def test_a_swapped_word_is_never_merged(old: str, new: str) -> None:
    # however close the embeddings: the newer fact may correct the older one
    assert decide(rec(new), (rec(old), 0.99), min_overlap=0.0).action == "ADD"


def test_added_words_merge_only_with_enough_overlap() -> None:
    old = rec("Ana lives in Lisbon")
    assert decide(rec("Ana lives in Lisbon, Portugal"), (old, 0.95)).action == "MERGE"
    assert decide(rec("Ana now lives in Lisbon"), (old, 0.95)).action == "MERGE"
    long = rec("Ana lives in Lisbon near the river with her three cats")
    assert decide(long, (old, 0.95)).action == "ADD"
    assert decide(old, (long, 0.95)).action == "ADD"
    assert decide(long, (old, 0.95), min_overlap=0.4).action == "MERGE"


def test_other_scope_or_kind_is_ignored() -> None:
    new = rec("Ana lives in Lisbon")
    assert decide(new, (rec("Ana lives in Lisbon", scope=Scope("bob")), 1.0)).action == "ADD"
    assert decide(new, (rec("Ana lives in Lisbon", kind=Kind.PROCEDURAL), 1.0)).action == "ADD"
    assert decide(new).action == "ADD"


def test_the_most_similar_mergeable_neighbour_wins() -> None:
    new = rec("Ana lives in central Lisbon")
    a, b = rec("Ana lives in Lisbon"), rec("Ana lives in central Lisbon now")
    assert decide(new, (a, 0.92), (b, 0.97)).target == b
    assert decide(new, (b, 0.97), (a, 0.92)).target == b
    unmergeable = rec("Completely unrelated words here")
    assert decide(new, (unmergeable, 0.99), (a, 0.92)).target == a
    exact = rec("ana lives in central lisbon")
    assert decide(new, (b, 0.99), (exact, 0.5)).action == "NOOP"


# -- consolidate.merge -------------------------------------------------------------------------

def test_merge_keeps_the_longer_text_and_both_sources() -> None:
    old = rec("Ana lives in Lisbon", metadata={"a": 1, "b": 1}, importance=0.3,
              observed_at=NOW - timedelta(days=2), provenance=("ep1",))
    new = rec("Ana lives in Lisbon, Portugal", metadata={"b": 2, "c": 3}, importance=0.7,
              observed_at=NOW - timedelta(days=1), provenance=("ep2",))
    later = NOW + timedelta(hours=1)
    m = consolidate.merge(old, new, later)
    assert m.id == old.id and m.created_at == old.created_at and m.updated_at == later
    assert m.text == new.text and m.content_hash == new.content_hash
    assert m.metadata == {"a": 1, "b": 2, "c": 3}
    assert m.importance == 0.7
    assert m.observed_at == NOW - timedelta(days=1)
    assert m.provenance == ("ep1", "ep2", new.id)


def test_merge_keeps_the_existing_text_when_it_says_more() -> None:
    old = rec("Ana lives in Lisbon, Portugal")
    m = consolidate.merge(old, rec("Ana lives in Lisbon"), NOW)
    assert m.text == old.text and m.content_hash == old.content_hash


def test_merge_of_direct_facts_names_both() -> None:
    old, new = rec("x y z"), rec("x y z w")
    m = consolidate.merge(old, new, NOW)
    assert m.provenance == (old.id, new.id)
    again = consolidate.merge(m, rec("x y z w v"), NOW)
    assert again.provenance[:2] == (old.id, new.id) and len(again.provenance) == 3


def test_merge_expiry() -> None:
    soon, later = NOW + timedelta(days=1), NOW + timedelta(days=5)
    assert consolidate.merge(rec("a", expires_at=soon), rec("ab", expires_at=later),
                             NOW).expires_at == later
    assert consolidate.merge(rec("a", expires_at=soon), rec("ab"), NOW).expires_at is None
    assert consolidate.merge(rec("a"), rec("ab", expires_at=soon), NOW).expires_at is None


# -- forget ------------------------------------------------------------------------------------

def test_retention_terms() -> None:
    fresh = rec("x", importance=1.0)
    assert forget.retention(fresh, NOW) == pytest.approx(0.5 + 0.3)
    old = rec("x", importance=0.0, created_at=NOW - timedelta(days=30))
    assert forget.recency(old, NOW) == pytest.approx(0.5)
    assert forget.retention(old, NOW) == pytest.approx(0.3 * 0.5)
    used = rec("x", importance=0.0, access_count=1, last_accessed_at=NOW)
    assert forget.retention(used, NOW) == pytest.approx(0.3 + 0.2 * 0.5)
    future = rec("x", created_at=NOW + timedelta(days=1))
    assert forget.recency(future, NOW) == 1.0  # clock skew never raises recency above 1


def test_retention_orders_by_importance_recency_and_use() -> None:
    base = dict(created_at=NOW - timedelta(days=10))
    low = rec("low", importance=0.1, **base)
    high = rec("high", importance=0.9, **base)
    stale = rec("stale", importance=0.5, created_at=NOW - timedelta(days=90))
    recent = rec("recent", importance=0.5, created_at=NOW - timedelta(days=1))
    touched = rec("touched", importance=0.5, created_at=NOW - timedelta(days=90),
                  access_count=5, last_accessed_at=NOW)
    r = {x.text: forget.retention(x, NOW) for x in (low, high, stale, recent, touched)}
    assert r["low"] < r["high"]
    assert r["stale"] < r["recent"]
    assert r["stale"] < r["touched"]
    assert all(0.0 <= v <= 1.0 for v in r.values())


def test_to_evict_drops_the_lowest_and_ties_go_to_the_oldest() -> None:
    a, c, d = rec("a", importance=0.2), rec("c", importance=0.9), rec("d", importance=0.1)
    pool = [c, a, d]
    assert forget.to_evict(pool, 3, NOW) == []
    assert forget.to_evict(pool, 10, NOW) == []
    assert forget.to_evict(pool, 2, NOW) == [d]
    assert forget.to_evict(pool, 1, NOW) == [d, a]
    day = NOW - timedelta(days=1)
    older = rec("t", importance=0.4, created_at=day - timedelta(microseconds=1),
                last_accessed_at=day)
    twins = [rec("t", importance=0.4, created_at=day, last_accessed_at=day) for _ in range(2)]
    first, second = sorted(twins, key=lambda x: x.id)
    assert forget.to_evict([second, first, older], 1, NOW) == [older, first]


# -- text ----------------------------------------------------------------------------------------

def test_normalize() -> None:
    assert normalize("  Hello   World. ") == "hello world"
    assert normalize("Hello\tWorld!?") == "hello world"
    assert normalize("ＡＢＣ") == "abc"      # NFKC: full-width letters
    assert normalize("Straße") == "strasse"  # casefold, not lower
    assert normalize("...") == ""
    assert normalize("a.b") == "a.b"


def test_content_hash_follows_normalize() -> None:
    assert content_hash("Hello  World.") == content_hash("hello world")
    assert content_hash("hello world") != content_hash("hello, world")
    assert len(content_hash("x")) == 64


def test_words() -> None:
    assert words("Don’t stop-me now, Ana_Lia!") == ["don't", "stop", "me", "now", "ana", "lia"]
    assert words("Café au lait 2024") == ["café", "au", "lait", "2024"]
    assert words("") == []


def test_terms_drop_stop_words_and_repeats() -> None:
    assert terms("What did Ana say about the trip to the Alps? The trip!") == [
        "ana", "say", "trip", "alps"]
    assert terms("the and of") == []
    assert "like" not in STOP_WORDS and "when" in STOP_WORDS


def test_overlap() -> None:
    assert overlap("Ana likes tea", "ana LIKES tea!") == 1.0
    assert overlap("The user likes tea", "The user likes coffee") == pytest.approx(2 / 4)
    assert overlap("tea", "coffee") == 0.0
    assert overlap("the", "of") == 1.0  # no content words on either side
    assert overlap("tea", "the") == 0.0

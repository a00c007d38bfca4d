"""The knowledge graph's decisions, as pure functions: names and their keys, staged entity
resolution, predicate cardinality, and where a new edge lands on its subject's timeline.

No I/O here: `entities.py` reads the candidates, calls these, and writes what they decide.
See docs/graph.md for the design and what each rule is for.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from ..model import Entity, Relation

# -- names ---------------------------------------------------------------------------------------

_PUNCT = re.compile(r"[^\w\s\-&']+")
_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"[\w][\w'\-&]*")
STOP = frozenset({"the", "a", "an", "of", "and", "for", "in", "on", "at", "to", "&", "de", "la",
                  "le", "du", "von", "van"})
# Legal forms say nothing about which organisation it is: "Acme Corp" is "Acme Inc."
LEGAL = frozenset({"inc", "corp", "corporation", "co", "company", "ltd", "llc", "plc", "gmbh",
                   "sa", "ag", "bv", "limited", "incorporated"})
# Titles say nothing about which person it is: "Dr. Ana Silva" is "Ana Silva".
TITLES = frozenset({"dr", "mr", "mrs", "ms", "miss", "prof", "sir", "dame", "mx"})
GENERIC_TYPES = frozenset({"", "entity", "thing", "unknown", "other"})
MAX_NGRAM = 4  # longest name (in words) that mention linking looks up


@lru_cache(maxsize=16_384)  # mention linking normalises every word of every turn: most repeat
def normalise(name: str) -> str:
    """The form two spellings of one name share: case-folded, accents dropped ("São" is
    "sao"), dots dropped ("U.S.A." is "usa"), other punctuation but `-`, `&` and `'` made
    spaces, spaces collapsed, a leading "the" dropped ("The Met" is "met")."""
    text = unicodedata.normalize("NFKD", name)
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = unicodedata.normalize("NFKC", text).casefold().replace("’", "'").replace(".", "")
    text = _SPACE.sub(" ", _PUNCT.sub(" ", text)).strip(" -'")
    text = text.removesuffix("'s") if text.endswith("'s") and len(text) > 3 else text
    return text[4:] if text.startswith("the ") and len(text) > 4 else text


def words(name: str) -> list[str]:
    return [w for w in re.split(r"[\s\-]+", normalise(name)) if w]


def core(name: str) -> str:
    """The normalised name without legal forms and titles ("acme corp" -> "acme",
    "dr ana silva" -> "ana silva")."""
    ws = [w for w in words(name) if w not in LEGAL and w not in TITLES]
    return " ".join(ws) if ws else normalise(name)


def is_identifier(name: str) -> bool:
    """Names with digits are identifiers (`SR-2023-052`, `Room 101`, `iPhone 15`): one digit
    apart is another thing, so they only ever resolve by exact key."""
    return any(c.isdigit() for c in name)


def acronym(name: str) -> str | None:
    """The initials of a name of two or more words, stop words left out
    ("International Business Machines" -> "ibm"), or None."""
    ws = [w for w in words(name) if w not in STOP and w not in LEGAL]
    return "".join(w[0] for w in ws) if len(ws) >= 2 else None


def is_acronym_of(short: str, long: str) -> bool:
    key = normalise(short).replace(" ", "").replace(".", "")
    return len(key) >= 2 and " " not in normalise(short) and acronym(long) == key


def predicate_key(predicate: str) -> str:
    """`Works at`, `works-at`, `WORKS_AT` -> `works_at`."""
    return "_".join(re.findall(r"\w+", unicodedata.normalize("NFKC", predicate).casefold()))


def name_keys(name: str, aliases: Iterable[str] = ()) -> list[tuple[str, Literal["name", "alias", "token"]]]:
    """The index rows of an entity: its normalised name (and the name without a legal form),
    each alias, and each distinctive word of them (lexical candidates for resolution)."""
    out: dict[str, Literal["name", "alias", "token"]] = {}
    for key in (normalise(name), core(name)):
        if key:
            out.setdefault(key, "name")
    for alias in aliases:
        for key in (normalise(alias), core(alias)):
            if key:
                out.setdefault(key, "alias")
    for text in (name, *aliases):
        for w in words(text):
            if len(w) >= 2 and w not in STOP and w not in LEGAL:
                out.setdefault(w, "token")
    return list(out.items())


def ngrams(text: str, n: int = MAX_NGRAM) -> list[str]:
    """Every run of 1..n words of a text, normalised: the keys a mention of a known name or
    alias would have. One index lookup finds them all (no pattern per entity)."""
    ws = [w for w in map(normalise, _WORD.findall(text)) if w]
    out: dict[str, None] = {}
    for i, first in enumerate(ws):
        if first not in STOP and len(first) >= 2:
            out[first] = None
        gram = first
        for w in ws[i + 1:i + n]:
            gram = f"{gram} {w}"
            out[gram] = None
    return list(out)


def claim_keys(name: str, type: str) -> tuple[str, str]:
    """The keys an owner's entities are unique by (the `entities.key` column): the name as
    exact resolution compares it (`core`: "Acme Corp" and "Acme Inc." are one), and, when an
    entity of another type holds that already ("Paris" the place, then "Paris" the person),
    the same with the type. Two writers creating one new entity at once meet on the first key;
    `#` never survives `normalise`, so a typed key never equals a plain one."""
    base = core(name) or normalise(name) or name.strip().casefold()
    return base, f"{base}#{type.casefold().strip() or 'entity'}"


def absorb(keep: Entity, other: Entity) -> Entity:
    """`keep` with what `other` (the same entity, written twice) adds: its names as aliases,
    its type if `keep` has none, attributes (keep's win), provenance, a summary if keep has
    none, and the earlier creation time."""
    known = {normalise(keep.name)} | {normalise(a) for a in keep.aliases}
    extra = []
    for a in (other.name, *other.aliases):
        if normalise(a) not in known:
            known.add(normalise(a))
            extra.append(a)
    typed = keep.type.casefold() not in GENERIC_TYPES
    summary, summary_by = (keep.summary, keep.summary_by) if keep.summary or not other.summary \
        else (other.summary, other.summary_by)
    return Entity(id=keep.id, scope=keep.scope, name=keep.name,
                  type=keep.type if typed else other.type or keep.type,
                  aliases=(*keep.aliases, *extra), summary=summary, summary_by=summary_by,
                  attributes={**other.attributes, **keep.attributes},
                  provenance=tuple(dict.fromkeys((*keep.provenance, *other.provenance))),
                  created_at=min(keep.created_at, other.created_at),
                  updated_at=max(keep.updated_at, other.updated_at))


def dedupe(entities: Sequence[Entity]) -> tuple[dict[str, Entity], dict[str, str], dict[str, str]]:
    """For a database made before entities were unique by name (two writers could create one
    entity twice): which entities are one. Entities of one owner whose first claim key is
    equal and whose types are compatible are merged into the oldest (same type first), as
    resolution would have merged them one at a time; entities of incompatible types stay apart
    and get the typed key. Returns (the merged survivors by id, duplicate id -> survivor id,
    survivor id -> its claim key). Pure: the migration applies it."""
    groups: dict[tuple[Any, str], list[Entity]] = {}
    for e in sorted(entities, key=lambda e: e.id):
        groups.setdefault((e.scope, claim_keys(e.name, e.type)[0]), []).append(e)
    kept: dict[str, Entity] = {}
    merged: dict[str, str] = {}
    keys: dict[str, str] = {}
    for (_, base), members in groups.items():
        alive: list[Entity] = []
        for e in members:
            fits = [k for k in alive if compatible(k.type, e.type)]
            fits.sort(key=lambda k: k.type.casefold() != e.type.casefold())
            if fits:
                into = absorb(fits[0], e)
                alive[alive.index(fits[0])] = into
                merged[e.id] = into.id
            else:
                alive.append(e)
        for n, e in enumerate(alive):
            kept[e.id] = e
            keys[e.id] = base if n == 0 else claim_keys(e.name, e.type)[1]
    return kept, merged, keys


# -- summaries without an LLM --------------------------------------------------------------------

SUMMARY_CLAUSES = 8   # relations a rules summary names at most
MAX_SUMMARY = 400     # characters of a summary (rules or LLM)


def describe(entity: Entity, relations: Sequence[Relation], *, dates: bool = False) -> str:
    """The summary of an entity without an LLM, from its type, aliases and the relations that
    hold now (`relations`: those touching it; the names are read from them), in a fixed
    order: "A person, also called Ana and A. Silva. Works at Globex; likes tea, hiking. Bob
    friend of Ana Silva." Deterministic: the same graph gives the same words. `dates`: each
    relation with its start ("Works at Globex (since 2023-01-01)"), for the context block."""

    def since(r: Relation) -> str:
        return f" (since {r.valid_from.date().isoformat()})" if dates and r.valid_from else ""

    out: list[str] = []
    kind = "" if entity.type.casefold() in GENERIC_TYPES else entity.type
    aliases = list(entity.aliases[:4])
    called = (" and ".join(aliases) if len(aliases) <= 2
              else ", ".join(aliases[:-1]) + " and " + aliases[-1])
    if kind:
        article = "An" if kind[:1].casefold() in "aeiou" else "A"
        out.append(f"{article} {kind}" + (f", also called {called}." if aliases else "."))
    elif aliases:
        out.append(f"Also called {called}.")
    live = sorted((r for r in relations if r.expired_at is None),
                  key=lambda r: (r.valid_from is None, r.valid_from or r.created_at, r.id))
    own: dict[str, list[str]] = {}
    for r in live:
        if r.subject == entity.id:
            objects = own.setdefault(r.predicate, [])
            if r.object_name + since(r) not in objects:
                objects.append(r.object_name + since(r))
    clauses = [f"{p.replace('_', ' ')} {', '.join(objs)}" for p, objs in own.items()]
    incoming = list(dict.fromkeys(
        f"{r.subject_name} {r.predicate.replace('_', ' ')} {entity.name}{since(r)}"
        for r in live if r.object == entity.id and r.subject != entity.id))
    clauses = clauses[:SUMMARY_CLAUSES]
    incoming = incoming[:max(0, SUMMARY_CLAUSES - len(clauses))]
    if clauses:
        text = "; ".join(clauses)
        out.append(text[:1].upper() + text[1:] + ".")
    if incoming:
        out.append("; ".join(incoming) + ".")
    text = " ".join(out)
    return text if len(text) <= MAX_SUMMARY else text[:MAX_SUMMARY - 1].rsplit(" ", 1)[0] + "…"


# -- staged resolution ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Known:
    """An existing entity as resolution sees it."""

    id: str
    name: str
    type: str
    aliases: tuple[str, ...] = ()
    vector: np.ndarray | None = field(default=None, compare=False)

    def keys(self) -> set[str]:
        return {k for k, kind in name_keys(self.name, self.aliases) if kind != "token"}


@dataclass(frozen=True)
class Resolution:
    """Which entity a name is: `entity` (an id) or None for a new one. `stage` says how it was
    decided: exact (a name or alias key), rule (acronym, legal form, a part of a name that only
    one candidate has), ambiguous (the candidates an LLM should choose among, in `candidates`),
    new (nothing close enough)."""

    entity: str | None
    stage: Literal["exact", "rule", "ambiguous", "new", "llm"]
    score: float = 0.0
    candidates: tuple[str, ...] = ()
    why: str = ""


def compatible(a: str, b: str) -> bool:
    """Two types may be one entity's: equal, or one of them unknown."""
    a, b = a.casefold().strip(), b.casefold().strip()
    return a == b or a in GENERIC_TYPES or b in GENERIC_TYPES


def lexical_similarity(a: str, b: str) -> float:
    """Dice coefficient of character trigrams of the normalised names (0..1)."""
    def grams(s: str) -> set[str]:
        s = f"  {normalise(s)} "
        return {s[i:i + 3] for i in range(len(s) - 2)}
    ga, gb = grams(a), grams(b)
    return 2 * len(ga & gb) / (len(ga) + len(gb)) if ga and gb else 0.0


PERSON_TYPES = frozenset({"person", "people", "human", "user", "character"})


def _part_of(short: str, long: str) -> bool:
    """`short` is one word of the person name `long` ("Ana" of "Ana Silva"). Only a single
    word: "Michael Jordan" is not "Michael B. Jordan" on that ground."""
    sw = [w for w in words(core(short)) if w not in STOP]
    lw = set(words(core(long)))
    return len(sw) == 1 and len(lw) >= 2 and sw[0] in lw and len(sw[0]) >= 3


def resolve(name: str, type: str, candidates: Sequence[Known], vector: np.ndarray | None = None,
            aliases: Sequence[str] = (), *, ambiguous_at: float = 0.45) -> Resolution:
    """Which of `candidates` `name` (of `type`) is, in stages; string similarity alone never
    merges.

    1. exact: the normalised name, its form without a legal suffix, or an alias is a key of a
       candidate of a compatible type (the one of the same type first).
    2. never past exact: identifier-like names (`SR-2023-052` is not `SR-2023-053`), and
       candidates of another type.
    3. rules: an acronym of the other's name (`IBM`), or, for people, a single name that is
       one word of the other (`Ana` of `Ana Silva`), when exactly one candidate qualifies.
    4. ambiguous: embedding cosine and trigram similarity averaged at least `ambiguous_at`:
       the caller asks the LLM, or (without one) keeps them apart — precision first.
    """
    mine = {normalise(name), core(name)} | {normalise(a) for a in aliases}
    mine.discard("")
    fits = [k for k in candidates if compatible(type, k.type)]
    exact = [k for k in fits if mine & k.keys()]
    if exact:
        exact.sort(key=lambda k: (k.type.casefold() != type.casefold(), k.id))
        return Resolution(exact[0].id, "exact", 1.0, why="same name or alias")
    if is_identifier(name):
        return Resolution(None, "new", why="identifier-like names resolve only exactly")
    fits = [k for k in fits if not is_identifier(k.name)]
    ruled = [k for k in fits
             if is_acronym_of(name, k.name) or is_acronym_of(k.name, name)
             or any(is_acronym_of(name, a) or is_acronym_of(a, name) for a in k.aliases)]
    if len(ruled) == 1:
        return Resolution(ruled[0].id, "rule", 0.9, why="acronym")
    person = type.casefold() in PERSON_TYPES
    parts = [k for k in fits if (person or k.type.casefold() in PERSON_TYPES)
             and (_part_of(name, k.name) or _part_of(k.name, name))]
    if len(parts) == 1 and not ruled:
        return Resolution(parts[0].id, "rule", 0.8, why="part of the name")
    scored: list[tuple[float, str]] = []
    for k in fits:
        lex = lexical_similarity(name, k.name)
        cos = 0.0
        if vector is not None and k.vector is not None:
            cos = float(np.dot(vector, k.vector) / (np.linalg.norm(vector) * np.linalg.norm(k.vector) or 1.0))
        score = 0.5 * lex + 0.5 * cos if vector is not None and k.vector is not None else lex
        if k in ruled or k in parts:
            score = max(score, ambiguous_at)
        if score >= ambiguous_at:
            scored.append((score, k.id))
    if scored:
        scored.sort(key=lambda s: (-s[0], s[1]))
        return Resolution(None, "ambiguous", scored[0][0], tuple(i for _, i in scored[:5]),
                          why="similar names; not merged on similarity alone")
    return Resolution(None, "new", why="no candidate close enough")


# -- cardinality ---------------------------------------------------------------------------------

# Predicates with one current value per subject; every other predicate is many-valued (a
# second value is added, never closes the first): wrongly closing an edge loses a fact, while
# a missed closure leaves two values that `relations(as_of=...)` still shows apart by time.
SINGLE_VALUED = frozenset({
    "works_at", "works_for", "employed_by", "employer", "lives_in", "resides_in", "based_in",
    "located_in", "headquartered_in", "married_to", "spouse", "spouse_of", "partner_of",
    "dating", "reports_to", "manager", "managed_by", "job_title", "title", "role", "position",
    "age", "status", "current_location", "studies_at", "attends", "nationality",
    "email", "phone", "home", "address", "ceo", "ceo_of", "capital", "owned_by", "born_in",
    "born_on", "birthday", "favorite", "favourite", "assigned_to", "state", "priority",
})
MULTI_VALUED = frozenset({
    "friend_of", "knows", "likes", "loves", "dislikes", "hates", "enjoys", "member_of",
    "parent_of", "child_of", "sibling_of", "has_child", "has_pet", "speaks", "visited",
    "owns", "has", "uses", "worked_at", "lived_in", "plays", "collaborates_with",
    "mentions", "related_to", "part_of", "interested_in", "allergic_to",
})


def single_valued(predicate: str, *, single: Collection[str] = (), multi: Collection[str] = (),
                  flag: bool | None = None) -> bool:
    """Does `predicate` hold one current value per subject? In order: the caller's flag,
    the configuration (`ENGRAM_GRAPH_SINGLE` / `ENGRAM_GRAPH_MULTI`), the declared defaults
    above; an undeclared predicate is many-valued."""
    if flag is not None:
        return flag
    key = predicate_key(predicate)
    if key in {predicate_key(p) for p in multi}:
        return False
    if key in {predicate_key(p) for p in single}:
        return True
    return key in SINGLE_VALUED


# -- the timeline of one subject and predicate ---------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Where a new edge goes among the edges of the same subject and predicate: a `duplicate`
    (the same value already holds then: nothing new), the edges it `closes` (with the time they
    stop holding), and its own `valid_to` (a late fact, older than a value already known, holds
    until that value began)."""

    duplicate: Relation | None = None
    closes: tuple[tuple[Relation, datetime], ...] = ()
    valid_to: datetime | None = None


def _holds(r: Relation, at: datetime) -> bool:
    return (r.valid_from is None or r.valid_from <= at) and (r.valid_to is None or r.valid_to > at)


def place(same_value: Callable[[Relation], bool], start: datetime, existing: Sequence[Relation],
          single: bool) -> Placement:
    """The placement of a new edge starting at `start` among `existing` (the unretired edges of
    its subject and predicate). Contradiction is only ever looked for here, within one subject
    and predicate, and only for a single-valued predicate."""
    for r in existing:
        if same_value(r) and _holds(r, start):
            return Placement(duplicate=r)
    if not single:
        return Placement()
    others = [r for r in existing if not same_value(r)]
    closes = tuple((r, start) for r in others if _holds(r, start))
    later = [r.valid_from for r in others if r.valid_from is not None and r.valid_from > start]
    return Placement(closes=closes, valid_to=min(later) if later else None)


# -- weighting -----------------------------------------------------------------------------------

def rarity(mentions: int, total: int) -> float:
    """An entity mentioned by few episodes says more about which ones are meant than one
    mentioned by most (a speaker): an inverse document frequency, 0 when everyone mentions it."""
    if total <= 0 or mentions <= 0:
        return 0.0
    return max(0.0, math.log((total + 1) / (mentions + 0.5)))


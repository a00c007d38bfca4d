"""The lexical score both stores share: BM25 over the text and the previous turn, with FTS5's
tokenizer and constants, for the PostgreSQL store's lexical index and the in-memory one
(index/lexicon.py); the SQLite store's FTS5 table finds the rows. No driver is imported here:
the embedded store uses it without the `postgres` extra.

    score = sum over phrases p of  idf(p) * f * (k1 + 1) / (f + k1 * (1 - b + b * D / avgdl))
    f = tf(the phrase's occurrences in the text) + previous_weight * tf(... in the previous turn)
    tf(n) = 1 + ln(n) for n >= 1, 0 for n = 0
    idf(p) = ln((N - n(p) + 0.5) / (n(p) + 0.5)), or 1e-6 where that is not positive

with N the rows, n(p) the rows whose text holds the phrase, D a row's tokens (both columns and
the scope tokens SQLite's index keeps in a third column) and avgdl the mean D. Where it departs
from FTS5's `bm25()`, and why:

* n(p) counts the text alone. The previous turn is another memory's text, kept beside a reply
  as its context: counted again, every word of a conversation counts twice, and in a scope of
  three memories "Tokyo", said once, is in two rows of three (its IDF the floor), so the turn
  that says it loses to the reply after it.
* tf grows with the log of the count. The first mention is the evidence; a repeat adds less,
  and less again. BM25's own saturation point, k1 * (1 - b + b * D / avgdl), grows with the
  row's length, so in a long message (code naming its functions again and again) raw counts
  would weigh almost linearly (twenty mentions twenty times one); by the log they weigh
  1 + ln 20 = 4.
* D keeps the previous turn: a reply found through the turn it answers is measured with that
  turn. Measured by its own text alone, a short reply ("Wow, nice!") matched only through its
  previous turn would outrank the turn itself (docs/lexicon.md, "The score").

What the score is made of, so that PostgreSQL ranks as SQLite does:

* the tokens, made by FTS5's tokenizer (`porter unicode61 remove_diacritics 2`): SQLite (in the
  standard library) runs in-process on an in-memory FTS5 table, so a word stems, folds and
  splits exactly as on SQLite (`Caroline's` is the phrase `carolin s`; stop words stay in the
  text and count in its length; `3:30` is `3 30`). PostgreSQL's `english` configuration differs
  on all of these (see docs/postgres.md), and a different stemmer or stop list changes which
  rows match at all;
* per row: its terms, i.e. its distinct tokens and pairs of adjacent tokens (`lex`, a tsvector
  under a GIN index: a row holds the phrase `carolin s` only if it holds the term `carolin s`),
  the tokens of each column in order (`lex_body`, `lex_context`: `<tok><tok>...`, so the
  frequency of a phrase in a column is a substring count), and its length in tokens (`lex_len`);
* per tenant (one tenant is one SQLite file): the rows indexed and their total length
  (`lex_stats`), maintained in the write transaction. n(p) is counted when the phrase is
  searched, over the rows holding its terms (`lex`), in their text (`lex_body`).
"""

from __future__ import annotations

import hashlib
import math
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..model import Scope

# The SQLite store's tokenizer (store/sqlite/schema.py, `memory_fts`); a test checks they agree.
TOKENIZE = "porter unicode61 remove_diacritics 2"
K1 = 1.2   # FTS5's bm25() constants (fts5_aux.c)
B = 0.75
MIN_IDF = 1e-6
MAX_TOKEN_BYTES = 1022  # two of them and a space fit a lexeme (PostgreSQL's limit: 2046 bytes)


Phrase = tuple[str, ...]


class Tokenizer:
    """FTS5's tokenizer, run on an in-memory SQLite table: `tokens(a, b)` gives the tokens of
    each text in order, as `memory_fts` indexes them. Thread-safe; query terms are cached."""

    CACHE = 4096

    def __init__(self) -> None:
        self._db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        # contentless: nothing is kept but the index the vocabulary table reads
        self._db.execute("CREATE VIRTUAL TABLE t USING fts5(a, b, content='', "
                         f"tokenize='{TOKENIZE}')")
        self._db.execute("CREATE VIRTUAL TABLE v USING fts5vocab(t, 'instance')")
        self._lock = threading.Lock()
        self._phrases: OrderedDict[str, Phrase] = OrderedDict()

    def tokens(self, *texts: str) -> list[list[str]]:
        """The tokens of each text (at most two), in order."""
        if not any(texts):
            return [[] for _ in texts]
        found: list[list[tuple[int, str]]] = [[] for _ in texts]
        with self._lock:
            self._db.execute(f"INSERT INTO t(rowid, {', '.join('ab'[:len(texts)])}) "
                             f"VALUES (1{', ?' * len(texts)})", texts)
            try:
                for term, col, offset in self._db.execute("SELECT term, col, offset FROM v"):
                    found["ab".index(col)].append((offset, term))
            finally:
                self._db.execute("INSERT INTO t(t) VALUES ('delete-all')")
        return [[term for _, term in sorted(col)] for col in found]

    def phrase(self, term: str) -> Phrase:
        """What a quoted query term is to FTS5: the phrase of its tokens (`caroline's` is
        `carolin s`, `co-op` is `co op`); empty if it has none."""
        with self._lock:
            hit = self._phrases.get(term)
            if hit is not None:
                self._phrases.move_to_end(term)
                return hit
        (tokens,) = self.tokens(term)
        phrase = tuple(tokens)
        with self._lock:
            self._phrases[term] = phrase
            while len(self._phrases) > self.CACHE:
                self._phrases.popitem(last=False)
        return phrase

    def close(self) -> None:
        self._db.close()


@dataclass(frozen=True)
class Document:
    """A memory's lexical index, as its row stores it."""

    terms: list[str]  # its distinct tokens and adjacent pairs (`lex`)
    body: str         # `<tok><tok>...` of the text
    context: str      # ... of the previous turn
    length: int       # tokens of both columns, plus the scope tokens SQLite indexes with them


def tagged(tokens: Sequence[str]) -> str:
    """Tokens as `<a><b>`: `<` and `>` separate tokens (they are never part of one), so a
    phrase's occurrences are the occurrences of its own tagged form."""
    return "".join(f"<{t}>" for t in tokens)


def pair(a: str, b: str) -> str:
    """Two adjacent tokens as one term (a space is never part of a token): the rows holding the
    two-token phrase `a b` (a possessive: `carolin s`) are the rows holding this term, so such a
    phrase is found and counted like a word."""
    return f"{a} {b}"


def untagged(column: str | None) -> list[str]:
    """The tokens of a tagged column (`tagged`'s inverse)."""
    return column[1:-1].split("><") if column else []


def scope_tokens(scope: Scope) -> list[str]:
    """Opaque full-text tokens for the set fields of a scope, as the SQLite index keeps them in
    its third column (letters and digits only, so the tokenizer keeps each whole; hashed, so ids
    of any shape fit)."""
    return ["o" + hashlib.sha256(f"{field}\x1f{value}".encode()).hexdigest()[:24]
            for field, value in scope.as_dict().items() if value is not None]


def owner_tokens(scope: Scope) -> int:
    """How many scope tokens the SQLite index adds to a row (one per set field): they count in
    the row's length, and so in BM25's length normalisation."""
    return sum(v is not None for v in scope.as_dict().values())


def fits(token: str) -> bool:
    """Whether a token can be a term, alone and in a pair (a lexeme holds at most 2046 bytes)."""
    return len(token.encode("utf-8")) <= MAX_TOKEN_BYTES


def document(tokenizer: Tokenizer, body: str, previous: str, scope: Scope) -> Document:
    terms: set[str] = set()
    cols = tokenizer.tokens(body, previous)
    for col in cols:
        terms.update(t for t in col if fits(t))
        terms.update(pair(a, b) for a, b in zip(col, col[1:], strict=False) if fits(a) and fits(b))
    b, c = cols
    return Document(sorted(terms), tagged(b), tagged(c), len(b) + len(c) + owner_tokens(scope))


def phrases(tokenizer: Tokenizer, terms: Sequence[str]) -> list[Phrase]:
    """The query's phrases, one per term, in order (two terms with one stem count twice, as in
    FTS5); terms without tokens match nothing, nor (here) terms with a token over 1 KB."""
    out = []
    for term in terms:
        p = tokenizer.phrase(term)
        if p and all(fits(t) for t in p):
            out.append(p)
    return out


def keys(p: Phrase) -> list[str]:
    """The terms every row holding the phrase holds: its token, or its adjacent pairs."""
    return [p[0]] if len(p) == 1 else [pair(a, b) for a, b in zip(p, p[1:], strict=False)]


def overlaps_itself(p: Phrase) -> bool:
    """Can two occurrences of `p` overlap (`s s` in `s s s`)? A substring count would then
    miss some: these are counted with a lookahead instead."""
    return any(p[:i] == p[-i:] for i in range(1, len(p)))


def occurrences(tokens: Sequence[str], p: Phrase) -> int:
    """How often a phrase occurs in a column's tokens (overlapping occurrences too, as FTS5
    counts them)."""
    n = len(p)
    return sum(tuple(tokens[i:i + n]) == p for i in range(len(tokens) - n + 1))


def best(rows: Iterable[tuple[str, Sequence[str], Sequence[str], int]], phrases: Sequence[Phrase],
         hits: Mapping[Phrase, int], count: int, avgdl: float, k: int,
         previous_weight: float) -> list[tuple[str, float]]:
    """The `k` best of `rows` (memory id, the tokens of its text, of its previous turn, and
    how many scope tokens it has) by the score above, best first: the query's `phrases` in
    order, `hits` each one's n(p), `count` N. The same operations, in the same order, as the
    in-memory index's (index/lexicon.py), so the same scores."""
    idfs = [idf(count, hits[p]) for p in phrases]
    scored = []
    for mid, body, context, scope in rows:
        norm = K1 * (1 - B + B * (len(body) + len(context) + scope) / avgdl)
        score = 0.0
        for p, weight in zip(phrases, idfs, strict=True):
            f = tf(occurrences(body, p))
            if previous_weight:
                f += tf(occurrences(context, p)) * previous_weight
            score += f * (K1 + 1.0) / (norm + f) * weight
        scored.append((mid, score))
    scored.sort(key=lambda hit: -hit[1])
    return scored[:k]


def tf(count: float) -> float:
    """A phrase's weight in a column it occurs in `count` times (see the module docstring)."""
    return 1.0 + math.log(count) if count > 0 else 0.0


def idf(rows: int, hits: int) -> float:
    """FTS5's IDF of a phrase found in `hits` of `rows` rows."""
    value = math.log((rows - hits + 0.5) / (hits + 0.5))
    return value if value > 0.0 else MIN_IDF

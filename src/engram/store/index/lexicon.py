"""The SQLite store's lexical index in memory, for large databases: BM25 without scanning
FTS5's matches per query.

`memory_fts` ranks a search with BM25 over every row a term matches in the scope; at 100k rows
in one scope that is ~60 ms of CPU per query, and it grows with the scope. This index holds the
same postings in numpy arrays and computes the score store/bm25.py states (FTS5's BM25 with
the previous turn weighted, a phrase's IDF from the texts alone and repeats weighing by their
log; both stores share it):

* documents are the rows of `memory_fts` (every scope: FTS5's N, avgdl and a phrase's IDF count
  the whole table), tokenised by FTS5 itself (an in-memory FTS5 table with the same tokenizer,
  read back through `fts5vocab`), so a word stems, folds and splits exactly as it is indexed;
* a term is a token or a pair of adjacent tokens of one column (a quoted query term is a
  phrase: `caroline's` is `carolin s`, found through the pair); its postings are the documents
  holding it, with its count in the body and in the previous-turn context;
* a phrase of three tokens or more (`o'neil's` is `o neil s`) is found in the documents
  holding each of its adjacent pairs, then counted in their tokens, which the index keeps in
  order (`seq`: 4 bytes a token, about a third of the postings): the documents holding the pairs
  need not hold the phrase (`o neil` and `neil s` apart), and how often it occurs is its
  count at each position, overlapping ones too (FTS5's), which no count of pairs gives;
* a document's length counts all three columns (the scope tokens too), as FTS5's does, and the
  scope of a search is the documents holding all its scope tokens, as in the SQL MATCH.

It follows the database exactly (index/follow.py): every change to a memory's document is
logged in `lex_log` in the writing transaction (by triggers on `memories`: schema.py), naming
the memory, and a search first applies the entries past the ones it has seen (any process may
have written them): the memory's old document dies, its current one (if any) is indexed again.
Documents are numbered by memory (`rids`), never by a row number a database may give again.
New documents go to small segments, merged by size (`merge`: each document is merged again
only as often as its segment grows eightfold, so a small write never merges a large index);
a quarter dead rebuilds the whole index.

The log stays bounded (sqlite/lexlog.py `prune_log`, on every write): past `keep` entries the
older half is deleted and `meta.lex_horizon` records the last id gone. An index older than the
horizon cannot replay what it missed: it is loaded from its file or built again.

Its file (`save` / `load`) lets a new process start from the index instead of building it
(a minute at 1M rows), then catch up through the log. The file is a cache, trusted only
while the database names it: each save draws a random token, written in the file's header
and in `meta.lex_file` in one write transaction, and any erasure (a trigger on deleting a
memory, schema.py) sets `meta.lex_file` to 0 in the erasing transaction. A file whose token
the database does not hold (another database's, a restored backup's, one saved before an
erasure), whose position the log cannot reach, or whose checksum fails is never read further.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path
from typing import Any

import numpy as np

from .. import bm25, cachefile
from ..bm25 import K1, TOKENIZE, B, Tokenizer
from ..cachefile import pack, unpack


def first_pool(k: int) -> int:
    """How many ranked documents a search for `k` visible ones looks at first: a margin for
    those the query may not see (deleted, expired, of other kinds)."""
    return k + k // 8 + 32


@dataclass(frozen=True)
class Ranked:
    """The lexicon's best documents for a search, best first, as memory ids and scores;
    `whole`: every document a term matches is here (a bigger pool finds no more)."""

    ids: list[str]
    scores: list[float]
    whole: bool

    def visible(self, visible: Callable[[list[str]], set[str]]) -> list[tuple[str, float]]:
        seen = visible(self.ids)
        return list(compress(zip(self.ids, self.scores, strict=True), map(seen.__contains__, self.ids)))


# (number, memory id, body, context, owner): a document as texts (a memory_fts row's columns)
Doc = tuple[int, str, str, str, str]
# (number, memory id, tokens of the body, of the context, of the scope): one already tokenised
Tokens = tuple[int, str, Sequence[str], Sequence[str], Sequence[str]]
FANOUT = 8  # segments of one size class merged into one (`merge`)
MAX_DEAD = 0.25
BATCH = 20_000       # documents tokenised at once while building
MAGIC = b"engram-lexicon\n\x00"  # the first 16 bytes of a saved index
FORMAT = 3  # 2: documents numbered by memory (index/follow.py), no longer by memory_fts rowid;
# 3: with the documents' tokens (`seq`)
GAP = -1  # in `seq`: after each column (a phrase never spans two), and for no token

log = logging.getLogger("engram.store")

def _tf(counts: np.ndarray, out: np.ndarray) -> None:
    """`bm25.tf` of each count, into `out`: ln(max(count, 1)) + (1 if count else 0)."""
    np.maximum(counts, 1.0, out=out)
    np.log(out, out=out)
    out += counts > 0


def size_class(postings: int) -> int:
    """A segment's order of magnitude, base FANOUT (`Lexicon.merge`)."""
    c = 0
    while postings >= FANOUT:
        postings //= FANOUT
        c += 1
    return c


def pair_key(a: Any, b: Any) -> Any:
    """The key of two adjacent tokens (ints or int64 arrays): a token id is < 2**31."""
    return ((a + 1) << 31) | b


@dataclass
class Segment:
    """Postings of a batch of documents: for each term key (sorted), the documents holding it
    (ascending) with its counts in the body and the context column."""

    keys: np.ndarray    # int64, unique, sorted
    starts: np.ndarray  # int64, len(keys) + 1: postings of keys[i] are [starts[i], starts[i+1])
    docs: np.ndarray    # int32
    body: np.ndarray    # float32 (whole numbers, exact): the term's occurrences in the body
    context: np.ndarray  # float32: ... in the previous turn
    # per term key searched: its largest counts and its shortest document (`peak`)
    peaks: dict[int, tuple[float, float, float]] = field(default_factory=dict, init=False,
                                                         repr=False)

    @staticmethod
    def of(keys: np.ndarray, docs: np.ndarray, cols: np.ndarray) -> Segment:
        """From one entry per occurrence (term key, document, column 0/1/2)."""
        order = np.lexsort((docs, keys))
        keys, docs, cols = keys[order], docs[order], cols[order]
        new = np.ones(len(keys), dtype=bool)
        new[1:] = (keys[1:] != keys[:-1]) | (docs[1:] != docs[:-1])
        at = np.flatnonzero(new)
        body = np.add.reduceat((cols == 0).astype(np.float32), at) if len(at) else \
            np.zeros(0, dtype=np.float32)
        ctx = np.add.reduceat((cols == 1).astype(np.float32), at) if len(at) else \
            np.zeros(0, dtype=np.float32)
        pkeys, pdocs = keys[at], docs[at].astype(np.int32)
        ukeys, first = np.unique(pkeys, return_index=True)
        starts = np.append(first, len(pkeys)).astype(np.int64)
        return Segment(ukeys, starts, pdocs, body, ctx)

    @staticmethod
    def merged(parts: Sequence[Segment]) -> Segment:
        keys = np.concatenate([np.repeat(p.keys, np.diff(p.starts)) for p in parts])
        docs = np.concatenate([p.docs for p in parts])
        order = np.lexsort((docs, keys))
        keys = keys[order]
        ukeys, first = np.unique(keys, return_index=True)
        return Segment(ukeys, np.append(first, len(keys)).astype(np.int64), docs[order],
                       np.concatenate([p.body for p in parts])[order],
                       np.concatenate([p.context for p in parts])[order])

    def postings(self, key: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        i = int(np.searchsorted(self.keys, key))
        if i == len(self.keys) or self.keys[i] != key:
            return None
        s, e = self.starts[i], self.starts[i + 1]
        return self.docs[s:e], self.body[s:e], self.context[s:e]

    def peak(self, key: int, lens: np.ndarray) -> tuple[float, float, float] | None:
        """A term's largest count in the body and in the context, and the length of its
        shortest document, over its postings here (dead documents too: a segment never
        changes, so neither do these); None if no document here holds it."""
        found = self.peaks.get(key)
        if found is None:
            posted = self.postings(key)
            if posted is None:
                return None
            docs, body, ctx = posted
            found = self.peaks[key] = (float(body.max()), float(ctx.max()),
                                       float(lens[docs].min()))
        return found


class Lexicon:
    """BM25 postings of every row of `memory_fts`, exact as of log entry `version`."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        """`tokenizer`: a query term's phrase, as FTS5 parses it (shared with its owner, who
        closes it; else the lexicon's own)."""
        self._fts: sqlite3.Connection | None = None  # tokenises `add`'s texts, made when needed
        self._owns_tokenizer = tokenizer is None
        self.query_tokens = Tokenizer() if tokenizer is None else tokenizer
        self.vocab: dict[str, int] = {}
        self.segments: list[Segment] = []
        self.rids = np.zeros(0, dtype=np.int64)   # per document: its number (one per memory)
        self.lens = np.zeros(0, dtype=np.float64)  # its tokens, all three columns
        self.alive = np.zeros(0, dtype=bool)
        self.ids: list[str] = []                   # its memory's id
        self.doc_of = np.zeros(0, dtype=np.int32)  # per number: its live document, or -1
        # every document's text and previous turn as token ids, in order, each followed by a
        # GAP (a phrase of three tokens or more is counted in them): document d's are
        # seq[at[d]:at[d + 1]], its text's before mid[d]
        self.seq = np.zeros(0, dtype=np.int32)
        self.at = np.zeros(1, dtype=np.int64)
        self.mid = np.zeros(0, dtype=np.int64)
        self.n = 0
        self.count = 0      # live documents: FTS5's N
        self.total = 0.0    # their tokens: N * avgdl
        self.version = -1   # the log position it is exact as of; -1: not built
        self.erasures = 0   # meta.erasures when built: an erasure since drops it (its words)
        self.saved = -1     # the version last saved to (or loaded from) its file
        self._scopes: dict[tuple[str, ...], tuple[tuple[int, int], np.ndarray | None]] = {}
        # per document, BM25's length normalisation (as of `count` and `total`), and the
        # score and hit buffers of a search (zero and False between searches)
        self._norm: tuple[tuple[int, float, int], np.ndarray] | None = None
        self._score = np.zeros(0)
        self._hit = np.zeros(0, dtype=bool)
        self._done = np.zeros(0, dtype=bool)
        self._tmp = np.zeros((3, 0))  # per posting of a term: f, numerator, denominator

    def close(self) -> None:
        if self._fts is not None:
            self._fts.close()
        if self._owns_tokenizer:
            self.query_tokens.close()

    # -- keeping it exact ----------------------------------------------------------------------

    def add(self, docs: Sequence[Doc], merge: bool = True) -> None:
        """Index documents given as texts (a memory_fts row's columns), as new documents; then
        `merge` (not: the caller adds more first)."""
        for i in range(0, len(docs), BATCH):
            self._add(docs[i:i + BATCH])
        if merge:
            self.merge()

    def add_tokens(self, docs: Sequence[Tokens], merge: bool = True) -> None:
        """Index documents given as their tokens (the PostgreSQL store's, made by the same
        tokenizer: bm25.py), as new documents; then `merge` (not: the caller adds more first)."""
        for i in range(0, len(docs), BATCH):
            self._add_tokens(docs[i:i + BATCH])
        if merge:
            self.merge()

    def merge(self) -> None:
        """Merge the segments of a size class once it holds FANOUT of them (a build adds its
        batches first, then merges once: merging after each batch would merge everything
        built so far again and again).

        A segment's class is its postings' order of magnitude, base FANOUT; merged, FANOUT
        of them make one of the class above. A posting is thus rewritten about
        log_FANOUT(postings) times in all, the few documents of a small write merge with
        segments as small as theirs, and the large segments of a build only with each other,
        when eight of them are there (a search after a write never merges the whole index).
        The classes hold at most FANOUT - 1 segments each: a few dozen lookups a term."""
        while True:
            classes: dict[int, list[int]] = {}
            for i, seg in enumerate(self.segments):
                classes.setdefault(size_class(len(seg.docs)), []).append(i)
            full = next((group for group in classes.values() if len(group) >= FANOUT), None)
            if full is None:
                return
            merged = Segment.merged([self.segments[i] for i in full])
            self.segments = [seg for i, seg in enumerate(self.segments) if i not in full] + [merged]

    def _add(self, docs: Sequence[Doc]) -> None:
        if not docs:
            return
        db = self._fts
        if db is None:
            db = self._fts = sqlite3.connect(":memory:", isolation_level=None,
                                             check_same_thread=False)
            db.execute(f"CREATE VIRTUAL TABLE t USING fts5(a, b, c, content='', tokenize='{TOKENIZE}')")
            db.execute("CREATE VIRTUAL TABLE v USING fts5vocab(t, 'instance')")
            db.execute("CREATE VIRTUAL TABLE vr USING fts5vocab(t, 'row')")
        db.execute("BEGIN")
        db.executemany("INSERT INTO t(rowid, a, b, c) VALUES (?, ?, ?, ?)",
                       [(j, d[2], d[3], d[4]) for j, d in enumerate(docs)])
        # Both vocabulary tables walk the index in term order: each distinct term with its
        # occurrences (`row`), then every occurrence, term by term (`instance`), read as one
        # integer each (document, column, position) to keep Python out of the inner loop.
        vocab = self.vocab
        counts = db.execute("SELECT term, cnt FROM vr").fetchall()
        packed = np.array([row[0] for row in db.execute(
            "SELECT (doc << 34) | ((CASE col WHEN 'a' THEN 0 WHEN 'b' THEN 1 ELSE 2 END) << 32) "
            "| offset FROM v")], dtype=np.int64)
        db.execute("INSERT INTO t(t) VALUES ('delete-all')")
        db.execute("COMMIT")
        ids = np.array([vocab.setdefault(term, len(vocab)) for term, _ in counts], dtype=np.int64)
        toks = np.repeat(ids, [c for _, c in counts])
        assert len(toks) == len(packed), "the vocabulary tables disagree"
        self._index(docs, toks, packed >> 34, ((packed >> 32) & 3).astype(np.int8),
                    packed & 0xFFFFFFFF)

    def _add_tokens(self, docs: Sequence[Tokens]) -> None:
        if not docs:
            return
        vocab = self.vocab
        toks: list[int] = []
        dids: list[int] = []
        cs: list[int] = []
        offs: list[int] = []
        for j, (_, _, *cols) in enumerate(docs):
            for c, col in enumerate(cols):
                toks += [vocab.setdefault(t, len(vocab)) for t in col]
                dids += [j] * len(col)
                cs += [c] * len(col)
                offs += range(len(col))
        self._index(docs, np.array(toks, dtype=np.int64), np.array(dids, dtype=np.int64),
                    np.array(cs, dtype=np.int8), np.array(offs, dtype=np.int64))

    def _index(self, docs: Sequence[Doc] | Sequence[Tokens], toks: np.ndarray, dids: np.ndarray,
               cs: np.ndarray, offs: np.ndarray) -> None:
        """A segment of new documents, from one entry per token occurrence: its term id,
        document (0-based in `docs`), column (0 text, 1 previous turn, 2 scope) and offset."""
        base = self.n
        lens = np.bincount(dids, minlength=len(docs)).astype(np.float64)
        # pairs of adjacent tokens of the same column (text and context; scope tokens are
        # never searched as phrases)
        order = np.lexsort((offs, cs, dids))
        toks, dids, cs, offs = toks[order], dids[order], cs[order], offs[order]
        adj = np.flatnonzero((dids[1:] == dids[:-1]) & (cs[1:] == cs[:-1]) & (cs[1:] < 2)
                             & (offs[1:] == offs[:-1] + 1))
        keys = np.concatenate([toks, pair_key(toks[adj], toks[adj + 1])])
        all_docs = np.concatenate([dids, dids[adj]]) + base
        all_cols = np.concatenate([cs, cs[adj]])
        self.segments.append(Segment.of(keys, all_docs, all_cols))
        self._grow(base + len(docs))
        self._sequence(len(docs), toks, dids, cs, offs)
        self.rids[base:base + len(docs)] = [d[0] for d in docs]
        self.lens[base:base + len(docs)] = lens
        self.alive[base:base + len(docs)] = True
        rids = np.array([d[0] for d in docs], dtype=np.int64)
        self._map(int(rids.max()))
        self._kill_docs(self.doc_of[rids])  # a row indexed again: its old document dies
        self.doc_of[rids] = np.arange(base, base + len(docs), dtype=np.int32)
        self.ids.extend(d[1] for d in docs)
        self.n = base + len(docs)
        self.count += len(docs)
        self.total += float(lens.sum())
        self._scopes.clear()

    def _sequence(self, m: int, toks: np.ndarray, dids: np.ndarray, cs: np.ndarray,
                  offs: np.ndarray) -> None:
        """`seq` of `m` new documents, from their occurrences sorted by document, column and
        offset (a column's tokens at their offsets: FTS5 matches a phrase by offset)."""
        text = cs < 2
        toks, dids, cs, offs = toks[text], dids[text], cs[text].astype(np.int64), offs[text]
        width = np.zeros((2, m), dtype=np.int64)  # per column and document: its last offset + 1
        last = np.flatnonzero(np.append((dids[1:] != dids[:-1]) | (cs[1:] != cs[:-1]), True)) \
            if len(dids) else np.zeros(0, dtype=np.int64)
        width[cs[last], dids[last]] = offs[last] + 1
        size = width[0] + width[1] + 2
        start = int(self.at[self.n]) + np.cumsum(size) - size
        end = int(start[-1] + size[-1])
        if end > len(self.seq):
            grown = np.full(max(end, 2 * len(self.seq)), GAP, dtype=np.int32)
            grown[:self.at[self.n]] = self.seq[:self.at[self.n]]
            self.seq = grown
        self.seq[self.at[self.n]:end] = GAP
        self.seq[start[dids] + offs + cs * (width[0][dids] + 1)] = toks
        self.at[self.n + 1:self.n + m + 1] = start + size
        self.mid[self.n:self.n + m] = start + width[0]

    def _grow(self, need: int) -> None:
        if need <= len(self.rids):
            return
        cap = max(need, 2 * len(self.rids), 16)
        self.rids = np.resize(self.rids, cap)
        self.lens = np.resize(self.lens, cap)
        self.mid = np.resize(self.mid, cap)
        at = np.zeros(cap + 1, dtype=np.int64)
        at[:len(self.at)] = self.at
        self.at = at
        alive = np.zeros(cap, dtype=bool)
        alive[:len(self.alive)] = self.alive
        self.alive = alive

    def _kill_docs(self, docs: np.ndarray) -> None:
        docs = docs[docs >= 0]
        docs = np.unique(docs[self.alive[docs]])
        self.alive[docs] = False
        self.count -= len(docs)
        self.total -= float(self.lens[docs].sum())  # whole numbers: exact in any order

    def remove(self, rids: Sequence[int]) -> None:
        """The documents of these numbers are gone (deleted, or about to be indexed again)."""
        held = np.array([rid for rid in rids if rid < len(self.doc_of)], dtype=np.int64)
        self._kill_docs(self.doc_of[held])
        self.doc_of[held] = -1
        self._scopes.clear()

    def _map(self, top: int) -> None:
        """Room in `doc_of` for numbers up to `top`."""
        if top >= len(self.doc_of):
            grown = np.full(max(top + 1, 2 * len(self.doc_of)), -1, dtype=np.int32)
            grown[:len(self.doc_of)] = self.doc_of
            self.doc_of = grown

    def dead_share(self) -> float:
        return 1.0 - self.count / self.n if self.n else 0.0

    # -- its file ------------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, Any], list[np.ndarray]] | None:
        """The index as a header and arrays (`write` saves them; the arrays are copies where
        later changes rewrite them in place); None if it cannot be saved (a NUL in an id)."""
        n = self.n
        terms, ids = pack(list(self.vocab)), pack(self.ids)
        if terms is None or ids is None:
            log.warning("the lexical index is not saved: an id holds a NUL character")
            return None
        out = [a for s in self.segments for a in (s.keys, s.starts, s.docs, s.body, s.context)]
        return {"format": FORMAT, "tokenize": TOKENIZE, "version": self.version,
                "erasures": self.erasures, "n": n, "count": self.count, "total": self.total,
                "terms": len(self.vocab), "segments": len(self.segments)}, \
            [*out, self.seq[:self.at[n]], self.at[:n + 1].copy(), self.mid[:n].copy(),
             self.rids[:n].copy(), self.lens[:n].copy(), self.alive[:n].copy(), terms, ids]

    @staticmethod
    def write(path: Path, token: int, state: tuple[dict[str, Any], list[np.ndarray]]) -> Path:
        """Write a `state` to a temporary file beside `path` (the caller renames it into
        place, under the database's write lock)."""
        head, arrays = state
        return cachefile.write(path, MAGIC, {**head, "token": token}, arrays)

    @classmethod
    def load(cls, path: Path, token: int) -> Lexicon | None:
        """The index saved at `path` if its header names `token` and its checksum holds; None
        otherwise (no file, another save's, torn, corrupt or of another format)."""
        found = cachefile.read(path, MAGIC, token, {"format": FORMAT, "tokenize": TOKENIZE})
        if found is None:
            return None
        head, arrays = found
        try:
            *segs, seq, at, mid, rids, lens, alive, terms, ids = arrays
            lex = cls()
            lex.segments = [Segment(*segs[i:i + 5]) for i in range(0, len(segs), 5)]
            lex.vocab = {t: i for i, t in enumerate(unpack(terms, head["terms"]))}
            lex.ids = unpack(ids, head["n"])
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
            log.warning("ignoring the malformed lexical index %s: %s", path, exc)
            return None
        n = lex.n = head["n"]
        lex.rids, lex.lens, lex.alive = rids.astype(np.int64), lens.astype(np.float64), \
            alive.astype(bool)
        lex.seq, lex.at, lex.mid = seq.astype(np.int32), at.astype(np.int64), mid.astype(np.int64)
        lex._map(int(rids.max()) if n else 0)
        live = np.flatnonzero(lex.alive)
        lex.doc_of[lex.rids[live]] = live.astype(np.int32)
        lex.count, lex.total = head["count"], head["total"]
        lex.version = lex.saved = head["version"]
        lex.erasures = head["erasures"]
        return lex

    # -- searching -----------------------------------------------------------------------------

    def _phrase_key(self, phrase: Sequence[str]) -> int | None:
        """The term key of a phrase of one or two tokens; -1 if no document can hold it."""
        ids = [self.vocab.get(t) for t in phrase]
        if any(i is None for i in ids):
            return -1
        if len(ids) == 1:
            return ids[0]
        a, b = ids
        assert a is not None and b is not None
        return int(pair_key(a, b))

    def _phrase_postings(self, phrase: Sequence[str]) -> tuple[np.ndarray, np.ndarray,
                                                               np.ndarray, int | None]:
        """The live documents holding a phrase, with its counts per column, and its term key
        (None: a phrase of three tokens or more, which no term holds)."""
        if len(phrase) <= 2:
            key = self._phrase_key(phrase)
            key = -1 if key is None else key
            return (*self._postings(key), key)
        ids = [self.vocab.get(t) for t in phrase]
        if any(i is None for i in ids):
            return (*self._postings(-1), None)
        return (*self._occurrences([i for i in ids if i is not None]), None)

    def _occurrences(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The live documents holding the phrase of these tokens (three or more) in their
        text or previous turn, with its occurrences in each: those holding each of its
        adjacent pairs, its occurrences counted in their tokens (`seq`) at every offset, as
        FTS5 counts them (overlapping ones too)."""
        pairs = sorted((self._postings(int(pair_key(a, b)))[0]
                        for a, b in zip(ids, ids[1:], strict=False)), key=len)
        docs = pairs[0]
        for other in pairs[1:]:
            docs = np.intersect1d(docs, other, assume_unique=True)
        starts, ends = self.at[docs], self.at[docs.astype(np.int64) + 1]
        lens = ends - starts
        total = int(lens.sum())
        owner = np.repeat(np.arange(len(docs)), lens)
        where = np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
        # each document's tokens end with a GAP: a phrase never runs into the next one
        tokens = np.append(self.seq[where], np.full(len(ids), GAP, dtype=np.int32))
        hit = tokens[:total] == ids[0]
        for j, t in enumerate(ids[1:], 1):
            hit &= tokens[j:j + total] == t
        at = np.flatnonzero(hit)
        doc = owner[at]
        in_text = where[at] < self.mid[docs[doc]]
        body = np.bincount(doc[in_text], minlength=len(docs)).astype(np.float32)
        ctx = np.bincount(doc[~in_text], minlength=len(docs)).astype(np.float32)
        held = (body > 0) | (ctx > 0)
        return docs[held].astype(np.int32), body[held], ctx[held]

    def _postings(self, key: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The live documents holding a term, with its counts per column."""
        found = [p for s in self.segments if key >= 0 and (p := s.postings(key)) is not None]
        if not found:
            empty = np.zeros(0)
            return empty.astype(np.int32), empty, empty
        docs, body, ctx = (np.concatenate(x) for x in zip(*found, strict=True)) \
            if len(found) > 1 else found[0]
        if self.count == self.n:
            return docs, body, ctx  # no dead document (a fresh index): no filtering
        live = self.alive[docs]
        return docs[live], body[live], ctx[live]

    def in_scope(self, owners: Sequence[str]) -> np.ndarray | None:
        """Documents holding every one of the scope's tokens (None: all of them)."""
        if not owners:
            return None
        key = tuple(owners)
        hit = self._scopes.get(key)
        if hit is not None and hit[0] == (self.n, self.count):
            return hit[1]
        mask = np.zeros(self.n, dtype=bool)
        first = True
        for o in owners:
            # as FTS5 reads the MATCH: the stemmer may change a scope token (`...dce` is `...dc`)
            p = self.query_tokens.phrase(o)
            t = self.vocab.get(p[0]) if len(p) == 1 else None
            docs = self._postings(t)[0] if t is not None else np.zeros(0, dtype=np.int32)
            m = np.zeros(self.n, dtype=bool)
            m[docs] = True
            mask = m if first else mask & m
            first = False
        if len(self._scopes) > 16:
            self._scopes.clear()
        # a scope holding every live document (one tenant) filters nothing: no mask at all
        everything = int(np.count_nonzero(mask & self.alive[:self.n])) == self.count
        self._scopes[key] = ((self.n, self.count), None if everything else mask)
        return None if everything else mask

    def top(self, terms: Sequence[str], owners: Sequence[str], size: int,
            previous_weight: float) -> tuple[np.ndarray, np.ndarray]:
        """The best `size` in-scope documents any term matches (fewer when fewer match), best
        first, with their `-bm25()`.

        Exact without scoring every match (MaxScore): a document that none of the phrases
        with the highest bounds holds scores at most the sum of the other phrases' bounds
        (`_bound`), so once the `size`-th best of the documents those phrases hold scores more
        than that, no other document can enter the top. The other phrases' postings are then
        only looked up for those documents, not scored. When the cut asks for more phrases,
        the next round scores only the documents they bring (the others' scores stand). A
        document's score is the very float a full scoring gives (its terms added in query
        order); among documents tied at the cut, which ones are returned may differ (as it
        may between FTS5 and this index)."""
        phrases = [p for p in map(self.query_tokens.phrase, terms) if p]
        if not phrases or not self.count or size <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        scope = self.in_scope(owners)
        posted = []  # per phrase: its in-scope postings, IDF and bound
        for p in phrases:
            docs, body, ctx, key = self._phrase_postings(p)
            # n(p): the documents whose text holds it (bm25.py: not their previous turn's)
            idf = bm25.idf(self.count, int(np.count_nonzero(body)))
            if scope is not None:
                keep = scope[docs]
                docs, body, ctx = docs[keep], body[keep], ctx[keep]
            # a hair above the bound: a score is summed in floats, the bound in others
            most = self._bound(key, previous_weight) if key is not None else \
                self._most(docs, body, ctx, previous_weight)
            bound = idf * most * (1 + 1e-9) if len(docs) else 0.0
            posted.append((docs, body, ctx, idf, bound))
        order = sorted(range(len(posted)), key=lambda i: -posted[i][4])
        rest = [0.0] * (len(order) + 1)  # rest[j]: the most a document outside order[:j] scores
        for j in range(len(order) - 1, -1, -1):
            rest[j] = rest[j + 1] + posted[order[j]][4]
        if len(self._score) < self.n:
            self._score, self._hit, self._done = (np.zeros(self.n), np.zeros(self.n, dtype=bool),
                                                  np.zeros(self.n, dtype=bool))
        # zero and False between searches: a document's score, whether it is to be scored in
        # this round, whether it was scored in an earlier one (its score then stands)
        score, hit, done = self._score, self._hit, self._done
        need, marked = 1, 0
        found = np.zeros(0, dtype=np.int64)
        try:
            while True:
                for i in order[marked:need]:
                    hit[posted[i][0]] = True
                marked = need
                hit[found] = False
                new = np.flatnonzero(hit)
                if len(found) + len(new) < size and need < len(order):  # too few to cut
                    need += 1
                    continue
                # the new documents only, by every phrase in query order (as FTS5 adds them);
                # in the first round every posting of the chosen phrases is a new document's
                whole = set(order[:need]) if not len(found) else set()
                for i, (docs, body, ctx, idf, _) in enumerate(posted):
                    if i not in whole:
                        m = hit[docs]
                        docs, body, ctx = docs[m], body[m], ctx[m]
                    self._accumulate(score, docs, body, ctx, idf, previous_weight)
                hit[new] = False
                done[new] = True
                found = np.flatnonzero(done)  # ascending, as if all were scored at once
                got = score[found]
                part = np.argpartition(-got, size - 1) if len(found) >= size else None
                cut = got[part[size - 1]] if part is not None else None
                if need == len(order) or (cut is not None and rest[need] < cut):
                    break
                need += 1  # the fewest phrases whose outside stays below the cut
                while cut is not None and need < len(order) and rest[need] >= cut:
                    need += 1
        except BaseException:
            score[:], hit[:], done[:] = 0.0, False, False
            raise
        score[found] = 0.0
        done[found] = False
        best = part[:size] if part is not None and len(found) > size else np.arange(len(found))
        best = best[np.argsort(-got[best], kind="stable")]
        return found[best], got[best]

    def _bound(self, key: int, previous_weight: float) -> float:
        """The most `f * (K1 + 1) / (f + norm)` can be for a document holding the term: its
        largest counts over its shortest document (the fraction grows with f and falls with
        the document's length)."""
        best, avgdl = 0.0, self.total / self.count
        for seg in self.segments:
            peak = seg.peak(key, self.lens)
            if peak is not None:
                body, ctx, shortest = peak
                f = bm25.tf(body) + bm25.tf(ctx) * max(previous_weight, 0.0)
                norm = K1 * (1 - B + B * shortest / avgdl)
                best = max(best, f * (K1 + 1.0) / (f + norm))
        return best

    def _most(self, docs: np.ndarray, body: np.ndarray, ctx: np.ndarray,
              previous_weight: float) -> float:
        """`_bound` of a phrase of three tokens or more, from its postings (no segment keeps
        its peaks): the most its fraction is over these documents."""
        if not len(docs):
            return 0.0
        f = np.zeros(len(docs))
        _tf(body, f)
        tail = np.zeros(len(docs))
        _tf(ctx, tail)
        f += tail * max(previous_weight, 0.0)
        return float(np.max(f * (K1 + 1.0) / (f + self._norms()[docs])))

    def _accumulate(self, score: np.ndarray, docs: np.ndarray, body: np.ndarray,
                    ctx: np.ndarray, idf: float, previous_weight: float) -> None:
        """Add a phrase's term to its documents' scores: idf * (f * (K1 + 1) / (f + norm))
        with f = tf(body) + tf(context) * previous_weight (bm25.py), in float64, in reused
        buffers (the same operations, so the same values, whichever documents are scored)."""
        if self._tmp.shape[1] < len(docs):
            self._tmp = np.zeros((3, max(len(docs), 2 * self._tmp.shape[1])))
        f, num, den = (t[:len(docs)] for t in self._tmp)
        _tf(body, f)
        if previous_weight:
            _tf(ctx, num)
            num *= previous_weight
            f += num
        np.multiply(f, K1 + 1.0, out=num)
        np.take(self._norms(), docs, out=den)
        den += f
        np.divide(num, den, out=num)
        num *= idf
        score[docs] += num

    def _norms(self) -> np.ndarray:
        """Each document's `K1 * (1 - B + B * len / avgdl)`, computed once per change of the
        index (the same operations, in the same order, as per posting)."""
        at = (self.count, self.total, self.n)
        if self._norm is None or self._norm[0] != at:
            avgdl = self.total / self.count
            self._norm = at, K1 * (1 - B + B * self.lens[:self.n] / avgdl)
        return self._norm[1]

    def search(self, terms: Sequence[str], owners: Sequence[str], k: int, previous_weight: float,
               visible: Callable[[list[str]], set[str]],
               pool: int | None = None) -> list[tuple[str, float]]:
        """The best `k` visible memories by BM25 (`visible` keeps the ids the query may see:
        the SQL's other conditions), in growing pools."""
        size = pool or first_pool(k)
        while True:
            ranked = self.ranked(terms, owners, size, previous_weight)
            hits = ranked.visible(visible)
            if len(hits) >= k or ranked.whole:
                return hits[:k]
            size *= 4

    def ranked(self, terms: Sequence[str], owners: Sequence[str], size: int,
               previous_weight: float) -> Ranked:
        """`top` as memory ids, before any visibility check."""
        docs, score = self.top(terms, owners, size, previous_weight)
        return Ranked(list(map(self.ids.__getitem__, docs.tolist())), score.tolist(), len(docs) < size)

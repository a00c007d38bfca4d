"""What encryption at rest costs, and the two SQLite cipher builds of PyPI side by side:
plain sqlite3, SQLCipher (`sqlcipher3-binary`, engram's choice) and SQLite3 Multiple Ciphers
(`apsw-sqlite3mc`, its default ChaCha20-Poly1305 cipher), on the same workload in WAL mode with
synchronous=FULL: small write transactions (a row and its FTS5 entry), point reads, FTS5
queries, and the cost of opening a connection with a passphrase.

    python bench/encryption.py [--rows 2000]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORDS = ("tea coffee lisbon porto cat ferry cello garden rain music bike train allergy "
         "peanut doctor sister birthday flight hotel meeting").split()
KEY = "correct horse battery staple"


def plain(path: Path) -> Any:
    return sqlite3.connect(path, isolation_level=None)


def sqlcipher(path: Path) -> Any:
    from sqlcipher3 import dbapi2

    conn = dbapi2.connect(str(path), isolation_level=None)
    conn.execute(f"PRAGMA key = '{KEY}'")
    return conn


def sqlite3mc(path: Path) -> Any:
    import apsw

    conn = apsw.Connection(str(path))
    conn.pragma("key", KEY)
    return conn


def workload(opener: Callable[[Path], Any], directory: Path, rows: int) -> dict[str, float]:
    path = directory / "bench.db"
    started = time.perf_counter()
    conn = opener(path)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("CREATE TABLE IF NOT EXISTS m (id INTEGER PRIMARY KEY, text TEXT, vec BLOB)")
    conn.execute("CREATE VIRTUAL TABLE IF NOT EXISTS f USING fts5(body)")
    opened = time.perf_counter() - started
    rng = random.Random(7)
    texts = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(rows)]
    vec = bytes(384 * 4)
    started = time.perf_counter()
    for i, text in enumerate(texts):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO m VALUES (?, ?, ?)", (i, text, vec))
        conn.execute("INSERT INTO f(rowid, body) VALUES (?, ?)", (i, text))
        conn.execute("COMMIT")
    writes = rows / (time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(rows):
        list(conn.execute("SELECT text, vec FROM m WHERE id = ?", (rng.randrange(rows),)))
    reads = rows / (time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(200):
        list(conn.execute("SELECT rowid FROM f WHERE f MATCH ? ORDER BY rank LIMIT 10",
                          (f"{rng.choice(WORDS)} {rng.choice(WORDS)}",)))
    fts = 200 / (time.perf_counter() - started)
    conn.close()
    started = time.perf_counter()
    again = opener(path)
    list(again.execute("SELECT count(*) FROM m"))
    reopen = time.perf_counter() - started
    again.close()
    size = sum(p.stat().st_size for p in directory.glob("bench.db*"))
    return {"open_ms": opened * 1000, "reopen_ms": reopen * 1000, "writes_s": writes,
            "reads_s": reads, "fts_s": fts, "mb": size / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    args = parser.parse_args()
    kdf = time.perf_counter()
    hashlib.pbkdf2_hmac("sha512", KEY.encode(), b"0" * 16, 256_000, 32)
    print(f"PBKDF2-HMAC-SHA512, 256,000 rounds (SQLCipher 4's key derivation): "
          f"{(time.perf_counter() - kdf) * 1000:.0f} ms")
    print(f"{'build':28} {'open ms':>8} {'reopen ms':>9} {'writes/s':>9} {'reads/s':>9} "
          f"{'fts q/s':>8} {'MB':>6}")
    for name, opener in (("sqlite3 (plain)", plain), ("sqlcipher3-binary", sqlcipher),
                         ("apsw-sqlite3mc (chacha20)", sqlite3mc)):
        try:
            with tempfile.TemporaryDirectory() as d:
                r = workload(opener, Path(d), args.rows)
        except ImportError as exc:
            print(f"{name:28} not installed ({exc.name})")
            continue
        print(f"{name:28} {r['open_ms']:8.1f} {r['reopen_ms']:9.1f} {r['writes_s']:9.0f} "
              f"{r['reads_s']:9.0f} {r['fts_s']:8.0f} {r['mb']:6.1f}")


if __name__ == "__main__":
    main()

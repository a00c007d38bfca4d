"""The file format of the caches the SQLite store saves beside its database (the lexical
index, index/lexicon.py, and the large dense caches, index/slab.py): numpy arrays behind a JSON
header, with a checksum, written to a temporary file that the store renames into place.

Such a file is only a cache, trusted while the database names it: each save draws a random
token, written in the file's header and in a `meta` row in one write transaction (the rename
under the same lock), and an erasure sets those rows to 0 in the erasing transaction
(schema.py's triggers). `read` returns nothing for a file whose token is not the one asked
for (another database's, a restored backup's, one saved before an erasure), whose checksum
fails, or of another format; the store then rebuilds from the tables.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ALIGN = 8

log = logging.getLogger("engram.store")


def pack(strings: Sequence[str]) -> np.ndarray | None:
    """Strings as one NUL-separated UTF-8 array; None if one holds a NUL itself."""
    blob = "\0".join(strings)
    if blob.count("\0") != max(len(strings) - 1, 0):
        return None
    return np.frombuffer(blob.encode(), dtype=np.uint8)


def unpack(arr: np.ndarray, n: int) -> list[str]:
    return arr.tobytes().decode().split("\0") if n else []


def private(path: Path) -> int:
    """Open `path` for writing (created or emptied), readable by its owner only whatever the
    umask, as the database beside it (0600; its folder 0700): the descriptor. A cache file
    holds what the database holds (terms, ids, vectors)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def write(path: Path, magic: bytes, header: dict[str, Any], arrays: Sequence[np.ndarray]) -> Path:
    """Write `header` (with the arrays' layout added) and `arrays` to a temporary file beside
    `path`, flushed to the disk; returns it (the caller renames it into place)."""
    layout, at = [], 0
    for a in arrays:
        layout.append([a.dtype.str, list(a.shape), at])
        at += -(-a.nbytes // ALIGN) * ALIGN
    raw = json.dumps({**header, "arrays": layout}).encode()
    head = magic + len(raw).to_bytes(8, "little") + raw
    head += b"\0" * (-len(head) % ALIGN)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    try:
        with os.fdopen(private(tmp), "wb") as f:
            crc = zlib.crc32(head)
            f.write(head)
            for a in arrays:
                data = np.ascontiguousarray(a).data.cast("B")
                pad = b"\0" * (-len(data) % ALIGN)
                crc = zlib.crc32(pad, zlib.crc32(data, crc))
                f.write(data)
                f.write(pad)
            f.write(crc.to_bytes(4, "little"))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def read(path: Path, magic: bytes, token: int,
         expect: dict[str, Any]) -> tuple[dict[str, Any], list[np.ndarray]] | None:
    """The header and arrays saved at `path` if its header names `token`, holds the values of
    `expect` (its format, ...) and its checksum holds; None otherwise."""
    what = magic.decode(errors="replace").strip("\n\0")
    try:
        with open(path, "rb") as f:
            start = f.read(len(magic) + 8)
            if len(start) < len(magic) + 8 or start[:len(magic)] != magic:
                raise ValueError(f"not a {what} file")
            size = int.from_bytes(start[len(magic):], "little")
            if size > 1 << 26:
                raise ValueError("header too long")
            raw = f.read(size)
            head = json.loads(raw)
            if not isinstance(head, dict) or head.get("token") != token:
                return None  # another save's (or another database's): not this one
            if any(head.get(k) != v for k, v in expect.items()):
                raise ValueError("another format")
            f.read(-(len(start) + size) % ALIGN)
            body = bytearray(os.fstat(f.fileno()).st_size - f.tell())
            f.readinto(body)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        log.warning("ignoring the unreadable %s %s: %s", what, path, exc)
        return None
    pre = start + raw + b"\0" * (-(len(start) + size) % ALIGN)
    if len(body) < 4 or zlib.crc32(memoryview(body)[:-4], zlib.crc32(pre)) != \
            int.from_bytes(body[-4:], "little"):
        log.warning("ignoring the %s %s: its checksum fails", what, path)
        return None
    try:
        arrays = [np.frombuffer(body, dtype=np.dtype(dt), count=math.prod(shape),
                                offset=at).reshape(shape) for dt, shape, at in head["arrays"]]
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring the malformed %s %s: %s", what, path, exc)
        return None
    return head, arrays

"""Many writers on one file: separate OS processes, and threads sharing one `Memory`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from engram import Memory

WRITER = textwrap.dedent("""
    import json, sys, time, traceback
    from pathlib import Path
    import torch
    torch.set_num_threads(1)  # two processes on two cores: do not oversubscribe
    from engram import Memory

    db, name, ready, go = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    errors, added = [], 0
    mem = Memory(db)
    mem.embedder.embed_batch(["warm up"])  # load the model before the race starts
    ready.touch()
    deadline = time.time() + 120
    while not go.exists() and time.time() < deadline:
        time.sleep(0.01)
    try:
        for i in range(100):  # 100 single adds ...
            res = mem.add(f"{name} says message {i}", user_id="shared", session_id=name)
            added += len(res.memories)
            if i % 10 == 0:
                mem.search("message", user_id="shared", limit=3)
        for j in range(10):   # ... and 10 batches of 5
            res = mem.add([f"{name} batch {j} item {k}" for k in range(5)], user_id="shared",
                          metadata={"writer": name})
            added += len(res.memories)
    except Exception:
        errors.append(traceback.format_exc())
    mem.close()
    print(json.dumps({"added": added, "errors": errors}))
""")


@pytest.mark.slow
def test_two_processes_write_the_same_file_at_once(tmp_path: Path, embedder) -> None:
    db = tmp_path / "shared.db"  # does not exist yet: both processes also race to create it
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    go = tmp_path / "go"
    procs = []
    for name in ("alpha", "beta"):
        ready = tmp_path / f"{name}.ready"
        procs.append((name, ready, subprocess.Popen(
            [sys.executable, str(script), str(db), name, str(ready), str(go)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    deadline = time.time() + 120
    while not all(r.exists() for _, r, _ in procs):
        assert time.time() < deadline, "writers did not start"
        for _, _, p in procs:
            assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    go.touch()
    results = {}
    for name, _, p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert "locked" not in err.lower() and "busy" not in err.lower(), err
        results[name] = json.loads(out.strip().splitlines()[-1])
    for name, res in results.items():
        assert res["errors"] == [], f"{name}: {res['errors']}"
        assert res["added"] == 150
    with Memory(db, embedder=embedder) as mem:
        st = mem.stats()
        assert st.memories == 300 and st.events == 300
        assert mem.stats(session_id="alpha").memories == 100
        assert len(mem.list(filters={"writer": "beta"}, limit=1000).items) == 50
        texts = [r.text for r in mem.list(user_id="shared", limit=1000).items]
        assert len(texts) == len(set(texts)) == 300
        # the processes really interleaved: neither wrote all of its rows in one block
        writers = ["alpha" if t.startswith("alpha") else "beta" for t in texts]
        switches = sum(a != b for a, b in zip(writers, writers[1:], strict=False))
        assert switches > 2


def test_threads_share_one_memory(mem: Memory) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def work(n: int) -> None:
        try:
            start.wait()
            for i in range(15):
                if i % 5 == 4:
                    mem.add([f"thread {n} batch {i} a", f"thread {n} batch {i} b"],
                            user_id=f"t{n}")
                else:
                    mem.add(f"thread {n} note {i}", user_id=f"t{n}")
                mem.search(f"note {i}", user_id=f"t{n}", limit=2)
                mem.list(user_id=f"t{n}", limit=5)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert mem.stats().memories == 4 * (12 + 3 * 2)
    for n in range(4):
        assert mem.stats(user_id=f"t{n}").memories == 18


def test_threads_update_and_delete_the_same_memories(mem: Memory) -> None:
    ids = [r.id for r in mem.add([f"shared note {i}" for i in range(8)]).memories]
    assert len(set(ids)) == 8
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i, mid in enumerate(ids):
                if (i + n) % 2:
                    mem.update(mid, metadata={"by": n})
                else:
                    mem.history(mid)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    updates = sum(len(mem.history(mid)) - 1 for mid in ids)
    assert updates == sum(1 for n in range(3) for i in range(8) if (i + n) % 2)

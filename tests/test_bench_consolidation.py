"""The consolidation benchmark runs in CI with the scripted oracle: engram's bookkeeping (related
fact lookup, supersession, late arrivals, `as_of`) must keep its targets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_consolidation_benchmark_meets_its_targets() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "consolidation.py"), "--people", "4",
                          "--late", "0.5"], capture_output=True, text=True, timeout=600, check=True)
    last = out.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"current_first=([\d.]+) as_of_old=([\d.]+)", last)
    assert m, out.stdout
    assert float(m[1]) >= 0.9 and float(m[2]) >= 0.9, out.stdout
    assert "late=0 " not in out.stdout  # the run did exercise late arrivals

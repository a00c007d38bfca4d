"""Redaction benchmark: precision and recall of `engram.redact` per type over the corpus in
tests/data/redaction_corpus.jsonl (positives in the common formats, look-alike negatives, and
the known limits, which count here but are not asserted by the tests).

    python bench/redaction.py [--corpus PATH] [--json] [--misses]

Every case is redacted with the `pii` policy (every type). A finding counts for precision when
it overlaps an expected value of its type; an expected value counts for recall when a finding of
its type covers it whole. Prints one row per type, the overall row, the cases that missed or
over-redacted (with --misses), the time to redact a 32,000-character adversarial input, and
last the line `precision=X recall=Y` (overall, limits included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from engram.redact import TYPES, Finding, Policy, find  # noqa: E402

CORPUS = ROOT / "tests" / "data" / "redaction_corpus.jsonl"


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    expect: tuple[Finding, ...]  # the ground truth, as spans
    limit: str | None = None     # a known limit: counted here, not asserted by the tests


def load(path: Path = CORPUS) -> list[Case]:
    cases = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        d: dict[str, Any] = json.loads(line)
        spans: list[Finding] = []
        for typ, value in d["expect"]:
            start = d["text"].find(value)
            while any(s.start == start for s in spans):  # a repeated value: its next occurrence
                start = d["text"].find(value, start + 1)
            if start < 0:
                raise ValueError(f"{d['id']}: {value!r} is not in the text")
            spans.append(Finding(typ, start, start + len(value)))
        cases.append(Case(d["id"], d["text"], tuple(spans), d.get("limit")))
    return cases


@dataclass
class Tally:
    tp_found: int = 0   # findings that overlap an expected value of their type
    found: int = 0
    covered: int = 0    # expected values covered whole by a finding of their type
    expected: int = 0

    @property
    def precision(self) -> float:
        return self.tp_found / self.found if self.found else 1.0

    @property
    def recall(self) -> float:
        return self.covered / self.expected if self.expected else 1.0


def judge(case: Case, found: list[Finding]) -> tuple[list[Finding], list[Finding]]:
    """(expected values missed, findings with no expected value of their type)."""
    missed = [e for e in case.expect
              if not any(f.type == e.type and f.start <= e.start and f.end >= e.end for f in found)]
    extra = [f for f in found
             if not any(f.type == e.type and f.start < e.end and e.start < f.end
                        for e in case.expect)]
    return missed, extra


def score(cases: list[Case]) -> tuple[dict[str, Tally], list[tuple[Case, list[Finding],
                                                                    list[Finding]]]]:
    tallies = {t: Tally() for t in TYPES}
    wrong = []
    for case in cases:
        found = find(case.text, Policy.PII)
        missed, extra = judge(case, found)
        for f in found:
            tallies[f.type].found += 1
            tallies[f.type].tp_found += f not in extra
        for e in case.expect:
            tallies[e.type].expected += 1
            tallies[e.type].covered += e not in missed
        if missed or extra:
            wrong.append((case, missed, extra))
    return tallies, wrong


def adversarial(n: int = 32_000) -> dict[str, float]:
    """Seconds to redact hostile inputs of `n` characters (the longest text engram takes)."""
    inputs = {
        "digits": "4" * n,
        "spaced digits": "41 " * (n // 3),
        "digit groups": "4111 " * (n // 5),
        "sk- prefixes": "sk-" * (n // 3),
        "dashed words": "a-" * (n // 2),
        "at signs": "a@" * (n // 2),
        "email labels": "a@" + "b." * (n // 2 - 1),
        "key=value": "password=" * (n // 9),
        "pem begins": "-----BEGIN RSA PRIVATE KEY-----" * (n // 31),
        "plus digits": "+1 " * (n // 3),
        "iban groups": "DE89 " * (n // 5),
        "urls": "a://b:" * (n // 6),
        "unicode": "４é𝟙\u200b" * (n // 4),
    }
    out = {}
    for name, text in inputs.items():
        t0 = time.perf_counter()
        find(text, Policy.PII)
        out[name] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--json", action="store_true", help="print the table as JSON")
    ap.add_argument("--misses", action="store_true", help="list every case that was not exact")
    args = ap.parse_args()
    cases = load(args.corpus)
    tallies, wrong = score(cases)
    total = Tally(*(sum(getattr(t, k) for t in tallies.values())
                    for k in ("tp_found", "found", "covered", "expected")))
    counts = Counter("limit" if c.limit else "positive" if c.expect else "negative" for c in cases)
    if args.json:
        print(json.dumps({t: {"precision": v.precision, "recall": v.recall, "found": v.found,
                              "expected": v.expected} for t, v in tallies.items()}, indent=2))
    else:
        print(f"{len(cases)} cases: {counts['positive']} positive, {counts['negative']} negative "
              f"(look-alikes), {counts['limit']} known limits\n")
        print(f"{'type':<12} {'expected':>8} {'found':>6} {'precision':>9} {'recall':>7}")
        for t, v in [*tallies.items(), ("overall", total)]:
            print(f"{t:<12} {v.expected:>8} {v.found:>6} {v.precision:>9.3f} {v.recall:>7.3f}")
        print()
        for case, missed, extra in wrong:
            if args.misses or not case.limit:
                tag = f" (known limit: {case.limit})" if case.limit else ""
                print(f"{case.id}{tag}: missed {[case.text[m.start:m.end] for m in missed]}, "
                      f"over-redacted {[(f.type, case.text[f.start:f.end]) for f in extra]}")
        slowest = max(adversarial().items(), key=lambda kv: kv[1])
        print(f"slowest adversarial 32,000-character input: {slowest[0]!r} {slowest[1] * 1000:.1f} ms")
    print(f"precision={total.precision:.3f} recall={total.recall:.3f}")


if __name__ == "__main__":
    main()

"""Consolidation benchmark: do updates and contradictions leave one current fact and a true history?

Scripted conversations (generated from a seed): people state facts about themselves (where they
live, work, what they drive, ...) and later change them, sometimes several times; some messages
arrive late (an older statement delivered after a newer one). After ingestion we ask, for each
changed fact:

- current_first: does `search(question, kinds=["semantic"])` rank the current value first?
- as_of_old:     does the same search with `as_of` between two values rank the older one first?

By default the LLM is the scripted provider answering like an ideal extractor and an oracle judge
that knows which facts are about the same thing (so this measures engram's bookkeeping: related
fact lookup, supersession, late arrivals, temporal queries). Against a real model:

    python bench/consolidation.py --llm-base-url http://127.0.0.1:8080/v1 [--model NAME]

The last line printed is `current_first=X as_of_old=Y`.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from engram import Config, Memory  # noqa: E402
from engram.pipeline.consolidate import LLMDecisions  # noqa: E402
from engram.pipeline.extract import Extraction  # noqa: E402
from engram.providers.llms import LLM, OpenAICompatible, ScriptedLLM  # noqa: E402

# slot: (question, fact template, message template, values)
SLOTS: dict[str, tuple[str, str, str, list[str]]] = {
    "city": ("Where does {p} live?", "{p} lives in {v}.", "I live in {v} now.",
             ["Porto", "Lisbon", "Berlin", "Madrid", "Oslo", "Vienna", "Lyon", "Krakow"]),
    "job": ("Where does {p} work?", "{p} works at {v}.", "These days I work at {v}.",
            ["Acme", "Globex", "Initech", "Umbrella", "Hooli", "Stark Industries", "Wayne Corp"]),
    "car": ("What car does {p} drive?", "{p} drives a {v}.", "My car is a {v}.",
            ["Toyota Corolla", "Tesla Model 3", "Volvo XC40", "Fiat Panda", "Renault Clio"]),
    "sport": ("Which sport does {p} practise?", "{p} practises {v}.", "I've been doing {v} lately.",
              ["climbing", "swimming", "tennis", "rowing", "judo", "cycling"]),
    "food": ("What is {p}'s favourite food?", "{p}'s favourite food is {v}.",
             "My favourite food is {v}.", ["ramen", "paella", "pierogi", "tacos", "lasagne"]),
    "language": ("Which language is {p} learning?", "{p} is learning {v}.",
                 "I'm learning {v} at the moment.", ["Japanese", "German", "Swahili", "Greek",
                                                     "Korean"]),
}
STABLE = ["{p} has a sister called {v}.", "{p} was born in {v}.", "{p} is allergic to {v}."]
STABLE_VALUES = [["Marta", "Ines", "Clara"], ["1988", "1991", "1979"], ["peanuts", "pollen", "cats"]]
PEOPLE = ["Ana", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jade",
          "Kofi", "Lena"]


@dataclass(frozen=True)
class Statement:
    person: str
    slot: str | None
    value: str
    fact: str
    message: str
    at: datetime


Timelines = dict[tuple[str, str], list[Statement]]


def scenario(seed: int, late_share: float,
             people: int = len(PEOPLE)) -> tuple[list[Statement], Timelines]:
    """Statements in delivery order, and per (person, slot) the values in world-time order."""
    rng = random.Random(seed)
    delivered: list[Statement] = []
    timelines: Timelines = {}
    start = datetime(2022, 1, 1, tzinfo=UTC)
    for person in PEOPLE[:people]:
        said: list[Statement] = []
        for tmpl, values in zip(STABLE, STABLE_VALUES, strict=True):
            v = rng.choice(values)
            fact = tmpl.format(p=person, v=v)
            said.append(Statement(person, None, v, fact, f"By the way: {fact.replace(person, 'I', 1)}",
                                  start + timedelta(days=rng.randint(0, 30))))
        for slot, (_, fact_t, msg_t, values) in SLOTS.items():
            chosen = rng.sample(values, rng.choice([2, 2, 3]))
            t = start + timedelta(days=rng.randint(0, 60))
            line = []
            for v in chosen:
                line.append(Statement(person, slot, v, fact_t.format(p=person, v=v),
                                      msg_t.format(v=v), t))
                t += timedelta(days=rng.randint(90, 300))
            timelines[(person, slot)] = line
            said += line
        said.sort(key=lambda s: s.at)
        # some statements arrive late: moved after a later statement about the same slot
        for (p, _slot), line in list(timelines.items()):
            if p == person and len(line) >= 2 and rng.random() < late_share:
                early = line[rng.randrange(len(line) - 1)]
                said.remove(early)
                said.insert(said.index(line[-1]) + 1, early)
        delivered += said
    return delivered, timelines


def oracle(statements: list[Statement]) -> ScriptedLLM:
    """An ideal extractor and judge, answering from the scenario's ground truth."""
    by_message = {(s.person, s.message): s for s in statements}
    slot_of = {s.fact: (s.person, s.slot) for s in statements if s.slot}

    def reply(messages: Any, schema: Any) -> dict[str, Any]:
        prompt = messages[-1]["content"]
        if schema is Extraction:
            new = prompt.split("New messages (extract from these):\n", 1)[1]
            out = []
            for n, who, text in re.findall(r"^\[(\d+)\] [\d\- :]+ user \((\w+)\): (.*)$", new, re.M):
                s = by_message.get((who, text))
                if s is not None:
                    out.append({"text": s.fact, "kind": "semantic", "importance": 0.7,
                                "date": s.at.date().isoformat(), "sources": [int(n)]})
            return {"facts": out}
        assert schema is LLMDecisions
        decisions = []
        for block in prompt.split("\n\n"):
            head, *rows = block.splitlines()
            n, fact = re.match(r"New fact (\d+): (.*)", head).groups()  # type: ignore[union-attr]
            action, target = "ADD", None
            for row in rows:
                m = re.match(r"\s+(m\d+) \(since [\d-]+\): (.*)", row)
                if not m:
                    continue
                if m[2] == fact:
                    action, target = "NOOP", m[1]
                    break
                if slot_of.get(fact) and slot_of.get(fact) == slot_of.get(m[2]):
                    action, target = "SUPERSEDE", m[1]
            decisions.append({"fact": int(n), "action": action, "target": target,
                              "text": None, "reason": "oracle"})
        return {"decisions": decisions}

    return ScriptedLLM([reply] * 100_000, model="oracle")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--late", type=float, default=0.25, help="share of fact lines with a late message")
    ap.add_argument("--people", type=int, default=len(PEOPLE), help=f"1..{len(PEOPLE)}")
    ap.add_argument("--llm-base-url", help="an OpenAI-compatible endpoint instead of the oracle")
    ap.add_argument("--model")
    args = ap.parse_args()

    statements, timelines = scenario(args.seed, args.late, args.people)
    if args.llm_base_url:
        llm = LLM(OpenAICompatible(args.llm_base_url, model=args.model), timeout_s=300)
    else:
        llm = LLM(oracle(statements))
    with tempfile.TemporaryDirectory() as tmp:
        mem = Memory(config=Config.from_env(path=Path(tmp) / "bench.db"), llm=llm)
        t0 = time.perf_counter()
        for s in statements:
            mem.add({"role": "user", "name": s.person, "content": s.message}, user_id=s.person,
                    session_id="chat", observed_at=s.at)
        ingest_s = time.perf_counter() - t0

        def top(question: str, person: str, **kw: Any) -> str:
            hits = mem.search(question, user_id=person, kinds=["semantic"], limit=1, **kw)
            return hits[0].memory.text.lower() if hits else ""

        current = as_of = n_current = n_as_of = 0
        for (person, slot), line in timelines.items():
            question = SLOTS[slot][0].format(p=person)
            n_current += 1
            current += line[-1].value.lower() in top(question, person)
            for old, new in zip(line, line[1:], strict=False):
                n_as_of += 1
                as_of += old.value.lower() in top(question, person, as_of=old.at + (new.at - old.at) / 2)
        stats = llm.stats()
        mem.close()
    late = sum(1 for i, s in enumerate(statements) if any(
        t.person == s.person and t.slot == s.slot and t.at > s.at for t in statements[:i]))
    print(f"statements={len(statements)} late={late} fact_lines={n_current} transitions={n_as_of}")
    print(f"llm={llm.name}:{llm.model} calls={stats.calls} tokens={stats.total_tokens} "
          f"calls_per_message={stats.calls / len(statements):.2f} ingest={ingest_s:.1f}s "
          f"add_mean={1000 * ingest_s / len(statements):.0f}ms")
    print(f"current_first={current / n_current:.3f} as_of_old={as_of / n_as_of:.3f}")


if __name__ == "__main__":
    main()

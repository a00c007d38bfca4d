"""Summary policies over a scripted long conversation: after 200 messages, which facts can still
be answered from what the model sees, per policy; plus `s.add` and `mem.context` latency.

The conversation (written here) is 100 user/assistant exchanges: 26 fact messages (names,
preferences, dates, decisions; four of them change earlier ones) spread among small talk and
topic chatter; 22 questions probe the latest value of each. A fact
counts as answerable when every keyword of its answer is in the text the model would get (a
proxy for "an LLM could answer": no LLM is needed to run this). With no LLM configured the
summaries are extractive.

    python bench/summaries.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from engram import Memory
from engram.providers.tokens import get_tokenizer
from engram.working import All, Incremental, Policy, Progressive, Summary, Tokens, Turns, Window

# (user message, assistant reply, question, answer keywords); None question = a fact that a
# later message changes (its question is asked on the later fact)
FACTS: list[tuple[str, str, str | None, tuple[str, ...]]] = [
    ("Hi! I'm Priya Raman, I run a small bakery called Flour Moon.", "Nice to meet you, Priya!",
     "What is the user's bakery called?", ("Flour Moon",)),
    ("My business partner is Tomasz Wojcik, he handles the accounts.", "Good to have Tomasz.",
     "Who is the user's business partner?", ("Tomasz",)),
    ("I'm allergic to hazelnuts, so we never use them in the shop.", "Understood, no hazelnuts.",
     "What is the user allergic to?", ("hazelnut",)),
    ("Our oven is a Rational iCombi, bought in 2019.", "A solid oven.",
     "What oven does the bakery use?", ("Rational",)),
    ("We open at 7am on weekdays and 8am on Saturdays.", "Early mornings!",
     "When does the bakery open on Saturdays?", ("8am",)),
    ("My daughter Anika turns six on 12 October.", "Happy early birthday to Anika!",
     "When is Anika's birthday?", ("12 October",)),
    ("I prefer oat milk in my coffee.", "Oat milk it is.",
     "What milk does the user like in coffee?", ("oat milk",)),
    ("Our best seller is the cardamom bun.", "Cardamom buns are wonderful.",
     "What is the bakery's best seller?", ("cardamom bun",)),
    ("The flour supplier is Millbrook Farms in Kent.", "Local flour, nice.",
     "Who supplies the flour?", ("Millbrook",)),
    ("We decided to close on Mondays from next month.", "Makes sense for rest.",
     "Which day will the bakery close?", ("Monday",)),
    ("The health inspection is on 3 June at 10am.", "I'll remind you.",
     None, ("3 June",)),
    ("Our head baker is Lucía Ortega.", "Lucía sounds great.",
     "Who is the head baker?", ("Lucía",)),
    ("I drive a blue Renault Kangoo for deliveries.", "Handy van.",
     "What vehicle does the user use for deliveries?", ("Kangoo",)),
    ("The shop's wifi password is croissant42.", "Noted, I'll keep it safe.",
     "What is the shop's wifi password?", ("croissant42",)),
    ("We pay rent of 2,400 pounds a month.", "That's a big cost.",
     "How much rent does the bakery pay?", ("2,400",)),
    ("Tomasz wants to add a sourdough subscription at 15 pounds a week.", "Good idea.",
     None, ("15 pounds",)),
    ("My favourite author is Ursula Le Guin.", "Great choice.",
     "Who is the user's favourite author?", ("Le Guin",)),
    ("We decided to hire a weekend assistant named Kofi.", "Welcome, Kofi.",
     "Who is the weekend assistant?", ("Kofi",)),
    ("Our accountant's firm is Patel & Rowe.", "Good to know.",
     "What firm does the accounts?", ("Patel",)),
    ("I'm learning Portuguese on Tuesday evenings.", "Boa sorte!",
     "What language is the user learning?", ("Portuguese",)),
    ("The summer menu launches on 21 June.", "Exciting!",
     None, ("21 June",)),
    ("We picked Tidewater Roasters for our coffee beans.", "Nice roaster.",
     None, ("Tidewater",)),
]
UPDATES = [  # later changes: the question is about the latest value
    ("The health inspection moved to 5 June at 9am.", "Updated: 5 June at 9am.",
     "When is the health inspection?", ("5 June",)),
    ("Tomasz and I settled the sourdough subscription at 18 pounds a week.", "18 pounds, noted.",
     "How much is the sourdough subscription?", ("18 pounds",)),
    ("The summer menu launch slipped to 28 June.", "28 June then.",
     "When does the summer menu launch?", ("28 June",)),
    ("We switched our coffee beans to Hollow Oak Roasters.", "Hollow Oak it is.",
     "Which roaster supplies the coffee beans?", ("Hollow Oak",)),
]
SMALL_TALK = [("Thanks!", "You're welcome!"), ("Haha, good one.", "Glad you liked it."),
              ("Busy day today.", "Hang in there."), ("Ok, sounds good.", "Great."),
              ("Let me think about it.", "Take your time."), ("Morning!", "Good morning!")]
CHATTER = [("What do you think about the weather this week?", "Looks like rain midweek."),
           ("Any tips for staying awake at 5am?", "Sleep early and drink water."),
           ("How do I price a new pastry?", "Cost of ingredients times three, roughly."),
           ("Should I post more on social media?", "Short videos of baking do well."),
           ("How long should dough proof?", "It depends on the temperature and the yeast.")]


def script(seed: int = 7) -> tuple[list[dict[str, str]], list[tuple[str, tuple[str, ...]]]]:
    """200 messages and the (question, answer keywords) probes."""
    rng = random.Random(seed)
    slots = list(range(100))
    fact_slots = sorted(rng.sample(slots[:70], len(FACTS)))
    update_slots = sorted(rng.sample(slots[75:98], len(UPDATES)))
    messages: list[dict[str, str]] = []
    probes = []
    facts = iter(FACTS)
    updates = iter(UPDATES)
    for i in slots:
        if i in fact_slots:
            user, reply, q, keys = next(facts)
        elif i in update_slots:
            user, reply, q, keys = next(updates)
        else:
            user, reply = rng.choice(SMALL_TALK if rng.random() < 0.5 else CHATTER)
            q, keys = None, ()
        if q is not None:
            probes.append((q, keys))
        messages += [{"role": "user", "name": "Priya", "content": user},
                     {"role": "assistant", "content": reply}]
    return messages, probes


POLICIES: list[Policy] = [All(), Window(n=20), Tokens(max_tokens=1000), Turns(n=10),
                          Summary(keep_recent=6, max_tokens=400),
                          Incremental(every_n=10, keep_recent=4, max_tokens=400),
                          Progressive(keep_recent=6, levels=(8, 4), max_tokens=200)]


def answerable(text: str, probes: list[tuple[str, tuple[str, ...]]]) -> float:
    low = text.lower()
    return sum(all(k.lower() in low for k in keys) for _, keys in probes) / len(probes)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


def run() -> dict:
    messages, probes = script()
    tok = get_tokenizer()
    out = {"messages": len(messages), "facts": len(probes), "policies": {}}
    with tempfile.TemporaryDirectory() as tmp:
        mem = Memory(Path(tmp) / "s.db")
        mem.embedder.embed_batch(["warm up"])
        for policy in POLICIES:
            s = mem.session(user_id=f"u-{policy.name}", policy=policy)
            adds = []
            for i in range(0, len(messages), 2):
                t0 = time.perf_counter()
                s.add(messages[i:i + 2])
                adds.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s.wait()
            settle = time.perf_counter() - t0
            v = s.view()
            chat = v.chat()
            text = "\n".join(m.get("content") or "" for m in chat)
            ctx_lat, ctx_found = [], []
            for q, keys in probes:
                t0 = time.perf_counter()
                ctx = mem.context(q, user_id=s.scope.user_id, session_id=s.id, budget_tokens=2000)
                ctx_lat.append(time.perf_counter() - t0)
                ctx_found.append(answerable(ctx.text, [(q, keys)]))
            out["policies"][policy.name] = {
                "policy": policy.to_dict(),
                "view_tokens": tok.count_messages(chat),
                "view_answerable": answerable(text, probes),
                "context2000_answerable": statistics.mean(ctx_found),
                "add_p50_ms": 1000 * pct(adds, 0.5), "add_p95_ms": 1000 * pct(adds, 0.95),
                "settle_s": settle,
                "context_p50_ms": 1000 * pct(ctx_lat, 0.5),
                "context_p95_ms": 1000 * pct(ctx_lat, 0.95),
            }
        mem.close()
    return out


def report(res: dict) -> str:
    lines = [f"{res['messages']} messages, {res['facts']} facts asked after the last one "
             "(no LLM: extractive summaries)",
             f"{'policy':<12} {'view tok':>8} {'view':>6} {'ctx2000':>8} {'add p50':>8} {'add p95':>8}"
             f" {'settle s':>8} {'ctx p50':>8} {'ctx p95':>8}"]
    for name, r in res["policies"].items():
        lines.append(f"{name:<12} {r['view_tokens']:>8} {r['view_answerable']:>6.2f} "
                     f"{r['context2000_answerable']:>8.2f} {r['add_p50_ms']:>8.1f} "
                     f"{r['add_p95_ms']:>8.1f} {r['settle_s']:>8.1f} {r['context_p50_ms']:>8.1f} "
                     f"{r['context_p95_ms']:>8.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run()
    print(json.dumps(res, indent=2) if args.json else report(res))


if __name__ == "__main__":
    sys.exit(main())

"""Why newest-wins did or did not put a revision first: for each question of a data set that
has an older and a newer statement (bench/retrieval.py's newer-first), the page newest-wins
looked at and, for the pair, what proposed or blocked a revision.

    python bench/why_newer.py [--data profiles|beam|locomo] [--chats N] [--all]

Per page row: the score before the lift, role, name, time, whether the text announces a change,
whether it is about the question (`about`), the lift. Per pair: the cosines of the older and
the newer to each other and to the question (the texts embedded again: the stored keys may
differ a little, e.g. by a speaker's name), the words they share with how many candidates use
them, and whether they answer the question alike. Prints the failed pairs (`--all`: every one).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import retrieval
from engram import PRESETS, Config, Memory
from engram.pipeline import retrieve, revisions

SEEN: dict[str, Any] = {}
_newest_wins = retrieve.newest_wins


def _spy(score: Any, recs: Any, page: int, *rest: Any) -> dict[str, float]:
    """newest_wins, keeping what it was given and what it returned"""
    lifts = _newest_wins(score, recs, page, *rest)
    SEEN.update(score=dict(score), recs=recs, page=page, rest=rest, lifts=lifts)
    return lifts


def memory_ids(mem: Memory, user: str, key: str) -> dict[str, str]:
    """The data set's id (metadata `key`) of each memory of a scope."""
    out: dict[str, str] = {}
    cursor = None
    while True:
        page = mem.list(user_id=user, limit=500, cursor=cursor)
        out.update({r.id: str(r.metadata.get(key, "")) for r in page.items})
        cursor = page.next_cursor
        if not cursor:
            return out


def explain(mem: Memory, question: str, old: list[str], new: list[str],
            ids: dict[str, str]) -> None:
    score, recs = SEEN["score"], SEEN["recs"]
    about, asked, _, words_asked = (*SEEN["rest"], None, None, None, None)[:4]
    asked = asked or frozenset()
    top = sorted(score, key=lambda m: (-score[m], m))[:SEEN["page"]]
    for m in top:
        c = recs[m]
        tag = "NEW" if ids.get(m) in new else "OLD" if ids.get(m) in old else "   "
        near = "" if about is None or m in about else " not-about"
        print(f"  {tag} {score[m]:.3f} {c.role or '-':9} {c.name or '-':8} "
              f"{(c.observed_at or c.created_at):%Y-%m-%d %H:%M} "
              f"change={revisions.announces_change(c.text):d}{near} "
              f"lift={SEEN['lifts'].get(m, 0):.3f} | {c.text[:100]!r}")
    olds = [m for m in top if ids.get(m) in old]
    news = [m for m in top if ids.get(m) in new]
    if not olds or not news:
        print("   not both on the page:", "old" if not olds else "new")
        return
    texts = [c.text for c in recs.values()]
    q_words = revisions.topic_words(question) - asked
    for a in olds:
        for b in news:
            vq, va, vb = mem.embedder.embed_batch([question, recs[a].text, recs[b].text])
            shared = (revisions.topic_words(recs[a].text) & revisions.topic_words(recs[b].text)) - asked
            df = revisions._counts(shared | q_words, texts)
            rare_q = {w for w in q_words if df[w] <= 2}
            answers = [revisions.topic_words(recs[m].text) & rare_q for m in (a, b)]
            alike = bool({w for w in shared if df[w] <= 2} & rare_q) and answers[0] == answers[1]
            print(f"   pair: a.b={float(va @ vb):.3f} a.q={float(va @ vq):.3f} "
                  f"b.q={float(vb @ vq):.3f} same speaker="
                  f"{(recs[a].name, recs[a].role) == (recs[b].name, recs[b].role)} "
                  f"alike={alike} shared={ {w: df[w] for w in sorted(shared)} }"[:400])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="profiles")
    ap.add_argument("--chats", type=int)
    ap.add_argument("--all", action="store_true", help="the pairs put right too")
    args = ap.parse_args()
    retrieve.newest_wins = _spy  # type: ignore[assignment]
    data = retrieval.SETS[args.data](args.chats)
    path = retrieval.database(args.data, data, args.chats, False)
    ok = n = 0
    with Memory(config=Config.from_env(path=path), retrieval=PRESETS["hybrid"]) as mem:
        ids: dict[str, dict[str, str]] = {}
        for user, question, _, old, new, _ in data.questions():
            if not (old and new):
                continue
            if user not in ids:
                ids[user] = memory_ids(mem, user, data.key)
            SEEN.clear()
            hits = mem.search(question, user_id=user, limit=retrieval.DEPTH, kinds=data.kinds)
            ranked = [str(h.memory.metadata.get(data.key, "")) for h in hits]
            at_new, at_old = retrieval.first(ranked, new), retrieval.first(ranked, old)
            n += 1
            ok += at_new < at_old
            if at_new < at_old and not args.all:
                continue
            print(f"\n{'OK ' if at_new < at_old else 'BAD'} [{user}] {question!r}  "
                  f"new at {at_new}, old at {at_old}")
            if not SEEN:
                print("   newest-wins did not run: a question about the past or a span")
                continue
            explain(mem, question, old, new, ids[user])
    print(f"\nnewer-first {ok}/{n} = {ok / max(n, 1):.3f}", file=sys.stderr)


if __name__ == "__main__":
    main()

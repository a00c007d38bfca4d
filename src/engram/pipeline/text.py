"""Text helpers shared by the write and read paths: normalising, hashing, tokenising."""

from __future__ import annotations

import hashlib
import re
import unicodedata

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*", re.UNICODE)
_SPACE = re.compile(r"\s+")

# English function words that carry no topic; kept short on purpose (content words like
# "like", "time", "first" stay, because questions hinge on them).
STOP_WORDS = frozenset("""
a about above after again against all am an and any are aren't as at be because been before
being below between both but by can could couldn't did didn't do does doesn't doing don't down
during each few for from further had hadn't has hasn't have haven't having he he'd he'll he's her
here here's hers herself him himself his how how's i i'd i'll i'm i've if in into is isn't it it's
its itself let's me more most mustn't my myself no nor not of off on once only or other ought our
ours ourselves out over own same shan't she she'd she'll she's should shouldn't so some such than
that that's the their theirs them themselves then there there's these they they'd they'll they're
they've this those through to too under until up very was wasn't we we'd we'll we're we've were
weren't what what's when when's where where's which while who who's whom why why's will with
won't would wouldn't you you'd you'll you're you've your yours yourself yourselves
""".split())


def normalize(text: str) -> str:
    """The form two texts must share to count as exact duplicates."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = _SPACE.sub(" ", text).strip()
    return text.rstrip(".!?;: ")


def content_hash(text: str) -> str:
    return hashlib.sha256(normalize(text).encode("utf-8")).hexdigest()


def words(text: str) -> list[str]:
    return [w.replace("’", "'") for w in _WORD.findall(unicodedata.normalize("NFKC", text).casefold())]


def terms(text: str) -> list[str]:
    """Content words of a text, in order, without repeats: the lexical query."""
    seen: dict[str, None] = {}
    for w in words(text):
        if w not in STOP_WORDS:
            seen.setdefault(w, None)
    return list(seen)


def overlap(a: str, b: str) -> float:
    """Jaccard overlap of the content-word sets of two texts (1.0 for two empty texts)."""
    sa, sb = set(terms(a)), set(terms(b))
    if not sa and not sb:
        return 1.0
    return len(sa & sb) / len(sa | sb)

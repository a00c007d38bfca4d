"""Text helpers shared by the write and read paths: normalising, hashing, tokenising."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Sequence
from itertools import compress
from operator import not_

from ..model import Kind, MemoryRecord

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*", re.UNICODE)
_SPACE = re.compile(r"\s+")
_GAP = re.compile(r"(?<=\S)[ \t]{2,}")  # where a word was left out of a line

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


def own_name(user_id: str | None) -> str | None:
    """The name of a scope's user as her turns and the facts about her spell it: a user id of
    one word ("ana"), casefolded; None for an identifier of several ("conv-26", "beam-3")."""
    found = terms(user_id) if user_id else []
    return found[0] if len(found) == 1 else None


def without_name(text: str, name: str | None) -> str:
    """`text` without the whole word `name` (nor its possessive, "Ana's"); the text itself
    when nothing else would be left."""
    if not name:
        return text
    rest = re.sub(rf"(?<![^\W_]){re.escape(name)}(?:['’]s)?(?![^\W_])", "", text,
                  flags=re.IGNORECASE)
    if rest == text or not _WORD.search(rest):
        return text
    return _GAP.sub(" ", rest).strip()


def key_text(rec: MemoryRecord) -> tuple[str, str]:
    """What a memory's dense keys embed, as (a speaker's "name: " or "", the text).

    A turn is read with its speaker ("Tom: I moved to Leeds"), who is part of what was said,
    but for the scope's own user (`own_name`): in her scope she is the speaker of half the
    turns and the subject of every fact, so her name tells nothing apart there, and in a key
    it only pulls the memories that spell it towards any question that names her (prefixed,
    "Ana: I just moved to Lisbon for a new job." was closer to "What does Ana do for work?"
    than her answer "Machine learning engineer at a clinic."). So her turns carry no name, as
    her unnamed ones never did, and a fact of her scope is read without her name ("Ana
    prefers window seats" as "prefers window seats"), as her own turns say "I". A turn is
    otherwise embedded as said. The question keeps the name (the speaker adjustment reads
    it); the lexical side leaves it out (`retrieve.lexical_terms`)."""
    own = own_name(rec.scope.user_id)
    if rec.kind is not Kind.EPISODIC:
        return "", without_name(rec.text, own)
    if rec.name and terms(rec.name) != [own]:
        return f"{rec.name}: ", rec.text
    return "", rec.text


def non_ascii(texts: Sequence[str]) -> list[int]:
    """The positions of the texts that are not ASCII."""
    if "".join(texts).isascii():  # one C-level pass: usually all of them are
        return []
    return list(compress(range(len(texts)), map(not_, map(str.isascii, texts))))

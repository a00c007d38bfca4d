"""What the model sees of a session: named, frozen policies and the pure functions behind them.

A policy either trims the conversation (`all`, `window`, `tokens`, `turns`) or folds older
messages into summaries (`summary`, `incremental`, `progressive`). Trimming keeps a tool call
with its results and never leaves a history that starts with an assistant or tool message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from typing import Any, ClassVar

from ..errors import InvalidInput
from ..validate import ROLE

CountTokens = Callable[[Mapping[str, Any]], int]
"""Tokens one wire message costs (e.g. `Tokenizer.count_message`)."""

TRAILING = ("assistant", "tool")  # roles a trimmed history may not start with


@dataclass(frozen=True)
class SessionMessage:
    """One message of a session, as the working layer handles it (the stored episode's fields
    that matter to a model: role, text, speaker name, time, tool call links)."""

    role: str
    content: str | None
    name: str | None = None
    id: str | None = None
    observed_at: datetime | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, OpenAI shape
    tool_call_id: str | None = None                 # a tool result: the call it answers

    @property
    def text(self) -> str:
        """Readable text, also for a tool call with no content (summaries quote it)."""
        if self.content:
            return self.content
        if self.tool_calls:
            return "; ".join(render_call(c) for c in self.tool_calls)
        return ""

    def to_chat(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


# What JSON leaves raw that a reader may still take for a line break (DEL and the C1 controls,
# NEL among them; the Unicode line and paragraph separators) or for an angle bracket (its
# full-width, small, single-guillemet, mathematical and CJK look-alikes): escaped as JSON's
# own \uXXXX, so the quoted line stays valid JSON and says exactly what was stored. A lone
# surrogate (UTF-8 cannot encode it) is escaped the same way.
_RAW = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\uff1c\uff1e\ufe64\ufe65\u2039\u203a\u2329"
                  "\u232a\u3008\u3009\u27e8\u27e9\u276c-\u276f\u02c2\u02c3\u1438\u1433"
                  "\u226e\u226f]")


def quote(text: str) -> str:
    """A memory's text as one quoted line of data: every line break, quote and control
    character escaped (JSON string rules, plus the breaks and look-alikes of `_RAW`), angle
    brackets as entities — so a stored text cannot close the memory section, open a role,
    start a heading or smuggle a chat-template token."""
    line = _RAW.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(text, ensure_ascii=False))
    return line.replace("<", "&lt;").replace(">", "&gt;")


SPEAKING_ROLES = ("user", "assistant")  # stored messages that come back with their own role


def as_data(v: View) -> View:
    """A stored conversation as a model may be shown it: a stored message speaks with its
    role only as a user or an assistant, or as a tool result that answers a call shown before
    it. Anything else (a stored system message, a tool result answering no shown call, any
    other role) is anyone's write, not the application's voice: it comes back as a user
    message that says what it is and quotes it as data."""
    calls: set[str] = set()
    out = []
    for m in v.messages:
        if m.role == "assistant" and m.tool_calls:
            calls |= {str(c.get("id")) for c in m.tool_calls if isinstance(c, Mapping)}
        if m.role in SPEAKING_ROLES or (m.role == "tool" and m.tool_call_id in calls):
            out.append(m)
            continue
        role = m.role if ROLE.fullmatch(m.role) else "unknown"
        out.append(SessionMessage(
            role="user", content=f"(a stored {role} message, shown as data) {quote(m.text)}",
            id=m.id, observed_at=m.observed_at))
    return replace(v, messages=tuple(out))


def render_call(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", "")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return f"called {fn.get('name', '?')}({args})"


# -- the policies ------------------------------------------------------------------------------

def _positive(value: Any, what: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInput(f"{what} must be an integer >= {minimum}, not {value!r}")


@dataclass(frozen=True)
class Policy:
    """Base of every policy: a frozen value with a `name`, stored as `to_dict()`."""

    name: ClassVar[str] = ""
    summarizes: ClassVar[bool] = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class All(Policy):
    """The whole conversation (a buffer). For short sessions, or when a later step (context
    assembly under a token budget) does the trimming."""

    name: ClassVar[str] = "all"


@dataclass(frozen=True)
class Window(Policy):
    """The last `n` messages. For chatty sessions where only the latest exchange matters and a
    fixed message count is easy to reason about; cheap, no summaries, forgets everything older."""

    name: ClassVar[str] = "window"
    n: int = 20

    def __post_init__(self) -> None:
        _positive(self.n, "window n")


@dataclass(frozen=True)
class Tokens(Policy):
    """The newest messages that fit in `max_tokens` (cl100k tokens). For a hard prompt budget
    when message lengths vary a lot (pasted documents, tool output)."""

    name: ClassVar[str] = "tokens"
    max_tokens: int = 2000

    def __post_init__(self) -> None:
        _positive(self.max_tokens, "tokens max_tokens")


@dataclass(frozen=True)
class Turns(Policy):
    """The last `n` user turns (a user message with every reply and tool call up to the next
    one); a pending user message is kept on top. For assistants whose exchanges have uneven
    lengths: it never cuts an answer away from its question."""

    name: ClassVar[str] = "turns"
    n: int = 5

    def __post_init__(self) -> None:
        _positive(self.n, "turns n")


@dataclass(frozen=True)
class Summary(Policy):
    """The last `keep_recent` messages verbatim; everything older folds into one running
    summary of at most `max_tokens`, updated in the background after each new message. For
    long conversations where older details still matter; one summary call per message."""

    name: ClassVar[str] = "summary"
    summarizes: ClassVar[bool] = True
    keep_recent: int = 6
    max_tokens: int = 400

    def __post_init__(self) -> None:
        _positive(self.keep_recent, "summary keep_recent", 0)
        _positive(self.max_tokens, "summary max_tokens", 16)


@dataclass(frozen=True)
class Incremental(Policy):
    """Like `summary`, but the running summary is updated only once `every_n` messages have
    piled up past the `keep_recent` newest: one summary call per `every_n` messages, and the
    model sees between `keep_recent` and `keep_recent + every_n` messages verbatim. For long
    sessions when summary calls cost (a paid or slow LLM)."""

    name: ClassVar[str] = "incremental"
    summarizes: ClassVar[bool] = True
    every_n: int = 10
    keep_recent: int = 4
    max_tokens: int = 400

    def __post_init__(self) -> None:
        _positive(self.every_n, "incremental every_n")
        _positive(self.keep_recent, "incremental keep_recent", 0)
        _positive(self.max_tokens, "incremental max_tokens", 16)


@dataclass(frozen=True)
class Progressive(Policy):
    """A hierarchy of summaries: the `keep_recent` newest messages verbatim; older messages in
    summaries of `levels[0]` messages each (level 1); once level j holds `levels[j]` summaries
    they merge into one summary of level j + 1; the last level merges into the session's running
    summary. The model sees fine detail of the recent past and coarser detail further back.
    For very long sessions (agents working for hours). The user's earlier sessions are the
    long-term level: context assembly adds their end-of-session summaries."""

    name: ClassVar[str] = "progressive"
    summarizes: ClassVar[bool] = True
    keep_recent: int = 6
    levels: tuple[int, ...] = (8, 4)
    max_tokens: int = 300  # per summary

    def __post_init__(self) -> None:
        _positive(self.keep_recent, "progressive keep_recent", 0)
        _positive(self.max_tokens, "progressive max_tokens", 16)
        levels = self.levels
        if isinstance(levels, list):
            object.__setattr__(self, "levels", tuple(levels))
        if not isinstance(self.levels, tuple) or not self.levels:
            raise InvalidInput("progressive levels must be a non-empty sequence of integers")
        _positive(self.levels[0], "progressive levels[0] (messages per summary)")
        for n in self.levels[1:]:
            _positive(n, "progressive levels[j] (summaries merged per level)", 2)


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (All, Window, Tokens, Turns, Summary, Incremental, Progressive)}
DEFAULT_POLICY: Policy = All()


def from_dict(data: Mapping[str, Any]) -> Policy:
    """A policy from its `to_dict()` form (as stored with a session)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("name"), str):
        raise InvalidInput("a policy must be a mapping with a 'name'")
    cls = POLICIES.get(data["name"])
    if cls is None:
        raise InvalidInput(f"unknown policy {data['name']!r}; policies: {sorted(POLICIES)}")
    params = {k: v for k, v in data.items() if k != "name"}
    known = {f.name for f in fields(cls)}
    if set(params) - known:
        raise InvalidInput(f"policy {cls.name!r} takes {sorted(known) or 'no parameters'}, "
                           f"not {sorted(set(params) - known)}")
    return cls(**params)


def as_policy(value: Policy | Mapping[str, Any] | str | None) -> Policy | None:
    """A policy given as a value, a dict, or a bare name (default parameters)."""
    if value is None or isinstance(value, Policy):
        return value
    if isinstance(value, str):
        return from_dict({"name": value})
    if isinstance(value, Mapping):
        return from_dict(value)
    raise InvalidInput(f"policy must be a Policy, a dict or a name, not {type(value).__name__}")


# -- units and safe starts -----------------------------------------------------------------------

def unit_starts(messages: Sequence[SessionMessage]) -> list[int]:
    """Indices where an indivisible unit begins: every message but a tool result, which stays
    with the call before it. A cut only ever happens at one of these."""
    return [i for i, m in enumerate(messages) if m.role != "tool"]


def safe_starts(messages: Sequence[SessionMessage]) -> list[int]:
    """Where a trimmed history may begin: a unit start that is not an assistant or tool message,
    plus `len(messages)` (the empty history)."""
    return [i for i in unit_starts(messages) if messages[i].role not in TRAILING] + [len(messages)]


def tail_within(messages: Sequence[SessionMessage], costs: Sequence[int], limit: int) -> int:
    """The start of the longest safe suffix whose total cost (`costs[i]` for message i) is at
    most `limit`."""
    suffix = [0] * (len(messages) + 1)
    for i in range(len(messages) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + costs[i]
    return next(i for i in safe_starts(messages) if suffix[i] <= limit)


def trim(policy: Policy, messages: Sequence[SessionMessage],
         count: CountTokens) -> list[SessionMessage]:
    """The messages a trimming policy shows (summary policies: every message given)."""
    msgs = list(messages)
    if isinstance(policy, Window):
        if len(msgs) <= policy.n:
            return msgs
        return msgs[tail_within(msgs, [1] * len(msgs), policy.n):]
    if isinstance(policy, Tokens):
        costs = [count(m.to_chat()) for m in msgs]
        if sum(costs) <= policy.max_tokens:
            return msgs
        return msgs[tail_within(msgs, costs, policy.max_tokens):]
    if isinstance(policy, Turns):
        users = [i for i, m in enumerate(msgs) if m.role == "user"]
        pending = bool(msgs) and msgs[-1].role == "user"
        need = policy.n + (1 if pending else 0)
        if len(users) <= need:
            return msgs
        return msgs[users[-need]:]
    return msgs


# -- summaries as state ------------------------------------------------------------------------

@dataclass(frozen=True)
class Digest:
    """A summary of a contiguous run of messages, below the running summary (progressive)."""

    text: str
    upto: str | None  # the last message id it covers
    count: int        # how many messages it covers

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "upto": self.upto, "count": self.count}


@dataclass(frozen=True)
class Digests:
    """Everything summarised so far in a session: the running summary (the top), the digests of
    each lower level (progressive only; levels[0] is level 1, oldest first), and `upto`, the last
    message folded into any of them. Messages after `upto` are shown verbatim."""

    summary: str = ""
    upto: str | None = None
    levels: tuple[tuple[Digest, ...], ...] = ()
    folded: int = 0  # messages folded so far

    def state(self) -> dict[str, Any]:
        """The policy-specific part, as stored in `Session.state`."""
        return {"levels": [[d.to_dict() for d in level] for level in self.levels],
                "folded": self.folded}

    @classmethod
    def load(cls, summary: str, upto: str | None, state: Mapping[str, Any]) -> Digests:
        levels = tuple(tuple(Digest(str(d["text"]), d.get("upto"), int(d.get("count", 0)))
                             for d in level) for level in state.get("levels", []))
        return cls(summary, upto, levels, int(state.get("folded", 0)))


@dataclass(frozen=True)
class Fold:
    """One summarisation to run: fold `messages` and/or lower `digests` into `previous`
    (level 0: the running summary) or into a new digest of `level` >= 1."""

    level: int
    previous: str
    messages: tuple[SessionMessage, ...] = ()
    digests: tuple[Digest, ...] = ()
    source_level: int = 0  # the level `digests` are taken from (their oldest ones)

    @property
    def upto(self) -> str | None:
        if self.messages:
            return self.messages[-1].id
        return self.digests[-1].upto if self.digests else None

    @property
    def count(self) -> int:
        return len(self.messages) + sum(d.count for d in self.digests)


def fold_boundary(pending: Sequence[SessionMessage], keep_recent: int) -> int:
    """Where the verbatim tail begins: the last safe start that keeps at least `keep_recent`
    messages (0: nothing can be folded yet). The tail is never empty: it starts at a user (or
    system) message, so whatever arrives next follows one, and the view never opens with an
    assistant reply after its summary."""
    cut = len(pending) - keep_recent
    starts = [i for i in safe_starts(pending)[:-1] if i <= cut]
    return starts[-1] if starts else 0


def plan(policy: Policy, digests: Digests, pending: Sequence[SessionMessage]) -> Fold | None:
    """The next summarisation a summary policy needs, given the messages after `digests.upto`
    (oldest first), or None when the summaries are up to date. Apply its result with `apply`
    and plan again until None."""
    if isinstance(policy, Summary | Incremental):
        b = fold_boundary(pending, policy.keep_recent)
        threshold = policy.every_n if isinstance(policy, Incremental) else 1
        if b >= threshold:
            return Fold(0, digests.summary, tuple(pending[:b]))
        return None
    if isinstance(policy, Progressive):
        levels = list(digests.levels)
        # Merge a full level first: the hierarchy stays bounded however far the fold lags.
        for j in range(1, len(policy.levels)):
            have = levels[j - 1] if j - 1 < len(levels) else ()
            if len(have) >= policy.levels[j]:
                merged = tuple(have[:policy.levels[j]])
                target = 0 if j == len(policy.levels) - 1 else j + 1
                return Fold(target, digests.summary if target == 0 else "", (), merged, j)
        b = fold_boundary(pending, policy.keep_recent)
        if b >= policy.levels[0]:
            # The chunk ends at the first safe start past levels[0] messages: no split unit.
            end = next(i for i in safe_starts(pending) if i >= policy.levels[0])
            end = min(end, b)
            target = 1 if len(policy.levels) > 1 else 0
            return Fold(target, digests.summary if target == 0 else "", tuple(pending[:end]))
        return None
    return None


def apply(digests: Digests, fold: Fold, text: str) -> Digests:
    """The state after `fold` produced `text`."""
    levels = [list(level) for level in digests.levels]
    if fold.digests:
        src = levels[fold.source_level - 1]
        del src[:len(fold.digests)]
    upto = fold.messages[-1].id if fold.messages else digests.upto
    folded = digests.folded + len(fold.messages)
    if fold.level == 0:
        return Digests(text, upto, tuple(map(tuple, levels)), folded)
    while len(levels) < fold.level:
        levels.append([])
    levels[fold.level - 1].append(Digest(text, fold.upto, fold.count))
    return Digests(digests.summary, upto, tuple(map(tuple, levels)), folded)


# -- the view ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class View:
    """What the model sees of a session: summaries (running summary first, then finer digests,
    oldest first) and the verbatim messages after them."""

    messages: tuple[SessionMessage, ...]
    summaries: tuple[str, ...] = ()
    omitted: int = field(default=0, compare=False)  # messages neither shown nor summarised

    def chat(self) -> list[dict[str, Any]]:
        """The view as wire messages: the summaries as one leading system message."""
        out: list[dict[str, Any]] = []
        if self.summaries:
            out.append({"role": "system", "content": "Summary of the earlier conversation:\n"
                        + "\n\n".join(self.summaries)})
        return out + [m.to_chat() for m in self.messages]


def view(policy: Policy, digests: Digests, pending: Sequence[SessionMessage],
         count: CountTokens) -> View:
    """The view of a session whose messages after `digests.upto` are `pending`.

    For a trimming policy `pending` is every message (its `digests` are ignored). For a summary
    policy the messages after `upto` all stay verbatim, however many: a summary that lags behind
    (still running, or failed) shows more messages, never fewer.
    """
    if not policy.summarizes:
        shown = trim(policy, pending, count)
        return View(tuple(shown), (), len(pending) - len(shown))
    summaries = [digests.summary] if digests.summary else []
    for level in reversed(digests.levels):
        summaries += [d.text for d in level if d.text]
    return View(tuple(pending), tuple(summaries))


def fit(v: View, max_tokens: int, count: CountTokens) -> View:
    """The view cut to `max_tokens` (as wire messages): the newest messages that fit beside the
    summaries, cut at a safe start; when not even the newest unit fits, summaries make room
    (the finest first, the running summary last)."""
    if count_view(v, count) <= max_tokens:
        return v
    msgs = list(v.messages)
    costs = [count(m.to_chat()) for m in msgs]
    summaries = list(v.summaries)
    while True:
        budget = max_tokens - count_view(View((), tuple(summaries)), count)
        if budget >= 0:
            start = tail_within(msgs, costs, budget)
            if start < len(msgs) or not msgs:
                kept = msgs[start:]
                return replace(v, messages=tuple(kept), summaries=tuple(summaries),
                               omitted=v.omitted + start)
        if not summaries:
            return replace(v, messages=(), summaries=(), omitted=v.omitted + len(msgs))
        summaries.pop()


def count_view(v: View, count: CountTokens) -> int:
    return sum(count(m) for m in v.chat())

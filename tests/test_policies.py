"""Session policies as pure functions: what each shows, the invariants of trimming (hypothesis),
and summary folding that never loses a message."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.errors import InvalidInput
from engram.providers.tokens import get_tokenizer
from engram.working.policies import (
    POLICIES,
    All,
    Digests,
    Incremental,
    Policy,
    Progressive,
    SessionMessage,
    Summary,
    Tokens,
    Turns,
    View,
    Window,
    apply,
    as_policy,
    fit,
    from_dict,
    plan,
    safe_starts,
    trim,
    view,
)

tok = get_tokenizer()
count = tok.count_message


# -- conversations -------------------------------------------------------------------------------

def user(text: str, i: int = 0) -> SessionMessage:
    return SessionMessage("user", text, id=f"m{i:05d}")


def conversation(kinds: list[tuple[str, int]]) -> list[SessionMessage]:
    """Messages from (kind, size) pairs: "u" user, "a" assistant, "s" system, "t" an assistant
    tool call followed by `size` tool results."""
    out: list[SessionMessage] = []
    for kind, size in kinds:
        i = len(out)
        words = " ".join(f"w{j}" for j in range(size * 3 + 1))
        if kind == "u":
            out.append(SessionMessage("user", f"question {i} {words}"))
        elif kind == "a":
            out.append(SessionMessage("assistant", f"answer {i} {words}"))
        elif kind == "s":
            out.append(SessionMessage("system", f"note {i}"))
        else:
            calls = [{"id": f"c{i}-{k}", "type": "function",
                      "function": {"name": "lookup", "arguments": f'{{"k": {k}}}'}}
                     for k in range(size)]
            out.append(SessionMessage("assistant", None, tool_calls=calls))
            out += [SessionMessage("tool", f"result {k} {words}", tool_call_id=f"c{i}-{k}")
                    for k in range(size)]
    return [SessionMessage(m.role, m.content, id=f"m{n:05d}", tool_calls=m.tool_calls,
                           tool_call_id=m.tool_call_id) for n, m in enumerate(out)]


conversations = st.lists(
    st.tuples(st.sampled_from("uuuaaats"), st.integers(min_value=1, max_value=3)),
    max_size=40).map(conversation)

trimming = st.one_of(
    st.builds(Window, n=st.integers(1, 30)),
    st.builds(Tokens, max_tokens=st.integers(1, 400)),
    st.builds(Turns, n=st.integers(1, 8)),
    st.just(All()),
)


def is_suffix(part: list[SessionMessage], whole: list[SessionMessage]) -> bool:
    return not part or whole[len(whole) - len(part):] == part


# -- trimming invariants ------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(conversations, trimming)
def test_trimming_keeps_a_safe_suffix(msgs: list[SessionMessage], policy: Policy) -> None:
    shown = trim(policy, msgs, count)
    assert is_suffix(shown, msgs)
    if len(shown) < len(msgs):
        start = len(msgs) - len(shown)
        # never starts with an assistant or tool message ...
        assert not shown or shown[0].role not in ("assistant", "tool")
        # ... and never separates a tool result from the call before it
        assert start in safe_starts(msgs)
    for i, m in enumerate(shown):
        if m.role == "tool":
            assert i > 0, "a tool result without its call"


@settings(max_examples=300, deadline=None)
@given(conversations, trimming)
def test_trimming_respects_its_limit_and_keeps_as_much_as_it_can(
        msgs: list[SessionMessage], policy: Policy) -> None:
    shown = trim(policy, msgs, count)
    start = len(msgs) - len(shown)
    longer = [s for s in safe_starts(msgs) if s < start]

    def fits(part: list[SessionMessage]) -> bool:
        if isinstance(policy, Window):
            return len(part) <= policy.n
        if isinstance(policy, Tokens):
            return sum(count(m.to_chat()) for m in part) <= policy.max_tokens
        return True

    if isinstance(policy, Turns):
        users = sum(m.role == "user" for m in shown)
        pending = bool(msgs) and msgs[-1].role == "user"
        assert users <= policy.n + pending
        if start > 0:
            assert users == policy.n + pending  # exactly n turns (+ the pending one) kept
    else:
        assert fits(shown)
        # maximal: no longer safe suffix would also fit
        assert not any(fits(msgs[s:]) for s in longer)


def test_turns_keeps_a_pending_user_message() -> None:
    msgs = conversation([("u", 1), ("a", 1), ("u", 1), ("a", 1), ("u", 1), ("a", 1), ("u", 1)])
    shown = trim(Turns(n=2), msgs, count)
    assert [m.role for m in shown] == ["user", "assistant", "user", "assistant", "user"]
    assert shown[-1] is msgs[-1]


def test_window_never_splits_a_tool_call_from_its_results() -> None:
    msgs = conversation([("u", 1), ("t", 2), ("a", 1), ("u", 1), ("t", 3), ("a", 1)])
    # roles: u, a(call), tool, tool, a, u, a(call), tool, tool, tool, a
    shown = trim(Window(n=4), msgs, count)
    assert shown == []  # the last 4 start inside a call: no safe start within 4 messages
    shown = trim(Window(n=6), msgs, count)
    assert [m.role for m in shown] == ["user", "assistant", "tool", "tool", "tool", "assistant"]


def test_a_history_that_fits_is_left_alone() -> None:
    msgs = conversation([("a", 1), ("u", 1), ("a", 1)])  # an assistant greeting first
    for policy in (All(), Window(n=3), Tokens(max_tokens=10_000), Turns(n=3)):
        assert trim(policy, msgs, count) == msgs


# -- policies as values ------------------------------------------------------------------------

@pytest.mark.parametrize("policy", [All(), Window(7), Tokens(900), Turns(3), Summary(4, 200),
                                    Incremental(5, 2, 300), Progressive(3, (6, 3, 2), 120)])
def test_policies_round_trip_through_dicts(policy: Policy) -> None:
    d = policy.to_dict()
    assert d["name"] == policy.name and POLICIES[policy.name] is type(policy)
    assert from_dict(d) == policy
    assert as_policy(d) == policy
    hash(policy)  # frozen values


@pytest.mark.parametrize("bad", [
    {"name": "window", "n": 0}, {"name": "window", "n": "3"}, {"name": "window", "n": True},
    {"name": "tokens", "max_tokens": -1}, {"name": "turns", "n": 1.5},
    {"name": "progressive", "levels": []}, {"name": "progressive", "levels": [4, 1]},
    {"name": "summary", "max_tokens": 3}, {"name": "nope"}, {"name": "window", "size": 3},
    {"n": 3}, "unknown",
])
def test_bad_policies_are_invalid_input(bad: Any) -> None:
    with pytest.raises(InvalidInput):
        as_policy(bad)


def test_a_policy_by_name_has_default_parameters() -> None:
    assert as_policy("summary") == Summary()
    assert as_policy("progressive") == Progressive(levels=(8, 4))


# -- summary folding ---------------------------------------------------------------------------

def run_folds(policy: Policy, digests: Digests, msgs: list[SessionMessage]) -> tuple[Digests, int]:
    """Plan and apply folds until up to date; a "summary" names the ids it covers."""
    folds = 0
    while True:
        pending = [m for m in msgs if digests.upto is None or m.id > digests.upto]  # type: ignore[operator]
        fold = plan(policy, digests, pending)
        if fold is None:
            return digests, folds
        text = f"<{fold.count} from {fold.upto}>"
        digests = apply(digests, fold, text)
        folds += 1
        assert folds < 1000


summarizing = st.one_of(
    st.builds(Summary, keep_recent=st.integers(0, 8)),
    st.builds(Incremental, every_n=st.integers(1, 10), keep_recent=st.integers(0, 6)),
    st.builds(Progressive, keep_recent=st.integers(0, 6),
              levels=st.lists(st.integers(2, 6), min_size=1, max_size=3).map(tuple)),
)


@settings(max_examples=200, deadline=None)
@given(conversations, summarizing, st.integers(1, 7))
def test_folding_never_loses_a_message(msgs: list[SessionMessage], policy: Policy,
                                       step: int) -> None:
    """Messages arrive a few at a time and folds run in between: at every point each message
    is either covered by a summary or shown verbatim, and the verbatim part starts safely."""
    digests = Digests()
    for end in range(step, len(msgs) + step, step):
        seen = msgs[:end]
        digests, _ = run_folds(policy, digests, seen)
        pending = [m for m in seen if digests.upto is None or m.id > digests.upto]
        v = view(policy, digests, pending, count)
        covered = [m for m in seen if digests.upto is not None and m.id <= digests.upto]
        assert covered + list(v.messages) == seen
        assert digests.folded == len(covered)
        if covered and v.messages:
            assert v.messages[0].role not in ("assistant", "tool")
        counts = [d.count for level in digests.levels for d in level]
        if isinstance(policy, Progressive):
            # the hierarchy stays bounded: level j never holds levels[j] digests once settled
            for j, level in enumerate(digests.levels[:len(policy.levels) - 1], start=1):
                assert len(level) < policy.levels[j]
            assert sum(counts) <= digests.folded


def test_summary_policy_keeps_the_recent_messages_verbatim() -> None:
    msgs = conversation([("u", 1), ("a", 1)] * 10)
    digests, folds = run_folds(Summary(keep_recent=4), Digests(), msgs)
    assert folds == 1 and digests.folded == 16
    v = view(Summary(keep_recent=4), digests, msgs[16:], count)
    assert v.summaries == ("<16 from m00015>",) and list(v.messages) == msgs[16:]
    chat = v.chat()
    assert chat[0]["role"] == "system" and "<16 from m00015>" in chat[0]["content"]


def test_incremental_folds_once_every_n_messages() -> None:
    policy = Incremental(every_n=6, keep_recent=2)
    msgs = conversation([("u", 1), ("a", 1)] * 10)
    digests = Digests()
    history = []
    for end in range(1, 21):
        digests, folds = run_folds(policy, digests, msgs[:end])
        history.append(folds)
    assert sum(history) == 3  # 20 messages, folds of >= 6 beyond the 2 most recent
    assert digests.folded == 18


def test_progressive_builds_a_hierarchy() -> None:
    policy = Progressive(keep_recent=2, levels=(4, 3, 2))
    msgs = conversation([("u", 1), ("a", 1)] * 30)  # 60 messages
    digests, _ = run_folds(policy, digests=Digests(), msgs=msgs)
    # 58 foldable: 14 chunks of 4 = 56; 3 chunks -> 1 level-2 digest; 2 level-2 -> the top
    assert digests.folded == 56
    assert digests.summary  # the top level (the session's running summary) was reached
    level1, level2 = digests.levels
    assert len(level1) < 3 and len(level2) < 2
    v = view(policy, digests, msgs[56:], count)
    assert v.summaries[0] == digests.summary and len(v.messages) == 4


def test_fit_cuts_the_oldest_messages_then_summaries() -> None:
    msgs = conversation([("u", 2), ("a", 2)] * 5)
    v = View(tuple(msgs), ("an earlier summary " * 10,))
    full = sum(count(m) for m in v.chat())
    assert fit(v, full, count) == v
    smaller = fit(v, full - 30, count)
    assert smaller.summaries == v.summaries and len(smaller.messages) < len(msgs)
    assert smaller.messages[0].role == "user" and list(smaller.messages) == msgs[-len(smaller.messages):]
    assert sum(count(m) for m in smaller.chat()) <= full - 30
    tiny = fit(v, 40, count)
    assert sum(count(m) for m in tiny.chat()) <= 40
    assert fit(v, 0, count).chat() == []

"""The redaction detectors and policies (engram.redact), pure: every corpus case, the
policies, placeholders, metadata, hostile and unicode input."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram import redact as r
from engram.redact import Finding, Policy, describe, find, key_type, redact, redact_value

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import redaction as bench  # noqa: E402  (bench/redaction.py: the corpus loader and the scoring)

CASES = bench.load()
ASSERTED = [c for c in CASES if not c.limit]


def test_the_corpus_is_large_and_has_both_sides() -> None:
    positives = [c for c in ASSERTED if c.expect]
    negatives = [c for c in ASSERTED if not c.expect]
    assert len(CASES) >= 100 and len(positives) >= 60 and len(negatives) >= 40
    assert {e.type for c in positives for e in c.expect} == set(r.TYPES)
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", ASSERTED, ids=[c.id for c in ASSERTED])
def test_corpus_case(case: bench.Case) -> None:
    """Exactly the expected values are found, with their types and exact spans."""
    found = find(case.text, Policy.PII)
    shown = [(f.type, case.text[f.start:f.end]) for f in found]
    assert sorted(found, key=lambda f: f.start) == sorted(case.expect, key=lambda f: f.start), shown
    done = redact(case.text, Policy.PII)
    for e in case.expect:
        assert case.text[e.start:e.end] not in done.text
        assert r.placeholder(e.type) in done.text
    assert sum(done.counts.values()) == len(case.expect)


def test_the_benchmark_scores_the_corpus() -> None:
    tallies, wrong = bench.score(ASSERTED)
    assert wrong == []
    assert all(t.precision == 1.0 and t.recall == 1.0 for t in tallies.values())


# -- policies -------------------------------------------------------------------------------------

MIXED = ("key sk-proj-Xq7RtY2uIo9pAs4dFg6hJk1lZx3cVb8nM0qW5eRt7yUi9oPa2sD4 card 4111 1111 1111 "
         "1111 mail ana@example.com phone +44 20 7946 0958")


def test_off_changes_nothing() -> None:
    assert find(MIXED, "off") == []
    assert redact(MIXED, Policy.OFF).text == MIXED and redact(MIXED, "off").counts == {}


def test_secrets_keeps_emails_and_phones() -> None:
    done = redact(MIXED, "secrets")
    assert done.counts == {"api_key": 1, "card": 1}
    assert "ana@example.com" in done.text and "+44 20 7946 0958" in done.text
    assert "sk-proj" not in done.text and "4111" not in done.text
    assert redact(MIXED).counts == done.counts  # secrets is the default


def test_pii_redacts_everything() -> None:
    done = redact(MIXED, "pii")
    assert done.counts == {"api_key": 1, "card": 1, "email": 1, "phone": 1}
    assert done.text == ("key [REDACTED:api_key] card [REDACTED:card] mail [REDACTED:email] "
                         "phone [REDACTED:phone]")


def test_policy_names() -> None:
    assert r.policy("pii") is Policy.PII and r.types_of("secrets") == r.SECRET_TYPES
    assert r.types_of(Policy.OFF) == ()
    with pytest.raises(ValueError):
        r.policy("all")


def test_describe_never_holds_a_value() -> None:
    assert describe({"card": 1, "api_key": 2}) == "redacted: api_key×2, card×1"
    assert describe({}) == ""
    assert r.add_counts({"card": 1}, {"card": 2, "email": 1}) == {"card": 3, "email": 1}


def test_overlaps_go_to_the_stronger_type() -> None:
    text = "postgres://ana:pa55word9@db.example.com/app"
    assert [(f.type, text[f.start:f.end]) for f in find(text, "pii")] == [("password", "pa55word9")]
    text = "Authorization: Bearer sk-proj-Xq7RtY2uIo9pAs4dFg6hJk1lZx3cVb8nM0qW5eRt7yUi9oPa2sD4"
    assert [f.type for f in find(text)] == ["api_key"]


# -- placeholders ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in ASSERTED if c.expect], ids=lambda c: c.id)
def test_redaction_is_idempotent(case: bench.Case) -> None:
    once = redact(case.text, "pii").text
    assert redact(once, "pii") == r.Redacted(once)


def test_placeholders_are_never_findings() -> None:
    text = " ".join(r.placeholder(t) for t in r.TYPES)
    assert find(text, "pii") == []
    for form in ("password: {}", 'password = "{}"', "my password is {}", "pw://u:{}@h",
                 '{{"api_key": "{}"}}'):
        assert find(form.format(r.placeholder("password")), "pii") == [], form


# -- key names and metadata -----------------------------------------------------------------------

@pytest.mark.parametrize(("name", "kind"), [
    ("password", "password"), ("DB_PASSWORD", "password"), ("dbPassword", "password"),
    ("MYSQL_ROOT_PASSWORD", "password"), ("passwd", "password"), ("db_pass", "password"),
    ("spring.datasource.password", "password"), ("pin", "pin"), ("pin_code", "pin"),
    ("aws_secret_access_key", "secret"), ("SecretAccessKey", "secret"), ("api_key", "secret"),
    ("apiKey", "secret"), ("client_secret", "secret"), ("GITHUB_TOKEN", "secret"),
    ("auth_token", "secret"), ("private_key", "secret"),
    ("max_tokens", None), ("tokenizer", None), ("password_reset_url", None), ("pass", None),
    ("password_hint", None), ("keyboard", None), ("monkey", None), ("spin", None),
    ("topic", None), ("passenger", None), ("secretary", None),
])
def test_key_names(name: str, kind: str | None) -> None:
    assert key_type(name) == kind


def test_metadata_is_redacted_by_value_and_by_key() -> None:
    counts: Counter[str] = Counter()
    meta = {"password": "hunter2", "pin": 4417, "note": "card 4111 1111 1111 1111",
            "nested": [{"api_key": "YOUR_API_KEY"}, {"token": "8f14e45fceea167a5a36dedd4bea2543"}],
            "max_tokens": 1024, "ok": True, "n": None, "from": "ana@example.com"}
    out = redact_value(meta, "secrets", counts)
    assert out == {"password": "[REDACTED:password]", "pin": "[REDACTED:password]",
                   "note": "card [REDACTED:card]",
                   "nested": [{"api_key": "YOUR_API_KEY"}, {"token": "[REDACTED:secret]"}],
                   "max_tokens": 1024, "ok": True, "n": None, "from": "ana@example.com"}
    assert counts == {"password": 2, "card": 1, "secret": 1}
    assert redact_value(meta, "off") is meta
    assert redact_value(meta, "pii")["from"] == "[REDACTED:email]"


# -- hostile and unicode input --------------------------------------------------------------------

N = 32_000  # the longest text engram takes (ENGRAM_MAX_TEXT_CHARS)


@pytest.mark.parametrize("name", sorted(bench.adversarial(10)))
def test_hostile_input_is_linear(name: str) -> None:
    """Each adversarial 32,000-character input takes well under a second (tens of ms here);
    catastrophic backtracking would take minutes."""
    r._fold_table()  # built once per process
    elapsed = bench.adversarial(N)[name]
    assert elapsed < 1.0, f"{name}: {elapsed:.2f}s"


def test_many_findings_stay_linear() -> None:
    jwt = "eyJhbGciOiJub25lIn0.eyJzdWIiOiIxIn0.c2ln "
    text = jwt * (N // len(jwt))
    t0 = time.perf_counter()
    done = redact(text)
    assert time.perf_counter() - t0 < 1.0
    assert done.counts == {"token": N // len(jwt)}


def test_unicode_is_folded_not_lost() -> None:
    assert find("٤١١١١١١١١١١١١١١١") == [Finding("card", 0, 16)]  # Arabic-Indic digits
    assert find("𝟒𝟏𝟏𝟏𝟏𝟏𝟏𝟏𝟏𝟏𝟏𝟏𝟏𝟏𝟏𝟏") == [Finding("card", 0, 16)]  # mathematical digits
    text = "e-mail: ana@exämple.com, café 4111 1111 1111 1111 🍣"
    done = redact(text, "pii")
    assert done.text == "e-mail: ana@exämple.com, café [REDACTED:card] 🍣"  # no IDN addresses


ALPHABET = st.sampled_from(list("aZ09 -_.:=@+/()[]{}\"'\n\t#*$<>") + [
    "sk-", "sk-proj-", "AKIA", "ghp_", "xoxb-", "eyJ", "Bearer ", "password", " is ", "4111 ",
    "DE89 ", "-----BEGIN RSA PRIVATE KEY-----", "-----END RSA PRIVATE KEY-----", "://", "é",
    "\u200b", "４", "🍣", "\ud7ff", "\U0001d7cf", "[REDACTED:card]"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ALPHABET, max_size=80).map("".join))
def test_any_text_redacts_without_error_and_idempotently(text: str) -> None:
    done = redact(text, "pii")
    assert redact(done.text, "pii").text == done.text
    for f in find(text, "pii"):
        assert 0 <= f.start < f.end <= len(text)
    if not done.counts:
        assert done.text == text

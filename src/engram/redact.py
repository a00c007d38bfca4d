"""Redaction on write: secrets (and, with the `pii` policy, emails and phone numbers) are
replaced by typed placeholders such as `[REDACTED:api_key]` before anything is stored or
embedded.

Pure functions, no I/O. The detectors are patterns plus checksums, not a model:

| type          | what (policy `secrets`, the default)                                         |
| ------------- | ---------------------------------------------------------------------------- |
| `private_key` | `-----BEGIN ... PRIVATE KEY-----` blocks (to the END line, or to the end of   |
|               | the base64 body when the paste was cut)                                       |
| `api_key`     | vendor formats: OpenAI `sk-` / `sk-proj-`, Anthropic `sk-ant-`, AWS access   |
|               | key ids (`AKIA...`), GitHub (`ghp_`, `gho_`, `ghu_`, `ghs_`, `ghr_`,          |
|               | `github_pat_`), GitLab `glpat-`, Slack `xox[bpars]-` / `xapp-`, Stripe        |
|               | `sk_live_` / `rk_live_` (and `_test_`, `whsec_`), Google `AIza...`, Hugging   |
|               | Face `hf_`                                                                    |
| `token`       | JWTs (`eyJ...`.`eyJ...`.sig), `Bearer <token>`, `Authorization: Basic ...`    |
| `secret`      | a random-looking value assigned to a secret-named key (`aws_secret_access_key |
|               | = ...`, `"client_secret": "..."`, `API_TOKEN=...`); Slack and Discord webhook |
|               | URLs                                                                          |
| `password`    | a value assigned to a password-named key (`password: x`, `DB_PASSWORD=x`,    |
|               | `"pwd": "x"`), a password said in prose (`my password is x` when x looks      |
|               | like one), the password of a URL (`scheme://user:pass@host`), a PIN           |
| `card`        | payment card numbers: 13-19 digits, alone or in groups, issuer prefix and     |
|               | Luhn checked                                                                  |
| `iban`        | IBANs: country code, the country's length, mod-97 checksum                   |
| `email`       | (`pii`) addresses (not `name@2x.png`-style file names)                        |
| `phone`       | (`pii`) `+` international numbers, NANP `(555) 123-4567`, national numbers   |
|               | with a trunk 0 (`020 7946 0958`, `06 12 34 56 78`), digits after "phone",     |
|               | "call me at", ...                                                             |

Every pattern is linear in the length of the text (possessive quantifiers, bounded runs, starts
only at token boundaries), so hostile input costs what its length costs; `tests/test_redact.py`
times a 32,000-character adversarial input per detector. Fullwidth forms and non-ASCII digits
are folded to ASCII (same length) before matching, so `４１１１ ...` is a card too.

What it misses, by design: a secret with no recognisable shape or context (a plain word given
as a password without "password", an AWS secret key without its name, a bare 40-character
token), secrets split by zero-width characters or spelled out ("s k dash ..."), names,
addresses and other PII that has no fixed shape. See docs/security.md.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Policy(StrEnum):
    OFF = "off"          # nothing is redacted
    SECRETS = "secrets"  # credentials, payment cards, IBANs (the default)
    PII = "pii"          # secrets, and emails and phone numbers


SECRET_TYPES = ("private_key", "api_key", "token", "secret", "password", "card", "iban")
PII_TYPES = ("email", "phone")
TYPES = SECRET_TYPES + PII_TYPES
PREFIX = "[REDACTED:"


def placeholder(kind: str) -> str:
    return f"{PREFIX}{kind}]"


def policy(value: Policy | str) -> Policy:
    """A policy from its name (ValueError for an unknown one)."""
    return value if isinstance(value, Policy) else Policy(value)


def types_of(p: Policy | str) -> tuple[str, ...]:
    """The types a policy redacts."""
    p = policy(p)
    return () if p is Policy.OFF else SECRET_TYPES if p is Policy.SECRETS else TYPES


@dataclass(frozen=True)
class Finding:
    type: str
    start: int
    end: int


@dataclass(frozen=True)
class Redacted:
    """A text with its findings replaced, and how many of each type were replaced."""

    text: str
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.counts)


# Higher wins when two findings overlap (the lower one is dropped).
PRIORITY = {"private_key": 100, "api_key": 80, "token": 75, "secret": 70, "password": 65,
            "card": 60, "iban": 55, "email": 40, "phone": 30}


# -- folding -------------------------------------------------------------------------------------

@functools.cache
def _fold_table() -> dict[int, int]:
    """Same-length folding: non-ASCII decimal digits, fullwidth ASCII, unusual spaces and
    dashes to their ASCII forms, so that positions in the folded text are positions in the
    original."""
    table: dict[int, int] = {}
    for cp in (*range(0x80, 0x10000), *range(0x1D7CE, 0x1D800)):
        digit = unicodedata.decimal(chr(cp), -1)
        if digit >= 0:
            table[cp] = 0x30 + digit
    for cp in range(0xFF01, 0xFF5F):  # fullwidth ! .. ~
        table[cp] = cp - 0xFEE0
    for cp in (0xA0, *range(0x2000, 0x200B), 0x202F, 0x205F, 0x3000):
        table[cp] = 0x20
    for cp in (*range(0x2010, 0x2016), 0x2212, 0xFE58, 0xFE63):
        table[cp] = 0x2D
    return table


def fold(text: str) -> str:
    return text if text.isascii() else text.translate(_fold_table())


# -- shapes of values ----------------------------------------------------------------------------

def _classes(s: str) -> tuple[bool, bool, bool]:
    lower = upper = digit = False
    for c in s:
        if "a" <= c <= "z":
            lower = True
        elif "A" <= c <= "Z":
            upper = True
        elif "0" <= c <= "9":
            digit = True
    return lower, upper, digit


def random_looking(s: str, min_len: int = 16) -> bool:
    """Like a generated credential rather than a word or a name: long enough, with digits and
    letters (or long and mixed-case)."""
    if len(s) < min_len:
        return False
    lower, upper, digit = _classes(s)
    return (digit and (lower or upper)) or (lower and upper and len(s) >= 24)


_REFERENCE = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|<[^<>]*>|\{\{[^{}]*\}\}|%\([^()]*\)s"
                        r"|[*xX•·.\-_]+|\?+")
_NOT_A_VALUE = frozenset({"null", "none", "nil", "true", "false", "required", "optional",
                          "empty", "unset", "undefined", "redacted", "hidden", "n/a"})


def placeholder_value(value: str) -> bool:
    """A reference, a template or a mask rather than a secret: `${DB_PASSWORD}`, `$PASS`,
    `<your password>`, `{{ vault.pw }}`, `********`, `null`, an engram placeholder."""
    return (value.startswith((PREFIX, "<", "{{", "${", "$(", "%(")) or value.lower() in _NOT_A_VALUE
            or _REFERENCE.fullmatch(value) is not None)


_TRAILING = ".,;:)]}"  # sentence punctuation; "!" and "?" may be the password's


def _strip_trailing(value: str, end: int) -> tuple[str, int]:
    while value and value[-1] in _TRAILING:
        value, end = value[:-1], end - 1
    return value, end


# -- key names: which assignments hold secrets ---------------------------------------------------

_SEGMENT = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_PASSWORD_SEGMENTS = frozenset({"password", "passwd", "passphrase", "passcode", "pwd",
                                "passwords", "pword"})
_SECRET_SEGMENTS = frozenset({"secret", "secrets", "token", "apikey", "secretkey", "accesskey",
                              "privatekey", "credential", "credentials", "authtoken"})
_KEY_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"),
                        ("auth", "key"), ("signing", "key"), ("client", "key"),
                        ("session", "key"), ("encryption", "key"), ("master", "key")})


def key_type(name: str) -> str | None:
    """"password", "pin" or "secret" for a key name that says it holds one, else None:
    `DB_PASSWORD`, `dbPassword`, `aws_secret_access_key`, `apiKey`, `pin`; not `max_tokens`,
    `tokenizer`, `password_reset_url`."""
    segments = [s.lower() for s in _SEGMENT.findall(name)]
    if not segments or len(segments) > 8:
        return None
    if segments[-1] in ("url", "link", "hint", "policy", "length", "reset", "expiry",
                        "expires", "type", "count", "file", "path", "id", "ids", "name"):
        return None
    if any(s in _PASSWORD_SEGMENTS for s in segments) or (
            len(segments) > 1 and segments[-1] == "pass"):
        return "password"
    if segments == ["pin"] or segments[-2:] in (["pin", "code"], ["pin", "number"]):
        return "pin"
    if any(s in _SECRET_SEGMENTS for s in segments) or any(
            pair in _KEY_PAIRS for pair in zip(segments, segments[1:], strict=False)):
        return "secret"
    return None


def _assigned(kind: str, value: str) -> str | None:
    """The finding type of `value` assigned to a key of type `kind`, or None if the value is
    not a secret (a reference, a mask, a word where a token was expected)."""
    if not value or placeholder_value(value):
        return None
    if kind == "password":
        return "password"
    if kind == "pin":
        return "password" if value.isdigit() and 4 <= len(value) <= 8 else None
    return "secret" if random_looking(value, 8) or len(value) >= 32 else None


# -- detectors -----------------------------------------------------------------------------------
# Each takes the folded text and yields findings. Patterns start only at token boundaries and
# use possessive or bounded quantifiers: no pattern can scan a long run more than once per start.

_VENDOR = re.compile(r"""
(?<![A-Za-z0-9_-])(?:
    (?P<sk>sk-(?:proj-|svcacct-|admin-|ant-(?:api|admin|sid)[0-9]{2}-)?[A-Za-z0-9_-]{20,}+)
  | (?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}+
  | whsec_[A-Za-z0-9]{24,}+
  | (?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Za-z0-9])
  | gh[pousr]_[A-Za-z0-9]{36,}+
  | github_pat_[A-Za-z0-9_]{22,}+
  | glpat-[A-Za-z0-9_-]{20,}+
  | xox[bpars]-[A-Za-z0-9-]{10,}+
  | xapp-[0-9]-[A-Za-z0-9-]{10,}+
  | AIza[0-9A-Za-z_-]{35}(?![0-9A-Za-z_-])
  | (?P<hf>hf_[A-Za-z]{34}(?![A-Za-z0-9_]))
)""", re.VERBOSE)


def _vendor_keys(text: str) -> Iterator[Finding]:
    for m in _VENDOR.finditer(text):
        if m.group("sk"):
            body = m.group("sk")[3:]
            lower, upper, digit = _classes(body)
            hexish = all(c in "0123456789abcdef" for c in body)
            if not ((lower and upper and digit) or (hexish and digit and lower and len(body) >= 32)
                    or (digit and len(body) >= 40)):
                continue  # "sk-learn-model-selection-guide": a word, not a key
        elif m.group("hf") and not all(_classes(m.group("hf")[3:])[:2]):
            continue  # hf_ tokens are mixed-case
        yield Finding("api_key", m.start(), m.end())


_JWT = re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{8,}+\.eyJ[A-Za-z0-9_-]{8,}+"
                  r"(?:\.[A-Za-z0-9_-]++)?")
_BEARER = re.compile(r"(?i:\bbearer)[ \t]++([A-Za-z0-9._~+/-]{12,}+=*+)")
_BASIC = re.compile(r"(?i:\bauthorization)[\"']?[ \t]*+[:=][ \t]*+[\"']?(?i:basic)[ \t]++"
                    r"([A-Za-z0-9+/]{8,}+={0,2})")


def _tokens(text: str) -> Iterator[Finding]:
    for m in _JWT.finditer(text):
        yield Finding("token", m.start(), m.end())
    for m in _BEARER.finditer(text):
        value = m.group(1)
        if not value.startswith("eyJ") and (random_looking(value, 12) or len(value) >= 32):
            yield Finding("token", m.start(1), m.end(1))
    for m in _BASIC.finditer(text):
        yield Finding("token", m.start(1), m.end(1))


_WEBHOOK = re.compile(r"https://(?:hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]{20,200}+"
                      r"|(?:ptb\.|canary\.)?discord(?:app)?\.com/api/webhooks/[0-9]{17,20}/"
                      r"[A-Za-z0-9_-]{60,100}+)")


def _webhooks(text: str) -> Iterator[Finding]:
    """Webhook URLs whose path is the credential (Slack, Discord)."""
    for m in _WEBHOOK.finditer(text):
        yield Finding("secret", m.start(), m.end())


_PEM_BEGIN = re.compile(r"-----BEGIN (?:[A-Z0-9]{1,20} ){0,4}PRIVATE KEY(?: BLOCK)?-----")
_PEM_END = re.compile(r"-----END (?:[A-Z0-9]{1,20} ){0,4}PRIVATE KEY(?: BLOCK)?-----")
_PEM_BODY = re.compile(r"(?:[ \t]*+(?:\\r|\\n|\r|\n){0,2}+[ \t]*+"
                       r"(?:[A-Za-z0-9+/]{16,}+={0,2}|[A-Za-z0-9+/]{2,15}+={1,2}"
                       r"|[A-Za-z-]{1,20}+:[^\n]{0,100}+))++")


def _private_keys(text: str) -> Iterator[Finding]:
    pos = 0
    ends = True  # False once no END is left after a BEGIN: none is after a later one either
    while (m := _PEM_BEGIN.search(text, pos)) is not None:
        end = _PEM_END.search(text, m.end()) if ends else None
        if end is not None:
            stop = end.end()
        else:  # cut off: the base64 body that follows, line by line
            ends = False
            body = _PEM_BODY.match(text, m.end())
            stop = body.end() if body else m.end()
        yield Finding("private_key", m.start(), stop)
        pos = stop


_URL_PASSWORD = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]{0,30}+://"
                           r"[^\s:/?#@\[\]\"'<>]{1,256}+:([^\s/?#@\"'<>]{1,256}+)@")
_ASSIGN = re.compile(
    r"(?<![A-Za-z0-9_.])([A-Za-z][A-Za-z0-9_.-]{0,63}+)[\"']?[ \t]*+(?::=|=>|[:=])[ \t]*+"
    r"(?:\"([^\"\n]{1,256}+)\"|'([^'\n]{1,256}+)'|([^\s\"',;<>\[\]]{1,256}+))")
_PROSE_PASSWORD = re.compile(
    r"(?i:\b(password|passwd|passphrase|passcode|pass|pwd|pw|pin(?:[ ]code|[ ]number)?)\b)"
    r"(?:[ ]for[ ][^\n.:=]{1,40}?)?[ \t]*+(?:(?i:is|was|will[ ]be|are|to)\b|[=:])[ \t]*+:?[ \t]*+"
    r"(?i:now[ ]|still[ ]|set[ ]to[ ])?"
    r"(?:\"([^\"\n]{1,128}+)\"|'([^'\n]{1,128}+)'|`([^`\n]{1,128}+)`|([^\s\"'`]{1,128}+))")


def _value(m: re.Match[str]) -> tuple[str, int, int, bool]:
    """The value of an assignment whose last group is the unquoted form and the groups
    before it the quoted forms: (text, start, end, quoted)."""
    last = m.re.groups
    for g in range(2, last + 1):
        if m.group(g) is not None:
            return m.group(g), m.start(g), m.end(g), g < last
    raise AssertionError("an assignment without a value")


def _passwords(text: str) -> Iterator[Finding]:
    for m in _URL_PASSWORD.finditer(text):
        if not placeholder_value(m.group(1)):
            yield Finding("password", m.start(1), m.end(1))
    for m in _ASSIGN.finditer(text):
        kind = key_type(m.group(1))
        if kind is None:
            continue
        value, start, end, quoted = _value(m)
        if not quoted:
            value, end = _strip_trailing(value, end)
        typ = _assigned(kind, value)
        if typ is not None:
            yield Finding(typ, start, end)
    for m in _PROSE_PASSWORD.finditer(text):
        value, start, end, quoted = _value(m)
        if not quoted:
            value, end = _strip_trailing(value, end)
        if not value or placeholder_value(value) or value.startswith("//"):
            continue  # "pw://user:...": a URL's scheme, not a label
        if m.group(1).lower().startswith("pin"):
            if value.isdigit() and 4 <= len(value) <= 8:
                yield Finding("password", start, end)
        elif quoted or _password_like(value):
            yield Finding("password", start, end)


def _password_like(value: str) -> bool:
    """A word said after "password is" that is a password, not an adjective: digits, symbols
    or an inner capital ("hunter2", "Tr0ub4dor&3", "correctHorse"), not "strong" or "12"."""
    if len(value) < 4:
        return False
    lower, upper, digit = _classes(value)
    symbol = any(not c.isalnum() for c in value)
    inner_upper = any("A" <= c <= "Z" for c in value[1:])
    return digit or symbol or inner_upper


# -- numbers -------------------------------------------------------------------------------------

_DIGIT_RUN = re.compile(r"(?<![0-9A-Za-z_+.,])[0-9]++(?:[ -][0-9]++)*+(?![0-9A-Za-z_]|[.,][0-9])")
_GROUP = re.compile(r"[0-9]++")


def luhn(digits: str) -> bool:
    total = 0
    for i, c in enumerate(reversed(digits)):
        d = ord(c) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def card_issuer(digits: str) -> bool:
    """An issuer prefix: Visa 4; Mastercard 51-55 and 2221-2720; Maestro 50, 56-58; Amex 34,
    37; Diners 30, 36, 38, 39; JCB 35; Discover, UnionPay, Maestro 6."""
    first = digits[0]
    if first in "456":
        return True
    if first == "3":
        return digits[1] in "0456789"
    if first == "2":
        return 2221 <= int(digits[:4]) <= 2720
    return False


def card_number(digits: str) -> bool:
    return 13 <= len(digits) <= 19 and card_issuer(digits) and luhn(digits)


def _cards(text: str) -> Iterator[Finding]:
    """A run of digit groups (single spaces or dashes between them) holds a card where a
    window of it is one group of 13-19 digits, or consecutive groups of 3-6 digits (4-4-4-4,
    4-6-5, 4-4-4-4-3) adding up to 13-19, with an issuer prefix and a Luhn check digit. The
    longest window wins; a run may hold several cards."""
    for m in _DIGIT_RUN.finditer(text):
        run = m.group()
        if len(run) < 13:
            continue
        groups = [(g.start(), g.end()) for g in _GROUP.finditer(run)]
        sizes = [e - s for s, e in groups]
        i = 0
        while i < len(groups):
            hit = None
            if 13 <= sizes[i] <= 19 and card_number(run[groups[i][0]:groups[i][1]]):
                hit = i
            elif 3 <= sizes[i] <= 6:
                total, j = sizes[i], i
                while j + 1 < len(groups) and 3 <= sizes[j + 1] <= 6 and total + sizes[j + 1] <= 19:
                    j += 1
                    total += sizes[j]
                for k in range(j, i, -1):  # the longest window first
                    if total >= 13 and card_number("".join(run[s:e] for s, e in groups[i:k + 1])):
                        hit = k
                        break
                    total -= sizes[k]
            if hit is None:
                i += 1
                continue
            yield Finding("card", m.start() + groups[i][0], m.start() + groups[hit][1])
            i = hit + 1


# Country -> IBAN length (the SWIFT registry).
IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22,
    "BI": 27, "BR": 29, "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DJ": 27,
    "DK": 18, "DO": 28, "EE": 20, "EG": 29, "ES": 24, "FI": 18, "FK": 18, "FO": 18, "FR": 27,
    "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28, "IE": 22,
    "IL": 23, "IQ": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LC": 32,
    "LI": 21, "LT": 20, "LU": 20, "LV": 21, "LY": 25, "MC": 27, "MD": 24, "ME": 22, "MK": 19,
    "MN": 20, "MR": 27, "MT": 31, "MU": 30, "NI": 28, "NL": 18, "NO": 15, "OM": 23, "PK": 24,
    "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "RU": 33, "SA": 24, "SC": 31,
    "SD": 18, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "SO": 23, "ST": 25, "SV": 28, "TL": 23,
    "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20, "YE": 30,
}
_IBAN_RUN = re.compile(r"(?<![A-Za-z0-9])[A-Za-z]{2}[0-9]{2}(?:[ ]?[A-Za-z0-9]){10,34}+")


def iban_valid(compact: str) -> bool:
    """Country, length and the mod-97 checksum of an IBAN without spaces."""
    compact = compact.upper()
    if IBAN_LENGTHS.get(compact[:2]) != len(compact) or not compact.isalnum():
        return False
    moved = compact[4:] + compact[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _ibans(text: str) -> Iterator[Finding]:
    for m in _IBAN_RUN.finditer(text):
        want = IBAN_LENGTHS.get(m.group()[:2].upper())
        if want is None:
            continue
        # the first `want` letters and digits, ending where a group ends
        seen = 0
        stop = None
        for k, c in enumerate(m.group()):
            if c != " ":
                seen += 1
                if seen == want:
                    stop = k + 1
                    break
        if stop is None:
            continue
        rest = m.group()[stop:]
        if rest and not rest.startswith(" "):
            continue  # the run goes on: not this IBAN
        if iban_valid(m.group()[:stop].replace(" ", "")):
            yield Finding("iban", m.start(), m.start() + stop)


_EMAIL = re.compile(r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}+@"
                    r"(?:[A-Za-z0-9-]{1,63}+\.)+[A-Za-z]{2,24}+(?![A-Za-z0-9-])")
_FILE_SUFFIXES = frozenset("png jpg jpeg gif svg webp ico bmp tif tiff pdf js mjs ts css html py md "
                           "txt json yaml yml toml zip gz tar whl lock".split())


def _emails(text: str) -> Iterator[Finding]:
    for m in _EMAIL.finditer(text):
        if m.group().rsplit(".", 1)[1].lower() in _FILE_SUFFIXES:
            continue  # logo@2x.png
        scheme = text.rfind("://", max(0, m.start() - 300), m.start())
        if scheme >= 0 and not any(c.isspace() for c in text[scheme:m.start()]):
            continue  # the user and host of a URL (scheme://user:password@host), not an address
        if text.startswith(":", m.end()) and m.end() + 1 < len(text) and not text[m.end() + 1].isspace():
            continue  # git@github.com:org/repo.git, an SSH remote
        yield Finding("email", m.start(), m.end())


_PHONE_INTL = re.compile(r"(?<![A-Za-z0-9+])\+[1-9](?:[ .-]?+\(?+[0-9]{1,5}+\)?+){2,8}+"
                         r"(?![0-9A-Za-z])")
_PHONE_NANP = re.compile(r"(?<![A-Za-z0-9+#/.:-])(?<![0-9][ .-])(?:1[ .-])?+(?:\([2-9][0-9]{2}\)[ .-]?+"
                         r"|[2-9][0-9]{2}[ .-])[0-9]{3}[ .-][0-9]{4}(?![0-9A-Za-z]|[.:-][0-9])")
_PHONE_TRUNK = re.compile(r"(?<![A-Za-z0-9+#/.:-])(?<![0-9][ .-])0[1-9][0-9]{0,4}+(?:[ .-][0-9]{2,8}+){1,4}+"
                          r"(?![0-9A-Za-z]|[.:-][0-9])")
_PHONE_SAID = re.compile(r"(?i:\b(?:phone|tel|telephone|mobile|cell|whatsapp|fax|sms|landline"
                         r"|call[ ]me[ ]at|text[ ]me[ ]at|reach[ ]me[ ]at|ring[ ]me[ ]on"
                         r"|m[oó]vil|telem[oó]vel|telefone|tel[eé]fono|telefon|handy|portable"
                         r"|cellulare|t[eé]l[eé]phone))"
                         r"\b[^0-9\n]{0,20}+(\+?[0-9](?:[ .()-]{0,2}+[0-9]){6,16}+)(?![0-9])")
_NOT_A_PHONE = re.compile(r"(?:\b(?i:order|invoice|ticket|tracking|ref|reference|isbn|id|no|nr"
                          r"|account|acct|serial|sku|part|case|version|build)\.?|#)[ .:#-]{0,3}$")


def _digits(s: str) -> int:
    return sum(c.isdigit() for c in s)


def _looks_like_date(groups: list[str]) -> bool:
    return (len(groups) >= 3 and len(groups[0]) <= 2 and len(groups[1]) <= 2
            and len(groups[2]) == 4 and groups[2][:2] in ("19", "20")
            and 1 <= int(groups[0]) <= 31 and 1 <= int(groups[1]) <= 31)


def _phones(text: str) -> Iterator[Finding]:
    for m in _PHONE_INTL.finditer(text):
        if 8 <= _digits(m.group()) <= 15:
            yield Finding("phone", m.start(), m.end())
    for pattern in (_PHONE_NANP, _PHONE_TRUNK):
        for m in pattern.finditer(text):
            if _NOT_A_PHONE.search(text[max(0, m.start() - 16):m.start()]):
                continue
            if pattern is _PHONE_TRUNK:
                groups = re.findall(r"[0-9]+", m.group())
                if not 10 <= _digits(m.group()) <= 11 or _looks_like_date(groups):
                    continue
            yield Finding("phone", m.start(), m.end())
    for m in _PHONE_SAID.finditer(text):
        if 7 <= _digits(m.group(1)) <= 15:
            yield Finding("phone", m.start(1), m.end(1))


# Each detector with the types it can find.
DETECTORS: tuple[tuple[frozenset[str], Callable[[str], Iterator[Finding]]], ...] = (
    (frozenset({"private_key"}), _private_keys),
    (frozenset({"api_key"}), _vendor_keys),
    (frozenset({"token"}), _tokens),
    (frozenset({"password", "secret"}), _passwords),
    (frozenset({"secret"}), _webhooks),
    (frozenset({"card"}), _cards),
    (frozenset({"iban"}), _ibans),
    (frozenset({"email"}), _emails),
    (frozenset({"phone"}), _phones),
)


# -- the policy ----------------------------------------------------------------------------------

def find(text: str, p: Policy | str = Policy.SECRETS) -> list[Finding]:
    """What `p` redacts in `text`, in order. Findings that overlap are joined into one, of the
    type with the higher `PRIORITY` (a password inside a URL is a password; what two
    detectors disagree on is redacted whole). An engram placeholder is never a finding."""
    wanted = set(types_of(p))
    if not wanted or not text:
        return []
    folded = fold(text)
    found = sorted((f for types, detect in DETECTORS if types & wanted for f in detect(folded)
                    if f.type in wanted and f.end > f.start), key=lambda f: (f.start, -f.end))
    joined: list[Finding] = []
    for f in found:
        last = joined[-1] if joined else None
        if last is None or f.start >= last.end:
            joined.append(f)
            continue
        strongest = max(last, f, key=lambda x: (PRIORITY[x.type], x.end - x.start))
        joined[-1] = Finding(strongest.type, last.start, max(last.end, f.end))
    return joined


MAX_PASSES = 4


def redact(text: str, p: Policy | str = Policy.SECRETS) -> Redacted:
    """`text` with every finding of `p` replaced by its placeholder.

    Idempotent: redacting a redacted text changes nothing. A replacement can change what a
    neighbour looks like (a token after `-----BEGIN ... KEY-----` was glued to the dashes;
    after the placeholder it stands alone), so the text is redacted again until nothing more
    is found (at most `MAX_PASSES` times; the second pass usually finds nothing)."""
    counts: Counter[str] = Counter()
    for _ in range(MAX_PASSES):
        findings = find(text, p)
        if not findings:
            break
        parts: list[str] = []
        pos = 0
        for f in findings:
            parts += [text[pos:f.start], placeholder(f.type)]
            pos = f.end
        parts.append(text[pos:])
        text = "".join(parts)
        counts.update(f.type for f in findings)
    return Redacted(text, add_counts(counts))


def redact_value(value: Any, p: Policy | str = Policy.SECRETS,
                 counts: Counter[str] | None = None) -> Any:
    """A JSON-like value (metadata) with every string redacted; the value of a key named like
    a password or a secret (`{"password": "hunter2"}`, `{"api_key": "..."}`, `{"pin": 4417}`)
    is redacted whole. `counts` (when given) is added to."""
    counts = counts if counts is not None else Counter()
    if policy(p) is Policy.OFF:
        return value
    if isinstance(value, str):
        done = redact(value, p)
        counts.update(done.counts)
        return done.text
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            kind = key_type(k) if isinstance(k, str) else None
            if kind is not None and isinstance(v, str | int) and not isinstance(v, bool):
                typ = _assigned(kind, str(v))
                if typ is not None:
                    counts[typ] += 1
                    out[k] = placeholder(typ)
                    continue
            out[k] = redact_value(v, p, counts)
        return out
    if isinstance(value, list | tuple):
        return [redact_value(v, p, counts) for v in value]
    return value


def add_counts(*many: Mapping[str, int]) -> dict[str, int]:
    """Counts summed, in `TYPES` order."""
    total: Counter[str] = Counter()
    for c in many:
        total.update(c)
    return {t: total[t] for t in TYPES if total[t]}


def describe(counts: Mapping[str, int]) -> str:
    """`"redacted: api_key×1, card×1"` (for an event's reason and `AddResult.notes`); ""
    for none. Never holds a redacted value."""
    ordered = add_counts(counts)
    if not ordered:
        return ""
    return "redacted: " + ", ".join(f"{t}×{n}" for t, n in ordered.items())


def noted(reason: str, counts: Mapping[str, int]) -> str:
    """An event's reason with what redaction replaced in its memory appended ("merged;
    redacted: api_key×1"): the history says it, never the value."""
    said = describe(counts)
    if not said:
        return reason
    return f"{reason}; {said}" if reason else said

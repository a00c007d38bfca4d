"""`engram chat`: a terminal chat with any OpenAI-compatible model that remembers across runs.

Before each answer it assembles a token-budgeted context (memories + this session); after it,
both messages are stored in the session. Leaving ends the session: a summary is written and
facts are extracted (when the lifecycle code and an LLM are there).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, TextIO

import typer

from .. import Memory
from ..errors import EngramError, InvalidInput, NotFound, ProviderError
from .base import EXIT_OK, AgentOpt, DbOpt, config, guard, state

if TYPE_CHECKING:
    from .. import Context, SessionHandle

NO_ENDPOINT = """engram chat needs an OpenAI-compatible chat endpoint, and none is configured.

Set ENGRAM_LLM_BASE_URL (and, if the endpoint needs them, ENGRAM_LLM_API_KEY and
ENGRAM_LLM_MODEL), then run `engram chat` again. For example:

  # llama.cpp:   llama-server -m model.gguf --port 8080
  export ENGRAM_LLM_BASE_URL=http://localhost:8080/v1
  # Ollama:      ollama serve;  ollama pull llama3.2
  export ENGRAM_LLM_BASE_URL=http://localhost:11434/v1 ENGRAM_LLM_MODEL=llama3.2
  # OpenAI
  export ENGRAM_LLM_BASE_URL=https://api.openai.com/v1 ENGRAM_LLM_API_KEY=sk-... ENGRAM_LLM_MODEL=gpt-4o-mini
"""

MAX_SCOPES = 1000  # sessions with one id under other agents of the user, looked through

INSTRUCTIONS = ("You are a helpful assistant with a long-term memory of the user. Use the recalled "
                "memories when they are relevant, say so when you do not know, and keep answers short.")

HELP = """commands:
  /memories [QUERY]   what is remembered about you (facts, lessons, earlier sessions); with a
                      query, the memories that match it
  /forget ID|TEXT     forget one memory: by id (or the start of one), or the best match for TEXT
  /session            this session: id, policy, messages, summary
  /session new|ID     end this session and start a new one, or resume session ID
  /context            what was sent to the model for the last answer, and tokens per block
  /help               this help
  /quit               end the session (summary + extraction) and leave; Ctrl-D too"""


@dataclass
class ChatSettings:
    user_id: str
    agent_id: str | None = None
    session_id: str | None = None
    policy: str = "incremental"
    budget_tokens: int = 2000
    max_tokens: int = 512
    end: bool = True  # end the session on leaving: summary + extraction


class Chat:
    """The chat loop, reading lines from `read` and writing to `out` (a terminal in practice)."""

    def __init__(self, memory: Memory, settings: ChatSettings, *, read: Callable[[str], str] = input,
                 out: TextIO = sys.stdout) -> None:
        if memory.llm is None:
            raise InvalidInput("engram chat needs an LLM endpoint (ENGRAM_LLM_BASE_URL)")
        self.memory = memory
        self.llm = memory.llm
        self.settings = settings
        self.read = read
        self.out = out
        self.session = self._open(settings.session_id)
        self.last: Context | None = None

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _open(self, session_id: str | None) -> SessionHandle:
        """Resume a stored session with its own policy; a new one gets the chat's policy."""
        s = self.settings
        handle = self.memory.session(session_id=session_id, user_id=s.user_id, agent_id=s.agent_id)
        stored = self.memory.sessions(user_id=s.user_id, agent_id=s.agent_id, session_id=handle.id,
                                      limit=MAX_SCOPES)
        if any(row.scope == handle.scope for row in stored):  # this very scope (agent None: none)
            return handle
        return self.memory.session(session_id=handle.id, user_id=s.user_id, agent_id=s.agent_id,
                                   policy=s.policy)

    def run(self) -> int:
        s = self.session
        n = len(s.messages())
        self.say(f"engram chat - {self.llm.model} - user {self.settings.user_id}, session {s.id}"
                 + (f" (resumed, {n} messages)" if n else " (new)"))
        self.say("type /help for commands, /quit or Ctrl-D to leave")
        while True:
            try:
                line = self.read("you> ")
            except (EOFError, KeyboardInterrupt):
                self.say()
                break
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    break
                continue
            self.answer(line)
        self.leave()
        return 0

    def answer(self, text: str) -> None:
        st = self.settings
        try:
            ctx = self.memory.context(text, user_id=st.user_id, agent_id=st.agent_id,
                                      session_id=self.session.id, budget_tokens=st.budget_tokens,
                                      instructions=INSTRUCTIONS)
            self.last = ctx
            reply = self.llm.complete(ctx.messages, max_tokens=st.max_tokens).text.strip()
        except ProviderError as exc:
            self.say(f"error: the model failed: {exc}")
            return
        except InvalidInput as exc:
            self.say(f"error: {exc}")
            return
        self.say(f"assistant> {reply or '(no answer)'}")
        # Written after the answer: the exchange is remembered for the next turns and runs.
        messages = [{"role": "user", "content": text}]
        if reply:
            messages.append({"role": "assistant", "content": reply})
        self.session.add(messages)

    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        try:
            parts = shlex.split(line)
        except ValueError:
            parts = line.split()
        name, args = parts[0].lower(), " ".join(parts[1:])
        try:
            if name in ("/quit", "/exit", "/q"):
                return False
            if name == "/help":
                self.say(HELP)
            elif name == "/memories":
                self.memories(args)
            elif name == "/forget":
                self.forget(args)
            elif name == "/session":
                self.session_command(args)
            elif name == "/context":
                self.show_context()
            else:
                self.say(f"unknown command {name}; /help lists them")
        except EngramError as exc:
            self.say(f"error: {exc}")
        return True

    def memories(self, query: str) -> None:
        st = self.settings
        if query:
            hits = self.memory.search(query, user_id=st.user_id, agent_id=st.agent_id, limit=10)
            records = [h.memory for h in hits]
        else:
            records = self.memory.list(user_id=st.user_id, agent_id=st.agent_id,
                                       kinds=["semantic", "procedural"], limit=100).items
            records += self.memory.list(user_id=st.user_id, agent_id=st.agent_id,
                                        filters={"engram": "session_summary"}, limit=100).items
        if not records:
            self.say("nothing remembered yet" + (" that matches" if query else ""))
        for r in records:
            when = (r.observed_at or r.created_at).date().isoformat()
            text = " ".join(r.text.split())
            self.say(f"  {r.id[:13]}  {r.kind.value:<10} {when}  {text[:200]}")
        count = self.memory.stats(user_id=st.user_id, agent_id=st.agent_id).by_kind.get("episodic", 0)
        self.say(f"({count} messages remembered in all)")

    def forget(self, target: str) -> None:
        st = self.settings
        if not target:
            self.say("usage: /forget ID|TEXT")
            return
        found = None
        for r in self.memory.list(user_id=st.user_id, agent_id=st.agent_id, limit=1000).items:
            if r.id == target or (len(target) >= 8 and r.id.startswith(target)):
                found = r
                break
        if found is None:
            hits = self.memory.search(target, user_id=st.user_id, agent_id=st.agent_id, limit=1)
            found = hits[0].memory if hits else None
        if found is None:
            raise NotFound(f"no memory matches {target!r}")
        self.memory.delete(found.id, user_id=st.user_id, agent_id=st.agent_id)
        self.say(f"forgotten: {' '.join(found.text.split())[:200]}")

    def session_command(self, arg: str) -> None:
        if arg:
            self.leave()
            self.session = self._open(None if arg == "new" else arg)
        s = self.session
        info = s.info()
        self.say(f"session {s.id}: policy {info.policy}, {len(s.messages())} messages, "
                 f"started {info.created_at.isoformat(timespec='seconds')}")
        if info.summary:
            self.say("summary so far:\n" + info.summary)

    def show_context(self) -> None:
        ctx = self.last
        if ctx is None:
            self.say("no answer yet")
            return
        self.say(f"{ctx.total_tokens} of {ctx.budget_tokens} tokens: "
                 + ", ".join(f"{k} {v}" for k, v in ctx.usage.items()))
        for m in ctx.messages:
            self.say(f"[{m['role']}] {m.get('content') or ''}")

    def leave(self) -> None:
        s = self.session
        if not self.settings.end or not s.messages():
            s.close()
            return
        self.say("ending the session: writing its summary...")
        try:
            summary = s.end()
        except ProviderError as exc:
            self.say(f"error: could not summarise the session ({exc}); its messages are kept")
            return
        if summary is not None:
            self.say(f"session {s.id} saved ({summary.metadata.get('messages')} messages)")


def chat(ctx: typer.Context,
         user: Annotated[str | None, typer.Option(
             "--user", "-u", metavar="ID", help="Who you are (default: your login name).")] = None,
         agent: AgentOpt = None,
         session: Annotated[str | None, typer.Option(
             "--session", "-s", metavar="ID", help="Resume this session (default: a new one).")]
         = None,
         policy: Annotated[str, typer.Option(
             "--policy", help="What the model sees of a new session: all, window, tokens, turns, "
                              "summary, incremental, progressive.")] = "incremental",
         budget: Annotated[int, typer.Option(
             "--budget", help="Context budget per answer, in tokens.")] = 2000,
         max_tokens: Annotated[int, typer.Option(
             "--max-tokens", help="Longest answer, in tokens.")] = 512,
         end: Annotated[bool, typer.Option(
             "--end/--no-end", help="On leaving, write the session summary and extract facts.")]
         = True,
         db: DbOpt = None) -> None:
    """Chat with an OpenAI-compatible model that remembers you across runs."""
    import getpass
    from contextlib import suppress

    from ..providers.llms import get_llm
    from ..working.policies import as_policy

    st = state(ctx, db, False)
    with guard():
        cfg = config(st)
        llm = get_llm(cfg)
    if llm is None:
        typer.echo(NO_ENDPOINT)
        raise typer.Exit(EXIT_OK)
    with suppress(ImportError):  # line editing and history at the prompt, where there is readline
        import readline  # noqa: F401
    with guard():
        as_policy(policy)  # a bad name fails before the model loads
        mem = Memory(config=cfg, llm=llm)
        try:
            settings = ChatSettings(user_id=user or getpass.getuser() or "me", agent_id=agent,
                                    session_id=session, policy=policy, budget_tokens=budget,
                                    max_tokens=max_tokens, end=end)
            code = Chat(mem, settings).run()
        finally:
            mem.close()
    raise typer.Exit(code)

"""The wire format of the REST API: pydantic models for request bodies and responses.

They mirror the `to_dict()` shapes of the core types (`MemoryRecord`, `Event`, `Job`,
`Session`), so a memory looks the same from the library, the CLI `--json` and the service. Times
are written one way everywhere, as `to_dict()` writes them: ISO-8601 with a numeric offset
(`2024-05-01T10:00:00+00:00`), also inside an event's `before` / `after` snapshots.
Bounds that protect the service (list lengths, `limit`) live here; the rules of memory (text
size, valid times, metadata) stay in `Memory` and come back as 422 `invalid_input`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, Strict, WithJsonSchema

from ..model import EventType, JobStatus, Kind

MAX_PAGE = 100       # `limit` of search and list
MAX_MESSAGES = 500   # messages in one add
MAX_ID = 256         # user / agent / session / memory ids (as in Memory)

MIN_BUDGET = 1       # budget_tokens: the engine's minimum (Memory.context), as in the MCP tools
MAX_BUDGET = 200_000

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID)]
# A time in a response, as `datetime.isoformat()` writes it (and `to_dict()` does): "+00:00",
# never pydantic's "Z", so that top-level times and the snapshots in events read the same.
Time = Annotated[datetime, PlainSerializer(lambda t: t.isoformat(), return_type=str, when_used="json"),
                 WithJsonSchema({"type": "string", "format": "date-time"}, mode="serialization")]


def _iso_text(value: Any) -> Any:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):
        return datetime.fromisoformat(value)  # ValueError -> 422
    raise ValueError("a time is an ISO-8601 string, such as 2024-05-01T10:00:00+00:00")


def _true_or_false(value: Any) -> Any:
    if value in ("true", "false"):  # a query string's boolean
        return value == "true"
    return value


# Request fields take JSON's own types, as the OpenAPI schema says: pydantic's lax mode would
# read `true` as a limit of 1, "5" as 5, "1" as true, or a number as a Unix time.
Int = Annotated[int, Strict()]
Flag = Annotated[bool, Strict()]
QueryFlag = Annotated[bool, Strict(), BeforeValidator(_true_or_false)]  # ?history=true
Number = Annotated[float, Strict()]   # an integer is a number too
When = Annotated[datetime, BeforeValidator(_iso_text)]
Limit = Annotated[Int, Field(ge=1, le=MAX_PAGE)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScopeIn(_In):
    user_id: Id | None = None
    agent_id: Id | None = None
    session_id: Id | None = None

    def scope(self) -> dict[str, str | None]:
        return {"user_id": self.user_id, "agent_id": self.agent_id, "session_id": self.session_id}


class MessageIn(_In):
    role: Annotated[str, Field(min_length=1, max_length=64)] = "user"
    content: str
    name: Annotated[str, Field(min_length=1, max_length=MAX_ID)] | None = None
    observed_at: When | None = None
    metadata: dict[str, Any] | None = None

    def as_message(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


Messages = str | Annotated[list[str | MessageIn], Field(min_length=1, max_length=MAX_MESSAGES)]


def as_messages(messages: Messages) -> str | list[Any]:
    if isinstance(messages, str):
        return messages
    return [m if isinstance(m, str) else m.as_message() for m in messages]


class AddIn(ScopeIn):
    messages: Messages = Field(description="A string, a message, or a list of them.")
    metadata: dict[str, Any] | None = None
    observed_at: When | None = None
    infer: Flag = True
    kind: Kind | None = None
    importance: Annotated[Number, Field(ge=0, le=1)] | None = None
    expires_at: When | None = None
    background: Flag = Field(False, description="Queue the add as a job and answer 202 at once.")


class SearchIn(ScopeIn):
    query: str
    filters: dict[str, Any] | None = None
    limit: Limit = 10
    kinds: Annotated[list[Kind], Field(max_length=3)] | None = None
    as_of: When | None = None


class UpdateIn(_In):
    """Only the fields present are changed; `null` clears metadata or expires_at."""

    text: str | None = None
    metadata: dict[str, Any] | None = None
    importance: Annotated[Number, Field(ge=0, le=1)] | None = None
    expires_at: When | None = None


class EraseIn(ScopeIn):
    id: Id | None = Field(None, description="Erase this one memory; else the whole scope.")


class SessionIn(_In):
    session_id: Id | None = Field(None, description="Chosen by the caller, or generated.")
    user_id: Id | None = None
    agent_id: Id | None = None
    policy: str | dict[str, Any] | None = Field(
        None, description='What the model sees of the session: a policy name such as "summary", '
                          "or its settings (see engram.working)")
    metadata: dict[str, Any] | None = None


class ChatMessageIn(_In):
    """A chat message in OpenAI shape; tool calls and tool results are kept exactly."""

    role: Literal["user", "assistant", "system", "tool"] = "user"
    content: str | None = None
    name: Annotated[str, Field(min_length=1, max_length=MAX_ID)] | None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=128)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=MAX_ID)] | None = None
    metadata: dict[str, Any] | None = None

    def as_message(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class SessionMessagesIn(_In):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1, max_length=MAX_MESSAGES)]


class ContextIn(ScopeIn):
    query: str = Field(description="The new user message the context is assembled for.")
    budget_tokens: Annotated[Int, Field(
        ge=MIN_BUDGET, le=MAX_BUDGET,
        description="At least 1 (the engine's minimum); a budget smaller than the query and the "
                    "framing answers 422 saying how many tokens they take.")] = 2000
    instructions: Annotated[str, Field(max_length=20_000)] | None = None


# -- responses ---------------------------------------------------------------------------------

class ScopeOut(BaseModel):
    user_id: str | None
    agent_id: str | None
    session_id: str | None


class MemoryOut(BaseModel):
    id: str
    scope: ScopeOut
    kind: Kind
    text: str
    metadata: dict[str, Any]
    importance: float
    created_at: Time
    updated_at: Time
    observed_at: Time | None
    valid_from: Time | None
    valid_to: Time | None
    superseded_by: str | None
    provenance: list[str]
    role: str | None
    name: str | None
    access_count: int
    last_accessed_at: Time | None
    expires_at: Time | None
    content_hash: str
    deleted_at: Time | None


class EventOut(BaseModel):
    id: str
    memory_id: str | None
    type: EventType
    at: Time
    scope: ScopeOut
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    reason: str | None


class JobOut(BaseModel):
    id: str
    task: str = Field(description="add | extract | reflect")
    scope: ScopeOut
    status: JobStatus
    created_at: Time
    updated_at: Time
    run_at: Time
    attempts: int
    key: str | None
    lease_until: Time | None
    result: dict[str, Any] | None
    error: str | None


class AddOut(BaseModel):
    memories: list[MemoryOut] = Field(description="What the add stored or touched (empty for a queued job).")
    events: list[EventOut]
    notes: list[str] = Field(default_factory=list, description="Why less was learned than asked.")
    job: JobOut | None = Field(None, description="The queued job when `background` is true.")


class HitOut(BaseModel):
    memory: MemoryOut
    score: float
    explain: dict[str, float]


class SearchOut(BaseModel):
    hits: list[HitOut]


class PageOut(BaseModel):
    items: list[MemoryOut]
    next_cursor: str | None


class HistoryOut(BaseModel):
    events: list[EventOut]


class EraseOut(BaseModel):
    erased: int
    receipt: dict[str, Any] | None = Field(
        default=None, description="What was removed: counts by kind, sessions, jobs, scope, "
                                  "time and a SHA-256 of the erased ids; never content.")


class ImportOut(BaseModel):
    imported: int


class SessionOut(BaseModel):
    scope: ScopeOut
    policy: dict[str, Any]
    created_at: Time
    updated_at: Time
    summary: str
    summary_upto: str | None
    metadata: dict[str, Any]
    ended_at: Time | None


class SessionsOut(BaseModel):
    items: list[SessionOut] = Field(description="Most recently updated first.")


class SessionMessageOut(BaseModel):
    """One message of a session, as a model is shown it (OpenAI shape, tool calls included)."""

    id: str | None
    role: str
    content: str | None
    name: str | None
    observed_at: Time | None
    tool_calls: list[dict[str, Any]] | None
    tool_call_id: str | None


class SessionTranscriptOut(BaseModel):
    messages: list[SessionMessageOut] = Field(description="Every message, oldest first.")


class SessionViewOut(BaseModel):
    summaries: list[str] = Field(description="The running summary first, then finer digests.")
    messages: list[SessionMessageOut] = Field(description="The messages shown verbatim.")
    omitted: int = Field(description="Messages neither shown nor summarised (trimming policies).")
    chat: list[dict[str, Any]] = Field(description="The view as chat messages: the summaries "
                                                   "as one leading system message, then the messages.")


class SessionEndOut(BaseModel):
    session: SessionOut
    summary: MemoryOut | None = Field(description="The end-of-session summary (an episode), or "
                                                  "null when nothing was said since the last end.")


class StatsOut(BaseModel):
    memories: int = Field(description="Visible now.")
    by_kind: dict[str, int]
    deleted: int
    superseded: int
    expired: int
    events: int
    scopes: int
    jobs: dict[str, int] = Field(description="Background jobs by status.")
    db_bytes: int | None = Field(description="Database size, where this scope's share is known.")
    retention: dict[str, Any] | None = Field(
        default=None, description="Retention policy in days per kind (null: kept) and how many "
                                  "memories it has removed in this scope.")


class BlockOut(BaseModel):
    name: str
    priority: int
    budget: int
    tokens: int
    items: int
    dropped: int


class ContextOut(BaseModel):
    messages: list[dict[str, Any]] = Field(description="Chat messages to send to the model next.")
    text: str = Field(description="The same context as one plain text.")
    blocks: dict[str, BlockOut] = Field(description="What each block (memories, session, ...) used.")
    total_tokens: int
    budget_tokens: int


class SessionMessagesOut(BaseModel):
    memories: list[MemoryOut] = Field(description="The stored messages (episodes of the session).")


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorOut(BaseModel):
    error: ErrorDetail


class HealthOut(BaseModel):
    status: str

"""The wire format of the REST API: pydantic models for request bodies and responses.

They mirror the `to_dict()` shapes of the core types (`MemoryRecord`, `Event`, `Job`,
`Session`), so a memory looks the same from the library, the CLI `--json` and the service.
Bounds that protect the service (list lengths, `limit`) live here; the rules of memory (text
size, valid times, metadata) stay in `Memory` and come back as 422 `invalid_input`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..model import EventType, JobStatus, Kind

MAX_PAGE = 100       # `limit` of search and list
MAX_MESSAGES = 500   # messages in one add
MAX_ID = 256         # user / agent / session / memory ids (as in Memory)

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID)]
Limit = Annotated[int, Field(ge=1, le=MAX_PAGE)]


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
    observed_at: datetime | None = None
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
    observed_at: datetime | None = None
    infer: bool = True
    kind: Kind | None = None
    importance: Annotated[float, Field(ge=0, le=1)] | None = None
    expires_at: datetime | None = None
    background: bool = Field(False, description="Queue the add as a job and answer 202 at once.")


class SearchIn(ScopeIn):
    query: str
    filters: dict[str, Any] | None = None
    limit: Limit = 10
    kinds: Annotated[list[Kind], Field(max_length=3)] | None = None
    as_of: datetime | None = None


class UpdateIn(_In):
    """Only the fields present are changed; `null` clears metadata or expires_at."""

    text: str | None = None
    metadata: dict[str, Any] | None = None
    importance: Annotated[float, Field(ge=0, le=1)] | None = None
    expires_at: datetime | None = None


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
    budget_tokens: Annotated[int, Field(ge=64, le=200_000)] = 2000
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
    created_at: datetime
    updated_at: datetime
    observed_at: datetime | None
    valid_from: datetime | None
    valid_to: datetime | None
    superseded_by: str | None
    provenance: list[str]
    role: str | None
    name: str | None
    access_count: int
    last_accessed_at: datetime | None
    expires_at: datetime | None
    content_hash: str
    deleted_at: datetime | None


class EventOut(BaseModel):
    id: str
    memory_id: str | None
    type: EventType
    at: datetime
    scope: ScopeOut
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    reason: str | None


class JobOut(BaseModel):
    id: str
    task: str = Field(description="add | extract | reflect")
    scope: ScopeOut
    status: JobStatus
    created_at: datetime
    updated_at: datetime
    run_at: datetime
    attempts: int
    key: str | None
    lease_until: datetime | None
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


class ImportOut(BaseModel):
    imported: int


class SessionOut(BaseModel):
    scope: ScopeOut
    policy: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    summary: str
    summary_upto: str | None
    metadata: dict[str, Any]
    ended_at: datetime | None


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

"""engram: long-term memory for LLM agents.

    from engram import Memory
    mem = Memory("engram.db")
    mem.add("I moved to Lisbon in May", user_id="ana")
    mem.search("where does Ana live?", user_id="ana")
"""

import logging as _logging

from .aio import AsyncMemory, AsyncSessionHandle
from .config import Config
from .context import Context
from .errors import (
    Conflict,
    EmbeddingMismatch,
    EncryptionError,
    EngramError,
    Erased,
    InProgress,
    InvalidFilter,
    InvalidImport,
    InvalidInput,
    KeyReused,
    LLMOutputError,
    LLMRejected,
    LLMTimeout,
    LLMUnavailable,
    NotFound,
    ProviderError,
    StoreBusy,
    StoreError,
    StoreUnavailable,
)
from .memory import Memory
from .model import (
    AddResult,
    Entity,
    EntityProfile,
    Event,
    EventType,
    Hit,
    Job,
    JobStatus,
    Kind,
    MemoryRecord,
    Mention,
    Message,
    Page,
    Receipt,
    Relation,
    Scope,
    Session,
    Subgraph,
)
from .pipeline.retrieve import PRESETS, RetrievalConfig
from .store import Stats
from .working.session import SessionHandle

_logging.getLogger("engram").addHandler(_logging.NullHandler())

__version__ = "0.2.0"

__all__ = [
    "PRESETS",
    "AddResult",
    "AsyncMemory",
    "AsyncSessionHandle",
    "Config",
    "Conflict",
    "Context",
    "EmbeddingMismatch",
    "EncryptionError",
    "EngramError",
    "Entity",
    "EntityProfile",
    "Erased",
    "Event",
    "EventType",
    "Hit",
    "InProgress",
    "InvalidFilter",
    "InvalidImport",
    "InvalidInput",
    "Job",
    "JobStatus",
    "KeyReused",
    "Kind",
    "LLMOutputError",
    "LLMRejected",
    "LLMTimeout",
    "LLMUnavailable",
    "Memory",
    "MemoryRecord",
    "Mention",
    "Message",
    "NotFound",
    "Page",
    "ProviderError",
    "Receipt",
    "Relation",
    "RetrievalConfig",
    "Scope",
    "Session",
    "SessionHandle",
    "Stats",
    "StoreBusy",
    "StoreError",
    "StoreUnavailable",
    "Subgraph",
    "__version__",
]

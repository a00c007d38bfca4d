"""Configuration: one frozen object built once from arguments, environment and defaults.

Every knob is listed in docs/configuration.md (tests/test_config.py keeps the two in step);
`Config.from_env()` is the only reader of `os.environ`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InvalidInput
from .redact import Policy as RedactPolicy

# how an LLM is asked for JSON; the rungs are described in providers/llms.py
LLM_STRUCTURED = ("auto", "json_schema", "json_object_schema", "json_object", "prompt")
# the redaction policies (engram.redact.Policy)
REDACT_POLICIES = tuple(p.value for p in RedactPolicy)
# the kinds a retention policy names (Config.retention)
RETENTION_KINDS = ("episodes", "messages", "facts")


def _days(value: str, var: str) -> float | None:
    """A retention in days from the environment: a number, or `keep` / `none` (kept)."""
    if value.strip().lower() in ("keep", "none", "forever"):
        return None
    try:
        return float(value)
    except ValueError:
        raise InvalidInput(f"{var}={value!r} must be a number of days or 'keep'") from None


def default_db_path() -> Path:
    """Where the embedded default lives when neither `path` nor ENGRAM_DB says otherwise."""
    return Path.home() / ".engram" / "engram.db"


def default_cache_dir() -> Path:
    """Where engram keeps files it can always rebuild (the embedder's ONNX graph):
    ENGRAM_CACHE_DIR, else $XDG_CACHE_HOME/engram, else ~/.cache/engram."""
    if os.environ.get("ENGRAM_CACHE_DIR"):
        return Path(os.environ["ENGRAM_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "engram"


@dataclass(frozen=True)
class Config:
    path: Path = field(default_factory=default_db_path)
    database_url: str | None = field(default=None, repr=False)  # postgresql://... ; None: SQLite at `path`
    embedder: str = "auto"                  # a registered embedder; auto: minilm-int8, or the database's
    retrieval: str = "hybrid"               # name of a retrieval preset (pipeline.retrieve)
    dedupe_threshold: float = 0.90          # cosine above which two facts may be one
    dedupe_min_overlap: float = 0.5         # ... and their word sets overlap at least this much
    max_text_chars: int = 32_000            # longer texts are refused, not truncated
    max_memories_per_scope: int | None = None  # capacity; None means unbounded
    busy_timeout_s: float = 30.0            # how long a writer waits for another's lock
    ann_threshold: int = 20_000             # a scope of up to this many keys is searched in process, exactly
    lexicon_threshold: int = 0              # SQLite: lexical search in memory above this many FTS rows
    cache_rows: int = 2_000_000             # keys the dense cache holds over all searched scopes
    log_level: str | None = None            # None leaves `engram` logging unconfigured
    llm: str = "openai"                     # name of a registered LLM provider (providers.llms)
    llm_base_url: str | None = None         # None: no LLM; every feature takes its no-LLM path
    llm_api_key: str | None = field(default=None, repr=False)
    llm_model: str | None = None            # None: the first model the endpoint lists
    llm_timeout_s: float = 60.0             # per request
    llm_structured: str = "auto"            # auto | json_schema | json_object_schema | json_object | prompt
    llm_retries: int = 2                    # extra tries after a transport error (with backoff)
    llm_output_retries: int = 2             # extra tries after a reply that fails validation
    worker: str = "thread"                  # thread: run background jobs in-process; off: `engram worker`
    job_retries: int = 3                    # extra tries of a failed background job (with backoff)
    reflect_every: int | None = None        # with an LLM: queue a reflection every N episodes of a scope

    # -- Embedders (ENGRAM_EMBED_*, ENGRAM_CACHE_DIR; providers/embedders.py) ---------------------
    cache_dir: Path = field(default_factory=default_cache_dir)  # the ONNX graph, built once
    embed_threads: int | None = None        # threads a local batch is split over; None: cores, max 4
    embed_base_url: str | None = None       # embedder `openai`: the /v1 endpoint
    embed_api_key: str | None = field(default=None, repr=False)
    embed_model: str | None = None          # embedder `openai`: None: the first model listed
    embed_timeout_s: float = 60.0           # embedder `openai`: per request
    embed_batch_size: int = 256             # embedder `openai`: texts per request

    # -- PostgreSQL tuning (ENGRAM_PG_*; read by store.postgres.PostgresStore.from_config) --------
    # The lock timeout of a PostgreSQL write is `busy_timeout_s` (ENGRAM_BUSY_TIMEOUT).
    pg_pool_size: int = 10                  # connections per process, shared by every tenant
    pg_pool_wait_s: float | None = None     # wait for a free connection; None: busy_timeout_s
    pg_statement_timeout_s: float | None = None  # None: max(60, 2 * busy_timeout_s)
    pg_connect_timeout_s: float = 5.0       # to open a connection (the server is down past it)
    pg_exact_limit: int = 2000              # dense search scans up to this many keys, then HNSW
    pg_cache_limit: int | None = None       # keys of a scope a process caches (None: cache_rows)
    pg_reclaim: str = "vacuum"              # after an erase: vacuum | full (VACUUM FULL) | none
    pg_lexicon_threshold: int = 100         # a tenant of more memories is ranked lexically in process
    pg_lexicon_rows: int = 1_000_000        # documents the lexicons of all tenants hold, per process

    @staticmethod
    def _pg_env() -> tuple[tuple[str, str, Any], ...]:
        """The ENGRAM_PG_* variables, as (field, variable, conversion) for `from_env`."""
        return (("pg_pool_size", "ENGRAM_PG_POOL_SIZE", int),
                ("pg_pool_wait_s", "ENGRAM_PG_POOL_WAIT", float),
                ("pg_statement_timeout_s", "ENGRAM_PG_STATEMENT_TIMEOUT", float),
                ("pg_connect_timeout_s", "ENGRAM_PG_CONNECT_TIMEOUT", float),
                ("pg_exact_limit", "ENGRAM_PG_EXACT_LIMIT", int),
                ("pg_cache_limit", "ENGRAM_PG_CACHE_LIMIT", int),
                ("pg_reclaim", "ENGRAM_PG_RECLAIM", str),
                ("pg_lexicon_threshold", "ENGRAM_PG_LEXICON_THRESHOLD", int),
                ("pg_lexicon_rows", "ENGRAM_PG_LEXICON_ROWS", int))

    def _pg_validated(self) -> None:
        if self.pg_pool_size < 1:
            raise InvalidInput("pg_pool_size must be positive")
        for name in ("pg_pool_wait_s", "pg_statement_timeout_s", "pg_connect_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InvalidInput(f"{name} must be positive")
        if self.pg_exact_limit < 0:
            raise InvalidInput("pg_exact_limit must be >= 0")
        if self.pg_cache_limit is not None and self.pg_cache_limit < 0:
            raise InvalidInput("pg_cache_limit must be >= 0")
        if self.pg_lexicon_threshold < 0:
            raise InvalidInput("pg_lexicon_threshold must be >= 0")
        if self.pg_lexicon_rows < 0:
            raise InvalidInput("pg_lexicon_rows must be >= 0")
        if self.pg_reclaim not in ("vacuum", "full", "none"):
            raise InvalidInput("pg_reclaim must be one of vacuum, full, none")
    # -- end of PostgreSQL tuning -----------------------------------------------------------------

    # -- Redaction on write (ENGRAM_REDACT; engram.redact, docs/security.md) ----------------------
    # What is replaced by a typed placeholder ([REDACTED:api_key]) before anything is stored or
    # embedded: off | secrets (keys, tokens, passwords, private keys, cards, IBANs) | pii
    # (secrets, emails and phone numbers). Per tenant: each tenant's Memory gets its own Config.
    redact: str = "secrets"

    def _redact_validated(self) -> None:
        if self.redact not in REDACT_POLICIES:
            raise InvalidInput(f"redact must be one of {', '.join(REDACT_POLICIES)}, "
                               f"not {self.redact!r} (ENGRAM_REDACT)")
    # -- end of redaction ---------------------------------------------------------------------------

    # -- The knowledge graph (ENGRAM_GRAPH_*; graph/rules.py, docs/graph.md) --------------------
    # Predicates with one current value per subject (a new value closes the old edge) beyond the
    # declared defaults (works_at, lives_in, ...), and predicates to treat as many-valued even
    # if declared single. Comma-separated names in the environment.
    graph_single: tuple[str, ...] = ()
    graph_multi: tuple[str, ...] = ()
    # Entity summaries: "rules" (composed from type, aliases and relations, no model) or "llm"
    # (generated by the configured LLM when an entity's relations change; rules without one).
    graph_summaries: str = "rules"
    # -- end of the knowledge graph -----------------------------------------------------------------
    # -- Trust: encryption at rest and retention (docs/security.md) ---------------------------------
    # With a key (ENGRAM_ENCRYPTION_KEY, or the first line of ENGRAM_ENCRYPTION_KEY_FILE) every
    # SQLite database is opened through SQLCipher: the file, its WAL and its shm hold ciphertext.
    encryption_key: str | None = field(default=None, repr=False)
    # Retention in days per kind (None: kept): episodes (every stored message), session messages
    # (episodes of a session; the shorter of the two applies to them) and facts (semantic and
    # procedural memories). `retention_tenants` overrides them per tenant of the service:
    # {"acme": {"episodes": 30, "facts": null}}. The worker enforces them.
    retention_episodes_days: float | None = None
    retention_messages_days: float | None = None
    retention_facts_days: float | None = None
    retention_tenants: dict[str, dict[str, float | None]] = field(default_factory=dict)

    @staticmethod
    def _trust_env(env: Mapping[str, str]) -> dict[str, Any]:
        """The ENGRAM_ENCRYPTION_* and ENGRAM_RETENTION_* variables, as Config fields."""
        values: dict[str, Any] = {}
        key, key_file = env.get("ENGRAM_ENCRYPTION_KEY"), env.get("ENGRAM_ENCRYPTION_KEY_FILE")
        if key and key_file:
            raise InvalidInput("set ENGRAM_ENCRYPTION_KEY or ENGRAM_ENCRYPTION_KEY_FILE, not both")
        if key_file:
            try:
                key = Path(key_file).expanduser().read_text(encoding="utf-8").splitlines()[0]
            except (OSError, UnicodeDecodeError, IndexError) as exc:
                raise InvalidInput(f"ENGRAM_ENCRYPTION_KEY_FILE={key_file!r} cannot be read "
                                   f"(or is empty): {exc}") from None
        if key:
            values["encryption_key"] = key
        for name, var in (("retention_episodes_days", "ENGRAM_RETENTION_EPISODES"),
                          ("retention_messages_days", "ENGRAM_RETENTION_MESSAGES"),
                          ("retention_facts_days", "ENGRAM_RETENTION_FACTS")):
            if env.get(var):
                values[name] = _days(env[var], var)
        if env.get("ENGRAM_RETENTION_TENANTS"):
            try:
                values["retention_tenants"] = json.loads(env["ENGRAM_RETENTION_TENANTS"])
            except json.JSONDecodeError as exc:
                raise InvalidInput(f"ENGRAM_RETENTION_TENANTS is not valid JSON: {exc}") from None
        return values

    def _trust_validated(self) -> None:
        if self.encryption_key is not None and not self.encryption_key.strip():
            raise InvalidInput("the encryption key must not be empty")
        tenants = self.retention_tenants
        if not isinstance(tenants, dict) or not all(
                isinstance(t, str) and isinstance(p, dict) for t, p in tenants.items()):
            raise InvalidInput('retention_tenants must map tenants to {"episodes": days, ...}')
        for policy in [{k: getattr(self, f"retention_{k}_days") for k in RETENTION_KINDS},
                       *tenants.values()]:
            for kind, days in policy.items():
                if kind not in RETENTION_KINDS:
                    raise InvalidInput(f"retention kind must be one of {', '.join(RETENTION_KINDS)}, "
                                       f"not {kind!r}")
                if days is not None and (isinstance(days, bool) or not isinstance(days, int | float)
                                         or not 0 < days < 1e6):
                    raise InvalidInput(f"retention of {kind} must be a positive number of days "
                                       f"or null (kept), not {days!r}")

    def retention(self, tenant: str | None = None) -> dict[str, float | None]:
        """The retention in days per kind (None: kept) of a tenant (None: the default)."""
        policy: dict[str, float | None] = {
            k: getattr(self, f"retention_{k}_days") for k in RETENTION_KINDS}
        if tenant is not None:
            policy.update(self.retention_tenants.get(tenant, {}))
        return policy
    # -- end of trust ---------------------------------------------------------------------------------

    @classmethod
    def from_env(cls, **overrides: Any) -> Config:
        env = os.environ
        values: dict[str, Any] = {}
        if env.get("ENGRAM_DB"):
            values["path"] = env["ENGRAM_DB"]
        if "ENGRAM_EMBEDDER" in env:
            values["embedder"] = env["ENGRAM_EMBEDDER"]
        if "ENGRAM_RETRIEVAL" in env:
            values["retrieval"] = env["ENGRAM_RETRIEVAL"]
        for name, key in (
            ("database_url", "ENGRAM_DATABASE_URL"),
            ("llm", "ENGRAM_LLM"),
            ("llm_base_url", "ENGRAM_LLM_BASE_URL"),
            ("llm_api_key", "ENGRAM_LLM_API_KEY"),
            ("llm_model", "ENGRAM_LLM_MODEL"),
            ("llm_structured", "ENGRAM_LLM_STRUCTURED"),
            ("worker", "ENGRAM_WORKER"),
            ("redact", "ENGRAM_REDACT"),  # redaction on write
            ("cache_dir", "ENGRAM_CACHE_DIR"),  # embedders
            ("embed_base_url", "ENGRAM_EMBED_BASE_URL"),
            ("embed_api_key", "ENGRAM_EMBED_API_KEY"),
            ("embed_model", "ENGRAM_EMBED_MODEL"),
        ):
            if env.get(key):
                values[name] = env[key]
        for name, key, conv in (
            ("dedupe_threshold", "ENGRAM_DEDUPE_THRESHOLD", float),
            ("dedupe_min_overlap", "ENGRAM_DEDUPE_MIN_OVERLAP", float),
            ("max_text_chars", "ENGRAM_MAX_TEXT_CHARS", int),
            ("max_memories_per_scope", "ENGRAM_MAX_MEMORIES_PER_SCOPE", int),
            ("busy_timeout_s", "ENGRAM_BUSY_TIMEOUT", float),
            ("ann_threshold", "ENGRAM_ANN_THRESHOLD", int),
            ("lexicon_threshold", "ENGRAM_LEXICON_THRESHOLD", int),
            ("cache_rows", "ENGRAM_CACHE_ROWS", int),
            ("llm_timeout_s", "ENGRAM_LLM_TIMEOUT", float),
            ("llm_retries", "ENGRAM_LLM_RETRIES", int),
            ("llm_output_retries", "ENGRAM_LLM_OUTPUT_RETRIES", int),
            ("job_retries", "ENGRAM_JOB_RETRIES", int),
            ("reflect_every", "ENGRAM_REFLECT_EVERY", int),
            *cls._pg_env(),  # PostgreSQL tuning
            ("embed_threads", "ENGRAM_EMBED_THREADS", int),  # embedders
            ("embed_timeout_s", "ENGRAM_EMBED_TIMEOUT", float),
            ("embed_batch_size", "ENGRAM_EMBED_BATCH_SIZE", int),
        ):
            if env.get(key):
                try:
                    values[name] = conv(env[key])
                except ValueError as exc:
                    raise InvalidInput(f"{key}={env[key]!r} is not a valid {conv.__name__}") from exc
        for name, key in (("graph_single", "ENGRAM_GRAPH_SINGLE"),
                          ("graph_multi", "ENGRAM_GRAPH_MULTI")):  # the knowledge graph
            if env.get(key):
                values[name] = tuple(p.strip() for p in env[key].split(",") if p.strip())
        if env.get("ENGRAM_GRAPH_SUMMARIES"):
            values["graph_summaries"] = env["ENGRAM_GRAPH_SUMMARIES"].strip().lower()
        if env.get("ENGRAM_LOG_LEVEL"):
            values["log_level"] = env["ENGRAM_LOG_LEVEL"]
        values.update(cls._trust_env(env))  # encryption and retention
        if overrides.get("path") is not None and overrides.get("database_url") is None:
            # A file named by the caller (`Memory("x.db")`, `--db x.db`) is where the data goes,
            # never a PostgreSQL database the environment names for everything else.
            values.pop("database_url", None)
        values.update({k: v for k, v in overrides.items() if v is not None})
        for name in ("path", "cache_dir"):
            if name in values:
                values[name] = Path(values[name]).expanduser()
        return cls(**values).validated()

    def validated(self) -> Config:
        if self.ann_threshold < 0:
            raise InvalidInput("ann_threshold must be >= 0")
        if self.lexicon_threshold < 0:
            raise InvalidInput("lexicon_threshold must be >= 0")
        if self.cache_rows < 0:
            raise InvalidInput("cache_rows must be >= 0")
        if not 0.0 < self.dedupe_threshold <= 1.0:
            raise InvalidInput("dedupe_threshold must be in (0, 1]")
        if not 0.0 <= self.dedupe_min_overlap <= 1.0:
            raise InvalidInput("dedupe_min_overlap must be in [0, 1]")
        if self.database_url is not None and not self.database_url.startswith(
                ("postgresql://", "postgres://")):
            raise InvalidInput("ENGRAM_DATABASE_URL must be a postgresql:// URL")
        if self.max_text_chars < 1:
            raise InvalidInput("max_text_chars must be positive")
        if self.max_memories_per_scope is not None and self.max_memories_per_scope < 1:
            raise InvalidInput("max_memories_per_scope must be positive")
        if self.llm_timeout_s <= 0:
            raise InvalidInput("llm_timeout_s must be positive")
        if self.llm_retries < 0 or self.llm_output_retries < 0:
            raise InvalidInput("llm_retries and llm_output_retries must be >= 0")
        if self.worker not in ("thread", "off"):
            raise InvalidInput("worker must be 'thread' or 'off'")
        if self.reflect_every is not None and self.reflect_every < 1:
            raise InvalidInput("reflect_every must be positive")
        if self.job_retries < 0:
            raise InvalidInput("job_retries must be >= 0")
        if self.llm_structured not in LLM_STRUCTURED:
            raise InvalidInput(f"llm_structured must be one of {', '.join(LLM_STRUCTURED)}")
        if self.embed_threads is not None and self.embed_threads < 1:
            raise InvalidInput("embed_threads must be positive (ENGRAM_EMBED_THREADS)")
        if self.embed_batch_size < 1:
            raise InvalidInput("embed_batch_size must be positive (ENGRAM_EMBED_BATCH_SIZE)")
        if self.embed_timeout_s <= 0:
            raise InvalidInput("embed_timeout_s must be positive (ENGRAM_EMBED_TIMEOUT)")
        self._pg_validated()  # PostgreSQL tuning
        self._redact_validated()  # redaction on write
        if self.graph_summaries not in ("rules", "llm"):
            raise InvalidInput(f"graph_summaries must be 'rules' or 'llm', not "
                               f"{self.graph_summaries!r} (ENGRAM_GRAPH_SUMMARIES)")
        self._trust_validated()  # encryption and retention
        return self

"""Language models: one method to implement (`complete`); retry, timeout, validation, token
accounting, timing and logging live once, in `LLM`, around any provider.

Providers are registered by name in `LLMS`; `Config.llm` picks one and `get_llm(config)` wraps it.
The LLM is optional (ARCHITECTURE rule 6): with no `llm_base_url`, `get_llm` returns None and
every feature takes its no-LLM path.

Structured output. Given a pydantic model class as `schema`, a provider asks for JSON the best way
its endpoint allows, and `LLM` validates the reply with pydantic. The OpenAI-compatible provider
climbs down a ladder of request styles (`STRUCTURED_MODES`), best first:

    json_schema         response_format={"type": "json_schema", ...}   OpenAI, vLLM, LM Studio,
                                                  llama-server, Ollama >= 0.5 (maps it to `format`)
    json_object_schema  response_format={"type": "json_object", "schema": ...}
                                                                       llama-cpp-python's server
    json_object         response_format={"type": "json_object"}        plain JSON mode
    prompt              nothing but the instruction in the prompt      anything else

Every style also puts the schema into the prompt (constrained decoders force the shape but never
show the model what the fields mean). With `structured="auto"`, a request the endpoint refuses
(HTTP 400 / 422, or llama-cpp-python's 500 naming `response_format`) is retried one rung lower,
and the rung that worked is remembered for the next call; a named mode uses that rung only.

A reply that does not validate is sent back to the model with the validation errors,
`output_retries` times; then `LLMOutputError` carries every raw reply and every reason, so the
caller can take its no-LLM path and record why. Half-validated data is never returned.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar, overload

from pydantic import BaseModel, ValidationError

from ..config import Config
from ..errors import (
    EngramError,
    InvalidInput,
    LLMOutputError,
    LLMRejected,
    LLMTimeout,
    LLMUnavailable,
    ProviderError,
)

log = logging.getLogger("engram.llm")

T = TypeVar("T", bound=BaseModel)

ChatMessage = Mapping[str, str]
"""One wire message: {"role": "system" | "user" | "assistant", "content": "..."}."""

STRUCTURED_MODES = ("json_schema", "json_object_schema", "json_object", "prompt")


@dataclass(frozen=True)
class Usage:
    """Tokens as counted by the endpoint (0 when it does not say)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens,
                     self.completion_tokens + other.completion_tokens)


@dataclass(frozen=True)
class Completion(Generic[T]):
    """One answer. `parsed` is the validated object when a schema was given, else None.

    From a provider, `usage` and `elapsed_s` are those of one request; from `LLM.complete`, the
    sums over every request the call made (retries included), and `attempts` the replies it took.
    """

    text: str
    model: str
    usage: Usage = field(default_factory=Usage)
    parsed: T | None = None
    elapsed_s: float = 0.0
    mode: str | None = None          # the structured-output rung used, None without a schema
    finish_reason: str | None = None
    attempts: int = 1


class LLMProvider(Protocol):
    """The whole provider contract. `complete` sends one request and returns the raw reply
    (`parsed` stays None); it raises `LLMUnavailable` / `LLMTimeout` for transport failures (which
    `LLM` retries) and `LLMRejected` when the endpoint refuses the request."""

    name: str

    @property
    def model(self) -> str: ...

    def complete(self, messages: Sequence[ChatMessage], schema: type[BaseModel] | None = None, *,
                 timeout: float, max_tokens: int | None = None) -> Completion[Any]: ...


@dataclass(frozen=True)
class LLMStats:
    """Cumulative counters of one `LLM` since it was made."""

    calls: int = 0               # complete() invocations
    requests: int = 0            # requests sent, retries included
    prompt_tokens: int = 0
    completion_tokens: int = 0
    transport_errors: int = 0    # requests that failed to get an answer (each retried or raised)
    invalid_outputs: int = 0     # replies that failed validation
    failures: int = 0            # calls that raised
    elapsed_s: float = 0.0       # wall time spent inside complete()

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class LLM:
    """A provider with the cross-cutting concerns: per-request timeout, retry with exponential
    backoff on transport errors, schema validation with retry-on-invalid, token and time
    accounting, logging under `engram.llm`. Thread-safe.

    `timeout_s` bounds each request; a call takes at most about
    `(retries + 1) * (output_retries + 1) * timeout_s` plus the backoff sleeps.
    """

    def __init__(self, provider: LLMProvider, *, timeout_s: float = 60.0, retries: int = 2,
                 output_retries: int = 2, backoff_s: float = 0.5, max_backoff_s: float = 8.0) -> None:
        self.provider = provider
        self.timeout_s = timeout_s
        self.retries = retries
        self.output_retries = output_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._stats = LLMStats()
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.provider.name

    @property
    def model(self) -> str:
        return self.provider.model

    def close(self) -> None:
        close = getattr(self.provider, "close", None)
        if close is not None:
            close()

    def stats(self) -> LLMStats:
        with self._lock:
            return self._stats

    def _count(self, **deltas: float) -> None:
        with self._lock:
            s = self._stats
            self._stats = replace(s, **{k: getattr(s, k) + v for k, v in deltas.items()})

    @overload
    def complete(self, messages: Sequence[ChatMessage], schema: None = None, *,
                 max_tokens: int | None = None) -> Completion[Any]: ...

    @overload
    def complete(self, messages: Sequence[ChatMessage], schema: type[T], *,
                 max_tokens: int | None = None) -> Completion[T]: ...

    def complete(self, messages: Sequence[ChatMessage], schema: type[T] | None = None, *,
                 max_tokens: int | None = None) -> Completion[Any]:
        """Ask the model; with `schema`, return only a reply that validates against it.

        Raises `LLMUnavailable` (or its `LLMTimeout`) once the transport retries are spent,
        `LLMRejected` when the endpoint refuses the request, `LLMOutputError` when no reply
        validated.
        """
        if not messages:
            raise InvalidInput("complete() needs at least one message")
        t0 = time.perf_counter()
        self._count(calls=1)
        try:
            result = self._complete(list(messages), schema, max_tokens)
        except EngramError:
            self._count(failures=1, elapsed_s=time.perf_counter() - t0)
            raise
        except Exception as exc:  # a provider bug must still surface as a typed error
            self._count(failures=1, elapsed_s=time.perf_counter() - t0)
            raise ProviderError(f"LLM provider {self.name!r} failed: {exc!r}") from exc
        elapsed = time.perf_counter() - t0
        self._count(elapsed_s=elapsed)
        log.debug("%s %s: %d+%d tokens, %d attempt(s), mode=%s, %.2fs", self.name, result.model,
                  result.usage.prompt_tokens, result.usage.completion_tokens, result.attempts,
                  result.mode, elapsed)
        return replace(result, elapsed_s=elapsed)

    def _complete(self, messages: list[ChatMessage], schema: type[T] | None,
                  max_tokens: int | None) -> Completion[Any]:
        if schema is None:
            return self._request(messages, None, max_tokens)
        usage = Usage()
        outputs: list[str] = []
        reasons: list[str] = []
        for attempt in range(1, self.output_retries + 2):
            reply = self._request(messages, schema, max_tokens)
            usage = usage + reply.usage
            try:
                parsed = schema.model_validate_json(json_text(reply.text))
            except ValidationError as exc:
                reason = describe_errors(exc)
                if reply.finish_reason == "length":
                    reason = f"reply cut off at max_tokens; {reason}"
            else:
                return replace(reply, usage=usage, parsed=parsed, attempts=attempt)
            self._count(invalid_outputs=1)
            outputs.append(reply.text)
            reasons.append(reason)
            log.warning("%s: reply %d/%d does not match %s: %s", self.name, attempt,
                        self.output_retries + 1, schema.__name__, reason)
            messages = [*messages, {"role": "assistant", "content": reply.text},
                        {"role": "user", "content": retry_instruction(reason)}]
        raise LLMOutputError(
            f"{self.name} gave no reply matching {schema.__name__} in {len(outputs)} attempt(s): "
            f"{reasons[-1]}", outputs=outputs, reasons=reasons)

    def _request(self, messages: Sequence[ChatMessage], schema: type[BaseModel] | None,
                 max_tokens: int | None) -> Completion[Any]:
        """One reply, retrying transport failures with exponential backoff and jitter."""
        for attempt in range(self.retries + 1):
            self._count(requests=1)
            try:
                reply = self.provider.complete(messages, schema, timeout=self.timeout_s,
                                               max_tokens=max_tokens)
            except LLMUnavailable as exc:
                self._count(transport_errors=1)
                if attempt == self.retries:
                    log.error("%s: giving up after %d request(s): %s", self.name, attempt + 1, exc)
                    raise
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
                delay *= random.uniform(0.5, 1.0)  # jitter: retrying clients do not march in step
                log.warning("%s: %s; retry %d/%d in %.2fs", self.name, exc, attempt + 1,
                            self.retries, delay)
                time.sleep(delay)
                continue
            self._count(prompt_tokens=reply.usage.prompt_tokens,
                        completion_tokens=reply.usage.completion_tokens)
            return reply
        raise AssertionError("unreachable")


# --- helpers shared by providers --------------------------------------------------------------

_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.DOTALL)


def json_text(text: str) -> str:
    """The JSON object inside a reply: models asked by prompt alone like code fences and prose.
    Only the wrapping is removed; whatever is left is validated in full."""
    text = text.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if not text.startswith("{"):
        start, end = text.find("{"), text.rfind("}")
        if 0 <= start < end:
            text = text[start:end + 1]
    return text


def describe_errors(exc: ValidationError, limit: int = 5) -> str:
    """A validation error in a few short lines a model (and a log reader) can act on."""
    parts = []
    for err in exc.errors(include_url=False)[:limit]:
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - limit
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts)


def schema_of(schema: type[BaseModel]) -> dict[str, Any]:
    return schema.model_json_schema()


def schema_instruction(schema: type[BaseModel]) -> str:
    return ("Reply with a single JSON object and nothing else (no prose, no code fences). "
            "It must match this JSON schema:\n" + json.dumps(schema_of(schema), separators=(",", ":")))


def retry_instruction(reason: str) -> str:
    return (f"That reply is not valid: {reason}. Reply again with only the corrected JSON object.")


def with_instruction(messages: Sequence[ChatMessage], instruction: str) -> list[dict[str, str]]:
    """Messages with `instruction` appended to the system message (one is added if none):
    some chat templates accept a single system message, and only first."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content', '')}\n\n{instruction}".strip()
    else:
        out.insert(0, {"role": "system", "content": instruction})
    return out


# --- the OpenAI-compatible provider -----------------------------------------------------------

class OpenAICompatible:
    """Any endpoint speaking OpenAI's chat completions: OpenAI, Ollama, vLLM, LM Studio,
    llama.cpp (llama-server and llama-cpp-python's server), through the `openai` package.

    `model=None` uses the first model the endpoint lists, asked within `discovery_timeout_s`
    (a local server still busy with an earlier request answers late). The client's own retries are off:
    `LLM` retries, so that one policy (and one log) covers every provider.
    """

    name = "openai"

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 structured: str = "auto", temperature: float | None = 0.0,
                 max_tokens: int | None = None, discovery_timeout_s: float = 60.0) -> None:
        if structured != "auto" and structured not in STRUCTURED_MODES:
            raise ProviderError(f"unknown structured-output mode {structured!r}; "
                                f"use 'auto' or one of {STRUCTURED_MODES}")
        import openai

        self._openai = openai
        # Local servers want no key, but the client insists on one; never fall back on
        # OPENAI_API_KEY, which would send an OpenAI key to whatever base_url says.
        self._client = openai.OpenAI(base_url=base_url, api_key=api_key or "unused", max_retries=0)
        self.base_url = base_url
        self.structured = structured
        self.temperature = temperature
        self.max_tokens = max_tokens
        self._model = model
        self.discovery_timeout_s = discovery_timeout_s
        # the rung to start from; in auto mode it moves down when a rung is refused
        self._rung = 0 if structured == "auto" else STRUCTURED_MODES.index(structured)
        self._lock = threading.Lock()

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self._discover_model(timeout=self.discovery_timeout_s)
        return self._model

    @property
    def mode(self) -> str:
        """The structured-output rung the next request with a schema starts from."""
        return STRUCTURED_MODES[self._rung]

    def close(self) -> None:
        self._client.close()

    def _discover_model(self, timeout: float) -> str:
        try:
            models = [m.id for m in self._client.models.list(timeout=timeout)]
        except self._openai.OpenAIError as exc:
            raise self._translate(exc) from exc
        if not models:
            raise LLMRejected(f"{self.base_url} lists no models; set ENGRAM_LLM_MODEL")
        return models[0]

    def complete(self, messages: Sequence[ChatMessage], schema: type[BaseModel] | None = None, *,
                 timeout: float, max_tokens: int | None = None) -> Completion[Any]:
        if schema is None:
            return self._send(list(messages), None, None, timeout, max_tokens)
        start = self._rung
        last = len(STRUCTURED_MODES) - 1 if self.structured == "auto" else start
        for rung in range(start, last + 1):
            mode = STRUCTURED_MODES[rung]
            try:
                reply = self._send(with_instruction(messages, schema_instruction(schema)),
                                   self._response_format(mode, schema), mode, timeout, max_tokens)
            except LLMRejected as exc:
                if rung == last or not _refuses_format(exc):
                    raise
                log.info("%s refused structured mode %s (%s); trying %s", self.base_url, mode,
                         exc, STRUCTURED_MODES[rung + 1])
                continue
            if rung != start:
                with self._lock:
                    self._rung = rung  # remember only what worked: a one-off 400 moves nothing
                log.info("%s: structured output now uses %s", self.base_url, mode)
            return reply
        raise AssertionError("unreachable")

    @staticmethod
    def _response_format(mode: str, schema: type[BaseModel]) -> dict[str, Any] | None:
        if mode == "json_schema":
            # not "strict": OpenAI's strict mode refuses schemas with optional fields or defaults,
            # which pydantic models often have; the reply is validated here either way
            name = re.sub(r"[^a-zA-Z0-9_-]", "_", schema.__name__)[:64]
            return {"type": "json_schema", "json_schema": {"name": name, "schema": schema_of(schema)}}
        if mode == "json_object_schema":
            return {"type": "json_object", "schema": schema_of(schema)}
        if mode == "json_object":
            return {"type": "json_object"}
        return None

    def _send(self, messages: list[Any], response_format: dict[str, Any] | None, mode: str | None,
              timeout: float, max_tokens: int | None) -> Completion[Any]:
        if self._model is None:
            self._model = self._discover_model(timeout)
        kwargs: dict[str, Any] = {"model": self._model, "messages": messages, "timeout": timeout}
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if max_tokens is not None or self.max_tokens is not None:
            kwargs["max_tokens"] = max_tokens if max_tokens is not None else self.max_tokens
        if response_format is not None:
            kwargs["response_format"] = response_format
        t0 = time.perf_counter()
        try:
            response = self._client.chat.completions.create(**kwargs)
        except self._openai.OpenAIError as exc:
            raise self._translate(exc) from exc
        elapsed = time.perf_counter() - t0
        if not response.choices:
            raise LLMUnavailable(f"{self.base_url} answered with no choices")
        choice = response.choices[0]
        text = choice.message.content or ""
        if not text and getattr(choice.message, "refusal", None):
            text = str(choice.message.refusal)
        u = response.usage
        usage = Usage(u.prompt_tokens or 0, u.completion_tokens or 0) if u else Usage()
        return Completion(text=text, model=response.model or self.model, usage=usage,
                          elapsed_s=elapsed, mode=mode, finish_reason=choice.finish_reason)

    def _translate(self, exc: Exception) -> ProviderError:
        """openai's errors, mapped at the boundary onto the ones a caller can act on."""
        oa = self._openai
        where = self.base_url
        if isinstance(exc, oa.APITimeoutError):
            return LLMTimeout(f"{where}: no answer within the timeout")
        if isinstance(exc, oa.APIConnectionError):
            return LLMUnavailable(f"{where}: cannot connect ({exc.__cause__ or exc})")
        if isinstance(exc, oa.APIStatusError):
            status = exc.status_code
            detail = _error_detail(exc)
            # llama-cpp-python's server answers a request it cannot parse with a 500 carrying
            # pydantic's "validation error ... ('body', ...)": a refusal, not an outage
            refused = status >= 500 and "validation error" in detail and "'body'" in detail
            if not refused and (status in (408, 409, 429) or status >= 500):
                return LLMUnavailable(f"{where}: HTTP {status}: {detail}", status=status)
            return LLMRejected(f"{where}: HTTP {status}: {detail}", status=status)
        return LLMUnavailable(f"{where}: {exc}")


def _refuses_format(exc: LLMRejected) -> bool:
    """Whether a refusal may be about the structured-output style, so a lower rung may pass:
    OpenAI-style servers say 400, FastAPI-style ones 422, llama-cpp-python a 500 naming the field."""
    return exc.status in (400, 422) or "response_format" in str(exc)


def _error_detail(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail") or err
            return str(msg)[:500]
        return str(err)[:500]
    return str(getattr(exc, "message", exc))[:500]


# --- the scripted provider --------------------------------------------------------------------

Reply = str | BaseModel | Mapping[str, Any] | BaseException
ScriptItem = Reply | Callable[[Sequence[ChatMessage], type[BaseModel] | None], Reply]


@dataclass(frozen=True)
class ScriptedRequest:
    messages: list[dict[str, str]]
    schema: type[BaseModel] | None
    max_tokens: int | None


class ScriptedLLM:
    """A deterministic provider for unit tests of decisions: each request takes the next item of
    the script — a string (sent as is, valid or not), a pydantic object or a dict (sent as JSON),
    an exception (raised), or a callable `(messages, schema) -> any of those`. Requests are kept
    in `requests`. Tokens are counted as whitespace-separated words."""

    name = "scripted"

    def __init__(self, script: Iterable[ScriptItem] = (), *, model: str = "scripted") -> None:
        self.script: deque[ScriptItem] = deque(script)
        self.requests: list[ScriptedRequest] = []
        self._model = model
        self._lock = threading.Lock()

    @property
    def model(self) -> str:
        return self._model

    def push(self, *items: ScriptItem) -> ScriptedLLM:
        self.script.extend(items)
        return self

    def complete(self, messages: Sequence[ChatMessage], schema: type[BaseModel] | None = None, *,
                 timeout: float, max_tokens: int | None = None) -> Completion[Any]:
        with self._lock:
            self.requests.append(ScriptedRequest([dict(m) for m in messages], schema, max_tokens))
            if not self.script:
                raise ProviderError(f"ScriptedLLM: script exhausted at request {len(self.requests)}")
            item = self.script.popleft()
        reply: Any = item(messages, schema) if callable(item) else item
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, BaseModel):
            text = reply.model_dump_json()
        elif isinstance(reply, Mapping):
            text = json.dumps(reply)
        else:
            text = str(reply)
        usage = Usage(sum(len(m.get("content", "").split()) for m in messages), len(text.split()))
        return Completion(text=text, model=self._model, usage=usage,
                          mode=None if schema is None else "scripted", finish_reason="stop")


# --- the registry -----------------------------------------------------------------------------

LLMFactory = Callable[[Config], LLMProvider | None]
"""Builds a provider from the config, or returns None when the config asks for no LLM."""


def _openai_from_config(config: Config) -> OpenAICompatible | None:
    if not config.llm_base_url:
        return None
    return OpenAICompatible(config.llm_base_url, api_key=config.llm_api_key, model=config.llm_model,
                            structured=config.llm_structured,
                            discovery_timeout_s=config.llm_timeout_s)


LLMS: dict[str, LLMFactory] = {
    "openai": _openai_from_config,
    "scripted": lambda config: ScriptedLLM(),
}


def register_llm(name: str, factory: LLMFactory) -> None:
    LLMS[name] = factory


def get_llm(config: Config) -> LLM | None:
    """The configured model wrapped in `LLM`, or None when no LLM is configured."""
    try:
        factory = LLMS[config.llm]
    except KeyError:
        raise ProviderError(f"unknown LLM provider {config.llm!r}; registered: {sorted(LLMS)}") from None
    provider = factory(config)
    if provider is None:
        return None
    return LLM(provider, timeout_s=config.llm_timeout_s, retries=config.llm_retries,
               output_retries=config.llm_output_retries)

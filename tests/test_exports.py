"""The public surface: `engram.__all__` lists exactly what the package exports, sorted.

"Sorted" is the isort-style order (ruff RUF022): CONSTANTS, then Classes, then the rest,
alphabetical within each group.
"""

from __future__ import annotations

import inspect

import engram


def _isort_key(name: str) -> tuple[int, str]:
    if name.isupper():
        return 0, name
    if name[:1].isupper():
        return 1, name
    return 2, name


def test_all_is_sorted() -> None:
    assert engram.__all__ == sorted(engram.__all__, key=_isort_key)
    assert len(set(engram.__all__)) == len(engram.__all__)


def test_all_is_exactly_the_public_names() -> None:
    public = {name for name, value in vars(engram).items()
              if not name.startswith("_") and not inspect.ismodule(value)}
    assert set(engram.__all__) == public | {"__version__"}


def test_every_exported_name_resolves() -> None:
    namespace: dict[str, object] = {}
    exec("from engram import *", namespace)
    assert set(engram.__all__) <= set(namespace)
    for name in engram.__all__:
        assert getattr(engram, name) is namespace[name]


def test_errors_are_exported_under_one_root() -> None:
    errors = [getattr(engram, n) for n in engram.__all__
              if inspect.isclass(getattr(engram, n)) and issubclass(getattr(engram, n), Exception)]
    assert engram.EngramError in errors and len(errors) > 1
    assert all(issubclass(e, engram.EngramError) for e in errors)


def test_every_error_a_caller_can_act_on_is_exported() -> None:
    """The LLM errors and `InProgress` are caught by callers: importable from `engram`."""
    from engram import errors

    defined = {name for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, Exception)}
    assert defined <= set(engram.__all__)
    assert {"InProgress", "LLMOutputError", "LLMRejected", "LLMTimeout",
            "LLMUnavailable"} <= set(engram.__all__)

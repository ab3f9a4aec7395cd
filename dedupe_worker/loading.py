"""Load a handler named ``module:function`` (or ``module.function``) for the CLI."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["load_callable"]


def load_callable(path: str) -> Callable[..., Any]:
    """Import ``package.module:function`` (attribute paths like ``module:Class.method`` work)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"expected 'module:function', got {path!r}")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{path} is not callable")
    return target  # type: ignore[no-any-return]

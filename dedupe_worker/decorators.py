"""``@idempotent``: deduplicate calls of a plain function."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from .deduplicator import Deduplicator
from .protocol.fingerprint import fingerprint_of

__all__ = ["idempotent"]

F = TypeVar("F", bound=Callable[..., Any])


def idempotent(
    deduplicator: Deduplicator,
    key: str | Callable[..., str],
    fingerprint: Callable[..., Any] | bool = True,
) -> Callable[[F], F]:
    """Run the decorated function at most once per key; later calls return the stored value.

    ``key`` is a callable taking the function's arguments, or a format string over its bound
    arguments (``"charge:{order_id}"``). ``fingerprint`` is a callable over the arguments, ``True``
    (default: a hash of the function's name and bound arguments, so a key reused with other
    arguments raises :class:`~dedupe_worker.KeyConflict`) or ``False`` (no check). Raises as
    :meth:`Deduplicator.run` does.
    """

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        name = f"{fn.__module__}.{fn.__qualname__}"

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            k = key(*args, **kwargs) if callable(key) else key.format(**bound.arguments)
            if callable(fingerprint):
                fp: Any = fingerprint(*args, **kwargs)
            elif fingerprint:
                fp = fingerprint_of([name, bound.arguments])
            else:
                fp = None
            return deduplicator.run(k, fn, *args, fingerprint=fp, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate

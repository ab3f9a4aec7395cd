"""``@idempotent``: deduplicate calls of a plain function or of an ``async def``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ._protocol import fingerprint_of, ttl_ms

__all__ = ["idempotent"]

F = TypeVar("F", bound=Callable[..., Any])


class Runner(Protocol):
    """What ``@idempotent`` needs of its deduplicator: a :class:`~dedupe_worker.Deduplicator` or
    an :class:`~dedupe_worker.asyncio.AsyncDeduplicator` (named structurally, so this module
    imports neither and sits below both)."""

    @property
    def run(self) -> Callable[..., Any]: ...


def idempotent(
    deduplicator: Runner,
    key: str | Callable[..., str],
    fingerprint: Callable[..., Any] | bool = True,
    ttl: float | Callable[..., float | None] | None = None,
) -> Callable[[F], F]:
    """Run the decorated function at most once per key; later calls return the stored value.

    ``key`` is a callable taking the function's arguments, or a format string over its bound
    arguments (``"charge:{order_id}"``). ``fingerprint`` is a callable over the arguments, ``True``
    (default: a hash of the function's name and bound arguments, so a key reused with other
    arguments raises :class:`~dedupe_worker.KeyConflict`) or ``False`` (no check). ``ttl``:
    seconds each outcome is kept instead of the deduplicator's ``result_ttl``, a number or a
    callable over the arguments (``None`` from it: ``result_ttl``). Raises as
    :meth:`Deduplicator.run` does (``ValueError`` at once for a ``ttl`` number that is not positive).

    An ``async def`` needs an :class:`~dedupe_worker.asyncio.AsyncDeduplicator` (and a plain
    function a :class:`Deduplicator`); the wrapper is then a coroutine function too, and
    ``current_claim()`` is set inside the coroutine. A mismatch raises ``TypeError`` at once.
    """

    if ttl is not None and not callable(ttl):
        ttl_ms(ttl)

    def ttl_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
        return ttl(*args, **kwargs) if callable(ttl) else ttl

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        name = f"{fn.__module__}.{fn.__qualname__}"
        is_async = inspect.iscoroutinefunction(fn)
        if is_async != inspect.iscoroutinefunction(deduplicator.run):
            wanted = "an AsyncDeduplicator" if is_async else "a Deduplicator"
            raise TypeError(f"@idempotent on {name} ({'async' if is_async else 'plain'} function) needs {wanted}")

        def key_and_fingerprint(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            k = key(*args, **kwargs) if callable(key) else key.format(**bound.arguments)
            if callable(fingerprint):
                return k, fingerprint(*args, **kwargs)
            return k, fingerprint_of([name, bound.arguments]) if fingerprint else None

        if is_async:
            @functools.wraps(fn)
            async def coroutine(*args: Any, **kwargs: Any) -> Any:
                k, fp = key_and_fingerprint(args, kwargs)
                return await deduplicator.run(k, fn, *args, fingerprint=fp, ttl=ttl_of(args, kwargs), **kwargs)

            return coroutine  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            k, fp = key_and_fingerprint(args, kwargs)
            return deduplicator.run(k, fn, *args, fingerprint=fp, ttl=ttl_of(args, kwargs), **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate

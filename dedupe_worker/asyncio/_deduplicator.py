"""The :class:`AsyncDeduplicator`: the asyncio protocol client, with the engine's ``run()`` on top."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .._deduplicator import DeduplicatorCore
from .._engine import decide_flow, handler_of, outcome
from .._protocol import Claim
from .._transport import AsyncClaimClient
from . import _engine as engine

__all__ = ["AsyncDeduplicator"]

T = TypeVar("T")


class AsyncDeduplicator(DeduplicatorCore, AsyncClaimClient):
    """Makes at-least-once delivery apply once for asyncio consumers, with Redis as the store.

    The asyncio twin of :class:`~dedupe_worker.Deduplicator`: the same options, Lua scripts,
    exceptions and guarantees, and the two interoperate on one namespace. While a key's records
    live (``result_ttl`` after completion) its work is *completed* at most once; a claimant whose
    lease ran out can never store an outcome over its successor's (fencing tokens); a failure of
    Redis never runs the handler unless ``fail_open`` is set. Many concurrent :meth:`run` calls on
    one key run the function once: the first claims it, the others answer
    :class:`~dedupe_worker.InProgress` (or, with ``wait``, the stored value once it is stored).

    What is not guaranteed: a process that dies mid-handler leaves its side effects half done and
    the claim held until the lease runs out; the next delivery then runs the handler again (fence
    side effects with :func:`~dedupe_worker.current_claim`, which is set inside the coroutine).

    One renewer task per event loop keeps the leases of running handlers alive; call
    :meth:`aclose` when done. ``outcomes``: as :class:`~dedupe_worker.Deduplicator`'s.
    """

    async def run(self, key: str | bytes, fn: Callable[..., Awaitable[T]], /, *args: Any, fingerprint: Any = None,
                  wait: float = 0.0, ttl: float | None = None, **kwargs: Any) -> T:
        """Claim ``key``, ``await fn(*args, **kwargs)`` once, store and return its value (kept
        ``ttl`` seconds when given, instead of ``result_ttl``).

        A duplicate returns the stored value without calling ``fn``. Raises as
        :meth:`Deduplicator.run <dedupe_worker.Deduplicator.run>`: :class:`InProgress`,
        :class:`KeyConflict`, :class:`PreviouslyFailed`, :class:`LeaseLost`,
        :class:`ResultNotSerializable`, :class:`StoreUnavailable` (``fn`` not run, unless
        ``fail_open``) and whatever ``fn`` raised (the claim released, or for
        ``permanent_errors`` the failure stored). Cancelling the caller releases the claim.
        """
        return outcome(await self._drive_async(decide_flow(  # type: ignore[no-any-return]
            self, key, handler_of(fn, args, kwargs), fingerprint, wait, "run", ttl)))

    async def apply(self, claim: Claim, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any) -> T:
        """Await ``fn`` for an ACQUIRED ``claim`` and store its outcome; raises as :meth:`run`."""
        decision = await engine.execute(self, claim, lambda: fn(*args, **kwargs))
        return outcome(decision)  # type: ignore[no-any-return]

    async def settle_failure(self, claim: Claim, exc: BaseException) -> None:
        """After work for ``claim`` raised ``exc``: store a permanent failure or release the
        claim. Never raises."""
        await engine.settle_failure(self, claim, exc)

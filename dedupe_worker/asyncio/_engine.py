"""The engine for one message on asyncio: claim, await the handler, store, verdict.

The same verdicts as :mod:`dedupe_worker._engine.single`, from the same code: :func:`decide`,
:func:`execute` and :func:`settle_failure` drive that module's flows (``decide_flow``,
``execute_flow``, ``settle_failure_flow``) with ``AsyncClaimClient._drive_async``, which awaits each
round trip and the ``async def`` handler. Nothing of the decision is written here.

Crash story, one message: as the synchronous engine's. The outcome is stored in the round trip
right after the handler returns, while the loop's renewer task keeps its lease alive. A process
that dies inside the handler (or before that round trip) leaves the claim held until its lease
runs out; the next delivery then runs the handler again under a larger fencing token. A task
cancelled inside the handler (``CancelledError``) releases the claim first, so a redelivery may
claim it at once, and the cancellation propagates.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .._engine import Decision, Pacing, batch_flow, decide_flow, execute_flow, handler_of, outcome, settle_failure_flow
from .._protocol import Claim
from .._transport import AsyncClaimClient

__all__ = ["AsyncHandler", "AsyncItem", "decide", "decide_many", "execute", "run", "settle_failure"]

T = TypeVar("T")

#: A zero-argument callable returning an awaitable: ``lambda: handle(message)``.
AsyncHandler = Callable[[], Awaitable[Any]]
#: ``(key, fingerprint, handler)``, the handler an :data:`AsyncHandler`.
AsyncItem = tuple[str | bytes, Any, AsyncHandler]


async def settle_failure(dedupe: AsyncClaimClient, claim: Claim, exc: BaseException) -> None:
    """After a handler raised ``exc``: store a permanent failure or release the claim, in one round
    trip. Never raises: if Redis is down the lease simply runs out."""
    await dedupe._drive_async(settle_failure_flow(dedupe, claim, exc))


async def execute(dedupe: AsyncClaimClient, claim: Claim, handler: AsyncHandler,
                  integration: str = "run") -> Decision:
    """Await ``handler()`` for an ACQUIRED claim, its lease renewed and ``current_claim()`` set in
    the awaiting task, and store its outcome. The handler's exceptions become the verdict's
    ``error``; a ``BaseException`` (``CancelledError``, ``KeyboardInterrupt``) releases the claim
    and propagates."""
    return await dedupe._drive_async(execute_flow(dedupe, claim, handler, integration))


async def decide(dedupe: AsyncClaimClient, key: str | bytes, handler: AsyncHandler, *, fingerprint: Any = None,
                 wait: float = 0.0, integration: str = "run", ttl: float | None = None) -> Decision:
    """Claim ``key``, await ``handler()`` if acquired, store its outcome, and return the verdict
    (the same :class:`~dedupe_worker.Decision` as the synchronous engine's). Never raises for bad
    input, Redis or the handler's own exceptions; ``CancelledError`` propagates (the claim
    released). ``integration`` names the caller in metrics and traces; ``ttl`` as the sync one's."""
    return await dedupe._drive_async(decide_flow(dedupe, key, handler, fingerprint, wait, integration, ttl))


async def run(dedupe: AsyncClaimClient, key: str | bytes, fn: Callable[..., Awaitable[T]], /, *args: Any,
              fingerprint: Any = None, wait: float = 0.0, ttl: float | None = None, **kwargs: Any) -> T:
    """:func:`decide` for ``await fn(*args, **kwargs)``, its verdict turned into the value or the
    exception by :func:`~dedupe_worker._engine.outcome`."""
    return outcome(await dedupe._drive_async(decide_flow(  # type: ignore[no-any-return]
        dedupe, key, handler_of(fn, args, kwargs), fingerprint, wait, "run", ttl)))


async def decide_many(dedupe: AsyncClaimClient, items: Sequence[AsyncItem], *,
                      run_batch: Callable[[list[int]], Awaitable[Sequence[Any]]] | None = None,
                      flush_after: float | None = None, pacing: Pacing | None = None,
                      integration: str = "run", ttl: float | Sequence[float | None] | None = None
                      ) -> list[Decision]:
    """The batch engine on asyncio: :func:`dedupe_worker.decide_many` for ``(key, fingerprint,
    handler)`` items whose handlers are ``async def`` (awaited one after the other, each with
    ``current_claim()`` set), in order. The same code decides (the engine's batch flow), so the
    verdicts, the chunking by ``flush_after``, the copies of a key within the batch and the crash
    story are the sync engine's; ``run_batch(indices)`` is awaited. Never raises for bad input,
    Redis or the handlers' own exceptions; ``CancelledError`` propagates once what finished is
    stored and the rest released. ``ttl``: as the sync one's."""
    return await dedupe._drive_async(batch_flow(dedupe, items, run_batch, flush_after, pacing, integration, ttl))

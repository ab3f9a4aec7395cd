"""The engine for one message on asyncio: claim, await the handler, store, verdict.

The same verdicts as :mod:`dedupe_worker._engine.single`, from the same code: a claim that was not
ACQUIRED is settled by :func:`~dedupe_worker._engine.settle`, a bad key by
:func:`~dedupe_worker._engine.poison`, a handler failure classified by
:func:`~dedupe_worker._engine.single.failure_reason`, a Redis outage by
:func:`~dedupe_worker._engine.single.outage` (``fail_open`` included), a failed completion by
:func:`~dedupe_worker._engine.single.not_stored`, and a verdict turned into a value or an exception
by :func:`~dedupe_worker._engine.outcome`. Only the round trips and the handler are awaited here.

Crash story, one message: as the synchronous engine's. The outcome is stored in the round trip
right after the handler returns, while the loop's renewer task keeps its lease alive. A process
that dies inside the handler (or before that round trip) leaves the claim held until its lease
runs out; the next delivery then runs the handler again under a larger fencing token. A task
cancelled inside the handler (``CancelledError``) releases the claim first, so a redelivery may
claim it at once, and the cancellation propagates.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .._engine.decision import Decision, Reason, outcome, poison, settle
from .._engine.single import attributes, failure_reason, not_stored, outage
from .._errors import AlreadyApplied, InvalidKey, LeaseLost, ResultNotSerializable, StoreUnavailable
from .._protocol.claim import Claim
from .._protocol.context import Holding
from ..observe._base import current as observer
from ._client import AsyncClaimClient
from ._recorded import applied_before_async, found_before_async, unclaimed_async

__all__ = ["AsyncHandler", "decide", "execute", "run", "settle_failure"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: A zero-argument callable returning an awaitable: ``lambda: handle(message)``.
AsyncHandler = Callable[[], Awaitable[Any]]


async def settle_failure(dedupe: AsyncClaimClient, claim: Claim, exc: BaseException) -> None:
    """After a handler raised ``exc``: store a permanent failure or release the claim, in one round
    trip. Never raises: if Redis is down the lease simply runs out."""
    try:
        if failure_reason(dedupe, exc) is Reason.PERMANENT_FAILURE:
            await dedupe.fail(claim, exc)
        elif not await dedupe.release(claim):
            log.warning("release found lease lost key=%s token=%s", claim.key, claim.token)
    except Exception as inner:  # Redis down, or fenced off: the lease runs out by itself
        log.warning("could not settle key=%s token=%s after %r: %s", claim.key, claim.token, exc, inner)


async def unavailable(dedupe: AsyncClaimClient, exc: StoreUnavailable, handler: AsyncHandler) -> Decision:
    """The verdict when the claim could not be made: STORE_UNAVAILABLE, or under ``fail_open``
    the handler awaited without deduplication (APPLIED or HANDLER_ERROR)."""
    deferred = outage(dedupe, exc, 1)
    if deferred is not None:
        return deferred[0]
    try:
        return Decision(Reason.APPLIED, value=await handler())
    except AlreadyApplied as found:
        return Decision(Reason.DUPLICATE, value=found.result)
    except Exception as err:
        return Decision(Reason.HANDLER_ERROR, error=err)


async def stored(dedupe: AsyncClaimClient, claim: Claim, value: Any, integration: str = "run") -> Decision:
    """Store ``value`` as ``claim``'s outcome (one round trip) and return the verdict."""
    try:
        if observer.enabled:
            with observer.span("dedupe.complete", attributes(claim, integration)):
                began = time.perf_counter()
                await dedupe.complete(claim, value)
                observer.round_trip("complete", time.perf_counter() - began)
        else:
            await dedupe.complete(claim, value)
    except (LeaseLost, ResultNotSerializable, StoreUnavailable) as exc:
        return not_stored(dedupe, claim, exc)
    return Decision(Reason.APPLIED, claim, value)


async def run_handler(handler: AsyncHandler, claim: Claim, integration: str) -> Any:
    """``await handler()``, timed and in a ``dedupe.handler`` span when observers are enabled."""
    if not observer.enabled:
        return await handler()
    with observer.span("dedupe.handler", attributes(claim, integration)):
        began = time.perf_counter()
        try:
            return await handler()
        finally:
            observer.handled(integration, time.perf_counter() - began)


async def execute(dedupe: AsyncClaimClient, claim: Claim, handler: AsyncHandler,
                  integration: str = "run") -> Decision:
    """Await ``handler()`` for an ACQUIRED claim, its lease renewed and ``current_claim()`` set in
    the awaiting task, and store its outcome. The handler's exceptions become the verdict's
    ``error``; a ``BaseException`` (``CancelledError``, ``KeyboardInterrupt``) releases the claim
    and propagates."""
    with Holding(dedupe.renewer, claim):
        if claim.reclaimed:  # a re-run: an earlier run may have committed its outcome (engine/recorded.py)
            found = await found_before_async(dedupe, claim)
            if found is not None:
                return found
        try:
            value = await run_handler(handler, claim, integration)
        except AlreadyApplied as exc:
            return await applied_before_async(dedupe, claim, exc)
        except Exception as exc:
            await settle_failure(dedupe, claim, exc)
            return Decision(failure_reason(dedupe, exc), claim, error=exc)
        except BaseException as exc:
            await settle_failure(dedupe, claim, exc)
            raise
        return await stored(dedupe, claim, value, integration)


async def _begin(dedupe: AsyncClaimClient, key: str | bytes, handler: AsyncHandler, fingerprint: Any,
                 wait: float) -> Claim | Decision:
    """The claim, or the verdict when there is none: a bad key, or Redis down."""
    try:
        return await dedupe.begin(key, fingerprint=fingerprint, wait=wait)
    except InvalidKey as exc:
        return poison(exc)
    except StoreUnavailable as exc:
        return await unavailable(dedupe, exc, unclaimed_async(dedupe, key, handler))


async def decide(dedupe: AsyncClaimClient, key: str | bytes, handler: AsyncHandler, *, fingerprint: Any = None,
                 wait: float = 0.0, integration: str = "run") -> Decision:
    """Claim ``key``, await ``handler()`` if acquired, store its outcome, and return the verdict
    (the same :class:`~dedupe_worker.Decision` as the synchronous engine's). Never raises for bad
    input, Redis or the handler's own exceptions; ``CancelledError`` propagates (the claim
    released). ``integration`` names the caller in metrics and traces."""
    if not observer.enabled:
        claim = await _begin(dedupe, key, handler, fingerprint, wait)
        if isinstance(claim, Decision):
            return claim
        return settle(claim) or await execute(dedupe, claim, handler, integration)
    with observer.span("dedupe.claim", {"dedupe.integration": integration}) as span:
        began = time.perf_counter()
        claim = await _begin(dedupe, key, handler, fingerprint, wait)
        if isinstance(claim, Claim):
            observer.round_trip("claim", time.perf_counter() - began)
            span.update(attributes(claim, integration))
    if isinstance(claim, Decision):
        decision = claim
    else:
        decision = settle(claim) or await execute(dedupe, claim, handler, integration)
    observer.decided(integration, decision.reason.value)
    return decision


async def run(dedupe: AsyncClaimClient, key: str | bytes, fn: Callable[..., Awaitable[T]], /, *args: Any,
              fingerprint: Any = None, wait: float = 0.0, **kwargs: Any) -> T:
    """:func:`decide` for ``await fn(*args, **kwargs)``, its verdict turned into the value or the
    exception by :func:`~dedupe_worker._engine.outcome`."""
    handler = functools.partial(fn, *args, **kwargs) if args or kwargs else fn
    return outcome(await decide(dedupe, key, handler, fingerprint=fingerprint, wait=wait))  # type: ignore[no-any-return]

"""The engine for one message: claim, run, store, verdict.

:func:`decide` is what ``run()``, ``@idempotent``, Celery's ``IdempotentTask`` and an unbatched
consumer call; :func:`~dedupe_worker.decide_many` is its batch form and shares the
helpers below (how a handler failure is classified and settled, what a Redis outage means).

Crash story, one message: the outcome is stored in the round trip right after the handler
returns, while its lease is still renewed. A crash inside the handler, or between its return and
that round trip, leaves the claim held until its lease runs out; the next delivery then runs the
handler again under a larger fencing token. Nothing else can be lost.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from .._errors import AlreadyApplied, InvalidKey, LeaseLost, ResultNotSerializable, StoreUnavailable
from .._protocol.claim import Claim
from .._protocol.client import ClaimClient
from .._protocol.context import bind, unbind
from ..observe._base import current as observer
from .decision import Decision, Reason, outcome, poison, settle
from .recorded import applied_before, found_before, unclaimed

__all__ = ["ClientOptions", "decide", "execute", "failure_reason", "not_stored", "outage", "refused", "run",
           "settle_failure", "unavailable"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientOptions(Protocol):
    """The options of a client (sync or asyncio) that the verdicts depend on."""

    @property
    def lease(self) -> float: ...
    @property
    def fail_open(self) -> bool: ...
    @property
    def permanent_errors(self) -> tuple[type[BaseException], ...]: ...


def failure_reason(dedupe: ClientOptions, exc: BaseException) -> Reason:
    """PERMANENT_FAILURE for the client's ``permanent_errors`` (stored as the outcome), else
    HANDLER_ERROR (the claim is released so a retry may claim again)."""
    return Reason.PERMANENT_FAILURE if isinstance(exc, dedupe.permanent_errors) else Reason.HANDLER_ERROR


def settle_failure(dedupe: ClaimClient, claim: Claim, exc: BaseException) -> None:
    """After a handler raised ``exc``: store a permanent failure or release the claim, in one round
    trip. Never raises: if Redis is down the lease simply runs out."""
    try:
        if failure_reason(dedupe, exc) is Reason.PERMANENT_FAILURE:
            dedupe.fail(claim, exc)
        elif not dedupe.release(claim):
            log.warning("release found lease lost key=%s token=%s", claim.key, claim.token)
    except Exception as inner:  # Redis down, or fenced off: the lease runs out by itself
        log.warning("could not settle key=%s token=%s after %r: %s", claim.key, claim.token, exc, inner)


def unavailable(dedupe: ClaimClient, exc: StoreUnavailable, handlers: Sequence[Callable[[], Any]]) -> list[Decision]:
    """The decisions when the claims for ``handlers`` could not be made (logged once for all).

    Fail closed: STORE_UNAVAILABLE, nothing run. With ``fail_open`` the handlers run without
    deduplication and their verdicts are APPLIED or HANDLER_ERROR.
    """
    if not handlers:
        return []
    deferred = outage(dedupe, exc, len(handlers))
    if deferred is not None:
        return deferred
    decisions = []
    for handler in handlers:
        try:
            decisions.append(Decision(Reason.APPLIED, value=handler()))
        except AlreadyApplied as found:
            decisions.append(Decision(Reason.DUPLICATE, value=found.result))
        except Exception as err:
            decisions.append(Decision(Reason.HANDLER_ERROR, error=err))
    return decisions


def outage(dedupe: ClientOptions, exc: StoreUnavailable, count: int) -> list[Decision] | None:
    """The verdicts on ``count`` messages whose claims could not be made (logged once for all):
    STORE_UNAVAILABLE each, or ``None`` under ``fail_open`` (the caller runs them unclaimed)."""
    if not dedupe.fail_open:
        log.warning("Redis unavailable, deferring %d message(s): %s", count, exc)
        return [Decision(Reason.STORE_UNAVAILABLE, error=exc, retry_after=1.0)] * count
    log.error("Redis unavailable; fail_open runs %d handler(s) WITHOUT deduplication: %s", count, exc)
    return None


def not_stored(dedupe: ClientOptions, claim: Claim,
               exc: LeaseLost | ResultNotSerializable | StoreUnavailable) -> Decision:
    """The verdict when storing a handler's outcome raised ``exc`` (the handler did run)."""
    if isinstance(exc, LeaseLost):
        return Decision(Reason.LEASE_LOST, claim, error=exc, retry_after=dedupe.lease)
    if isinstance(exc, ResultNotSerializable):  # stored as "completed, body omitted"
        return Decision(Reason.UNSERIALIZABLE_RESULT, claim, error=exc)
    # StoreUnavailable: the outcome may not be stored; the claim stays held until its lease runs
    # out, then a redelivery may run the handler again (fence side effects).
    return Decision(Reason.STORE_UNAVAILABLE, claim, error=exc, retry_after=dedupe.lease)


def stored(dedupe: ClaimClient, claim: Claim, value: Any, integration: str = "run") -> Decision:
    """Store ``value`` as ``claim``'s outcome (one round trip) and return the verdict."""
    try:
        if observer.enabled:
            with observer.span("dedupe.complete", attributes(claim, integration)):
                began = time.perf_counter()
                dedupe.complete(claim, value)
                observer.round_trip("complete", time.perf_counter() - began)
        else:
            dedupe.complete(claim, value)
    except (LeaseLost, ResultNotSerializable, StoreUnavailable) as exc:
        return not_stored(dedupe, claim, exc)
    return Decision(Reason.APPLIED, claim, value)


def attributes(claim: Claim, integration: str | None = None) -> dict[str, Any]:
    """Span attributes of a claim: the Redis key (a hashed key shows its hash), token, outcome."""
    return {"dedupe.key": claim.stem, "dedupe.token": claim.token, "dedupe.outcome": claim.outcome.name.lower(),
            "dedupe.integration": integration}


def run_handler(handler: Callable[[], Any], claim: Claim, integration: str) -> Any:
    """``handler()``, timed and in a ``dedupe.handler`` span when observers are enabled."""
    if not observer.enabled:
        return handler()
    with observer.span("dedupe.handler", attributes(claim, integration)):
        began = time.perf_counter()
        try:
            return handler()
        finally:
            observer.handled(integration, time.perf_counter() - began)


def execute(dedupe: ClaimClient, claim: Claim, handler: Callable[[], Any], integration: str = "run") -> Decision:
    """Run ``handler`` for an ACQUIRED claim, lease renewed and ``current_claim()`` set, and store
    its outcome. The handler's exceptions become the verdict's ``error``; a ``BaseException``
    (``KeyboardInterrupt``, ``SystemExit``) releases the claim and propagates."""
    # What ``with Holding(dedupe.renewer, claim)`` does, spelled out: this runs once per message,
    # and the context manager's three calls cost more than the lease tracking itself.
    renewer, stem, token = dedupe.renewer, claim.stem, claim.token
    renewer.track(stem, token)
    reset = bind(claim)
    try:
        if claim.reclaimed:  # a re-run: an earlier run may have committed its outcome (engine/recorded.py)
            found = found_before(dedupe, claim)
            if found is not None:
                return found
        try:
            value = run_handler(handler, claim, integration) if observer.enabled else handler()
        except AlreadyApplied as exc:
            return applied_before(dedupe, claim, exc)
        except Exception as exc:
            settle_failure(dedupe, claim, exc)
            return Decision(failure_reason(dedupe, exc), claim, error=exc)
        except BaseException as exc:
            settle_failure(dedupe, claim, exc)
            raise
        if observer.enabled:
            return stored(dedupe, claim, value, integration)
        try:  # stored(), without the observers
            dedupe.complete(claim, value)
        except (LeaseLost, ResultNotSerializable, StoreUnavailable) as exc:
            return not_stored(dedupe, claim, exc)
        return Decision(Reason.APPLIED, claim, value)
    finally:
        unbind(reset)
        renewer.untrack(stem, token)


def refused(error: BaseException, integration: str) -> Decision:
    """The verdict on a message whose key could not be derived (:func:`poison`), reported to the
    observers like every other verdict."""
    decision = poison(error)
    if observer.enabled:
        observer.decided(integration, decision.reason.value)
    return decision


def decide(dedupe: ClaimClient, key: str | bytes, handler: Callable[[], Any], *, fingerprint: Any = None,
           wait: float = 0.0, integration: str = "run") -> Decision:
    """Claim ``key``, run ``handler`` if acquired, store its outcome, and return the verdict.
    Never raises for bad input, Redis or the handler's own exceptions.

    ``wait``: when another worker holds the key, wait up to this many seconds for it (see
    :meth:`~dedupe_worker._protocol.ClaimClient.begin`) before answering IN_PROGRESS.
    ``integration`` names the caller in metrics and traces."""
    if not observer.enabled:
        try:  # _begin(), inline: one frame less per message
            claim = dedupe.begin(key, fingerprint=fingerprint, wait=wait)
        except InvalidKey as exc:
            return poison(exc)
        except StoreUnavailable as exc:
            return unavailable(dedupe, exc, [unclaimed(dedupe, key, handler)])[0]
        return settle(claim) or execute(dedupe, claim, handler, integration)
    with observer.span("dedupe.claim", {"dedupe.integration": integration}) as span:
        began = time.perf_counter()
        begun = _begin(dedupe, key, handler, fingerprint, wait)
        if isinstance(begun, Claim):
            observer.round_trip("claim", time.perf_counter() - began)
            span.update(attributes(begun, integration))
    decision = begun if isinstance(begun, Decision) else settle(begun) or execute(dedupe, begun, handler, integration)
    observer.decided(integration, decision.reason.value)
    return decision


def _begin(dedupe: ClaimClient, key: str | bytes, handler: Callable[[], Any], fingerprint: Any,
           wait: float) -> Claim | Decision:
    """The claim, or the verdict when there is none: a bad key, or Redis down."""
    try:
        return dedupe.begin(key, fingerprint=fingerprint, wait=wait)
    except InvalidKey as exc:
        return poison(exc)
    except StoreUnavailable as exc:
        return unavailable(dedupe, exc, [unclaimed(dedupe, key, handler)])[0]


def run(dedupe: ClaimClient, key: str | bytes, fn: Callable[..., T], /, *args: Any,
        fingerprint: Any = None, wait: float = 0.0, **kwargs: Any) -> T:
    """:func:`decide` for ``fn(*args, **kwargs)``, its verdict turned into the value or the
    exception by :func:`~dedupe_worker._engine.decision.outcome`."""
    handler = functools.partial(fn, *args, **kwargs) if args or kwargs else fn
    return outcome(decide(dedupe, key, handler, fingerprint=fingerprint, wait=wait))  # type: ignore[no-any-return]

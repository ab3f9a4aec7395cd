"""The engine for one message: claim, run, store, verdict; written once for sync and asyncio.

:func:`decide` is what ``run()``, ``@idempotent``, Celery's ``IdempotentTask`` and an unbatched
consumer call; :func:`~dedupe_worker.decide_many` is its batch form and shares the
helpers below (how a handler failure is classified and settled, what a Redis outage means).

Each step is a flow (:mod:`dedupe_worker._protocol.flows`): :func:`decide_flow`,
:func:`execute_flow`, :func:`settle_failure_flow`, :func:`unavailable_flow` yield the protocol's
round trips and the handler call, and never do I/O themselves. :func:`decide`, :func:`execute` and
:func:`settle_failure` here drive them with blocking calls; :mod:`dedupe_worker.asyncio`'s
functions of the same names drive the same flows on an event loop, awaiting ``async def``
handlers. A verdict is therefore decided by the same lines on both.

The flows are flat on the common path (``bench.core``'s ``run`` cases): :func:`decide_flow`
claims with ``ClientCore.begin_flow`` and answers a duplicate itself; an acquired claim runs
:func:`execute_flow`, which calls the handler (or yields it, on asyncio) and stores the outcome
with ``ClientCore.complete_flow``; each of those yields its round trip in its own frame. Every
other case (the store's first check, replicas to wait for, ``wait``, observers, a reclaimed key's
committed row, ``atomic()`` in a joined transaction, a handler's failure, a finishing write
retried, Redis down) enters its sub-flow only when it arises, from the same flow.

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

from .._errors import (
    AlreadyApplied,
    InvalidKey,
    KeyConflict,
    LeaseLost,
    NotCommitted,
    ResultNotSerializable,
    StoreUnavailable,
)
from .._protocol import Claim, ClientCore, Flow, Handler, Outcome, bind, unbind
from .._transport import ClaimClient
from ..observe._base import current as observer
from . import recorded
from .decision import Decision, Reason, outcome, poison, verdict_of
from .recorded import applied_before_flow, found_before_flow, unclaimed_flow

__all__ = ["ClientOptions", "decide", "decide_flow", "execute", "execute_flow", "failure_reason", "handler_of",
           "not_stored",
           "outage", "refused", "run", "settle_failure", "settle_failure_flow", "unavailable", "unavailable_flow"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_ACQUIRED = Outcome.ACQUIRED


class ClientOptions(Protocol):
    """The options of a client (sync or asyncio) that the verdicts depend on."""

    @property
    def lease(self) -> float: ...
    @property
    def fail_open(self) -> bool: ...
    @property
    def permanent_errors(self) -> tuple[type[BaseException], ...]: ...


def failure_reason(dedupe: ClientOptions, exc: BaseException) -> Reason:
    """PERMANENT_FAILURE for the client's ``permanent_errors`` (stored as the outcome); CONFLICT for
    a :class:`KeyConflict` (``atomic()`` found the key committed for another payload: released,
    as Redis refuses a conflict without a record); else HANDLER_ERROR (the claim is released so a
    retry may claim again). :class:`NotCommitted` is always HANDLER_ERROR, whatever
    ``permanent_errors`` says: nothing committed, so no outcome (not even a failure) is stored."""
    if isinstance(exc, NotCommitted):
        return Reason.HANDLER_ERROR
    if isinstance(exc, dedupe.permanent_errors):
        return Reason.PERMANENT_FAILURE
    return Reason.CONFLICT if isinstance(exc, KeyConflict) else Reason.HANDLER_ERROR


def settle_failure_flow(dedupe: ClientCore, claim: Claim, exc: BaseException) -> Flow[None]:
    """After a handler raised ``exc``: store a permanent failure or release the claim, in one round
    trip. Never raises: if Redis is down the lease simply runs out."""
    try:
        if failure_reason(dedupe, exc) is Reason.PERMANENT_FAILURE:
            yield from dedupe.fail_flow(claim, exc)
        elif not (yield from dedupe.release_flow((claim,)))[0]:
            log.warning("release found lease lost key=%s token=%s", claim.key, claim.token)
    except Exception as inner:  # Redis down, or fenced off: the lease runs out by itself
        log.warning("could not settle key=%s token=%s after %r: %s", claim.key, claim.token, exc, inner)


def settle_failure(dedupe: ClaimClient, claim: Claim, exc: BaseException) -> None:
    """:func:`settle_failure_flow`, driven with blocking calls."""
    dedupe._drive(settle_failure_flow(dedupe, claim, exc))


def unavailable_flow(dedupe: ClientCore, exc: StoreUnavailable,
                     runs: Sequence[tuple[str | bytes, Callable[[], Any]]]) -> Flow[list[Decision]]:
    """The decisions when the claims for ``runs`` (``(key, handler)``) could not be made (logged
    once for all).

    Fail closed: STORE_UNAVAILABLE, nothing run. With ``fail_open`` the handlers run without
    deduplication (:func:`~dedupe_worker._engine.recorded.unclaimed_flow`) and their verdicts are
    APPLIED or HANDLER_ERROR.
    """
    if not runs:
        return []
    deferred = outage(dedupe, exc, len(runs))
    if deferred is not None:
        return deferred
    decisions = []
    for key, handler in runs:
        try:
            decisions.append(Decision(Reason.APPLIED, value=(yield from unclaimed_flow(dedupe, key, handler))))
        except AlreadyApplied as found:
            decisions.append(Decision(Reason.DUPLICATE, value=found.result))
        except Exception as err:
            decisions.append(Decision(Reason.HANDLER_ERROR, error=err))
    return decisions


def unavailable(dedupe: ClaimClient, exc: StoreUnavailable,
                runs: Sequence[tuple[str | bytes, Callable[[], Any]]]) -> list[Decision]:
    """:func:`unavailable_flow`, driven with blocking calls."""
    return dedupe._drive(unavailable_flow(dedupe, exc, runs))


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


def observed_complete_flow(dedupe: ClientCore, claim: Claim, value: Any, integration: str) -> Flow[None]:
    """``complete_flow`` in a ``dedupe.complete`` span, its round trip timed (observers enabled)."""
    with observer.span("dedupe.complete", attributes(claim, integration)):
        began = time.perf_counter()
        yield from dedupe.complete_flow(claim, value, None)
        observer.round_trip("complete", time.perf_counter() - began)


def attributes(claim: Claim, integration: str | None = None) -> dict[str, Any]:
    """Span attributes of a claim: the Redis key (a hashed key shows its hash), token, outcome."""
    return {"dedupe.key": claim.stem, "dedupe.token": claim.token, "dedupe.outcome": claim.outcome.name.lower(),
            "dedupe.integration": integration}


def handled_flow(handler: Callable[[], Any], claim: Claim, integration: str) -> Flow[Any]:
    """The handler's value, timed and in a ``dedupe.handler`` span (observers enabled)."""
    with observer.span("dedupe.handler", attributes(claim, integration)):
        began = time.perf_counter()
        try:
            return (yield Handler(handler))
        finally:
            observer.handled(integration, time.perf_counter() - began)


def execute_flow(dedupe: ClientCore, claim: Claim, handler: Callable[[], Any],
                 integration: str = "run") -> Flow[Decision]:
    """Run ``handler`` for an ACQUIRED claim, lease renewed and ``current_claim()`` set, and store
    its outcome. The handler's exceptions become the verdict's ``error``; a ``BaseException``
    (``KeyboardInterrupt``, ``SystemExit``, asyncio's ``CancelledError``) releases the claim and
    propagates.

    Few frames on the common path: the handler is called here where the driver would call it
    anyway (``calls_handlers``, the sync client), else yielded, and the outcome is stored by
    ``ClientCore.complete_flow`` (one frame); the cases that need more (a reclaimed key's
    committed row, an ``atomic()`` block that joined a transaction, a failure to settle,
    observers) enter their sub-flows only when they arise."""
    renewer, stem, token = dedupe.renewer, claim.stem, claim.token
    renewer.track(stem, token)
    reset, run = bind(claim), recorded.opened(dedupe)
    try:
        if claim.reclaimed:  # a re-run: an earlier run may have committed its outcome (engine/recorded.py)
            found = yield from found_before_flow(dedupe, claim)
            if found is not None:
                return found
        try:
            if observer.enabled:
                value = yield from handled_flow(handler, claim, integration)
            elif dedupe.calls_handlers:
                value = handler()
            else:
                value = yield Handler(handler)
            if run is not None and run.joined:  # atomic() inside a transaction it did not open: did that commit?
                uncommitted = yield from recorded.uncommitted_flow(claim, run)
                if uncommitted is not None:
                    raise uncommitted
        except AlreadyApplied as exc:
            return (yield from applied_before_flow(dedupe, claim, exc))
        except GeneratorExit:
            raise
        except Exception as exc:
            yield from settle_failure_flow(dedupe, claim, exc)
            return Decision(failure_reason(dedupe, exc), claim, error=exc)
        except BaseException as exc:
            yield from settle_failure_flow(dedupe, claim, exc)
            raise
        try:  # the outcome stored in the round trip right after the handler returned
            if observer.enabled:
                yield from observed_complete_flow(dedupe, claim, value, integration)
            else:
                yield from dedupe.complete_flow(claim, value, None)
        except (LeaseLost, ResultNotSerializable, StoreUnavailable) as exc:
            return not_stored(dedupe, claim, exc)
        return Decision(Reason.APPLIED, claim, value)
    finally:
        if run is not None:
            recorded.closed(run)
        unbind(reset)
        renewer.untrack(stem, token)


def execute(dedupe: ClaimClient, claim: Claim, handler: Callable[[], Any], integration: str = "run") -> Decision:
    """:func:`execute_flow`, driven with blocking calls."""
    return dedupe._drive(execute_flow(dedupe, claim, handler, integration))


def refused(error: BaseException, integration: str) -> Decision:
    """The verdict on a message whose key could not be derived (:func:`poison`), reported to the
    observers like every other verdict."""
    decision = poison(error)
    if observer.enabled:
        observer.decided(integration, decision.reason.value)
    return decision


def not_begun_flow(dedupe: ClientCore, exc: InvalidKey | StoreUnavailable, key: str | bytes,
                   handler: Callable[[], Any]) -> Flow[Decision]:
    """The verdict when ``key`` could not be claimed: POISON for a bad key, else Redis's outage
    (:func:`unavailable_flow`: deferred, or under ``fail_open`` the handler run unclaimed)."""
    if isinstance(exc, InvalidKey):
        return poison(exc)
    return (yield from unavailable_flow(dedupe, exc, ((key, handler),)))[0]


def begin_flow(dedupe: ClientCore, key: str | bytes, handler: Callable[[], Any], fingerprint: Any,
               wait: float, ttl: float | None = None) -> Flow[Claim | Decision]:
    """The claim (carrying ``ttl``), or the verdict when there is none: a bad key, or Redis down."""
    try:
        return (yield from dedupe.begin_flow(key, fingerprint, wait, ttl))
    except (InvalidKey, StoreUnavailable) as exc:
        return (yield from not_begun_flow(dedupe, exc, key, handler))


def decide_flow(dedupe: ClientCore, key: str | bytes, handler: Callable[[], Any], fingerprint: Any = None,
                wait: float = 0.0, integration: str = "run", ttl: float | None = None) -> Flow[Decision]:
    """Claim ``key``, run ``handler`` if acquired, store its outcome (kept ``ttl`` seconds, else
    ``result_ttl``), and return the verdict.

    The claim is ``ClientCore.begin_flow``'s (one frame: its :class:`Send` yielded as it is, the
    general cases in sub-flows); a bad key or Redis down is :func:`not_begun_flow`'s verdict; a
    duplicate is answered here; an acquired claim runs :func:`execute_flow`. With observers
    enabled, :func:`observed_flow` adds their spans around the same steps."""
    if observer.enabled:
        return (yield from observed_flow(dedupe, key, handler, fingerprint, wait, integration, ttl))
    try:
        claim = yield from dedupe.begin_flow(key, fingerprint, wait, ttl)
    except (InvalidKey, StoreUnavailable) as exc:
        return (yield from not_begun_flow(dedupe, exc, key, handler))
    if claim.outcome is not _ACQUIRED:
        return verdict_of(claim)  # type: ignore[return-value]
    return (yield from execute_flow(dedupe, claim, handler, integration))


def observed_flow(dedupe: ClientCore, key: str | bytes, handler: Callable[[], Any], fingerprint: Any,
                  wait: float, integration: str, ttl: float | None) -> Flow[Decision]:
    """:func:`decide_flow` with observers enabled: the claim in a ``dedupe.claim`` span (its
    round trip timed), the verdict reported to them."""
    with observer.span("dedupe.claim", {"dedupe.integration": integration}) as span:
        began = time.perf_counter()
        begun = yield from begin_flow(dedupe, key, handler, fingerprint, wait, ttl)
        if isinstance(begun, Claim):
            observer.round_trip("claim", time.perf_counter() - began)
            span.update(attributes(begun, integration))
    if isinstance(begun, Decision):
        decision = begun
    else:
        decision = verdict_of(begun) or (yield from execute_flow(dedupe, begun, handler, integration))
    observer.decided(integration, decision.reason.value)
    return decision


def decide(dedupe: ClaimClient, key: str | bytes, handler: Callable[[], Any], *, fingerprint: Any = None,
           wait: float = 0.0, integration: str = "run", ttl: float | None = None) -> Decision:
    """Claim ``key``, run ``handler`` if acquired, store its outcome, and return the verdict.
    Never raises for bad input, Redis or the handler's own exceptions.

    ``wait``: when another worker holds the key, wait up to this many seconds for it (see
    :meth:`~dedupe_worker._transport.ClaimClient.begin`) before answering IN_PROGRESS.
    ``integration`` names the caller in metrics and traces. ``ttl``: seconds the outcome is kept,
    instead of the client's ``result_ttl`` (the lease is unchanged); ``ValueError`` unless positive."""
    return dedupe._drive(decide_flow(dedupe, key, handler, fingerprint, wait, integration, ttl))


def run(dedupe: ClaimClient, key: str | bytes, fn: Callable[..., T], /, *args: Any,
        fingerprint: Any = None, wait: float = 0.0, ttl: float | None = None, **kwargs: Any) -> T:
    """:func:`decide` for ``fn(*args, **kwargs)``, its verdict turned into the value or the
    exception by :func:`~dedupe_worker._engine.decision.outcome`."""
    return outcome(dedupe._drive(decide_flow(dedupe, key, handler_of(fn, args, kwargs),  # type: ignore[no-any-return]
                                             fingerprint, wait, "run", ttl)))


def handler_of(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any]:
    """``fn`` bound to ``args`` and ``kwargs`` (``fn`` itself when there are none: no partial on
    the per-message path); for the sync and the asyncio ``run``."""
    return functools.partial(fn, *args, **kwargs) if args or kwargs else fn

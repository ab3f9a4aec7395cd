"""The dedupe decision, in one place for every integration.

Celery, RabbitMQ and Kafka consumers derive a key, call :func:`decide` (or
:func:`decide_many` for a batch) and map the returned :class:`Decision` to broker actions; they
contain no dedupe logic of their own. The mapping each integration implements:

========================  ===========  ==============================================
reason                    action       what the broker wrapper does
========================  ===========  ==============================================
applied, duplicate,       ACK          ack / commit past it
previously_failed
in_progress, lease_lost,  DEFER        redeliver later (delay, countdown, pause+seek);
store_unavailable                      never drop, never count as a failed attempt
handler_error             RETRY        claim released; retry with backoff, dead-letter
                                       after the integration's attempt limit
conflict, invalid_key,    DEAD_LETTER  dead-letter with the reason and error attached
undecodable,
permanent_failure,
unserializable_result
========================  ===========  ==============================================
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .claim import Claim, Outcome
from .context import bind_claim
from .deduplicator import Deduplicator
from .errors import (
    InvalidKey,
    KeyConflict,
    LeaseLost,
    ResultNotSerializable,
    StoreUnavailable,
    UndecodableMessage,
)

__all__ = ["Action", "Decision", "Reason", "decide", "decide_many", "execute", "poison", "settle"]

log = logging.getLogger(__name__)


class Action(enum.Enum):
    """What the broker wrapper must do with the message."""

    ACK = "ack"
    DEFER = "defer"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"


class Reason(str, enum.Enum):
    """Why; the value is what goes into dead-letter headers and logs."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    PREVIOUSLY_FAILED = "previously_failed"
    IN_PROGRESS = "in_progress"
    LEASE_LOST = "lease_lost"
    STORE_UNAVAILABLE = "store_unavailable"
    HANDLER_ERROR = "handler_error"
    CONFLICT = "conflict"
    INVALID_KEY = "invalid_key"
    UNDECODABLE = "undecodable"
    PERMANENT_FAILURE = "permanent_failure"
    UNSERIALIZABLE_RESULT = "unserializable_result"


_ACTION = {
    Reason.APPLIED: Action.ACK,
    Reason.DUPLICATE: Action.ACK,
    Reason.PREVIOUSLY_FAILED: Action.ACK,
    Reason.IN_PROGRESS: Action.DEFER,
    Reason.LEASE_LOST: Action.DEFER,
    Reason.STORE_UNAVAILABLE: Action.DEFER,
    Reason.HANDLER_ERROR: Action.RETRY,
    Reason.CONFLICT: Action.DEAD_LETTER,
    Reason.INVALID_KEY: Action.DEAD_LETTER,
    Reason.UNDECODABLE: Action.DEAD_LETTER,
    Reason.PERMANENT_FAILURE: Action.DEAD_LETTER,
    Reason.UNSERIALIZABLE_RESULT: Action.DEAD_LETTER,
}


@dataclass(frozen=True)
class Decision:
    """The verdict on one message. ``value`` is the handler's (or the stored) result, ``error``
    the exception behind a non-ACK verdict, ``retry_after`` the minimum seconds before a DEFER
    should come back."""

    reason: Reason
    claim: Claim | None = None
    value: Any = None
    error: BaseException | None = None
    retry_after: float = 0.0

    @property
    def action(self) -> Action:
        return _ACTION[self.reason]

    @property
    def detail(self) -> str:
        """A one-line description of ``error`` for headers and logs."""
        return "" if self.error is None else f"{type(self.error).__name__}: {self.error}"


def poison(error: BaseException) -> Decision:
    """The decision for a message whose key could not be derived."""
    reason = Reason.UNDECODABLE if isinstance(error, UndecodableMessage) else Reason.INVALID_KEY
    return Decision(reason, error=error)


def settle(claim: Claim) -> Decision | None:
    """The decision for a claim that was not ACQUIRED; ``None`` when the handler must run."""
    if claim.outcome is Outcome.ACQUIRED:
        return None
    if claim.outcome is Outcome.DUPLICATE:
        return Decision(Reason.PREVIOUSLY_FAILED if claim.failed else Reason.DUPLICATE, claim, claim.result)
    if claim.outcome is Outcome.IN_PROGRESS:
        return Decision(Reason.IN_PROGRESS, claim, retry_after=claim.retry_after)
    return Decision(Reason.CONFLICT, claim, error=KeyConflict(claim.key))


def execute(dedupe: Deduplicator, claim: Claim, handler: Callable[[], Any]) -> Decision:
    """Run ``handler`` for an ACQUIRED claim and store its outcome; never raises for the
    handler's own exceptions (they become the decision's ``error``)."""
    try:
        value = dedupe.apply(claim, handler)
    except LeaseLost as exc:
        return Decision(Reason.LEASE_LOST, claim, error=exc, retry_after=dedupe.lease)
    except ResultNotSerializable as exc:
        return Decision(Reason.UNSERIALIZABLE_RESULT, claim, error=exc)
    except StoreUnavailable as exc:
        # The handler ran but the outcome could not be stored: the claim stays held until its
        # lease runs out, then a redelivery may run the handler again (fence side effects).
        return Decision(Reason.STORE_UNAVAILABLE, claim, error=exc, retry_after=dedupe.lease)
    except Exception as exc:
        return _handler_failed(dedupe, claim, exc)
    return Decision(Reason.APPLIED, claim, value)


def _handler_failed(dedupe: Deduplicator, claim: Claim, exc: Exception) -> Decision:
    """The decision after the handler raised ``exc`` (the claim already settled)."""
    reason = Reason.PERMANENT_FAILURE if isinstance(exc, dedupe.permanent_errors) else Reason.HANDLER_ERROR
    return Decision(reason, claim, error=exc)


def _unavailable(dedupe: Deduplicator, exc: StoreUnavailable, handler: Callable[[], Any],
                 count: int = 1) -> Decision:
    """The decision when the claim could not be made; logged once per call of decide/decide_many
    (``count`` messages), not once per message."""
    if not dedupe.fail_open:
        if count:
            log.warning("Redis unavailable, deferring %d message(s): %s", count, exc)
        return Decision(Reason.STORE_UNAVAILABLE, error=exc, retry_after=1.0)
    if count:
        log.error("Redis unavailable; fail_open runs %d handler(s) WITHOUT deduplication: %s", count, exc)
    try:
        return Decision(Reason.APPLIED, value=handler())
    except Exception as err:
        return Decision(Reason.HANDLER_ERROR, error=err)


def decide(
    dedupe: Deduplicator, key: str | bytes, handler: Callable[[], Any], *, fingerprint: Any = None
) -> Decision:
    """Claim ``key``, run ``handler`` if acquired, and return the verdict. Never raises."""
    try:
        claim = dedupe.begin(key, fingerprint=fingerprint)
    except InvalidKey as exc:
        return poison(exc)
    except StoreUnavailable as exc:
        return _unavailable(dedupe, exc, handler)
    return settle(claim) or execute(dedupe, claim, handler)


def decide_many(
    dedupe: Deduplicator,
    items: Sequence[tuple[str | bytes, Any, Callable[[], Any]]],
    *,
    run_batch: Callable[[list[int]], Sequence[Any]] | None = None,
) -> list[Decision]:
    """:func:`decide` for a batch of ``(key, fingerprint, handler)``: one round trip to claim them
    all, handlers run in order (every acquired lease renewed meanwhile), one round trip to store
    the outcomes of the applied ones. Never raises.

    A key repeated inside the batch runs once: its later copies take the first copy's verdict
    (DUPLICATE when it was applied, IN_PROGRESS otherwise, so they are deferred, not dropped).

    With ``run_batch`` the per-item handlers are not called: ``run_batch(indices)`` is called once
    with the indices (into ``items``) of the acquired items and returns their values in that
    order. If it raises, every one of them gets that error (HANDLER_ERROR, claims released; or
    PERMANENT_FAILURE, stored). ``current_claim()`` is not set inside it.
    """
    decisions: dict[int, Decision] = {}
    valid: list[int] = []
    for i, (key, _, _) in enumerate(items):
        try:
            dedupe.check_key(key)
            valid.append(i)
        except InvalidKey as exc:
            decisions[i] = poison(exc)
    try:
        claims = dedupe.begin_many([items[i][0] for i in valid], fingerprints=[items[i][1] for i in valid])
    except StoreUnavailable as exc:
        for n, i in enumerate(valid):
            decisions[i] = _unavailable(dedupe, exc, items[i][2], count=0 if n else len(valid))
        return [decisions[i] for i in range(len(items))]
    acquired = [c for c in claims if c.acquired]
    applied: list[tuple[int, Claim, Any]] = []
    first_copy: dict[str, int] = {}
    with dedupe.keep_leases(acquired):
        ran = None if run_batch is None else _run_batch(
            dedupe, [(i, c) for i, c in zip(valid, claims, strict=True) if c.acquired], run_batch)
        for i, claim in zip(valid, claims, strict=True):
            if claim.acquired:
                first_copy[claim.stem] = i
                decisions[i] = ran[i] if ran is not None else _run_handler(dedupe, claim, items[i][2])
                if decisions[i].reason is Reason.APPLIED:
                    applied.append((i, claim, decisions[i].value))
            elif not (claim.outcome is Outcome.IN_PROGRESS and claim.stem in first_copy):
                decisions[i] = settle(claim) or Decision(Reason.IN_PROGRESS, claim)
        try:
            problems = dedupe.complete_each([(claim, value) for _, claim, value in applied])
        except StoreUnavailable as exc:
            for i, claim, _ in applied:
                decisions[i] = Decision(Reason.STORE_UNAVAILABLE, claim, error=exc, retry_after=dedupe.lease)
        else:
            for (i, claim, _), problem in zip(applied, problems, strict=True):
                if isinstance(problem, LeaseLost):
                    decisions[i] = Decision(Reason.LEASE_LOST, claim, error=problem, retry_after=dedupe.lease)
                elif problem is not None:
                    decisions[i] = Decision(Reason.UNSERIALIZABLE_RESULT, claim, error=problem)
    for i, claim in zip(valid, claims, strict=True):
        if i not in decisions:  # a later copy of a key acquired earlier in this batch
            first = decisions[first_copy[claim.stem]]
            if first.reason is Reason.APPLIED:
                decisions[i] = Decision(Reason.DUPLICATE, claim, first.value)
            else:
                decisions[i] = Decision(Reason.IN_PROGRESS, claim)
    return [decisions[i] for i in range(len(items))]


def _run_handler(dedupe: Deduplicator, claim: Claim, handler: Callable[[], Any]) -> Decision:
    """Run one handler of a batch with its claim current; the outcome is stored by the caller."""
    with bind_claim(claim):
        try:
            return Decision(Reason.APPLIED, claim, handler())
        except Exception as exc:
            dedupe.settle_failure(claim, exc)
            return _handler_failed(dedupe, claim, exc)


def _run_batch(dedupe: Deduplicator, acquired: list[tuple[int, Claim]],
               run_batch: Callable[[list[int]], Sequence[Any]]) -> dict[int, Decision]:
    """Run one batch handler for every acquired claim; its error is every claim's error."""
    if not acquired:
        return {}
    try:
        values = list(run_batch([i for i, _ in acquired]))
        if len(values) != len(acquired):
            raise ValueError(f"batch handler returned {len(values)} values for {len(acquired)} items")
    except Exception as exc:
        if isinstance(exc, dedupe.permanent_errors):
            for _, claim in acquired:
                dedupe.settle_failure(claim, exc)
        else:
            try:  # one round trip for the whole batch, not settle_failure per claim
                dedupe.release_many([claim for _, claim in acquired])
            except Exception as inner:  # Redis down: the leases run out by themselves
                log.warning("could not release %d claims after a batch error: %s", len(acquired), inner)
        return {i: _handler_failed(dedupe, claim, exc) for i, claim in acquired}
    return {i: Decision(Reason.APPLIED, claim, value)
            for (i, claim), value in zip(acquired, values, strict=True)}

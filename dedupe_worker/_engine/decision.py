"""The verdict on one message: :class:`Decision`, its :class:`Reason` and the :class:`Action` it asks for.

Every integration gets its verdicts from the engine (:func:`~dedupe_worker.decide`,
:func:`~dedupe_worker.decide_many`) and only maps the action to its broker; none holds
dedupe logic of its own. ``run()`` and Celery turn a verdict into a value or an exception through
the one mapping here, :func:`outcome`.

========================  ===========  ==============================================
reason                    action       what the broker wrapper does
========================  ===========  ==============================================
applied, duplicate,       ACK          ack / commit past it
previously_failed
in_progress, lease_lost,  DEFER        redeliver later (delay, countdown, pause+seek);
store_unavailable                      never drop, never count as a failed attempt
handler_error             RETRY        claim released; retry with backoff, dead-letter
                                       after ``max_attempts``
conflict, invalid_key,    DEAD_LETTER  dead-letter with the reason and error attached
undecodable,
permanent_failure,
unserializable_result,
unreadable_record
========================  ===========  ==============================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .._errors import InProgress, KeyConflict, PreviouslyFailed, UndecodableMessage
from .._protocol import Claim, Outcome

__all__ = ["Action", "Decision", "Reason", "outcome", "poison", "verdict_of"]


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
    #: A record under the key's names is not one we write (:class:`~dedupe_worker.UnreadableRecord`):
    #: nothing ran; set aside until an operator removes it (``forget --force``) or it expires.
    UNREADABLE_RECORD = "unreadable_record"


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
    Reason.UNREADABLE_RECORD: Action.DEAD_LETTER,
}

#: Reasons for which the handler ran and failed (they count as an attempt).
HANDLER_RAN = frozenset({Reason.HANDLER_ERROR, Reason.PERMANENT_FAILURE, Reason.UNSERIALIZABLE_RESULT})


_set = object.__setattr__


@dataclass(frozen=True, init=False)
class Decision:
    """The verdict on one message. ``value`` is the handler's (or the stored) result; ``error`` is
    what :func:`outcome` raises, set on every verdict but APPLIED and DUPLICATE; ``retry_after``
    the least seconds before a DEFER should come back."""

    reason: Reason
    claim: Claim | None = None
    value: Any = None
    error: BaseException | None = None
    retry_after: float = 0.0

    def __init__(self, reason: Reason, claim: Claim | None = None, value: Any = None,
                 error: BaseException | None = None, retry_after: float = 0.0) -> None:
        # One per message: its __dict__ built whole, as Claim's (the frozen dataclass __init__
        # sets each field with object.__setattr__); the fields and defaults are the ones above.
        _set(self, "__dict__", {"reason": reason, "claim": claim, "value": value, "error": error,
                                "retry_after": retry_after})

    @property
    def action(self) -> Action:
        return _ACTION[self.reason]

    @property
    def token(self) -> int:
        """The fencing token of the claim behind the verdict (0 when there was none)."""
        return self.claim.token if self.claim is not None else 0

    @property
    def detail(self) -> str:
        """A one-line description of ``error`` for headers and logs."""
        return "" if self.error is None else f"{type(self.error).__name__}: {self.error}"


def outcome(decision: Decision) -> Any:
    """The value of an APPLIED or DUPLICATE verdict; raise the verdict's error for any other.

    The one mapping from verdict to exception, shared by ``run()``, ``@idempotent`` and Celery:
    ``InProgress``, ``KeyConflict``, ``PreviouslyFailed``, ``LeaseLost``, ``StoreUnavailable``
    (``UnreadableRecord``), ``ResultNotSerializable``, ``InvalidKey``, or the handler's own exception.
    """
    if decision.error is None:
        return decision.value
    raise decision.error


def poison(error: BaseException) -> Decision:
    """The decision for a message whose key could not be derived."""
    reason = Reason.UNDECODABLE if isinstance(error, UndecodableMessage) else Reason.INVALID_KEY
    return Decision(reason, error=error)


def verdict_of(claim: Claim) -> Decision | None:
    """The decision for a claim that was not ACQUIRED; ``None`` when the handler must run."""
    if claim.outcome is Outcome.ACQUIRED:
        return None
    if claim.outcome is Outcome.DUPLICATE:
        if claim.failed:
            return Decision(Reason.PREVIOUSLY_FAILED, claim, error=PreviouslyFailed(claim.key, claim.error))
        return Decision(Reason.DUPLICATE, claim, claim.result)
    if claim.outcome is Outcome.IN_PROGRESS:
        return in_progress(claim.key, claim.retry_after, claim)
    if claim.outcome is Outcome.UNREADABLE:
        return Decision(Reason.UNREADABLE_RECORD, claim, error=claim.error)
    return Decision(Reason.CONFLICT, claim, error=KeyConflict(claim.key))


def in_progress(key: str, retry_after: float, claim: Claim | None = None) -> Decision:
    """IN_PROGRESS: the key is held by a live lease (``claim`` when we asked Redis)."""
    token = claim.token if claim is not None else 0
    return Decision(Reason.IN_PROGRESS, claim, error=InProgress(key, retry_after, token), retry_after=retry_after)

"""Send-side checks: whether a producer should publish work for a key, in one round trip.

``send.lua`` reads the key's claim and outcome, and the *send mark* a producer leaves when it
publishes (``<namespace>:{<key>}:sent``: the task id it sent, until when that counts as queued,
the payload fingerprint). :func:`send_call` builds the call and :func:`send_answer` reads the
reply, without I/O; the round trips (``check_send``, and ``unsend``, which takes back the mark of a
send whose publish raised) are the transport's (:mod:`dedupe_worker._transport.sending`).

The answer is a hint. A mark lives ``ttl`` seconds as "queued", then only names the task; the
worker's claim, not this check, is what makes the work run once. When the message is lost or the
worker dies before it claims, the next send after ``ttl`` publishes again; once a worker has
claimed the key since the mark, a send publishes as soon as no live lease holds it (the claim was
released after a retryable failure, or its worker died).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .calls import Call, _claim_reply
from .claim import Claim
from .codec import ClaimCodec, Request
from .layout import KeyLayout

__all__ = ["SendAnswer", "SendState", "send_answer", "send_call"]


class SendState(enum.Enum):
    """What ``send.lua`` found for a key."""

    #: Nothing holds the key: publish (the mark now records this send's task id).
    PUBLISH = 1
    #: An outcome is stored: do not publish; :attr:`SendAnswer.claim` carries it.
    DONE = 2
    #: A live lease holds the key and a mark names the task sent for it: do not publish.
    RUNNING = 3
    #: The claim, the outcome or a live mark carries another payload fingerprint.
    CONFLICT = 4
    #: A live mark, not claimed yet: the task sent for it waits in the queue; do not publish.
    QUEUED = 5


_STATES = {int(s.value): s for s in SendState}


@dataclass(frozen=True)
class SendAnswer:
    """``send.lua``'s answer for one key.

    ``task_id`` is the id of the task sent for the key (this send's for PUBLISH), ``""`` when no
    mark names one (a DONE key sent without this check, or whose mark expired). ``claim`` is a
    DUPLICATE :class:`Claim` with the stored outcome for DONE (:meth:`Deduplicator.answer` turns it
    into the value or the error). ``remaining`` is, in seconds, how long the lease (RUNNING) or
    the mark (PUBLISH, QUEUED) still runs.
    """

    state: SendState
    key: str
    task_id: str = ""
    claim: Claim | None = None
    remaining: float = 0.0


def send_call(request: Request, task_id: str, ttl_ms: int, keep_ms: int) -> Call:
    """The ``send.lua`` call for ``request`` recording ``task_id`` for ``ttl_ms``, kept ``keep_ms``
    longer to name the task after completion."""
    stem = request.stem
    return ("send", (*KeyLayout.records(stem), KeyLayout.sent(stem)),
            (task_id, max(1, ttl_ms), max(0, keep_ms), request.fingerprint))


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)


def send_answer(codec: ClaimCodec, request: Request, reply: Any) -> SendAnswer:
    """Read ``send.lua``'s reply (``{code, token, a, b, task_id}``) for ``request``."""
    code, token, a, b, task_id = (list(reply) + [None] * 5)[:5]
    state = _STATES[int(code)]
    if state is SendState.DONE:
        claim = codec._claim(request, _claim_reply(2, token, a, b))
        return SendAnswer(state, request.key, _text(task_id), claim)
    if state is SendState.CONFLICT:
        return SendAnswer(state, request.key)
    return SendAnswer(state, request.key, _text(task_id), remaining=int(a or 0) / 1000)


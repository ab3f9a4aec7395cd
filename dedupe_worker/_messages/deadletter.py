"""Headers written on every dead-lettered message, by the RabbitMQ and Kafka consumers alike.

The replay command reads them back to know why a message was dead-lettered and where it came
from; keep the names stable. Values are text.
"""

from __future__ import annotations

import enum
from typing import Protocol

from .._protocol import Claim

__all__ = [
    "ATTEMPTS",
    "ERROR",
    "KEY",
    "ORIGINAL_EXCHANGE",
    "ORIGINAL_OFFSET",
    "ORIGINAL_PARTITION",
    "ORIGINAL_QUEUE",
    "ORIGINAL_ROUTING_KEY",
    "ORIGINAL_TOPIC",
    "REASON",
    "REPLAYED",
    "Verdict",
    "dead_letter_headers",
]

#: A :class:`~dedupe_worker.Reason` value: why the message was dead-lettered.
REASON = "x-dedupe-reason"
#: ``ExceptionType: message`` of the error behind it (cut to 1,000 characters).
ERROR = "x-dedupe-error"
#: The idempotency key derived for the message, when one could be derived.
KEY = "x-dedupe-key"
#: How many times the handler was attempted.
ATTEMPTS = "x-dedupe-attempts"
#: Where a Kafka record came from.
ORIGINAL_TOPIC = "x-dedupe-original-topic"
ORIGINAL_PARTITION = "x-dedupe-original-partition"
ORIGINAL_OFFSET = "x-dedupe-original-offset"
#: Where an AMQP message came from.
ORIGINAL_QUEUE = "x-dedupe-original-queue"
ORIGINAL_EXCHANGE = "x-dedupe-original-exchange"
ORIGINAL_ROUTING_KEY = "x-dedupe-original-routing-key"
#: Set by the replay on a message it moved back to work: how many times it was replayed.
REPLAYED = "x-dedupe-replayed"

MAX_ERROR_LENGTH = 1000


class Verdict(Protocol):
    """What the headers are written from: an engine :class:`~dedupe_worker.Decision` (named by
    its shape, so this layer does not depend on the engine)."""

    @property
    def reason(self) -> enum.Enum: ...

    @property
    def claim(self) -> Claim | None: ...

    @property
    def detail(self) -> str: ...


def dead_letter_headers(decision: Verdict, *, key: str | None = None, attempts: int = 0,
                        **origin: str) -> dict[str, str]:
    """Headers for a dead-lettered message: reason, error, key, attempts, plus ``origin``
    (pass the ``ORIGINAL_*`` names as keyword arguments without the ``x-dedupe-`` prefix,
    e.g. ``original_topic="payments"``)."""
    headers = {REASON: decision.reason.value, ERROR: decision.detail[:MAX_ERROR_LENGTH]}
    if key is None and decision.claim is not None:
        key = decision.claim.key
    if key is not None:
        headers[KEY] = key
    if attempts:
        headers[ATTEMPTS] = str(attempts)
    for name, value in origin.items():
        headers["x-dedupe-" + name.replace("_", "-")] = str(value)
    return headers

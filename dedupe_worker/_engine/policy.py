"""Retry and deferral options, with the same names and defaults in every integration, and the
backoff with full jitter that every integration's deferrals and retries wait by."""

from __future__ import annotations

import random

__all__ = ["RetryPolicy", "backoff"]


def backoff(attempt: int, *, base: float = 0.5, cap: float = 60.0, floor: float = 0.0) -> float:
    """Seconds to wait before attempt ``attempt`` (1-based): ``floor`` plus a random value in
    ``[0, min(cap, base * 2 ** (attempt - 1))]`` ("full jitter").

    ``floor`` is a least wait added in front (0 by default).
    """
    ceiling = min(cap, base * (2 ** max(0, attempt - 1)))
    return floor + random.uniform(0.0, ceiling)


class RetryPolicy:
    """Mixed into ``IdempotentTask``, ``DedupeConsumer`` and ``DedupeKafkaConsumer``; each option
    is a class attribute, so a subclass or a keyword argument may set it."""

    #: Handler attempts before a failing message is dead-lettered (Celery: fails for good).
    max_attempts: int = 5
    #: Backoff between handler attempts: full jitter over ``retry_base * 2 ** (attempt - 1)``
    #: seconds, capped at ``retry_cap``.
    retry_base: float = 1.0
    retry_cap: float = 60.0
    #: Backoff of deferrals (in progress elsewhere, lease lost, Redis down), which never count as
    #: an attempt: full jitter over ``defer_base * 2 ** (deferrals - 1)``, capped at ``defer_cap``
    #: and at the holder's remaining lease. It starts at tens of milliseconds: a live holder
    #: usually finishes long before its lease would run out, and a dead one is taken over as soon
    #: as its lease does.
    defer_base: float = 0.05
    defer_cap: float = 30.0
    #: Seconds a copy of in-flight work may wait on its key (woken when the holder stores its
    #: outcome or releases) before it is deferred, where the integration can wait without
    #: blocking other messages (Celery's task body, the RabbitMQ consumer's waiting room, a
    #: paused Kafka partition). 0 turns waiting off.
    defer_wait: float = 5.0

    def set_options(self, **options: float | None) -> None:
        """Set each option given (``max_attempts=3``, ``defer_wait=0``, ...) on this instance;
        ``None`` keeps the class's value. The integrations' keyword arguments go through here."""
        for name, value in options.items():
            if not hasattr(RetryPolicy, name) or callable(getattr(RetryPolicy, name)):
                raise TypeError(f"unknown retry option {name!r}")
            if value is not None:
                setattr(self, name, value)

    def retry_delay(self, attempt: int) -> float:
        """Seconds before handler attempt ``attempt + 1``."""
        return backoff(attempt, base=self.retry_base, cap=self.retry_cap)

    def defer_delay(self, deferrals: int, holder_left: float | None = None) -> float:
        """Seconds before a message deferred ``deferrals`` times (this one included) comes back:
        the backoff, but never later than just after the holder's lease (``holder_left``
        seconds) can have run out."""
        delay = backoff(deferrals, base=self.defer_base, cap=self.defer_cap)
        return delay if holder_left is None else min(delay, holder_left + 0.01)

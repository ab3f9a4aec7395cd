"""Retry and deferral options on the integrations (those of :class:`~.options.ConsumerOptions`), and the
backoff with full jitter that every integration's deferrals and retries wait by."""

from __future__ import annotations

import random

from .options import RETRY_OPTIONS, ConsumerOptions

__all__ = ["RetryPolicy", "backoff"]


def backoff(attempt: int, *, base: float = 0.5, cap: float = 60.0, floor: float = 0.0) -> float:
    """Seconds to wait before attempt ``attempt`` (1-based): ``floor`` plus a random value in
    ``[0, min(cap, base * 2 ** (attempt - 1))]`` ("full jitter").

    ``floor`` is a least wait added in front (0 by default).
    """
    ceiling = min(cap, base * (2 ** max(0, attempt - 1)))
    return floor + random.uniform(0.0, ceiling)


class RetryPolicy:
    """Mixed into ``IdempotentTask``, ``DedupeConsumer``, ``DedupeKafkaConsumer`` and the Dramatiq
    and FastStream middlewares: the retry and deferral options of :class:`~.options.ConsumerOptions`
    (their defaults and meaning are written there) as attributes, and the delays they give."""

    max_attempts: int = ConsumerOptions.max_attempts
    retry_base: float = ConsumerOptions.retry_base
    retry_cap: float = ConsumerOptions.retry_cap
    defer_base: float = ConsumerOptions.defer_base
    defer_cap: float = ConsumerOptions.defer_cap
    defer_wait: float = ConsumerOptions.defer_wait

    def use(self, options: ConsumerOptions) -> None:
        """Take the retry and deferral options of ``options`` on this instance."""
        for name in RETRY_OPTIONS:
            setattr(self, name, getattr(options, name))

    def retry_delay(self, attempt: int) -> float:
        """Seconds before handler attempt ``attempt + 1``."""
        return backoff(attempt, base=self.retry_base, cap=self.retry_cap)

    def defer_delay(self, deferrals: int, holder_left: float | None = None) -> float:
        """Seconds before a message deferred ``deferrals`` times (this one included) comes back:
        the backoff, but never later than just after the holder's lease (``holder_left``
        seconds) can have run out."""
        delay = backoff(deferrals, base=self.defer_base, cap=self.defer_cap)
        return delay if holder_left is None else min(delay, holder_left + 0.01)

"""Retry and deferral options, with the same names and defaults in every integration."""

from __future__ import annotations

from ..backoff import backoff

__all__ = ["RetryPolicy"]


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
    #: an attempt: full jitter over ``defer_base * 2 ** (deferrals - 1)``, capped at ``defer_cap``,
    #: added to the other worker's remaining lease.
    defer_base: float = 0.5
    defer_cap: float = 30.0

    def retry_delay(self, attempt: int) -> float:
        """Seconds before handler attempt ``attempt + 1``."""
        return backoff(attempt, base=self.retry_base, cap=self.retry_cap)

    def defer_delay(self, deferrals: int, floor: float = 0.0) -> float:
        """Seconds before a message deferred ``deferrals`` times (this one included) comes back."""
        return backoff(deferrals, base=self.defer_base, cap=self.defer_cap, floor=floor)

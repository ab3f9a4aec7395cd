"""When to try a finishing write again: the retry policy of ``complete``, ``fail`` and ``release``.

Sans-I/O: :class:`FinishRetry` says which store errors are worth another attempt and how long to
wait before it; the sync client (:mod:`~dedupe_worker._transport.client`) sleeps with ``time.sleep`` and the asyncio
client with ``asyncio.sleep``, both driven by the same :class:`FinishAttempts`.

Why retry a finishing write at all? Deferring a message whose handler already ran means running
it again once its lease is over. A transient error (a reconnect, a Redis Cluster slot migration
answering ``TRYAGAIN``/``ASK``/``MOVED``, ``LOADING`` after a restart, ``BUSY`` while a script
runs long, ``OOM`` at ``maxmemory``) usually clears in well under a second, and the lease is
still ours: the renewer keeps extending it while we retry. Retrying is safe because every
finishing script checks the fencing token: ``complete.lua`` answers 1 again for an outcome it
already stored under the same token (a reply lost to a reset), and a write arriving after the
lease passed to another worker is refused (LEASE_LOST), never applied.

How long: until the lease is nearly spent. The lease's end is estimated from the last moment it
is known to have been extended (the renewer's last successful round, or, when the renewer has
not run since, the start of the write less one renewal interval), plus the lease, less a
reserve. Past that estimate another worker may already hold the key, so the message is deferred
as before. Claims are never retried this way: deferring a claim runs nothing twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    MovedError,
    OutOfMemoryError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["TRANSIENT_REPLIES", "FinishAttempts", "FinishRetry", "transient"]

#: Error replies (their first word) that say "not now" rather than "never".
TRANSIENT_REPLIES = ("TRYAGAIN", "ASK", "MOVED", "LOADING", "BUSY", "OOM", "CLUSTERDOWN", "MASTERDOWN")

_TRANSIENT_TYPES = (RedisConnectionError, RedisTimeoutError, TryAgainError, AskError, MovedError, BusyLoadingError,
                    ClusterDownError, SlotNotCoveredError, OutOfMemoryError, ConnectionError, TimeoutError)


def transient(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from (``StoreUnavailable`` chains the
    redis-py error it wraps), is a store error that may clear by itself.

    redis-py's cluster client retries ``TRYAGAIN`` itself about 16 times over ~0.4 s and then
    raises ``ClusterError("TTL exhausted.")``: that counts as transient too."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, _TRANSIENT_TYPES):
            return True
        if isinstance(exc, ClusterError) and "TTL exhausted" in str(exc):
            return True
        if isinstance(exc, ResponseError) and (str(exc).split(" ", 1)[0].upper() in TRANSIENT_REPLIES
                                               or "OOM command not allowed" in str(exc)):
            return True
        exc = exc.__cause__
        seen += 1
    return False


@dataclass(frozen=True)
class FinishRetry:
    """The retry policy of finishing writes for leases of ``lease`` seconds renewed every
    ``renew_interval`` seconds: exponential backoff from ``first_delay`` up to ``max_delay``,
    while the lease's estimated end, less ``reserve`` (default a tenth of the lease, at least
    50 ms), is not reached."""

    lease: float
    renew_interval: float
    first_delay: float = 0.01
    max_delay: float = 0.25
    reserve: float | None = None

    def attempts(self, started: float) -> FinishAttempts:
        """The attempts of one write first sent at ``started`` (``time.monotonic()``)."""
        return FinishAttempts(self, started)

    def delays(self) -> Iterator[float]:
        """The backoff sequence: ``first_delay``, doubling, capped at ``max_delay``."""
        delay = self.first_delay
        while True:
            yield delay
            delay = min(self.max_delay, delay * 2)

    @property
    def spare(self) -> float:
        return self.reserve if self.reserve is not None else max(0.05, self.lease / 10)

    def lease_end(self, started: float, renewed_at: float) -> float:
        """The estimated end of a lease tracked since before ``started`` (or claimed within the last
        renewal interval), last extended by a renewal round begun at ``renewed_at``."""
        return max(started - self.renew_interval, renewed_at) + self.lease


class FinishAttempts:
    """The state of one finishing write's attempts: ask :meth:`after` each time one failed."""

    def __init__(self, policy: FinishRetry, started: float) -> None:
        self.policy = policy
        self.started = started
        self.failures = 0
        self._delays = policy.delays()

    def after(self, error: BaseException, now: float, renewed_at: float) -> float | None:
        """Seconds to wait before the next attempt after ``error``, or ``None``: give up (the
        error is not transient, or the lease is nearly spent)."""
        if not transient(error):
            return None
        self.failures += 1
        delay = next(self._delays)
        if now + delay >= self.policy.lease_end(self.started, renewed_at) - self.policy.spare:
            return None
        return delay

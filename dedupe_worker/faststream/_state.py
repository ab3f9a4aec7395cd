"""What the FastStream middleware keeps between messages, apart from how it handles them, so that
the single-message path (:mod:`._middleware`) and the batch path (:mod:`._batch`) share it without
importing each other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._engine import Hooks, RetryPolicy
from .._messages.envelope import Envelope
from .._messages.ttl import TTL_HEADER, TtlHeader
from ..asyncio import AsyncClaimClient
from ..keys import KeyStrategy, body_fingerprint

__all__ = ["MAX_TRACKED_DEFERRALS", "MiddlewareState"]

#: Deferral counts kept per key (they only grow the backoff); past this many keys, they start over.
MAX_TRACKED_DEFERRALS = 10_000


class MiddlewareState(Hooks, RetryPolicy):
    """The middleware's options and its per-key deferral counts (in memory: a restarted consumer
    starts every backoff over, which only makes its first retry sooner)."""

    #: The reader of ``ttl_header`` (:meth:`ttl_of`), made again when the name changes.
    _ttl_reader: TtlHeader | None = None

    def __init__(self, dedupe: AsyncClaimClient, *, key: KeyStrategy | None = None,
                 fingerprint: Callable[[Envelope], Any] | None = body_fingerprint,
                 dead_letter_producer: Any = None, defer_base: float | None = None, defer_cap: float | None = None,
                 defer_wait: float | None = None, ttl_header: str | None = TTL_HEADER) -> None:
        self.dedupe = dedupe
        self.key = key
        self.fingerprint = fingerprint
        #: The header holding a message's ttl in seconds (``None``: not read).
        self.ttl_header = ttl_header
        self.dead_letter_producer = dead_letter_producer
        self.set_options(defer_base=defer_base, defer_cap=defer_cap, defer_wait=defer_wait)
        self._deferrals: dict[str, int] = {}

    def ttl_of(self, headers: Any) -> float | None:
        """The ttl in ``headers`` under ``ttl_header`` (``None`` when unset or absent), as
        :func:`~dedupe_worker._messages.ttl.header_ttl` reads it, by one
        :class:`~dedupe_worker._messages.ttl.TtlHeader` kept across messages. Raises
        :class:`~dedupe_worker.UndecodableMessage` for a value that is not a positive number."""
        reader = self._ttl_reader = TtlHeader.of(self.ttl_header, self._ttl_reader)
        return reader(headers) if reader is not None else None

    def next_deferral(self, key: str | None) -> int:
        """Count one more deferral of ``key`` (kept while the key keeps being deferred)."""
        deferrals = self._deferrals.pop(key, 0) + 1 if key is not None else 1
        if key is not None:
            if len(self._deferrals) >= MAX_TRACKED_DEFERRALS:
                self._deferrals.clear()
            self._deferrals[key] = deferrals
        return deferrals

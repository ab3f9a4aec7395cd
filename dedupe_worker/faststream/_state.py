"""What the FastStream middleware keeps between messages, apart from how it handles them, so that
the single-message path (:mod:`._middleware`) and the batch path (:mod:`._batch`) share it without
importing each other."""

from __future__ import annotations

from typing import Any

from .._engine import FASTSTREAM_RENAMED, ConsumerOptions, Decision, Hooks, Identify, Identity, RetryPolicy
from .._messages.envelope import Envelope
from ..asyncio import AsyncClaimClient
from ..keys import KeyStrategy

__all__ = ["MAX_TRACKED_DEFERRALS", "OPTION_NAMES", "MiddlewareState"]

#: The options of :class:`~dedupe_worker.ConsumerOptions` the middleware takes as keywords.
OPTION_NAMES = ("key_strategy", "fingerprint", "ttl_header", "defer_base", "defer_cap", "defer_wait")

#: Deferral counts kept per key (they only grow the backoff); past this many keys, they start over.
MAX_TRACKED_DEFERRALS = 10_000


class MiddlewareState(Hooks, RetryPolicy):
    """The middleware's options and its per-key deferral counts (in memory: a restarted consumer
    starts every backoff over, which only makes its first retry sooner)."""

    def __init__(self, dedupe: AsyncClaimClient, *, options: ConsumerOptions | None = None,
                 dead_letter_producer: Any = None, **keywords: Any) -> None:
        self.dedupe = dedupe
        #: The options every integration shares (``options`` with the keywords on top; ``key``
        #: is the old name of ``key_strategy``).
        self.options = options = ConsumerOptions.of(options, names=OPTION_NAMES, renamed=FASTSTREAM_RENAMED, **keywords)
        self.use(options)
        self.dead_letter_producer = dead_letter_producer
        self._deferrals: dict[str, int] = {}
        # One per default key strategy: FastStream's default key depends on the broker.
        self._identify: dict[KeyStrategy | None, Identify[Envelope]] = {}

    def identify(self, envelope: Envelope, default_key: KeyStrategy) -> Identity | Decision:
        """``envelope``'s :class:`~dedupe_worker._engine.Identity` or its refusal, by the
        ``key_strategy`` option, else the broker's ``default_key``."""
        strategy = self.options.key_strategy or default_key
        identify = self._identify.get(strategy)
        if identify is None:
            identify = self._identify[strategy] = Identify("faststream", strategy, self.options.fingerprint,
                                                           ttl_header=self.options.ttl_header)
        return identify(envelope)

    def next_deferral(self, key: str | None) -> int:
        """Count one more deferral of ``key`` (kept while the key keeps being deferred)."""
        deferrals = self._deferrals.pop(key, 0) + 1 if key is not None else 1
        if key is not None:
            if len(self._deferrals) >= MAX_TRACKED_DEFERRALS:
                self._deferrals.clear()
            self._deferrals[key] = deferrals
        return deferrals

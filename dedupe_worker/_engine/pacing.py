"""How many messages the batch engine claims at a time, and in how many calls: sized from what
handlers took so far.

A chunk should take about ``flush_after`` of handler time, so that finished outcomes wait at
most that long to be stored, and claims are taken only for work about to start (see
:mod:`dedupe_worker._engine.batch`). A streamed chunk's calls should each carry about
:data:`STREAM_WORK` of it, so that the handlers of one call run while Redis claims the next.
"""

from __future__ import annotations

import math

__all__ = ["FLUSH_AFTER", "STREAM_STEP", "STREAM_WORK", "Pacing"]

#: Default bound, in seconds of handler time, on finished work whose outcome is not stored yet.
FLUSH_AFTER = 0.005
#: The fewest claims per ``claim.lua`` call of a streamed chunk.
STREAM_STEP = 32
#: Seconds of handler time a streamed call's claims should carry at least. Each call's reply is
#: read, handed on and answered on its own, which costs the client a fixed price a call and Redis a
#: script call's set-up: worth it only where there is handler work to run while Redis claims
#: (docs/performance.md, bench.kafka_cpu).
STREAM_WORK = 0.001


class Pacing:
    """Remembers how long handlers take, and how many claims start one, to size the next chunk
    so that its handlers should take about ``flush_after``.

    A consumer keeps one across batches, so a steady stream of fast handlers (or of duplicates,
    which run no handler) claims each whole batch in one round trip. With nothing seen yet a
    chunk is one message, and it doubles while its claims run no handler.
    """

    def __init__(self, flush_after: float = FLUSH_AFTER) -> None:
        if flush_after < 0:
            raise ValueError("flush_after must not be negative")
        self.flush_after = flush_after
        #: Moving average of one handler's run time, in seconds (``None``: none seen yet): each
        #: handler's time weighs half, ``(mean + seconds) / 2``, as the batch engine's handler
        #: loop (``_Batch.call_each``) keeps it.
        self.mean: float | None = None
        #: Moving average of the share of claims that were ACQUIRED (and so ran a handler).
        self.acquired = 1.0

    def claimed(self, claims: int, acquired: int) -> None:
        """``claims`` were made, of which ``acquired`` will run a handler."""
        if claims:
            self.acquired = (self.acquired + acquired / claims) / 2

    def per_message(self) -> float:
        """Handler seconds a claimed message should take: a handler's mean (``flush_after`` while
        none was seen) times the share of claims that run one."""
        return (self.mean if self.mean is not None else self.flush_after) * self.acquired

    def chunk(self, remaining: int) -> int:
        """How many of ``remaining`` messages to claim next (at least one, when any remain)."""
        if remaining <= 1:
            return remaining
        per_message = self.per_message()
        if per_message * remaining <= self.flush_after:  # also after a long run of duplicates, when
            return remaining  # ``acquired`` is so small that flush_after / per_message overflows
        return max(1, min(remaining, int(self.flush_after / per_message)))

    def step(self, claims: int) -> int:
        """How many of a streamed chunk's ``claims`` to ask for per ``claim.lua`` call: at least
        :data:`STREAM_STEP`, and enough that their handlers should take :data:`STREAM_WORK`; the
        whole chunk when all of them should take less (fast handlers, or duplicates, which run
        none: nothing to overlap with Redis' work)."""
        per_message = self.per_message()
        if per_message * claims <= STREAM_WORK:  # also when it is 0 (``acquired`` halved to 0)
            return max(1, claims)
        return max(STREAM_STEP, math.ceil(STREAM_WORK / per_message))

"""One task per event loop that keeps every live claim's lease from running out.

A deliberate twin of :mod:`dedupe_worker._transport.renewer` (a thread there, a task per loop
here): a round is one flow both drive (``ClientCore.renewal_flow``), and when a refusal is a loss
is shared (:mod:`~dedupe_worker._protocol.leases`), as is the fork hook.

The asyncio form of :class:`~dedupe_worker._transport.renewer.LeaseRenewer`: claims are tracked per
running loop, and each loop gets one renewer task that wakes every ``interval`` seconds and
extends all of that loop's tracked leases in one batched ``renew.lua`` round trip. A thousand
coroutines in flight cost one task and one round trip per interval, never a task per message.
The task starts on the first ``track`` in a loop and ends by itself once that loop holds no
lease (the next ``track`` starts another), or when :meth:`AsyncLeaseRenewer.aclose` cancels it.

A claim that renewal finds no longer ours is marked lost; completing it then raises
:class:`~dedupe_worker.LeaseLost`. If Redis is unreachable the task logs and keeps trying; the
lease may then run out and another worker take over, which the fencing token makes safe. If the
process dies, nothing renews: the leases run out and the keys are claimed again. A forked child
starts with no tracked lease and no task (an event loop does not survive ``fork()`` in use).
When a refused renewal counts as lost is decided by :class:`~dedupe_worker._protocol.leases.LeaseBook`,
shared with the thread renewer.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._protocol import Lease, LeaseBook, Renewed, forget_after_fork

__all__ = ["AsyncLeaseRenewer"]

log = logging.getLogger(__name__)


@dataclass
class _LoopLeases:
    """The leases tracked in one event loop, and the task renewing them."""

    book: LeaseBook = field(default_factory=LeaseBook)
    task: asyncio.Task[None] | None = None
    #: ``time.monotonic()`` at the start of the last renewal round Redis answered.
    renewed_at: float = float("-inf")


class AsyncLeaseRenewer:
    """Renews the leases of tracked claims, identified by ``(stem, token)``, one task per loop.

    ``track`` and ``untrack`` are plain methods (they never wait) and must be called from a
    coroutine running in the loop that holds the claim."""

    def __init__(self, renew_round: Callable[[list[Lease], Callable[[Lease], bool]], Awaitable[Renewed | None]],
                 interval: float) -> None:
        #: Runs one round (the client's ``renewal_flow``, awaited): ``(began, lost)`` or ``None``.
        self.renew_round = renew_round
        self.interval = interval
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopLeases] = weakref.WeakKeyDictionary()
        forget_after_fork(self)

    def _leases(self) -> _LoopLeases:
        loop = asyncio.get_running_loop()
        leases = self._loops.get(loop)
        if leases is None:
            leases = self._loops[loop] = _LoopLeases()
        return leases

    def track(self, stem: str, token: int) -> None:
        """Keep this claim's lease alive from now on; starts the loop's renewer task if none runs."""
        leases = self._leases()
        leases.book.track((stem, token))
        if leases.task is None or leases.task.done():
            leases.task = asyncio.get_running_loop().create_task(self._renew_while_held(leases),
                                                                 name="dedupe-lease-renewer")

    def untrack(self, stem: str, token: int) -> None:
        """Stop renewing this claim (once every holder that tracked it has untracked it)."""
        self._leases().book.untrack((stem, token))

    def track_many(self, leases: Iterable[Lease]) -> None:
        """:meth:`track` for each ``(stem, token)`` (the batch engine's)."""
        for stem, token in leases:
            self.track(stem, token)

    def track_group(self, claims: Sequence[Any]) -> int:
        """Keep the leases of ``claims`` (a batch's) alive as one group until
        :meth:`untrack_group`; returns its id (see :class:`~dedupe_worker._protocol.leases.LeaseBook`)."""
        leases = self._leases()
        group = leases.book.track_group(claims)
        if leases.task is None or leases.task.done():
            leases.task = asyncio.get_running_loop().create_task(self._renew_while_held(leases),
                                                                 name="dedupe-lease-renewer")
        return group

    def settle_group(self, group: int) -> None:
        """:meth:`settle` for every claim of ``group``."""
        leases = self._loops.get(asyncio.get_running_loop())
        if leases is not None:
            leases.book.settle_group(group)

    def untrack_group(self, group: int) -> None:
        """Stop renewing the claims of ``group``."""
        self._leases().book.untrack_group(group)

    def untrack_many(self, leases: Iterable[Lease]) -> None:
        """:meth:`untrack` for each ``(stem, token)``."""
        for stem, token in leases:
            self.untrack(stem, token)

    def is_lost(self, stem: str, token: int) -> bool:
        """Whether renewal found the claim taken by another token (this loop's claims)."""
        leases = self._loops.get(asyncio.get_running_loop())
        return leases is not None and (stem, token) in leases.book.lost

    def settle(self, claims: Iterable[Lease]) -> None:
        """The completion or release of ``claims`` (``(stem, token)``) is being sent: until they
        are untracked, a refused renewal of one of them is not a loss (see
        :mod:`~dedupe_worker._protocol.leases`)."""
        leases = self._loops.get(asyncio.get_running_loop())
        if leases is not None:
            leases.book.settle(claims)

    def last_renewal(self) -> float:
        """``time.monotonic()`` at the start of the running loop's last answered renewal round."""
        leases = self._loops.get(asyncio.get_running_loop())
        return leases.renewed_at if leases is not None else float("-inf")

    def tasks(self) -> list[asyncio.Task[None]]:
        """The renewer tasks running now (at most one per event loop)."""
        return [leases.task for leases in list(self._loops.values())
                if leases.task is not None and not leases.task.done()]

    async def renew_now(self) -> None:
        """Renew every lease tracked in the running loop once, in one round trip."""
        leases = self._leases()
        renewed = await self.renew_round(leases.book.due(), leases.book.refused)
        if renewed is not None:  # lost leases are marked in the book (and logged) by the round
            leases.renewed_at = renewed[0]

    async def _renew_while_held(self, leases: _LoopLeases) -> None:
        loop = asyncio.get_running_loop()
        try:
            while leases.book.holds():
                await asyncio.sleep(self.interval)
                try:
                    await self.renew_now()
                except Exception:  # never let the renewer die silently
                    log.exception("lease renewer failed; continuing")
        finally:
            # nothing held, or cancelled: forget this loop (its task would keep a closed loop
            # alive); a later track starts afresh
            if self._loops.get(loop) is leases:
                del self._loops[loop]

    def _forget_after_fork(self) -> None:
        """In a forked child: no tracked lease and no task (an event loop does not survive
        ``fork()`` in use)."""
        self._loops = weakref.WeakKeyDictionary()

    async def aclose(self) -> None:
        """Cancel the renewer task of the running loop (and ask other loops to cancel theirs)."""
        current = asyncio.get_running_loop()
        for loop, leases in list(self._loops.items()):
            task = leases.task
            if task is None or task.done():
                continue
            if loop is current:
                task.cancel()
                await asyncio.wait({task})  # our own cancellation still propagates
            elif not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)


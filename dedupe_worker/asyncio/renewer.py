"""One task per event loop that keeps every live claim's lease from running out.

The asyncio form of :class:`~dedupe_worker.protocol.renewer.LeaseRenewer`: claims are tracked per
running loop, and each loop gets one renewer task that wakes every ``interval`` seconds and
extends all of that loop's tracked leases in one batched ``renew.lua`` round trip. A thousand
coroutines in flight cost one task and one round trip per interval, never a task per message.
The task starts on the first ``track`` in a loop and ends by itself once that loop holds no
lease (the next ``track`` starts another), or when :meth:`AsyncLeaseRenewer.aclose` cancels it.

A claim that renewal finds no longer ours is marked lost; completing it then raises
:class:`~dedupe_worker.LeaseLost`. If Redis is unreachable the task logs and keeps trying; the
lease may then run out and another worker take over, which the fencing token makes safe. If the
process dies, nothing renews: the leases run out and the keys are claimed again.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import StoreUnavailable
from ..observe.base import current as observer
from .store import AsyncRedisStore

__all__ = ["AsyncLeaseRenewer"]

log = logging.getLogger(__name__)


@dataclass
class _LoopLeases:
    """The leases tracked in one event loop, and the task renewing them."""

    live: dict[tuple[str, int], int] = field(default_factory=dict)  # (stem, token) -> how many holders
    lost: set[tuple[str, int]] = field(default_factory=set)
    #: Claims whose completion or release is in flight: a renewal refused meanwhile is that write's
    #: doing, not a loss (the write itself tells whether the claim was still ours).
    settling: set[tuple[str, int]] = field(default_factory=set)
    task: asyncio.Task[None] | None = None


class AsyncLeaseRenewer:
    """Renews the leases of tracked claims, identified by ``(stem, token)``, one task per loop.

    ``track`` and ``untrack`` are plain methods (they never wait) and must be called from a
    coroutine running in the loop that holds the claim."""

    def __init__(self, store: AsyncRedisStore, lease_ms: int, retention_ms: int, interval: float) -> None:
        self.store = store
        self.lease_ms = lease_ms
        self.retention_ms = retention_ms
        self.interval = interval
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopLeases] = weakref.WeakKeyDictionary()

    def _leases(self) -> _LoopLeases:
        loop = asyncio.get_running_loop()
        leases = self._loops.get(loop)
        if leases is None:
            leases = self._loops[loop] = _LoopLeases()
        return leases

    def track(self, stem: str, token: int) -> None:
        """Keep this claim's lease alive from now on; starts the loop's renewer task if none runs."""
        leases = self._leases()
        leases.live[(stem, token)] = leases.live.get((stem, token), 0) + 1
        if leases.task is None or leases.task.done():
            leases.task = asyncio.get_running_loop().create_task(self._renew_while_held(leases),
                                                                 name="dedupe-lease-renewer")

    def untrack(self, stem: str, token: int) -> None:
        """Stop renewing this claim (once every holder that tracked it has untracked it)."""
        leases = self._leases()
        left = leases.live.get((stem, token), 0) - 1
        if left > 0:
            leases.live[(stem, token)] = left
        else:
            leases.live.pop((stem, token), None)
            leases.lost.discard((stem, token))

    def is_lost(self, stem: str, token: int) -> bool:
        """Whether renewal found the claim taken by another token (this loop's claims)."""
        leases = self._loops.get(asyncio.get_running_loop())
        return leases is not None and (stem, token) in leases.lost

    @contextmanager
    def settling(self, claims: Iterable[tuple[str, int]]) -> Iterator[None]:
        """While inside, a renewal of one of ``claims`` (``(stem, token)``) that Redis refuses does
        not mark it lost: our own completion or release, in flight, is what ends the lease."""
        leases = self._leases()
        mine = set(claims) - leases.settling
        leases.settling |= mine
        try:
            yield
        finally:
            leases.settling -= mine

    def tasks(self) -> list[asyncio.Task[None]]:
        """The renewer tasks running now (at most one per event loop)."""
        return [leases.task for leases in list(self._loops.values())
                if leases.task is not None and not leases.task.done()]

    async def renew_now(self) -> None:
        """Renew every lease tracked in the running loop once, in one round trip."""
        leases = self._leases()
        items = [k for k in leases.live if k not in leases.lost]
        observer.leases(len(items))
        if not items:
            return
        try:
            renewed = await self.store.renew(items, self.lease_ms, self.retention_ms)
        except StoreUnavailable as exc:
            log.warning("lease renewal of %d claims failed, will retry: %s", len(items), exc)
            observer.renewal_failed(len(items))
            return
        for (stem, token), ok in zip(items, renewed, strict=True):
            if ok or (stem, token) not in leases.live or (stem, token) in leases.settling:
                continue
            leases.lost.add((stem, token))
            log.warning("lease lost: key=%s token=%s", stem, token)
            observer.lease_lost()

    async def _renew_while_held(self, leases: _LoopLeases) -> None:
        loop = asyncio.get_running_loop()
        try:
            while leases.live:
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

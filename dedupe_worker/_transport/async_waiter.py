"""One task per event loop that waits on every held key its coroutines wait for.

A deliberate twin of :mod:`dedupe_worker._transport.watcher` (the waiting itself differs: one
blocked connection per loop here, BLPOP per wait or one watcher thread there).

``begin(key, wait=...)`` on a key held elsewhere waits for the holder's completion or release.
The synchronous client blocks one connection per waiter (``BLPOP`` on the key's notice list);
here the waits of one event loop share one task and one connection: the first coroutine to wait on
a key counts one waiter on it (``watch.lua``), later ones on the same key join it without a round
trip, and the task blocks in one ``BLPOP`` over the notice lists of every watched key (plus a
private wake-up list, pushed when a key is added). When a notice arrives, every coroutine waiting
on that key wakes; when the holder's lease would run out, they wake too and claim again.

Nothing here changes a claim: waking only means "claim again now". A notice that is missed (Redis
down, the task cancelled) only means the lease's end wakes the waiters instead; a notice left by a
waiter that gave up wakes a later one early, which claims again and waits on. On a Redis Cluster
one ``BLPOP`` cannot span slots, so each coroutine blocks on its own key there, as in the sync client.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field

from .._protocol import KeyLayout
from .async_store import AsyncRedisStore
from .watcher import Watched

__all__ = ["AsyncKeyWaiter"]

log = logging.getLogger(__name__)


@dataclass
class _LoopWaits:
    watched: dict[str, Watched[asyncio.Future[bool]]] = field(default_factory=dict)  # stem -> its waiters
    task: asyncio.Task[None] | None = None
    #: stem -> the ``watch.lua`` call in flight for it (its holder's lease left, or ``None`` if it failed)
    watching: dict[str, asyncio.Future[float | None]] = field(default_factory=dict)


class AsyncKeyWaiter:
    """Waits on held keys for the coroutines of each event loop, one task and one ``BLPOP`` per loop."""

    def __init__(self, store: AsyncRedisStore) -> None:
        self.store = store
        self.wake = f"{store.layout.namespace}:{{waiter-{uuid.uuid4().hex}}}:wake"
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaits] = weakref.WeakKeyDictionary()

    async def wait(self, stem: str, timeout: float) -> bool:
        """Wait until the key of ``stem`` is completed or released (True), or its holder's lease
        ends or ``timeout`` seconds pass (False); at once when no live lease holds it now.
        Raises :class:`~dedupe_worker.StoreUnavailable` when the key cannot be watched."""
        if self.store.scripts.is_cluster:
            holder_left = await self.store.watch(stem)
            return holder_left > 0 and await self.store.wait_notice(stem, min(timeout, holder_left + 0.005))
        loop = asyncio.get_running_loop()
        watched = self._waits(loop).watched.get(stem)
        interrupt = False
        if watched is None:
            holder_left = await self._watch(loop, stem)  # counts one waiter: one notice for all of ours
            if holder_left <= 0:
                return False
            waits = self._waits(loop)  # afresh: meanwhile the task may have ended, or another coroutine watched
            watched = waits.watched.get(stem)
            if watched is None:
                watched = waits.watched[stem] = Watched(time.monotonic() + holder_left + 0.005)
                if waits.task is None or waits.task.done():
                    waits.task = loop.create_task(self._listen(waits), name="dedupe-key-waiter")
                else:
                    interrupt = True
        future: asyncio.Future[bool] = loop.create_future()
        watched.waiters.append(future)
        try:
            if interrupt:
                await self._interrupt()
            done, _ = await asyncio.wait({future}, timeout=timeout)
            return bool(done) and future.result()
        finally:
            future.cancel()  # no-op once it has a result

    async def _watch(self, loop: asyncio.AbstractEventLoop, stem: str) -> float:
        """``watch.lua`` on ``stem`` (seconds left of its holder's lease), called once for the
        coroutines of ``loop`` that start waiting on it together: the later ones share the reply
        of the call in flight (and call it themselves if that one failed)."""
        waits = self._waits(loop)
        pending = waits.watching.get(stem)
        if pending is not None:
            shared = await asyncio.shield(pending)  # our cancellation must not cancel theirs
            return shared if shared is not None else await self.store.watch(stem)
        pending = waits.watching[stem] = loop.create_future()
        holder_left: float | None = None
        try:
            holder_left = await self.store.watch(stem)
            return holder_left
        finally:
            pending.set_result(holder_left)
            if waits.watching.get(stem) is pending:
                del waits.watching[stem]

    def _waits(self, loop: asyncio.AbstractEventLoop) -> _LoopWaits:
        waits = self._loops.get(loop)
        if waits is None:
            waits = self._loops[loop] = _LoopWaits()
        return waits

    def waiting(self, stem: str) -> int:
        """How many coroutines of the running loop wait on the key of ``stem`` now."""
        waits = self._loops.get(asyncio.get_running_loop())
        watched = waits.watched.get(stem) if waits is not None else None
        return 0 if watched is None else sum(not f.done() for f in watched.waiters)

    async def _interrupt(self) -> None:
        """Wake the task's blocking ``BLPOP`` so it blocks again with the new key in it."""
        try:
            await self.store.wake_pipeline(self.wake).execute()
        except Exception as exc:  # the new key's deadline still wakes its waiters
            log.debug("could not wake the key waiter: %s", exc)

    @staticmethod
    def _fire(waits: _LoopWaits, stems: list[str], notified: bool) -> None:
        for stem in stems:
            watched = waits.watched.pop(stem, None)
            for future in watched.waiters if watched is not None else ():
                if not future.done():
                    future.set_result(notified)

    async def _listen(self, waits: _LoopWaits) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self._listen_while_watched(waits)
        finally:
            # nothing watched, or cancelled: forget this loop (its task would keep a closed loop
            # alive); a later wait starts afresh
            if self._loops.get(loop) is waits:
                del self._loops[loop]

    async def _listen_while_watched(self, waits: _LoopWaits) -> None:
        client = self.store.client
        while waits.watched:
            now = time.monotonic()
            self._fire(waits, [s for s, w in waits.watched.items() if w.deadline <= now], notified=False)
            if not waits.watched:
                break
            nearest = min(w.deadline for w in waits.watched.values())
            timeout = max(0.005, min(nearest - now, self.store.max_block))
            try:
                reply = await client.blpop([self.wake, *(KeyLayout.notice(s) for s in waits.watched)],
                                           timeout=timeout)
            except Exception as exc:
                log.warning("key waiter cannot reach Redis, relying on lease deadlines: %s", exc)
                await asyncio.sleep(min(timeout, 0.5))
                continue
            stem = self.store.noticed(reply, self.wake)
            if stem is not None:
                self._fire(waits, [stem], notified=True)

    async def aclose(self) -> None:
        """Cancel the waiter task of the running loop; its waiters wake as at their deadline."""
        current = asyncio.get_running_loop()
        for loop, waits in list(self._loops.items()):
            task = waits.task
            if task is None or task.done():
                continue
            if loop is current:
                task.cancel()
                await asyncio.wait({task})
                self._fire(waits, list(waits.watched), notified=False)
            elif not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)

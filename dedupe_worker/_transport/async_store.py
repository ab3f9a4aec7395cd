"""The claim protocol's transitions on ``redis.asyncio``: the same calls, the same replies.

A deliberate twin of :mod:`dedupe_worker._transport.store` for the few calls made outside a flow
(the waiter's ``watch``/``wait_notice``): connection set-up and blocking
differ; every multi-step operation is a flow (:mod:`dedupe_worker._protocol.flows`).

:class:`AsyncRedisStore` builds its script calls and reads their replies with the code the
synchronous :class:`~dedupe_worker._transport.RedisStore` uses
(:class:`~dedupe_worker._protocol.calls.StoreCalls`); only the round trips are awaited. The
guarantees are those of the protocol: one transition is one atomic script, every write checks the
caller's fencing token, every Redis failure is :class:`~dedupe_worker.StoreUnavailable`.
"""

from __future__ import annotations

import logging

from .._protocol import KeyLayout
from .async_scripts import AsyncRedis, AsyncScriptRunner
from .store import StoreBase

__all__ = ["AsyncRedisStore"]

log = logging.getLogger(__name__)


class AsyncRedisStore(StoreBase):
    """Runs the protocol transitions for keys laid out by a :class:`KeyLayout`, awaited."""

    scripts: AsyncScriptRunner

    def __init__(self, client: AsyncRedis, layout: KeyLayout) -> None:
        super().__init__(client, layout, AsyncScriptRunner(client))

    async def watch(self, stem: str) -> float:
        """Count one waiter on ``stem`` (``watch.lua``); the seconds its holder's lease still runs,
        or 0 when no live lease holds it."""
        return self.holder_left(await self.scripts.call(*self.watch_call(stem)))

    async def wait_notice(self, stem: str, timeout: float) -> bool:
        """Block (BLPOP, one pooled connection) until the holder of ``stem`` completes or
        releases it, at most ``timeout`` seconds; True when a notice came."""
        with self.waiting_on(stem):
            return await self.client.blpop(*self.notice_wait(stem, timeout)) is not None

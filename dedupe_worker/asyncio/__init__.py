"""dedupe-worker on asyncio: :class:`AsyncDeduplicator` on ``redis.asyncio``.

::

    from dedupe_worker.asyncio import AsyncDeduplicator, idempotent

    dedupe = AsyncDeduplicator.from_url("redis://127.0.0.1:6379/0", namespace="orders")
    value = await dedupe.run(f"charge:{order_id}", charge, order_id, amount)

The same Lua scripts, options, exceptions and verdicts as the synchronous
:class:`~dedupe_worker.Deduplicator` (the key checks, reply decoding, result encoding and the
engine's decision logic are shared code, not copies), so sync and async workers can share one
namespace. :func:`decide` is what an asyncio integration calls: it returns the same
:class:`~dedupe_worker.Decision` as :func:`dedupe_worker.decide`, and :func:`decide_many` is the
batch engine with ``async def`` handlers. Both run the very flows the synchronous engine runs
(:mod:`dedupe_worker._protocol.flows`), awaited. One renewer task per event loop renews every held
lease in one round trip per interval. ``current_claim()`` is
:func:`dedupe_worker.current_claim`, set inside the handler's coroutine.

This package sits beside ``deduplicator.py``: it uses the protocol, its transport (where the
asyncio client, store, renewer and waiter live, beside their sync twins), the messages and the
engine, and nothing below it imports it.
"""

from __future__ import annotations

from .._decorators import idempotent
from .._protocol import current_claim
from .._transport import AsyncClaimClient, AsyncKeyWaiter, AsyncLeaseRenewer, AsyncRedisStore, async_redis_from_url
from ._deduplicator import AsyncDeduplicator
from ._engine import AsyncHandler, AsyncItem, decide, decide_many, execute, run

__all__ = [
    "AsyncClaimClient",
    "AsyncDeduplicator",
    "AsyncHandler",
    "AsyncItem",
    "AsyncKeyWaiter",
    "AsyncLeaseRenewer",
    "AsyncRedisStore",
    "async_redis_from_url",
    "current_claim",
    "decide",
    "decide_many",
    "execute",
    "idempotent",
    "run",
]

"""The claim protocol's transitions on ``redis.asyncio``: the same calls, the same replies.

:class:`AsyncRedisStore` builds its script calls and reads their replies with the code the
synchronous :class:`~dedupe_worker._protocol.RedisStore` uses
(:class:`~dedupe_worker._protocol.calls.StoreCalls`); only the round trips are awaited. The
guarantees are those of the protocol: one transition is one atomic script, every write checks the
caller's fencing token, every Redis failure is :class:`~dedupe_worker.StoreUnavailable`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from .._errors import StoreUnavailable
from .._protocol.calls import ClaimReply, KeyState, StoreCalls, _claim_reply, acquired_in, block_limit, key_state
from .._protocol.claim import Stored
from .._protocol.layout import KeyLayout
from .._protocol.scripts import Call, NotDurable
from ._scripts import AsyncRedis, AsyncScriptRunner

__all__ = ["AsyncRedisStore"]

log = logging.getLogger(__name__)


class AsyncRedisStore(StoreCalls):
    """Runs the protocol transitions for keys laid out by a :class:`KeyLayout`, awaited."""

    scripts: AsyncScriptRunner

    def __init__(self, client: AsyncRedis, layout: KeyLayout) -> None:
        self.client = client
        self.layout = layout
        self.scripts = AsyncScriptRunner(client)
        #: Longest single blocking wait, in seconds (waits are split into such pieces).
        self.max_block = block_limit(client)
        self.durability = None
        super().__init__()

    async def run(self, *groups: list[Call]) -> list[list[Any]]:
        """Send every call of every group in one round trip; each group's replies flattened.
        As :meth:`RedisStore.run <dedupe_worker._protocol.RedisStore.run>`, :class:`NotDurable`
        after giving back the claims a round trip took when too few replicas acknowledged it."""
        calls = [call for group in groups for call in group]
        durable = self.durability if any(name in ("claim", "complete") for name, _, _ in calls) else None
        try:
            replies = iter(await self.scripts.call_all(calls, durable))
        except NotDurable as exc:
            await self._give_back(calls, exc.replies)
            raise
        return [[v for _ in group for v in next(replies)] for group in groups]

    async def _give_back(self, calls: list[Call], replies: list[Any]) -> None:
        taken = acquired_in(calls, replies)
        if not taken:
            return
        try:
            await self.scripts.call_all(self.release_calls(taken, 1))
        except StoreUnavailable as exc:  # the leases run out by themselves
            log.warning("could not give back %d claims after a write that was not durable: %s", len(taken), exc)

    async def claim(self, items: Sequence[tuple[str, str, str]], lease_ms: int, retention_ms: int) -> list[ClaimReply]:
        """Claim every item; ``items`` are ``(stem, fingerprint, original_key)``."""
        return self.claim_replies((await self.run(self.claim_calls(items, lease_ms, retention_ms)))[0])

    async def claim_one(self, stem: str, fingerprint: str, original: str, lease_ms: int,
                        retention_ms: int) -> ClaimReply:
        """:meth:`claim` for one key (one EVALSHA)."""
        if self.durability is not None:
            return (await self.claim([(stem, fingerprint, original)], lease_ms, retention_ms))[0]
        return _claim_reply(*await self.scripts.call(
            "claim", (KeyLayout.started(stem), KeyLayout.result(stem)),
            (lease_ms, retention_ms, fingerprint, original, *self.format_args)
        ))

    async def complete(self, items: Sequence[tuple[str, int, Stored, bytes]], result_ttl_ms: int) -> list[bool]:
        """``items`` are ``(stem, token, status, value)``; True where the outcome was stored."""
        return [bool(v) for v in (await self.run(self.complete_calls(items, result_ttl_ms)))[0]]

    async def release(self, items: Sequence[tuple[str, int]], retention_ms: int) -> list[bool]:
        """``items`` are ``(stem, token)``; True where the claim was released."""
        return [bool(v) for v in (await self.run(self.release_calls(items, retention_ms)))[0]]

    async def renew(self, items: Sequence[tuple[str, int]], lease_ms: int, retention_ms: int) -> list[bool]:
        """``items`` are ``(stem, token)``; True where the lease was extended."""
        return [bool(v) for v in (await self.run(self.renew_calls(items, lease_ms, retention_ms)))[0]]

    async def watch(self, stem: str) -> float:
        """Count one waiter on ``stem`` (``watch.lua``); the seconds its holder's lease still runs,
        or 0 when no live lease holds it."""
        held, remaining_ms = await self.scripts.call("watch", (KeyLayout.started(stem), KeyLayout.result(stem)), ())
        return int(remaining_ms) / 1000 if int(held) else 0.0

    async def wait_notice(self, stem: str, timeout: float) -> bool:
        """Block (BLPOP, one pooled connection) until the holder of ``stem`` completes or
        releases it, at most ``timeout`` seconds; True when a notice came."""
        try:
            reply = await self.client.blpop(
                [KeyLayout.notice(stem)], timeout=max(0.001, min(timeout, self.max_block)))
            return reply is not None
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed waiting on {stem}: {exc}") from exc

    async def forget(self, stem: str, token: int | None, force: bool) -> tuple[int, int]:
        """``forget.lua``: ``(code, token)`` as :meth:`RedisStore.forget`."""
        code, found = await self.scripts.call(
            "forget", (KeyLayout.started(stem), KeyLayout.result(stem), KeyLayout.notice(stem)),
            ("" if token is None else token, "1" if force else "0"))
        return int(code), int(found)

    async def inspect(self, stem: str) -> KeyState:
        """``inspect.lua``: the key's records, unchanged."""
        return key_state(*await self.scripts.call("inspect", (KeyLayout.started(stem), KeyLayout.result(stem)), ()))

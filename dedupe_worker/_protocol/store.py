"""The claim protocol on Redis: each transition is one Lua script, called by SHA.

Why fencing tokens? A lease alone cannot stop a paused worker::

    A claims key (token 7) ... GC pause / network stall ...      A wakes, completes (token 7)
              B claims after A's lease ran out (token 8), completes

Without a token A's late completion would overwrite B's result. Here every write checks that the
caller's token still owns the claim, so A gets LEASE_LOST and writes nothing; a handler can pass
the token to its own storage (``UPDATE ... WHERE fence < :token``) to fence its side effects too.

Methods take batches; on a standalone Redis a batch is one EVALSHA over all its keys, on a Redis
Cluster it is one pipelined EVALSHA per key (each key's two records share a slot).
:meth:`RedisStore.run` sends the calls of several transitions in one pipelined round trip (store
one group's outcomes and claim the next chunk together); Redis still runs each script atomically,
one after the other, in the order given.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from .._errors import StoreUnavailable
from .calls import ClaimReply, KeyState, StoreCalls, _claim_reply, acquired_in, block_limit, key_state
from .claim import Stored
from .layout import KeyLayout
from .scripts import Call, NotDurable, ScriptRunner

__all__ = ["ClaimReply", "KeyState", "RedisStore"]

log = logging.getLogger(__name__)


class RedisStore(StoreCalls):
    """Runs the protocol transitions for keys laid out by a :class:`KeyLayout`.

    The ``*_calls`` methods build the script calls of one transition over a batch; :meth:`run`
    sends any number of such groups in one round trip and hands back each group's flat reply.
    """

    scripts: ScriptRunner

    def __init__(self, client: redis.Redis | RedisCluster, layout: KeyLayout) -> None:
        self.client = client
        self.layout = layout
        self.scripts = ScriptRunner(client)
        #: Longest single blocking wait, in seconds (waits are split into such pieces).
        self.max_block = block_limit(client)
        self.durability = None
        super().__init__()

    # -- running them ---------------------------------------------------------------------------

    def run(self, *groups: list[Call]) -> list[list[Any]]:
        """Send every call of every group in one round trip; return each group's replies flattened
        (one value per item for complete/release/renew, four per item for claim).

        With :attr:`durability` set, a round trip that claims or completes also waits for the
        replicas; when too few acknowledge it raises :class:`NotDurable` (a
        :class:`~dedupe_worker.StoreUnavailable`), after giving back the claims it took."""
        calls = [call for group in groups for call in group]
        durable = self.durability if any(name in ("claim", "complete") for name, _, _ in calls) else None
        try:
            replies = iter(self.scripts.call_all(calls, durable))
        except NotDurable as exc:
            self._give_back(calls, exc.replies)
            raise
        return [[v for _ in group for v in next(replies)] for group in groups]

    def _give_back(self, calls: list[Call], replies: list[Any]) -> None:
        """Release the claims ``calls`` acquired, after their round trip was not durable: they
        could be lost in a failover, and the caller will not run their work now."""
        taken = acquired_in(calls, replies)
        if not taken:
            return
        try:
            self.scripts.call_all(self.release_calls(taken, 1))
        except StoreUnavailable as exc:  # the leases run out by themselves
            log.warning("could not give back %d claims after a write that was not durable: %s", len(taken), exc)

    def claim(self, items: Sequence[tuple[str, str, str]], lease_ms: int, retention_ms: int) -> list[ClaimReply]:
        """Claim every item; ``items`` are ``(stem, fingerprint, original_key)``."""
        return self.claim_replies(self.run(self.claim_calls(items, lease_ms, retention_ms))[0])

    def claim_one(self, stem: str, fingerprint: str, original: str, lease_ms: int, retention_ms: int) -> ClaimReply:
        """:meth:`claim` for one key, without the batch bookkeeping (the per-message hot path)."""
        if self.durability is not None:
            return self.claim([(stem, fingerprint, original)], lease_ms, retention_ms)[0]
        return _claim_reply(*self.scripts.call(
            "claim", (KeyLayout.started(stem), KeyLayout.result(stem)),
            (lease_ms, retention_ms, fingerprint, original, *self.format_args)
        ))

    def complete_one(self, stem: str, token: int, status: Stored, value: bytes, result_ttl_ms: int) -> bool:
        """:meth:`complete` for one key (the per-message hot path)."""
        if self.durability is not None:
            return self.complete([(stem, token, status, value)], result_ttl_ms)[0]
        reply = self.scripts.call(
            "complete", (KeyLayout.started(stem), KeyLayout.result(stem), KeyLayout.notice(stem)),
            (result_ttl_ms, token, status.value, self.record(token, status, value), *self.format_args),
        )
        return bool(reply[0])

    def complete(self, items: Sequence[tuple[str, int, Stored, bytes]], result_ttl_ms: int) -> list[bool]:
        """``items`` are ``(stem, token, status, value)``; True where the outcome was stored."""
        return [bool(v) for v in self.run(self.complete_calls(items, result_ttl_ms))[0]]

    def release(self, items: Sequence[tuple[str, int]], retention_ms: int) -> list[bool]:
        """``items`` are ``(stem, token)``; True where the claim was released."""
        return [bool(v) for v in self.run(self.release_calls(items, retention_ms))[0]]

    def renew(self, items: Sequence[tuple[str, int]], lease_ms: int, retention_ms: int) -> list[bool]:
        """``items`` are ``(stem, token)``; True where the lease was extended."""
        return [bool(v) for v in self.run(self.renew_calls(items, lease_ms, retention_ms))[0]]

    def watch(self, stem: str) -> float:
        """Count one waiter on ``stem`` (``watch.lua``); the seconds its holder's lease still runs,
        or 0 when no live lease holds it (claim again instead of waiting)."""
        held, remaining_ms = self.scripts.call("watch", (KeyLayout.started(stem), KeyLayout.result(stem)), ())
        return int(remaining_ms) / 1000 if int(held) else 0.0

    def wait_notice(self, stem: str, timeout: float) -> bool:
        """Block until the holder of ``stem`` completes or releases it (a notice arrives), at most
        ``timeout`` seconds; True when a notice came."""
        try:
            reply = self.client.blpop([KeyLayout.notice(stem)], timeout=max(0.001, min(timeout, self.max_block)))
            return reply is not None
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed waiting on {stem}: {exc}") from exc

    def forget(self, stem: str, token: int | None, force: bool) -> tuple[int, int]:
        """``forget.lua``: ``(code, token)``, code 1 removed, 0 nothing there, -1 a live lease
        (not forced), -2 another token than ``token``."""
        code, found = self.scripts.call(
            "forget", (KeyLayout.started(stem), KeyLayout.result(stem), KeyLayout.notice(stem)),
            ("" if token is None else token, "1" if force else "0"))
        return int(code), int(found)

    def inspect(self, stem: str) -> KeyState:
        code, token, a, b = self.scripts.call(
            "inspect", (KeyLayout.started(stem), KeyLayout.result(stem)), ()
        )
        return key_state(code, token, a, b)

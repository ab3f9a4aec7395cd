"""The claim protocol on Redis: each transition is one Lua script, called by SHA.

A deliberate twin of :mod:`dedupe_worker._transport.async_store` for the few calls made outside a flow;
every multi-step operation is a flow (:mod:`~dedupe_worker._protocol.flows`), written once for both clients.

Why fencing tokens? A lease alone cannot stop a paused worker::

    A claims key (token 7) ... GC pause / network stall ...      A wakes, completes (token 7)
              B claims after A's lease ran out (token 8), completes

Without a token A's late completion would overwrite B's result. Here every write checks that the
caller's token still owns the claim, so A gets LEASE_LOST and writes nothing; a handler can pass
the token to its own storage (``UPDATE ... WHERE fence < :token``) to fence its side effects too.

Methods take batches; on a standalone Redis a batch is one EVALSHA over all its keys, on a Redis
Cluster it is one pipelined EVALSHA per key (each key's two records share a slot).
The client's ``round_trip`` flow (:mod:`~dedupe_worker._protocol.flows`) sends the calls of several transitions in one
pipelined round trip (store one group's outcomes and claim the next chunk together); Redis still
runs each script atomically, one after the other, in the order given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from .._errors import StoreUnavailable
from .._protocol import KeyLayout, KeyState, StoreCalls, block_limit, key_state
from .scripts import ScriptRunner

__all__ = ["RedisStore", "StoreBase"]

log = logging.getLogger(__name__)


class StoreBase(StoreCalls):
    """What the sync and asyncio stores hold alike: the Redis client, the key layout, the script
    runner (blocking or awaited), the longest blocking wait and the durability (``WAIT``) setting."""

    def __init__(self, client: Any, layout: KeyLayout, scripts: Any) -> None:
        self.client = client
        self.layout = layout
        self.scripts = scripts
        #: Longest single blocking wait, in seconds (waits are split into such pieces).
        self.max_block = block_limit(client)
        self.durability = None
        super().__init__()

    # -- waiting on a held key, described once (each store makes the call, blocking or awaited) --

    @staticmethod
    def watch_call(stem: str) -> tuple[str, tuple[str, str, str], tuple[()]]:
        """The ``watch.lua`` call that counts one waiter on ``stem``."""
        return "watch", KeyLayout.records(stem), ()

    @staticmethod
    def holder_left(reply: Any) -> float:
        """``watch.lua``'s reply: the seconds the holder's lease still runs, or 0 when no live
        lease holds the key (claim again instead of waiting)."""
        held, remaining_ms = reply
        return int(remaining_ms) / 1000 if int(held) else 0.0

    def notice_wait(self, stem: str, timeout: float) -> tuple[list[str], float]:
        """``BLPOP``'s arguments for a wait on ``stem``'s notice: at most ``timeout`` seconds, and
        no longer than one blocking wait may last (:attr:`max_block`)."""
        return [KeyLayout.notice(stem)], max(0.001, min(timeout, self.max_block))

    def wake_pipeline(self, wake: str) -> Any:
        """A pipeline (not sent) that pushes one wake-up on a waiter's private list ``wake``, kept a
        minute: it ends the waiter's blocking ``BLPOP`` so it blocks again over its new keys."""
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(wake, 1)
        pipe.pexpire(wake, 60_000)
        return pipe

    @staticmethod
    def noticed(reply: Any, wake: str) -> str | None:
        """The stem whose notice a waiter's ``BLPOP`` popped; ``None`` when it timed out or popped
        the waiter's own wake-up list ``wake``."""
        if reply is None:
            return None
        name = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        return None if name == wake else name.removesuffix(":notice")

    @staticmethod
    @contextmanager
    def waiting_on(stem: str) -> Iterator[None]:
        """A Redis error while waiting on ``stem`` is :class:`~dedupe_worker.StoreUnavailable`."""
        try:
            yield
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed waiting on {stem}: {exc}") from exc


class RedisStore(StoreBase):
    """Runs the protocol transitions for keys laid out by a :class:`KeyLayout`.

    The ``*_calls`` methods build the script calls of one transition over a batch; the client's
    flows send them (:mod:`~dedupe_worker._protocol.flows`). Beside them, the few calls made outside a flow: the key
    watcher's ``watch``/``wait_notice``, the command line's ``forget``/``inspect``.
    """

    scripts: ScriptRunner

    def __init__(self, client: redis.Redis | RedisCluster, layout: KeyLayout) -> None:
        super().__init__(client, layout, ScriptRunner(client))

    def watch(self, stem: str) -> float:
        """Count one waiter on ``stem`` (``watch.lua``); the seconds its holder's lease still runs,
        or 0 when no live lease holds it (claim again instead of waiting)."""
        return self.holder_left(self.scripts.call(*self.watch_call(stem)))

    def wait_notice(self, stem: str, timeout: float) -> bool:
        """Block until the holder of ``stem`` completes or releases it (a notice arrives), at most
        ``timeout`` seconds; True when a notice came."""
        with self.waiting_on(stem):
            return self.client.blpop(*self.notice_wait(stem, timeout)) is not None

    def forget(self, stem: str, token: int | None, force: bool) -> tuple[int, int, str]:
        """``forget.lua``: ``(code, token, detail)``, code 1 removed, 0 nothing there, -1 a live
        lease (not forced), -2 another token than ``token``, -3 a record we cannot read (not
        forced, or a token given: ``detail`` says what lies there; forced, it is removed)."""
        reply = self.scripts.call("forget", KeyLayout.names(stem),
                                  ("" if token is None else token, "1" if force else "0"))
        detail = reply[2] if len(reply) > 2 else b""
        return int(reply[0]), int(reply[1]), detail.decode() if isinstance(detail, bytes) else str(detail)

    def inspect(self, stem: str) -> KeyState:
        code, token, a, b = self.scripts.call(
            "inspect", KeyLayout.records(stem), ()
        )
        return key_state(code, token, a, b)

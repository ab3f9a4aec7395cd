"""The claim protocol on Redis: each method is one Lua transition in one round trip.

Why fencing tokens? A lease alone cannot stop a paused worker::

    A claims key (token 7) ... GC pause / network stall ...      A wakes, completes (token 7)
              B claims after A's lease ran out (token 8), completes

Without a token A's late completion would overwrite B's result. Here every write checks that the
caller's token still owns the claim, so A gets LEASE_LOST and writes nothing; a handler can pass
the token to its own storage (``UPDATE ... WHERE fence < :token``) to fence its side effects too.

Methods take batches; on a standalone Redis a batch is one EVALSHA over all its keys, on a Redis
Cluster it is one pipelined EVALSHA per key (each key's two records share a slot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis
from redis.cluster import RedisCluster

from .claim import Outcome
from .layout import KeyLayout
from .scripts import ScriptRunner

__all__ = ["ClaimReply", "KeyState", "RedisStore"]


_OUTCOMES = {int(o.value): o for o in Outcome}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _claim_reply(code: Any, token: Any, a: Any, b: Any) -> ClaimReply:
    outcome = _OUTCOMES[int(code)]
    if outcome is Outcome.DUPLICATE:
        return ClaimReply(outcome, int(token), _text(a), b)
    if outcome is Outcome.IN_PROGRESS:
        return ClaimReply(outcome, int(token), remaining_ms=int(a))
    return ClaimReply(outcome, int(token))


class ClaimReply(NamedTuple):
    """One key's answer from ``claim.lua``: the raw material of a :class:`~dedupe_worker.Claim`."""

    outcome: Outcome
    token: int
    #: 'c', 'o' or 'f' for a DUPLICATE, else ''.
    status: str = ""
    value: bytes | str | None = None
    remaining_ms: int = 0


@dataclass(frozen=True)
class KeyState:
    """What ``inspect.lua`` saw: ``state`` is "done", "in_progress" or "free"."""

    state: str
    token: int
    status: str = ""
    value: bytes | str | None = None
    remaining_ms: int = 0


class RedisStore:
    """Runs the protocol transitions for keys laid out by a :class:`KeyLayout`."""

    def __init__(self, client: redis.Redis | RedisCluster, layout: KeyLayout) -> None:
        self.client = client
        self.layout = layout
        self.scripts = ScriptRunner(client)

    def _run(
        self,
        name: str,
        keys: Sequence[Sequence[str]],
        shared: Sequence[Any],
        per_item: Sequence[Sequence[Any]],
    ) -> list[Any]:
        """Run ``name`` over items; return the flat reply in item order."""
        if not self.scripts.is_cluster:
            flat_keys = [k for ks in keys for k in ks]
            flat_args = [*shared, *(a for args in per_item for a in args)]
            return list(self.scripts.call(name, flat_keys, flat_args))
        calls = [(ks, [*shared, *args]) for ks, args in zip(keys, per_item, strict=True)]
        replies = self.scripts.call_each(name, calls)
        return [v for reply in replies for v in reply]

    def claim(
        self, items: Sequence[tuple[str, str, str]], lease_ms: int, retention_ms: int
    ) -> list[ClaimReply]:
        """``items`` are ``(stem, fingerprint, original_key)``."""
        if not items:
            return []
        flat = self._run(
            "claim",
            [(KeyLayout.started(s), KeyLayout.result(s)) for s, _, _ in items],
            (lease_ms, retention_ms),
            [(fp, orig) for _, fp, orig in items],
        )
        return [_claim_reply(*flat[i : i + 4]) for i in range(0, len(flat), 4)]

    def claim_one(self, stem: str, fingerprint: str, original: str, lease_ms: int, retention_ms: int) -> ClaimReply:
        """:meth:`claim` for one key, without the batch bookkeeping (the per-message hot path)."""
        return _claim_reply(*self.scripts.call(
            "claim", (KeyLayout.started(stem), KeyLayout.result(stem)), (lease_ms, retention_ms, fingerprint, original)
        ))

    def complete_one(self, stem: str, token: int, status: str, value: bytes, result_ttl_ms: int) -> bool:
        """:meth:`complete` for one key (the per-message hot path)."""
        reply = self.scripts.call(
            "complete", (KeyLayout.started(stem), KeyLayout.result(stem)), (result_ttl_ms, token, status, value)
        )
        return bool(reply[0])

    def complete(
        self, items: Sequence[tuple[str, int, str, bytes]], result_ttl_ms: int
    ) -> list[bool]:
        """``items`` are ``(stem, token, status, value)``; True where the outcome was stored."""
        if not items:
            return []
        flat = self._run(
            "complete",
            [(KeyLayout.started(s), KeyLayout.result(s)) for s, _, _, _ in items],
            (result_ttl_ms,),
            [(token, status, value) for _, token, status, value in items],
        )
        return [bool(v) for v in flat]

    def release(self, items: Sequence[tuple[str, int]], retention_ms: int) -> list[bool]:
        """``items`` are ``(stem, token)``; True where the claim was released."""
        if not items:
            return []
        flat = self._run("release", [(KeyLayout.started(s),) for s, _ in items], (retention_ms,),
                         [(token,) for _, token in items])
        return [bool(v) for v in flat]

    def renew(self, items: Sequence[tuple[str, int]], lease_ms: int, retention_ms: int) -> list[bool]:
        """``items`` are ``(stem, token)``; True where the lease was extended."""
        if not items:
            return []
        flat = self._run("renew", [(KeyLayout.started(s),) for s, _ in items], (lease_ms, retention_ms),
                         [(token,) for _, token in items])
        return [bool(v) for v in flat]

    def inspect(self, stem: str) -> KeyState:
        code, token, a, b = self.scripts.call(
            "inspect", (KeyLayout.started(stem), KeyLayout.result(stem)), ()
        )
        if int(code) == 2:
            return KeyState("done", int(token), _text(a), b)
        if int(code) == 3:
            return KeyState("in_progress", int(token), remaining_ms=int(a))
        return KeyState("free", int(token))

"""The start-up check that Redis will not evict our records (``maxmemory-policy``).

An evicted ``:started`` record or outcome (the string at the stem, or the ``:result`` hash) is a
key that was never seen: its next delivery runs
the handler again. Every record we write has a TTL, so the ``volatile-*`` policies evict them as
readily as the ``allkeys-*`` ones; only ``noeviction`` keeps them (Redis then refuses new claims,
and the engine defers those messages).

Each client checks once, before its first claim (clients sharing one Redis client object, as
clients made per request do, share the check: a Redis that passed is not asked again) (:meth:`ClaimClient.check_store
<dedupe_worker._transport.ClaimClient.check_store>`), and the consumers call it as they start, so
they refuse to start. On a Redis Cluster every primary is asked. What happens:

- an evicting policy on any primary raises :class:`~dedupe_worker.EvictionPolicyError` (naming the
  node, the policy and the fix), unless the client was built with ``allow_eviction=True``, which
  skips the check;
- ``CONFIG GET`` refused (``NOPERM``, or the command renamed away as on managed services): a
  warning is logged, once per process and Redis, and work goes on;
- Redis unreachable: :class:`~dedupe_worker.StoreUnavailable`, as a claim would raise; the check
  is tried again on the next claim.

The decision is :class:`EvictionCheck` (no I/O); :func:`check_store` and
:func:`check_store_async` only ask the nodes.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import redis
import redis.asyncio.cluster
from redis.cluster import RedisCluster
from redis.exceptions import NoPermissionError, RedisError, ResponseError

from .._errors import EvictionPolicyError, StoreUnavailable

__all__ = ["EVICTING_PREFIXES", "EvictionCheck", "check_store", "check_store_async", "is_evicting"]

log = logging.getLogger(__name__)

#: ``maxmemory-policy`` values that evict keys with a TTL (all of ours have one).
EVICTING_PREFIXES = ("allkeys-", "volatile-")

_warned: set[str] = set()
#: Redis client objects whose primaries passed (weakly held: a client dropped is forgotten).
_passed: weakref.WeakSet[Any] = weakref.WeakSet()


def is_evicting(policy: str | None) -> bool:
    """Whether ``policy`` may evict our records (``None``: unknown, not evicting as far as we know)."""
    return policy is not None and policy.startswith(EVICTING_PREFIXES)


def _refused(exc: RedisError) -> bool:
    """``CONFIG GET`` is not allowed here (ACL without ``+config``, or the command renamed away)."""
    text = str(exc).lower()
    return isinstance(exc, NoPermissionError) or (isinstance(exc, ResponseError) and (
        "unknown command" in text or "noperm" in text or "no permissions" in text))


class EvictionCheck:
    """What one check decides from each primary's answer: :meth:`answer` or :meth:`refused` per
    node, then :meth:`finish` raises, warns or passes."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.evicting: list[tuple[str, str]] = []
        self.refusals: list[tuple[str, str]] = []

    def answer(self, node: str, reply: Any) -> None:
        """``reply``: the node's ``CONFIG GET maxmemory-policy`` (a dict, as redis-py parses it)."""
        policy = reply.get("maxmemory-policy") if isinstance(reply, dict) else None
        if isinstance(policy, bytes):
            policy = policy.decode()
        if is_evicting(policy):
            self.evicting.append((node, str(policy)))

    def refused(self, node: str, exc: RedisError) -> None:
        self.refusals.append((node, str(exc)))

    def failed(self, node: str, exc: RedisError) -> StoreUnavailable:
        """The error to raise when ``node`` could not be asked at all."""
        return StoreUnavailable(f"Redis failed checking maxmemory-policy on {node}: {exc}")

    def finish(self) -> None:
        """Raise :class:`EvictionPolicyError` for an evicting policy; warn when ``CONFIG`` was refused."""
        if self.evicting:
            raise EvictionPolicyError(self.evicting)
        if self.refusals and self.where not in _warned:
            _warned.add(self.where)
            node, error = self.refusals[0]
            log.warning("could not read maxmemory-policy of %s (%s: %s); make sure it is noeviction: an "
                        "evicted claim or result lets a duplicate apply again (all our records have a TTL, "
                        "so volatile-* policies evict them too)", self.where, node, error)


def _primaries(client: Any) -> list[tuple[str, Any]]:
    """``(name, target)`` for each node to ask: every primary of a cluster, else the client itself."""
    if isinstance(client, (RedisCluster, redis.asyncio.cluster.RedisCluster)):
        return [(node.name, node) for node in client.get_primaries()]
    return [(_location(client), None)]


def _location(client: Any) -> str:
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    if "host" in kwargs:
        return f"{kwargs['host']}:{kwargs.get('port', 6379)}"
    return str(kwargs.get("path") or type(client).__name__)


def _ask(client: Any, target: Any) -> Any:
    if target is None:
        return client.config_get("maxmemory-policy")
    return client.config_get("maxmemory-policy", target_nodes=target)


def check_store(client: redis.Redis | RedisCluster) -> None:
    """Ask every primary of ``client`` for its ``maxmemory-policy`` and decide (module doc)."""
    if client in _passed:
        return
    nodes = _primaries(client)
    check = EvictionCheck(", ".join(name for name, _ in nodes))
    for name, target in nodes:
        try:
            check.answer(name, _ask(client, target))
        except RedisError as exc:
            if not _refused(exc):
                raise check.failed(name, exc) from exc
            check.refused(name, exc)
    check.finish()
    _passed.add(client)


async def check_store_async(client: Any) -> None:
    """:func:`check_store` on a ``redis.asyncio`` client."""
    if client in _passed:
        return
    if isinstance(client, redis.asyncio.cluster.RedisCluster):
        await client.initialize()  # learns the nodes (once; a no-op after)
    nodes = _primaries(client)
    check = EvictionCheck(", ".join(name for name, _ in nodes))
    for name, target in nodes:
        try:
            check.answer(name, await _ask(client, target))
        except RedisError as exc:
            if not _refused(exc):
                raise check.failed(name, exc) from exc
            check.refused(name, exc)
    check.finish()
    _passed.add(client)

"""``redis.asyncio`` clients built from a URL, with a bounded pool that queues instead of failing.

``redis://``, ``rediss://`` and ``unix://`` as redis-py reads them; ``redis+cluster://`` (or
``?cluster=1``) for a Redis Cluster. Sentinel URLs are not supported here yet: build a
``redis.asyncio.sentinel.Sentinel`` primary yourself and pass it to the constructor.

A standalone client gets a :class:`~redis.asyncio.BlockingConnectionPool` of ``max_connections``
(default 64): with hundreds of coroutines in flight, a call waits for a free connection instead
of failing with "Too many connections" as redis-py's default pool (100, non-blocking) does. The
retry policy is the synchronous one's: two quick retries, then
:class:`~dedupe_worker.StoreUnavailable`.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from ..protocol.connection import SENTINEL_SCHEMES
from .scripts import AsyncRedis

__all__ = ["async_redis_from_url"]


def _retry() -> Retry:
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=2)


def async_redis_from_url(url: str, max_connections: int = 64) -> AsyncRedis:
    """A ``redis.asyncio`` client for ``url`` (see the module doc for the schemes)."""
    parts = urlsplit(url)
    if parts.scheme in SENTINEL_SCHEMES:
        raise ValueError("Sentinel URLs are not supported by the asyncio client yet; pass a "
                         "redis.asyncio.sentinel.Sentinel(...).master_for(...) client instead")
    if parts.scheme == "redis+cluster" or parse_qs(parts.query).get("cluster") == ["1"]:
        plain = parts._replace(scheme="redis", query="").geturl()
        return RedisCluster.from_url(plain, retry=_retry())
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=20, socket_connect_timeout=2, socket_timeout=10,
        retry=_retry())
    return redis.asyncio.Redis.from_pool(pool)

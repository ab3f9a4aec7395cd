"""``redis.asyncio`` clients built from a URL, with a bounded pool that queues instead of failing.

``redis://``, ``rediss://`` and ``unix://`` as redis-py reads them; ``redis+cluster://`` (or
``?cluster=1``) for a Redis Cluster; ``redis+sentinel://`` and ``rediss+sentinel://`` for a
primary found through Sentinel, written as for the sync client. The scheme dispatch and the retry
policy are the sync module's (:func:`~dedupe_worker._transport.connection.by_scheme`,
:func:`~dedupe_worker._transport.connection.retry_policy`); only the clients built differ.

A standalone client gets a :class:`~redis.asyncio.BlockingConnectionPool` of ``max_connections``
(default 64): with hundreds of coroutines in flight, a call waits for a free connection instead
of failing with "Too many connections" as redis-py's default pool (100, non-blocking) does. A
Sentinel-managed primary gets redis-py's ``SentinelConnectionPool`` (it has no blocking form),
allowed ``max_connections`` * 16 connections. The retry policy is the synchronous one's: two quick
retries, then :class:`~dedupe_worker.StoreUnavailable`; after a failover the pool asks the
sentinels for the new primary.
"""

from __future__ import annotations

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel

from .async_scripts import AsyncRedis
from .connection import by_scheme, retry_policy, sentinel_options

__all__ = ["async_redis_from_url"]


def async_redis_from_url(url: str, max_connections: int = 64) -> AsyncRedis:
    """A ``redis.asyncio`` client for ``url`` (see the module doc for the schemes)."""
    return by_scheme(  # type: ignore[no-any-return]
        url, sentinel=lambda url: _sentinel_primary(url, max_connections * 16),
        cluster=lambda plain: RedisCluster.from_url(plain, retry=retry_policy(Retry)),
        plain=lambda url: redis.asyncio.Redis.from_pool(redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=20, socket_connect_timeout=2, socket_timeout=10,
            retry=retry_policy(Retry))))


def _sentinel_primary(url: str, max_connections: int) -> redis.asyncio.Redis:
    """The Sentinel-managed primary named in ``url``, on ``redis.asyncio``."""
    o = sentinel_options(url)
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        o.sentinels,
        sentinel_kwargs={"password": o.sentinel_password, "socket_connect_timeout": 2, "socket_timeout": 2, **o.tls},
        socket_connect_timeout=2, socket_timeout=10, retry=retry_policy(Retry), **o.tls,
    )
    primary: redis.asyncio.Redis = sentinel.master_for(o.service, db=o.db, username=o.username,
                                                       password=o.password, max_connections=max_connections)
    return primary

"""Redis clients built from a URL, with a retry policy that suits a claim store."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

__all__ = ["redis_from_url"]


def _retry() -> Retry:
    """Two quick retries: a blip is absorbed, an outage surfaces as StoreUnavailable in well under
    a second instead of redis-py's default of several seconds of backoff per command."""
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=2)


def redis_from_url(url: str) -> redis.Redis | RedisCluster:
    """A client for ``url``; ``redis+cluster://`` or ``?cluster=1`` selects Redis Cluster."""
    parts = urlsplit(url)
    if parts.scheme == "redis+cluster" or parse_qs(parts.query).get("cluster") == ["1"]:
        plain = parts._replace(scheme="redis", query="").geturl()
        return RedisCluster.from_url(plain, retry=_retry())
    return redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10, retry=_retry())

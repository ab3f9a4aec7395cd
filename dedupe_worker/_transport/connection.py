"""Redis clients built from a URL, with a retry policy that suits a claim store.

``redis://``, ``rediss://`` and ``unix://`` as redis-py reads them; ``redis+cluster://`` (or
``?cluster=1``) for a Redis Cluster; ``redis+sentinel://`` and ``rediss+sentinel://`` for a
primary found through Sentinel::

    redis+sentinel://[[user]:password@]host1:26379,host2:26379/<service>/<db>[?sentinel_password=...]

The password in the URL is the data nodes'; ``sentinel_password`` (query) the sentinels', when they
have one. ``rediss+sentinel`` speaks TLS to the data nodes and the sentinels (``ssl_cert_reqs``,
``ssl_ca_certs`` in the query as redis-py reads them).

After a failover the Sentinel-managed pool asks the sentinels for the new primary: a connection
reset, or ``READONLY`` from a demoted primary, is retried on the new one (two quick retries; past
them the call fails as :class:`~dedupe_worker.StoreUnavailable` and the message is deferred).
Retrying is safe: a retried claim at worst finds our own claim and defers the message until its
lease ends; a retried completion finds our outcome stored and answers stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import FullJitterBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

__all__ = ["SentinelOptions", "by_scheme", "redis_from_url", "retry_policy", "sentinel_options"]

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
R = TypeVar("R")


def retry_policy(retry: Callable[..., R] = Retry) -> R:  # type: ignore[assignment]
    """Two quick retries: a blip is absorbed, an outage surfaces as StoreUnavailable in well under
    a second instead of redis-py's default of several seconds of backoff per command. Each wait
    is drawn from 0 to 0.05 s * 2^attempt (``FullJitterBackoff``: in every redis-py the package
    admits, from 5.0; ``ExponentialWithJitterBackoff`` draws the same below its cap, from 5.3 on).
    ``retry``: redis-py's ``Retry`` class, or ``redis.asyncio``'s."""
    return retry(FullJitterBackoff(cap=0.5, base=0.05), retries=2)


def by_scheme(url: str, *, plain: Callable[[str], Any], cluster: Callable[[str], Any],
              sentinel: Callable[[str], Any]) -> Any:
    """The client for ``url`` that the builder its scheme names returns (see the module doc), for
    the sync and the asyncio connection set-up alike: ``sentinel(url)``, ``cluster(url)`` with the
    URL as ``redis://`` and no query, or ``plain(url)``."""
    parts = urlsplit(url)
    if parts.scheme in SENTINEL_SCHEMES:
        return sentinel(url)
    if parts.scheme == "redis+cluster" or parse_qs(parts.query).get("cluster") == ["1"]:
        return cluster(parts._replace(scheme="redis", query="").geturl())
    return plain(url)


def redis_from_url(url: str) -> redis.Redis | RedisCluster:
    """A client for ``url`` (see the module doc for the schemes)."""
    return by_scheme(  # type: ignore[no-any-return]
        url, sentinel=_sentinel_primary, cluster=lambda plain: RedisCluster.from_url(plain, retry=retry_policy()),
        plain=lambda url: redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10, retry=retry_policy()))


class SentinelOptions(NamedTuple):
    """A ``redis+sentinel://`` URL taken apart: what a sync or asyncio ``Sentinel`` needs."""

    sentinels: list[tuple[str, int]]
    service: str
    db: int
    username: str | None
    password: str | None
    sentinel_password: str | None
    #: ``ssl=True`` and the ``ssl_*`` query options for ``rediss+sentinel``, else empty.
    tls: dict[str, Any]


def sentinel_options(url: str) -> SentinelOptions:
    """Parse a Sentinel URL (see the module doc); ``ValueError`` without hosts or a service."""
    scheme, rest = url.split("://", 1)
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    credentials, _, hosts = netloc.rpartition("@")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    service, _, db = path.strip("/").partition("/")
    if not hosts or not service:
        raise ValueError(f"expected {scheme}://host:port[,host:port...]/<service>[/<db>], got {url!r}")
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "26379")
        sentinels.append((name or host, int(port or 26379)))
    options = {k: v[-1] for k, v in parse_qs(query).items()}
    tls: dict[str, Any] = {}
    if scheme == "rediss+sentinel":
        tls = {"ssl": True, **{k: options.pop(k) for k in list(options) if k.startswith("ssl_")}}
    return SentinelOptions(sentinels, service, int(db or 0), unquote(username) or None, unquote(password) or None,
                           options.pop("sentinel_password", None), tls)


def _sentinel_primary(url: str) -> redis.Redis:
    """The Sentinel-managed primary named in ``url``."""
    o = sentinel_options(url)
    common = {"socket_connect_timeout": 2, "socket_timeout": 10, "retry": retry_policy(), **o.tls}
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        o.sentinels,
        sentinel_kwargs={"password": o.sentinel_password, "socket_connect_timeout": 2, "socket_timeout": 2, **o.tls},
        **common,
    )
    primary: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        o.service, db=o.db, username=o.username, password=o.password,
    )
    return primary

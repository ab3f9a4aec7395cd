"""Fixtures for the asyncio client: a ``redis.asyncio`` client on the session's real Redis and an
:class:`AsyncDeduplicator` in the test's own namespace. Import them into a test module."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
import redis
import redis.asyncio

from dedupe_worker.asyncio import AsyncDeduplicator

from . import services

__all__ = ["adedupe", "aredis"]


@pytest_asyncio.fixture
async def aredis(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        await client.ping()
    except redis.RedisError as exc:
        services.unavailable(f"Redis at {redis_url} ({exc})")
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def adedupe(aredis: redis.asyncio.Redis, namespace: str) -> AsyncIterator[AsyncDeduplicator]:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=5.0, result_ttl=60.0)
    yield d
    await d.aclose()

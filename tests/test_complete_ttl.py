"""``complete(claim, value, ttl=)``: one outcome kept for its own time instead of ``result_ttl``,
sync and asyncio (the HTTP layer's ``Idempotency-TTL``)."""

from __future__ import annotations

import pytest
import redis

from dedupe_worker import Deduplicator
from dedupe_worker.asyncio import AsyncDeduplicator

from .test_ttl import outcome_pttl


def test_complete_with_ttl(dedupe: Deduplicator, redis_client: redis.Redis) -> None:
    short, default = dedupe.begin("short"), dedupe.begin("default")
    dedupe.complete(short, {"v": 1}, ttl=2.5)
    dedupe.complete(default, {"v": 2})
    assert 0 < outcome_pttl(redis_client, short.stem) <= 2500
    assert outcome_pttl(redis_client, default.stem) > 50_000  # result_ttl is 60 s
    with pytest.raises(ValueError):
        dedupe.complete(dedupe.begin("bad"), 1, ttl=0)


@pytest.mark.asyncio
async def test_async_complete_with_ttl(redis_url: str, namespace: str, redis_client: redis.Redis) -> None:
    async with AsyncDeduplicator.from_url(redis_url, namespace=namespace, result_ttl=60.0) as dedupe:
        claim = await dedupe.begin("short")
        await dedupe.complete(claim, {"v": 1}, ttl=1.5)
        assert 0 < outcome_pttl(redis_client, claim.stem) <= 1500

"""The claim protocol through :class:`AsyncDeduplicator`, transition by transition, on a real Redis
(records and TTLs included): the cases of ``test_protocol.py``, awaited, plus what is asyncio's own
(Redis down, waiting on a held key, interplay with the synchronous client)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio

from dedupe_worker import OMITTED, Deduplicator, LeaseLost, Outcome, Stored, StoreUnavailable
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker.asyncio import AsyncDeduplicator

from . import services
from .async_fixtures import adedupe, aredis

__all__ = ["adedupe", "aredis"]

pytestmark = pytest.mark.asyncio


def keys_of(d: AsyncDeduplicator, key: str) -> tuple[str, str]:
    """The started key and the key the outcome is stored at in the format ``d`` writes."""
    stem = d.layout.stem(d.layout.stored_key(key)[0])
    return KeyLayout.started(stem), (KeyLayout.record(stem) if d.store.record_format == 2 else KeyLayout.result(stem))


async def test_first_claim_acquires_with_a_clock_token_and_records_a_lease(
    adedupe: AsyncDeduplicator, redis_client: redis.Redis
) -> None:
    claim = await adedupe.begin("order-1", fingerprint="fp-a")
    assert claim.outcome is Outcome.ACQUIRED and 0 < claim.token < 2**53
    started, result = keys_of(adedupe, "order-1")
    fields = redis_client.hgetall(started)
    token = str(claim.token).encode()
    assert fields[b"owner"] == token and fields[b"next"] == token and fields[b"fp"] == b"fp-a"
    seconds, micros = redis_client.time()
    assert 0 <= seconds * 1_000_000 + micros - claim.token < 5_000_000  # Redis' clock, in µs
    assert 0 < int(fields[b"deadline"]) - seconds * 1000 <= 6000  # lease 5 s, on Redis' clock
    assert not redis_client.exists(result)
    assert 5000 < redis_client.pttl(started) <= 60_000


async def test_second_claim_while_held_is_in_progress_with_remaining_lease(adedupe: AsyncDeduplicator) -> None:
    first = await adedupe.begin("k")
    second = await adedupe.begin("k")
    assert second.outcome is Outcome.IN_PROGRESS
    assert second.token == first.token
    assert 4.0 < second.retry_after <= 5.0


async def test_complete_stores_result_with_ttl_and_drops_the_lease(
    adedupe: AsyncDeduplicator, redis_client: redis.Redis
) -> None:
    claim = await adedupe.begin("k", fingerprint="fp")
    await adedupe.complete(claim, {"charged": 12.5, "currency": "EUR"})
    started, result = keys_of(adedupe, "k")
    assert not redis_client.exists(started)
    assert 55_000 < redis_client.pttl(result) <= 60_000
    again = await adedupe.begin("k", fingerprint="fp")
    assert again.outcome is Outcome.DUPLICATE
    assert again.result == {"charged": 12.5, "currency": "EUR"}
    assert again.token == claim.token and not again.failed


async def test_conflict_on_a_different_fingerprint_while_held_and_after_completion(
    adedupe: AsyncDeduplicator,
) -> None:
    claim = await adedupe.begin("k", fingerprint="payload-a")
    assert (await adedupe.begin("k", fingerprint="payload-b")).outcome is Outcome.CONFLICT
    await adedupe.complete(claim, 1)
    assert (await adedupe.begin("k", fingerprint="payload-b")).outcome is Outcome.CONFLICT
    assert (await adedupe.begin("k", fingerprint="payload-a")).outcome is Outcome.DUPLICATE
    assert (await adedupe.begin("k")).outcome is Outcome.DUPLICATE  # no fingerprint: no check


async def test_release_frees_the_key_and_the_next_token_is_larger(adedupe: AsyncDeduplicator) -> None:
    first = await adedupe.begin("k")
    assert await adedupe.release(first) is True
    second = await adedupe.begin("k")
    assert second.outcome is Outcome.ACQUIRED and second.token > first.token
    assert await adedupe.release(first) is False  # stale token: nothing changes
    assert (await adedupe.begin("k")).outcome is Outcome.IN_PROGRESS


async def test_tokens_increase_across_lease_expiry(aredis: redis.asyncio.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=0.15, result_ttl=30)
    tokens = []
    for _ in range(3):
        claim = await d.begin("k")
        assert claim.outcome is Outcome.ACQUIRED
        tokens.append(claim.token)
        await asyncio.sleep(0.2)
    assert tokens == sorted(set(tokens)) and len(tokens) == 3  # strictly increasing


async def test_zombie_completion_is_fenced_off(aredis: redis.asyncio.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=0.2, result_ttl=30)
    a = await d.begin("payment-9")
    await asyncio.sleep(0.3)  # A is paused past its lease
    b = await d.begin("payment-9")
    assert b.outcome is Outcome.ACQUIRED and b.token > a.token
    await d.complete(b, "B's result")
    with pytest.raises(LeaseLost) as info:
        await d.complete(a, "A's late result")
    assert info.value.token == a.token
    assert (await d.begin("payment-9")).result == "B's result"


async def test_zombie_cannot_complete_over_a_live_successor(aredis: redis.asyncio.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=0.2, result_ttl=30)
    a = await d.begin("k")
    await asyncio.sleep(0.3)
    b = await d.begin("k")
    with pytest.raises(LeaseLost):
        await d.complete(a, "late")
    assert await d.renew(a) is False and await d.release(a) is False
    assert (await d.begin("k")).outcome is Outcome.IN_PROGRESS  # B's lease is untouched
    await d.complete(b, "ok")


async def test_renew_extends_only_the_owner(aredis: redis.asyncio.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=0.3, result_ttl=30)
    claim = await d.begin("k")
    for _ in range(4):
        await asyncio.sleep(0.15)
        assert await d.renew(claim) is True
    assert (await d.begin("k")).outcome is Outcome.IN_PROGRESS  # 0.6 s later, still ours
    await d.complete(claim, None)
    assert await d.renew(claim) is False


async def test_an_expired_lease_nobody_took_is_still_ours(aredis: redis.asyncio.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=0.1, result_ttl=30)
    claim = await d.begin("k")
    await asyncio.sleep(0.15)
    await d.complete(claim, "late but unopposed")
    assert (await d.begin("k")).result == "late but unopposed"


async def test_fail_stores_a_permanent_failure(adedupe: AsyncDeduplicator) -> None:
    claim = await adedupe.begin("k")
    await adedupe.fail(claim, ValueError("card declined"))
    again = await adedupe.begin("k")
    assert again.outcome is Outcome.DUPLICATE and again.failed
    assert again.error == {"type": "builtins.ValueError", "message": "card declined"}


async def test_result_ttl_ends_protection(aredis: redis.asyncio.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=1, result_ttl=0.2)
    await d.complete(await d.begin("k"), 1)
    assert (await d.begin("k")).outcome is Outcome.DUPLICATE
    await asyncio.sleep(0.3)
    assert (await d.begin("k")).outcome is Outcome.ACQUIRED


async def test_released_records_expire_after_retention(
    aredis: redis.asyncio.Redis, redis_client: redis.Redis, namespace: str
) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=0.1, result_ttl=30, token_retention=0.3)
    await d.release(await d.begin("k"))
    started, _ = keys_of(d, "k")
    assert 0 < redis_client.pttl(started) <= 300
    await asyncio.sleep(0.4)
    assert not redis_client.exists(started)


async def test_oversized_result_is_stored_as_omitted(aredis: redis.asyncio.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, max_result_bytes=100)

    async def big() -> str:
        return "x" * 1000

    async def never() -> str:
        return "never"

    assert await d.run("k", big) == "x" * 1000  # the caller still gets its value
    assert (await d.begin("k")).result is OMITTED
    assert await d.run("k", never) is OMITTED


async def test_status_reads_without_changing(adedupe: AsyncDeduplicator) -> None:
    assert (await adedupe.status("k")).state == "free"
    claim = await adedupe.begin("k")
    state = await adedupe.status("k")
    assert state.state == "in_progress" and state.token == claim.token and state.remaining_ms > 0
    await adedupe.complete(claim, [1, 2])
    done = await adedupe.status("k")
    assert done.state == "done" and done.status == "c"
    assert (await adedupe.begin("k")).outcome is Outcome.DUPLICATE


async def test_forget_removes_records_only_for_their_owner(adedupe: AsyncDeduplicator) -> None:
    claim = await adedupe.begin("k")
    assert await adedupe.forget("k") is False  # a live lease, not forced
    assert await adedupe.forget("k", token=claim.token + 1) is False
    assert await adedupe.forget("k", token=claim.token) is True
    assert (await adedupe.begin("k")).outcome is Outcome.ACQUIRED


async def test_script_cache_flush_is_survived(adedupe: AsyncDeduplicator, redis_client: redis.Redis) -> None:
    await adedupe.begin("warm")
    redis_client.script_flush()
    assert (await adedupe.begin("k")).outcome is Outcome.ACQUIRED
    redis_client.script_flush()
    assert (await adedupe.begin_many(["a", "b"]))[1].outcome is Outcome.ACQUIRED


async def test_a_retried_completion_that_already_succeeded_answers_stored(adedupe: AsyncDeduplicator) -> None:
    claim = await adedupe.begin("retried")
    row = [(claim.stem, claim.token, Stored.COMPLETED, b'"v"')]
    assert await adedupe.store.scripts.call_all(adedupe.store.complete_calls(row, 60_000)) == [[1]]
    assert await adedupe.store.scripts.call_all(adedupe.store.complete_calls(row, 60_000)) == [[1]]  # the retry
    later = await adedupe.begin("retried")
    assert later.outcome is Outcome.DUPLICATE and later.result == "v"
    other = [(claim.stem, claim.token - 1, Stored.COMPLETED, b'"x"')]
    assert await adedupe.store.scripts.call_all(adedupe.store.complete_calls(other, 60_000)) == [[0]]  # refused


async def test_batches_claim_and_complete_in_one_round_trip_each(adedupe: AsyncDeduplicator) -> None:
    claims = await adedupe.begin_many(["a", "b", "a"])
    assert [c.outcome for c in claims] == [Outcome.ACQUIRED, Outcome.ACQUIRED, Outcome.IN_PROGRESS]
    assert claims[2].token == claims[0].token  # the repeat is held by our own first copy
    assert await adedupe.complete_many([(claims[0], 1), (claims[1], object())]) == [True, True]
    again = await adedupe.begin_many(["a", "b"])
    assert again[0].result == 1 and again[1].omitted  # not serialisable: stored as omitted


async def test_sync_and_async_clients_share_one_namespace(
    adedupe: AsyncDeduplicator, redis_client: redis.Redis, namespace: str
) -> None:
    sync = Deduplicator(redis_client, namespace=namespace)
    claim = sync.begin("shared", fingerprint="p")
    assert (await adedupe.begin("shared", fingerprint="p")).outcome is Outcome.IN_PROGRESS
    sync.complete(claim, {"by": "sync"})
    assert (await adedupe.begin("shared", fingerprint="p")).result == {"by": "sync"}
    mine = await adedupe.begin("other")
    assert sync.begin("other").outcome is Outcome.IN_PROGRESS
    await adedupe.complete(mine, "async")
    assert sync.begin("other").result == "async"
    sync.close()


async def test_begin_with_wait_is_woken_by_the_holders_completion(adedupe: AsyncDeduplicator) -> None:
    holder = await adedupe.begin("held")

    async def complete_later() -> float:
        await asyncio.sleep(0.5)
        await adedupe.complete(holder, "holder's value")
        return time.monotonic()

    completing = asyncio.create_task(complete_later())
    began = time.monotonic()
    claim = await adedupe.begin("held", wait=5)
    returned = time.monotonic()
    assert claim.outcome is Outcome.DUPLICATE and claim.result == "holder's value"
    assert returned - began >= 0.4  # it did wait
    assert returned - await completing < 1.0  # woken by the completion, well before the 5 s bound


async def test_begin_with_wait_takes_a_released_key_and_never_outlasts_its_bound(
    adedupe: AsyncDeduplicator,
) -> None:
    await adedupe.begin("stuck")
    began = time.monotonic()
    assert (await adedupe.begin("stuck", wait=0.3)).outcome is Outcome.IN_PROGRESS
    assert time.monotonic() - began < 4.0  # bounded by wait, not by the 5 s lease
    holder = await adedupe.begin("given-back")
    asyncio.get_running_loop().call_later(0.2, lambda: asyncio.ensure_future(adedupe.release(holder)))
    taken = await adedupe.begin("given-back", wait=5)
    assert taken.outcome is Outcome.ACQUIRED and taken.token > holder.token


async def test_redis_down_is_store_unavailable(namespace: str) -> None:
    d = AsyncDeduplicator.from_url(f"redis://127.0.0.1:{services.free_port()}/0", namespace=namespace)
    with pytest.raises(StoreUnavailable):
        await d.begin("k")
    with pytest.raises(StoreUnavailable):
        await d.begin_many(["a", "b"])
    await d.aclose()


async def test_from_settings_reads_the_environment(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    monkeypatch.setenv("DEDUPE_REDIS_URL", redis_url)
    monkeypatch.setenv("DEDUPE_LEASE", "2.5")
    monkeypatch.setenv("DEDUPE_NAMESPACE", "billing-async")
    d = AsyncDeduplicator.from_settings(result_ttl=7)
    assert d.lease == 2.5 and d.result_ttl == 7 and d.layout.namespace == "billing-async"
    assert d.store.client.connection_pool.max_connections == 64  # a bounded pool that queues
    await d.aclose()


async def test_wait_replicas_refuses_a_claim_no_replica_acknowledged_and_gives_it_back(
    private_redis: services.RedisServer,
) -> None:
    """A redis-server of the test's own, without replicas: ``WAIT 1`` in the claim's pipeline is
    never acknowledged, so the claim is refused as not durable and given back."""
    d = AsyncDeduplicator.from_url(private_redis.url, namespace="w", wait_replicas=1, wait_timeout=0.05)
    calls = []

    async def never() -> None:
        calls.append(1)

    with pytest.raises(StoreUnavailable, match="not durable"):
        await d.begin("k")
    assert (await d.status("k")).state == "free"  # the claim it took was given back
    with pytest.raises(StoreUnavailable, match="not durable"):
        await d.run("k2", never)
    assert calls == [] and (await d.status("k2")).state == "free"
    await d.aclose()


async def test_waiters_of_one_loop_share_one_watch_one_task_and_one_connection(
    redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    """200 coroutines wait on one held key through a pool of 4 connections: one waiter is counted
    in Redis, one task blocks on the notices, and the holder's completion (which needs a pooled
    connection too) wakes them all with its value."""
    pool = redis.asyncio.BlockingConnectionPool.from_url(redis_url, max_connections=4, timeout=30)
    client = redis.asyncio.Redis.from_pool(pool)
    d = AsyncDeduplicator(client, namespace=namespace, lease=10)
    holder = await d.begin("order")
    before = asyncio.all_tasks()
    waiters = [asyncio.create_task(d.begin("order", wait=20)) for _ in range(200)]
    deadline = time.monotonic() + 15
    while d.waiter.waiting(holder.stem) < 200 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert d.waiter.waiting(holder.stem) == 200
    started, _ = keys_of(d, "order")
    assert redis_client.hget(started, "w") == b"1"  # one watch.lua for all 200
    assert [t.get_name() for t in asyncio.all_tasks() - before - set(waiters)] == ["dedupe-key-waiter"]
    await d.complete(holder, "charged")
    claims = await asyncio.gather(*waiters)
    assert {(c.outcome, c.result) for c in claims} == {(Outcome.DUPLICATE, "charged")}
    assert d.waiter.waiting(holder.stem) == 0
    await d.aclose()
    await client.aclose()


async def test_a_missing_script_reloads_them_all(
        private_redis: services.RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the synchronous runner: after a NOSCRIPT every protocol script is loaded, so a pipeline
    that gives a claim back and claims the key again never finds release.lua missing while
    claim.lua is loaded (the retried release would run after the claim: our own lease, IN_PROGRESS)."""
    from dedupe_worker._transport.script_flow import SCRIPT_NAMES

    monkeypatch.setenv("DEDUPE_SCRIPTS", "eval")  # SCRIPT LOAD + EVALSHA (Functions: test_functions)
    sync_client = redis.Redis.from_url(private_redis.url)
    d = AsyncDeduplicator(redis.asyncio.Redis.from_url(private_redis.url), namespace="reload", lease=5)
    try:
        shas = [(await d.store.scripts.shas())[name] for name in SCRIPT_NAMES]
        sync_client.script_flush()
        first = await d.begin("given-back")  # NOSCRIPT for claim.lua
        assert sync_client.script_exists(*shas) == [True] * len(shas)
        request = d.request("given-back")
        released, replies = await d._drive(d.round_trip((
            d.store.release_calls([(first.stem, first.token)], 5000),
            d.store.claim_calls([(request.stem, request.fingerprint, request.original)], 5000, 60_000))))
        (again,) = d.store.claim_replies(replies)
        assert released == [1] and again.outcome is Outcome.ACQUIRED and again.token > first.token
    finally:
        await d.aclose()
        sync_client.close()

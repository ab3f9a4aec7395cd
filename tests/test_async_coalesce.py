"""Coalesced round trips of the asyncio script runner: script calls of concurrent coroutines made
in one event-loop turn go to Redis as one pipeline, each caller getting its own reply or error."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import hiredis
import pytest
import redis
import redis.asyncio
from redis.asyncio.connection import AbstractConnection

from dedupe_worker import InProgress, StoreUnavailable
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker.asyncio import AsyncDeduplicator

from . import services
from .async_fixtures import adedupe, aredis

__all__ = ["adedupe", "aredis"]

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("accelerated")]  # the direct sender is tested here too


async def zero() -> int:
    return 0


async def echo(i: int) -> int:
    return i


def count_round_trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every write of a ``redis.asyncio`` connection (one entry per round trip: a single
    command, or a pipeline of several, whichever way it was sent), independently of the runner's
    own counter: the written bytes are parsed back into commands."""
    trips: list[str] = []
    send = AbstractConnection.send_packed_command

    async def counted(self: AbstractConnection, command: Any, *args: Any, **kwargs: Any) -> None:
        reader = hiredis.Reader()
        for chunk in [command] if isinstance(command, (bytes, str)) else command:
            reader.feed(chunk.encode() if isinstance(chunk, str) else bytes(chunk))
        names = []
        while (parsed := reader.gets()) is not False:
            names.append(parsed[0].decode().upper())
        trips.append(f"command {names[0]}" if len(names) == 1 else f"pipeline of {len(names)}")
        await send(self, command, *args, **kwargs)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    return trips


async def test_fifty_concurrent_runs_share_round_trips(adedupe: AsyncDeduplicator,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    await adedupe.run("warm-up", zero)
    trips = count_round_trips(monkeypatch)
    calls: list[int] = []

    async def handler(i: int) -> str:
        calls.append(i)
        return f"value-{i}"

    results = await asyncio.gather(*(adedupe.run(f"k{i}", handler, i) for i in range(50)))
    assert results == [f"value-{i}" for i in range(50)]
    assert sorted(calls) == list(range(50))
    assert len(trips) <= 10, trips  # 100 script calls (claim + complete each), one trip each before
    # each answer is its own, and stored: run again, every key is a duplicate with its own value
    again = await asyncio.gather(*(adedupe.run(f"k{i}", handler, i) for i in range(50)))
    assert again == results and len(calls) == 50


async def test_sequential_calls_are_sent_at_once(adedupe: AsyncDeduplicator, monkeypatch: pytest.MonkeyPatch) -> None:
    await adedupe.run("warm-up", zero)
    trips = count_round_trips(monkeypatch)
    for i in range(5):
        assert await adedupe.run(f"s{i}", echo, i) == i
    assert len(trips) == 10 and all(trip.startswith("command") for trip in trips), trips


async def test_one_callers_error_or_cancellation_leaves_the_others_alone(
        adedupe: AsyncDeduplicator, aredis: redis.asyncio.Redis, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = adedupe.store.scripts
    await adedupe.run("warm-up", zero)
    trips = count_round_trips(monkeypatch)
    broken = f"{namespace}:{{bad}}"
    stems = [f"{namespace}:{{c{i}}}" for i in range(20)]

    def claim(stem: str) -> Any:
        # a lease that is not a number: claim.lua's arithmetic on it fails, an error reply for
        # this call alone (a record of another type is answered UNREADABLE, not an error)
        lease = "not a number" if stem == broken else 30000
        return runner.call("claim", list(KeyLayout.records(stem)), [lease, 600000, "", ""])

    blocker = asyncio.ensure_future(claim(stems[0]))  # in flight: the others queue behind it
    await asyncio.sleep(0)
    tasks = [asyncio.ensure_future(claim(stem)) for stem in stems[1:]]
    bad = asyncio.ensure_future(claim(broken))
    await asyncio.sleep(0)  # they ran and queued; the flush comes in the next turn
    assert len(runner._queue) == 20
    tasks[3].cancel()  # queued, before the flush: left out of the pipeline
    results = await asyncio.gather(blocker, *tasks, bad, return_exceptions=True)
    assert isinstance(results[-1], StoreUnavailable) and "arithmetic" in str(results[-1])
    assert isinstance(results[4], asyncio.CancelledError)
    for i, reply in enumerate(results[:-1]):
        if i != 4:
            assert not isinstance(reply, BaseException), reply
            assert reply[0] in (0, b"0", 1, b"1") or reply is not None
    assert any(trip.startswith("pipeline") for trip in trips) and len(trips) < 10, trips
    # the cancelled caller's claim never ran; every other claim ran once
    assert await aredis.exists(stems[4] + ":started") == 0
    assert await aredis.exists(*[stem + ":started" for i, stem in enumerate(stems) if i != 4]) == 19

    # cancelled after the flush: its reply is dropped, the others' are theirs
    await asyncio.sleep(0)
    blocker = asyncio.ensure_future(claim(f"{namespace}:{{d0}}"))
    await asyncio.sleep(0)
    later = [asyncio.ensure_future(claim(f"{namespace}:{{d{i}}}")) for i in range(1, 10)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the flush ran: the pipeline is on its way
    later[0].cancel()
    done = await asyncio.gather(blocker, *later, return_exceptions=True)
    assert isinstance(done[1], asyncio.CancelledError)
    assert all(not isinstance(reply, BaseException) for i, reply in enumerate(done) if i != 1)
    assert await aredis.exists(f"{namespace}:{{d1}}:started") == 1  # it was sent: only its reply was dropped


async def test_a_connection_drop_fails_the_whole_pipeline_and_applies_nothing_twice(
        private_redis: services.RedisServer, namespace: str) -> None:
    admin = redis.Redis.from_url(private_redis.url)
    d = AsyncDeduplicator.from_url(private_redis.url, namespace=namespace, lease=5.0, result_ttl=60.0)
    calls: list[int] = []

    async def handler(i: int) -> int:
        calls.append(i)
        return i

    try:
        await d.run("warm-up", zero)
        admin.client_pause(5000, all=False)  # writes (the claims) wait on the server
        runs = [asyncio.ensure_future(d.run(f"k{i}", handler, i)) for i in range(20)]
        await asyncio.sleep(0.3)
        assert d.store.scripts.round_trips >= 2 and not any(run.done() for run in runs)
        private_redis.stop()  # the pipeline's connection drops; no reconnect can succeed
        outcomes = await asyncio.gather(*runs, return_exceptions=True)
        assert all(isinstance(outcome, StoreUnavailable) for outcome in outcomes), outcomes
        assert calls == []
    finally:
        await d.aclose()
        admin.close()
    private_redis.start()
    d = AsyncDeduplicator.from_url(private_redis.url, namespace=namespace, lease=5.0, result_ttl=60.0)
    try:
        assert await asyncio.gather(*(d.run(f"k{i}", handler, i) for i in range(20))) == list(range(20))
        assert sorted(calls) == list(range(20))
    finally:
        await d.aclose()


def lose_first_replies(monkeypatch: pytest.MonkeyPatch, adedupe: AsyncDeduplicator) -> list[list[Any]]:
    """Make round trips lose their replies once: the scripts ran, then the connection drops before
    the answers reach us, so redis-py's retry sends the whole round trip again. Lost: the first
    round trip of several calls (a coalesced batch of claims) and every one carrying a completion.
    Returns the replies of each round trip that were lost."""
    runner = adedupe.store.scripts
    sender = runner._direct
    assert sender is not None, "a plain redis.asyncio client sends script calls directly"
    completion = {f"{runner.flows.library}_complete", runner.sha.get("complete")}
    attempts: contextvars.ContextVar[list[int]] = contextvars.ContextVar("attempts")
    execute_many, read = sender.execute_many, sender._replies
    lost: list[list[Any]] = []

    async def marked(commands: Any) -> list[Any]:
        batch = len(commands) > 1 and not any(len(replies) > 1 for replies in lost)
        lose = batch or any(command[1] in completion for command in commands)
        attempts.set([0 if lose else 1])  # one round trip: every attempt of it runs in this context
        return await execute_many(commands)

    async def lossy(connection: Any, count: int) -> list[Any]:
        replies = await read(connection, count)  # the scripts ran and answered
        attempt = attempts.get()
        attempt[0] += 1
        if attempt[0] == 1:
            lost.append(replies)
            await connection.disconnect()
            raise redis.ConnectionError("connection reset before the replies were read")
        return replies

    monkeypatch.setattr(sender, "execute_many", marked)
    monkeypatch.setattr(sender, "_replies", lossy)
    return lost


async def test_replies_lost_mid_batch_resend_it_and_run_no_handler_twice(
        redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # from_url: the client retries a connection error twice (redis-py's own default is no retry)
    d = AsyncDeduplicator.from_url(redis_url, namespace=namespace, lease=1.0, result_ttl=60.0)
    calls: list[int] = []

    async def handler(i: int) -> int:
        calls.append(i)
        return i

    try:
        await d.run("warm-up", zero)
        lost = lose_first_replies(monkeypatch, d)
        outcomes = await asyncio.gather(*(d.run(f"k{i}", handler, i) for i in range(30)), return_exceptions=True)
        assert lost, "some calls were coalesced"
        assert any(isinstance(outcome, InProgress) for outcome in outcomes)  # a claim was resent
        assert any(reply == [1] for replies in lost for reply in replies)  # and a completion
        assert not any(isinstance(outcome, BaseException) and not isinstance(outcome, InProgress)
                       for outcome in outcomes), outcomes
        assert len(calls) == len(set(calls))  # nothing ran twice
        for i, outcome in enumerate(outcomes):
            # a resent claim finds the key held by its own first attempt: InProgress, nothing run;
            # a resent completion answers [1] again: the caller gets its value
            if isinstance(outcome, InProgress):
                assert i not in calls
            else:
                assert outcome == i and i in calls, outcome
        monkeypatch.undo()
        await asyncio.sleep(1.2)  # the leases taken by lost claims run out
        again = await asyncio.gather(*(d.run(f"k{i}", handler, i) for i in range(30)))
        assert again == list(range(30))
        assert sorted(calls) == list(range(30))  # each handler ran exactly once in all
    finally:
        await d.aclose()


@pytest.mark.parametrize("flush", ["FUNCTION", "SCRIPT"])
async def test_scripts_flushed_mid_run_are_reloaded_per_call(
        redis_url: str, namespace: str, flush: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if flush == "SCRIPT":  # EVALSHA, as on Redis 6 (Redis 7 would call the function library)
        monkeypatch.setenv("DEDUPE_SCRIPTS", "eval")
    d = AsyncDeduplicator.from_url(redis_url, namespace=namespace, lease=5.0, result_ttl=60.0)
    sender = d.store.scripts._direct
    assert sender is not None
    read = sender._replies
    missing: list[str] = []  # the error replies that coalesced round trips met

    async def recorded(connection: Any, count: int) -> list[Any]:
        replies = await read(connection, count)
        missing.extend(f"{type(reply).__name__}: {reply}" for reply in replies if isinstance(reply, Exception))
        return replies

    monkeypatch.setattr(sender, "_replies", recorded)
    calls: list[int] = []
    claimed = asyncio.Event()

    async def handler(i: int) -> int:
        calls.append(i)
        if len(calls) == 40:  # every claim is in: flushed again, the batches of completions miss
            await d.store.client.execute_command(flush, "FLUSH")
            claimed.set()
        await claimed.wait()
        return i

    try:
        await d.run("warm-up", zero)
        await d.store.client.execute_command(flush, "FLUSH")  # the first batch of claims misses
        results = await asyncio.gather(*(d.run(f"k{i}", handler, i) for i in range(40)))
        assert results == list(range(40)) and sorted(calls) == list(range(40))
        assert missing and all(("NoScriptError" if flush == "SCRIPT" else "Function not found") in error
                               for error in missing), missing
        assert await asyncio.gather(*(d.run(f"k{i}", handler, i) for i in range(40))) == results
        assert len(calls) == 40
    finally:
        claimed.set()
        await d.aclose()


async def test_a_run_cancelled_in_a_batch_leaves_the_others_alone(adedupe: AsyncDeduplicator) -> None:
    await adedupe.run("warm-up", zero)
    started = asyncio.Event()
    calls: list[int] = []

    async def handler(i: int) -> int:
        calls.append(i)
        if i == 7 and not started.is_set():  # the first time only: cancelled in there
            started.set()
            await asyncio.sleep(10)
        return i

    runs = [asyncio.ensure_future(adedupe.run(f"k{i}", handler, i)) for i in range(20)]
    await started.wait()
    runs[7].cancel()  # inside its handler: its claim is released, in a batch with others' calls
    outcomes = await asyncio.gather(*runs, return_exceptions=True)
    assert isinstance(outcomes[7], asyncio.CancelledError)
    assert [o for i, o in enumerate(outcomes) if i != 7] == [i for i in range(20) if i != 7]
    assert await adedupe.run("k7", handler, 7) == 7  # released: claimed and run again at once
    assert sorted(calls) == sorted([*range(20), 7])


async def test_a_client_that_is_not_plain_redis_keeps_the_pipeline() -> None:
    from dedupe_worker.testing import in_memory_async

    d = in_memory_async()
    assert d.store.scripts._direct is None  # fakeredis replaces the connection's reads
    try:
        assert await asyncio.gather(*(d.run(f"k{i}", echo, i) for i in range(20))) == list(range(20))
    finally:
        await d.aclose()


async def test_sequential_calls_share_one_held_connection_given_back_on_close(
        redis_url: str, namespace: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    pool = client.connection_pool
    d = AsyncDeduplicator(client, namespace=namespace, lease=5.0, result_ttl=60.0)
    sender = d.store.scripts._direct
    assert sender is not None
    try:
        for i in range(20):
            assert await d.run(f"k{i}", echo, i) == i
        assert sender._held is not None
        held = sender._held.connection
        assert held is not None and held in pool._in_use_connections  # kept out of the pool
        for i in range(20):
            assert await d.run(f"k{i}", echo, -1) == i  # duplicates: the same connection
        assert sender._held.connection is held
        other = AsyncDeduplicator(client, namespace=namespace + "-other", lease=5.0, result_ttl=60.0)
        assert await other.run("k-other", echo, 3) == 3
        assert other.store.scripts._direct._held is sender._held  # one held connection per pool
        assert len(pool._in_use_connections) == 1
        await other.aclose()
        assert held in pool._in_use_connections  # still ours
        assert await d.run("k-after", echo, 4) == 4 and sender._held.connection is held
    finally:
        await d.aclose()
    assert sender._held is None and held in pool._available_connections  # given back by the last one
    assert not pool._in_use_connections
    await client.aclose()


async def test_a_call_cancelled_on_the_held_connection_drops_it_and_the_next_reconnects(
        adedupe: AsyncDeduplicator) -> None:
    await adedupe.run("warm-up", zero)
    sender = adedupe.store.scripts._direct
    assert sender is not None and sender._held is not None and sender._held.connection is not None
    read = sender._replies
    stalled = asyncio.Event()

    async def stall(connection: Any, count: int) -> list[Any]:
        stalled.set()
        await asyncio.sleep(10)  # the reply is never read
        return await read(connection, count)

    sender._replies = stall  # type: ignore[method-assign]
    claim = asyncio.ensure_future(adedupe.begin("k-cancelled"))
    await stalled.wait()
    claim.cancel()
    with pytest.raises(asyncio.CancelledError):
        await claim
    assert not sender._held.connection.is_connected  # an unread reply: never sent on again as it is
    del sender._replies
    assert await adedupe.run("k-next", echo, 7) == 7  # reconnected, in step
    assert sender._held.connection.is_connected


async def test_a_small_pool_keeps_no_connection(redis_url: str, namespace: str) -> None:
    client = redis.asyncio.Redis.from_pool(redis.asyncio.ConnectionPool.from_url(redis_url, max_connections=4))
    d = AsyncDeduplicator(client, namespace=namespace, lease=5.0, result_ttl=60.0)
    try:
        assert await d.run("k", echo, 1) == 1
        assert d.store.scripts._direct is not None and d.store.scripts._direct._held is None
        assert not client.connection_pool._in_use_connections
    finally:
        await d.aclose()
        await client.aclose()


async def test_a_write_that_outlasts_socket_timeout_fails_as_redis_does(redis_url: str) -> None:
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from dedupe_worker._transport.async_direct import DirectSender

    client = redis.asyncio.Redis.from_url(redis_url, socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
    sender = DirectSender.for_client(client)
    assert sender is not None
    try:
        assert await sender.execute(("PING",)) == b"PONG"
        connection = sender._held.connection
        send = connection.send_packed_command

        async def stuck(packed: Any, check_health: bool = True) -> None:
            await asyncio.sleep(5)  # a full socket buffer: the write never completes

        connection.send_packed_command = stuck
        began = asyncio.get_running_loop().time()
        with pytest.raises(redis.TimeoutError):
            await sender.execute(("PING",))
        assert asyncio.get_running_loop().time() - began < 2  # bounded by socket_timeout
        assert connection.socket_timeout == 0.2  # set back after the call
        connection.send_packed_command = send
        assert await sender.execute(("PING",)) == b"PONG"
        assert connection.socket_timeout == 0.2
    finally:
        await sender.release_held()
        await client.aclose()

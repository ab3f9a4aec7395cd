"""Coalesced round trips of the asyncio script runner: script calls of concurrent coroutines made
in one event-loop turn go to Redis as one pipeline, each caller getting its own reply or error."""

from __future__ import annotations

import asyncio
from typing import Any

import hiredis
import pytest
import redis
import redis.asyncio
from redis.asyncio.connection import AbstractConnection

from dedupe_worker import StoreUnavailable
from dedupe_worker.asyncio import AsyncDeduplicator

from . import services
from .async_fixtures import adedupe, aredis

__all__ = ["adedupe", "aredis"]

pytestmark = pytest.mark.asyncio


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
    await aredis.rpush(broken + ":started", "x")  # claim.lua meets WRONGTYPE on this key
    stems = [f"{namespace}:{{c{i}}}" for i in range(20)]

    def claim(stem: str) -> Any:
        return runner.call("claim", [stem + ":started", stem + ":result"], [30000, 600000, "", ""])

    blocker = asyncio.ensure_future(claim(stems[0]))  # in flight: the others queue behind it
    await asyncio.sleep(0)
    tasks = [asyncio.ensure_future(claim(stem)) for stem in stems[1:]]
    bad = asyncio.ensure_future(claim(broken))
    await asyncio.sleep(0)  # they ran and queued; the flush comes in the next turn
    assert len(runner._queue) == 20
    tasks[3].cancel()  # queued, before the flush: left out of the pipeline
    results = await asyncio.gather(blocker, *tasks, bad, return_exceptions=True)
    assert isinstance(results[-1], StoreUnavailable) and "WRONGTYPE" in str(results[-1])
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

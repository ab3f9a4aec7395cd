"""Finishing writes retried on transient store errors while the lease lasts; script flags by version.

The policy (:mod:`dedupe_worker._protocol.retry`) is sans-I/O and tested as such; the drivers are
tested on a private Redis made ``BUSY`` by a long script while handlers finish, sync and asyncio.
The ``#!lua`` flags decision is tested as a function of ``INFO server`` (no Redis 6 binary here)
and end to end with a client that reports Redis 6.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterError,
    OutOfMemoryError,
    ResponseError,
    TryAgainError,
)

from dedupe_worker import Deduplicator, LeaseLost, Reason, StoreUnavailable, decide
from dedupe_worker._protocol.calls import NotDurable
from dedupe_worker._protocol.retry import FinishRetry, transient
from dedupe_worker._transport.script_flow import script_text, takes_flags
from dedupe_worker._transport.scripts import ScriptRunner, load_script
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.asyncio import decide as async_decide
from dedupe_worker.testing import in_memory

from .services import RedisServer

BUSY_SECONDS = 0.6
BUSY_SCRIPT = """
local s = redis.call('TIME')
repeat
  local t = redis.call('TIME')
until (t[1] - s[1]) * 1000000 + (t[2] - s[2]) > tonumber(ARGV[1])
return 1
"""


def wrapped(error: BaseException) -> StoreUnavailable:
    """As the script runners raise it: the redis-py error chained."""
    try:
        raise StoreUnavailable(f"Redis failed running complete.lua: {error}") from error
    except StoreUnavailable as exc:
        return exc


# -- the policy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [
    TryAgainError("Multiple keys request during rehashing of slot"), AskError("3999 127.0.0.1:6381"),
    ClusterError("TTL exhausted."), BusyLoadingError("Redis is loading the dataset in memory"),
    ResponseError("BUSY Redis is busy running a script."), OutOfMemoryError("command not allowed"),
    ResponseError("Error running script: @user_script:33: OOM command not allowed when used memory > 'maxmemory'"),
    redis.ConnectionError("Connection reset by peer"), redis.TimeoutError("Timeout reading from socket"),
])
def test_transient_errors_are_seen_through_store_unavailable(error: Exception) -> None:
    assert transient(wrapped(error))


@pytest.mark.parametrize("error", [
    ResponseError("ERR Error running script: attempt to compare nil with number"), ValueError("bad"),
    NotDurable(0, 1, 100, []), LeaseLost("k", 1), StoreUnavailable("no cause"),
])
def test_other_errors_are_not_retried(error: Exception) -> None:
    assert not transient(error if isinstance(error, StoreUnavailable) else wrapped(error))


def test_backoff_doubles_and_stops_before_the_lease_is_spent() -> None:
    policy = FinishRetry(lease=3.0, renew_interval=1.0)
    assert [d for d, _ in zip(policy.delays(), range(7), strict=False)] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.25, 0.25]
    error = wrapped(TryAgainError("TRYAGAIN"))
    attempts = policy.attempts(started=100.0)
    # not renewed since: the lease is taken to end one interval after the write began, less 0.3 s
    assert attempts.after(error, now=100.0, renewed_at=float("-inf")) == 0.01
    assert attempts.after(error, now=101.69, renewed_at=float("-inf")) is None
    # a renewal round Redis answered moves the end on
    assert policy.attempts(100.0).after(error, now=101.69, renewed_at=101.5) == 0.01
    assert policy.attempts(100.0).after(wrapped(ResponseError("ERR wrong")), now=100.0, renewed_at=100.0) is None


# -- the drivers, on a Redis kept BUSY by a long script -------------------------------------------


@pytest.fixture
def busy_redis(private_redis: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url)
    client.config_set("busy-reply-threshold", 50)  # others get BUSY once a script ran 50 ms
    yield client
    client.close()


def keep_busy(url: str, started: threading.Event) -> threading.Thread:
    def run() -> None:
        blocker = redis.Redis.from_url(url)
        started.set()
        blocker.eval(BUSY_SCRIPT, 0, int(BUSY_SECONDS * 1_000_000))
        blocker.close()
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_completions_wait_out_a_busy_script(busy_redis: redis.Redis, private_redis: RedisServer) -> None:
    d = Deduplicator(busy_redis, namespace="busy", lease=3.0, result_ttl=60)
    started = threading.Event()
    blocker: list[threading.Thread] = []

    def handler() -> str:
        blocker.append(keep_busy(private_redis.url, started))
        started.wait(5)
        time.sleep(0.15)  # the script has run past the threshold: Redis answers BUSY
        return "done"

    began = time.monotonic()
    decision = decide(d, "k", handler)
    took = time.monotonic() - began
    blocker[0].join(5)
    assert decision.reason is Reason.APPLIED, decision
    assert took >= BUSY_SECONDS * 0.8  # it did wait for the script
    assert decide(d, "k", lambda: "again").reason is Reason.DUPLICATE
    d.close()


def test_asyncio_completions_wait_out_a_busy_script(busy_redis: redis.Redis, private_redis: RedisServer) -> None:
    async def main() -> tuple[Reason, Reason]:
        d = AsyncDeduplicator(redis.asyncio.Redis.from_url(private_redis.url), namespace="busy-a", lease=3.0,
                              result_ttl=60)
        started = threading.Event()
        blocker: list[threading.Thread] = []

        async def handler() -> str:
            blocker.append(keep_busy(private_redis.url, started))
            started.wait(5)
            await asyncio.sleep(0.15)
            return "done"

        first = (await async_decide(d, "k", handler)).reason
        blocker[0].join(5)

        async def again() -> str:
            return "again"

        second = (await async_decide(d, "k", again)).reason
        await d.aclose()
        await d.store.client.aclose()
        return first, second

    assert asyncio.run(main()) == (Reason.APPLIED, Reason.DUPLICATE)


# -- script flags by server version ---------------------------------------------------------------


def test_flags_only_for_redis_7_and_later() -> None:
    assert takes_flags({"redis_version": "7.0.15"})
    assert takes_flags({"redis_version": "7.2.4"})  # Valkey reports this
    assert not takes_flags({"redis_version": "6.2.14"})
    assert not takes_flags(None)  # INFO refused (fakeredis, managed ACLs): no flags, as on Redis 6
    assert not takes_flags({"redis_version": "unknown"})
    cluster = {"127.0.0.1:7000": {"redis_version": "7.0.15"}, "127.0.0.1:7001": {"redis_version": "6.2.14"}}
    assert not takes_flags(cluster)  # mid-upgrade: every primary must take them
    cluster["127.0.0.1:7001"] = {"redis_version": "7.0.15"}
    assert takes_flags(cluster)


def test_the_shebang_is_stripped_for_redis_6() -> None:
    for name in ("complete", "release", "renew", "forget"):
        text = load_script(name)
        assert text.startswith("#!lua flags=allow-oom\n")
        assert script_text(text, True) == text
        assert script_text(text, False) == text.split("\n", 1)[1]
        assert not script_text(text, False).startswith("#!")
    claim = load_script("claim")
    assert not claim.startswith("#!")  # claims are refused at maxmemory: new work is deferred
    assert script_text(claim, False) == claim


class ReportsRedis6(redis.Redis):
    """A client of the real Redis 7 that says it is Redis 6, to run the Redis 6 texts end to end."""

    def info(self, section: Any = None, *args: Any, **kwargs: Any) -> Any:
        return {"redis_version": "6.2.14"}


@pytest.mark.parametrize("version", [6, 7])
def test_the_sha_sent_is_the_sha_of_the_text_loaded(redis_url: str, namespace: str, version: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # EVALSHA, as on Redis 6 or with functions refused (Redis 7 would call the function library)
    monkeypatch.setenv("DEDUPE_SCRIPTS", "eval")
    # a pool too small for a held connection: INFO goes through the client's own info()
    client = (ReportsRedis6 if version == 6 else redis.Redis).from_url(redis_url, max_connections=2)
    d = Deduplicator(client, namespace=namespace, lease=5)
    runner: ScriptRunner = d.store.scripts
    assert runner.held is None
    complete = script_text(load_script("complete"), version >= 7)
    assert runner.sha["complete"] == hashlib.sha1(complete.encode()).hexdigest()
    claim = d.begin("k")
    d.complete(claim, 1)  # loaded on NOSCRIPT if missing, under the same SHA
    assert client.script_exists(runner.sha["complete"]) == [True]
    assert d.begin("k").result == 1
    d.close()
    client.close()


def test_the_in_memory_double_runs_the_scripts_without_flags() -> None:
    d = in_memory()
    claim = d.begin("k")
    d.complete(claim, {"ok": True})
    assert d.begin("k").result == {"ok": True}
    released = d.begin("r")
    assert d.release(released)
    assert d.forget("k")
    assert not d.store.scripts._text["complete"].startswith("#!")


def test_a_connection_torn_down_inside_redis_py_is_a_connection_error() -> None:
    """redis-py 8.1's asyncio client can raise AttributeError/TypeError from a connection that a
    concurrent disconnect tore down (seen during the slot migration test): counted as a
    connection error, so the write is retried or the message deferred, never an escaped crash."""
    from dedupe_worker._transport.async_scripts import torn_connection

    try:
        redis.connection.Connection.pack_command(object(), "PING")  # type: ignore[arg-type]
    except AttributeError as exc:
        torn = torn_connection(exc)
    assert isinstance(torn, redis.ConnectionError)
    assert transient(wrapped(torn))
    try:
        getattr(None, "writelines")  # noqa: B009 - raised here, in our code: not redis-py's
    except AttributeError as exc:
        assert torn_connection(exc) is None

"""The protocol as one Redis function library (``FCALL``) on Redis 7+ and Valkey: loaded and
called, kept across a restart with persistence and a Sentinel failover (no reload), loaded again
after ``FUNCTION FLUSH``, on every primary of a cluster; ``EVALSHA`` when ``FUNCTION`` is refused
or ``DEDUPE_SCRIPTS=eval``. Runs on Valkey too (conftest's ``BOTH_SERVERS``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.cluster import RedisCluster

from dedupe_worker import Deduplicator, decide_many
from dedupe_worker._operate import diagnose
from dedupe_worker._operate.doctor import loaded_libraries
from dedupe_worker._transport.script_flow import SCRIPTS_ENV
from dedupe_worker.asyncio import AsyncDeduplicator

from . import services
from .test_failover import Topology, topology, until

__all__ = ["topology"]  # fixture used by name


@pytest.fixture(autouse=True)
def _functions_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SCRIPTS_ENV, raising=False)


@pytest.fixture
def private() -> Iterator[services.RedisServer]:
    server = services.RedisServer(extra=("--appendonly", "yes", "--appendfsync", "always")).start()
    yield server
    server.stop()


def fcalls(client: Any) -> int:
    return int(client.info("commandstats").get("cmdstat_fcall", {}).get("calls", 0))


def test_calls_are_fcalls_of_our_versioned_library(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    dedupe = Deduplicator(client, namespace=f"fn-{uuid.uuid4().hex[:8]}", lease=5)
    before = fcalls(client)
    assert dedupe.run("a", lambda: "done") == "done"
    assert dedupe.run("a", lambda: "again") == "done"
    flows = dedupe.store.scripts.flows
    assert flows.functions and flows.library.startswith("dedupe_") and len(flows.library) == len("dedupe_") + 8
    assert flows.library in (loaded_libraries(client) or [])
    assert fcalls(client) >= before + 3  # claim, complete, claim (the duplicate)
    dedupe.close()


@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_a_flushed_library_is_loaded_again_sync_and_asyncio(kind: str) -> None:
    """``FUNCTION FLUSH`` (on a private server of each kind): the sync and asyncio runners meet
    "function not found", load the library once and send only the calls that ran nothing again."""
    binary = services.valkey_server_binary() if kind == "valkey" else None
    if kind == "valkey" and binary is None:
        services.unavailable("valkey-server")
    server = services.RedisServer(binary=binary).start()
    try:
        client = redis.Redis(port=server.port)
        dedupe = Deduplicator(client, namespace="fn", lease=5)
        assert dedupe.run("a", lambda: "a") == "a"
        client.function_flush()
        decisions = decide_many(dedupe, [(f"m{i}", None, (lambda i=i: i)) for i in range(5)])
        assert [d.value for d in decisions] == list(range(5))
        flows = dedupe.store.scripts.flows
        assert flows.functions and flows.loads == 2
        assert loaded_libraries(client) == [flows.library]
        dedupe.close()

        async def scenario() -> None:
            async with AsyncDeduplicator(redis.asyncio.Redis(port=server.port), namespace="fn", lease=5) as d:
                assert await d.run("b", _value, "b") == "b"
                aflows = d.store.scripts.flows
                assert aflows.functions and aflows.loads == 0  # the sync runner had loaded it
                client.function_flush()
                claims = await d.begin_many([f"n{i}" for i in range(3)])
                assert all(c.acquired for c in claims) and aflows.loads == 1
                assert loaded_libraries(client) == [aflows.library]

        asyncio.run(scenario())
        client.close()
    finally:
        server.stop()


async def _value(text: str) -> str:
    return text


def test_the_library_survives_a_restart_with_persistence_and_needs_no_reload(
        private: services.RedisServer) -> None:
    dedupe = Deduplicator(redis.Redis(port=private.port), namespace="fn", lease=5)
    assert dedupe.run("a", lambda: "done") == "done"
    flows = dedupe.store.scripts.flows
    assert flows.functions and flows.loads == 1  # a new server: loaded once
    private.stop()
    private.start()
    assert until(lambda: dedupe.run("a", lambda: "again"), what="run after the restart") == "done"
    assert dedupe.run("b", lambda: "b done") == "b done"
    assert flows.loads == 1  # the first calls after the restart found the library
    dedupe.close()


def test_eval_is_reloaded_after_a_restart_but_functions_after_a_flush(
        private: services.RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCRIPTS_ENV, "eval")
    client = redis.Redis(port=private.port)
    dedupe = Deduplicator(client, namespace="fn", lease=5)
    assert dedupe.run("a", lambda: "done") == "done"
    flows = dedupe.store.scripts.flows
    assert not flows.functions and flows.loads == 1 and loaded_libraries(client) == []
    private.stop()
    private.start()
    assert until(lambda: dedupe.run("a", lambda: "again"), what="run after the restart") == "done"
    assert flows.loads == 2  # scripts are not persisted: NOSCRIPT, loaded again
    dedupe.close()

    monkeypatch.delenv(SCRIPTS_ENV)
    dedupe = Deduplicator(client, namespace="fn", lease=5)
    assert dedupe.run("b", lambda: "b") == "b"
    client.function_flush()
    decisions = decide_many(dedupe, [(f"m{i}", None, (lambda i=i: i)) for i in range(5)])
    assert [d.value for d in decisions] == list(range(5))
    assert dedupe.store.scripts.flows.functions and dedupe.store.scripts.flows.loads == 2
    dedupe.close()


def test_a_user_without_function_falls_back_to_evalsha(
        private: services.RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    admin = redis.Redis(port=private.port)
    admin.execute_command("ACL", "SETUSER", "limited", "on", "nopass", "~*", "&*", "+@all", "-function")
    client = redis.Redis(port=private.port, username="limited", password="")
    dedupe = Deduplicator(client, namespace="fn", lease=5)
    with caplog.at_level("WARNING"):
        assert dedupe.run("a", lambda: "done") == "done"
        assert dedupe.run("a", lambda: "again") == "done"
    flows = dedupe.store.scripts.flows
    assert not flows.functions and loaded_libraries(admin) == []
    assert int(admin.info("commandstats")["cmdstat_evalsha"]["calls"]) >= 2
    assert any("EVALSHA" in r.getMessage() for r in caplog.records) or flows.loads == 1
    checks = {c.name: c for c in diagnose(client)}
    assert checks["functions"].warn and "EVALSHA" in checks["functions"].detail
    dedupe.close()


def test_the_replicated_library_needs_no_reload_after_a_sentinel_failover(topology: Topology) -> None:
    topology.start_sentinels()
    dedupe = Deduplicator.from_url(topology.sentinel_url, namespace="fn-ha", lease=5)
    try:
        assert dedupe.run("before", lambda: "done before") == "done before"
        assert redis.Redis(port=topology.primary.port).wait(1, 2000) == 1  # the replica has it all
        flows = dedupe.store.scripts.flows
        assert flows.functions and flows.loads == 1
        assert flows.library in (loaded_libraries(redis.Redis(port=topology.replica.port)) or [])
        topology.primary.stop()
        assert until(lambda: dedupe.run("after", lambda: "done after"), 30, "run on the new primary") == "done after"
        assert redis.Redis(port=topology.replica.port).info("replication")["role"] == "master"
        assert dedupe.run("before", lambda: "ran again") == "done before"
        assert flows.loads == 1  # no NOSCRIPT, no reload on the promoted replica
    finally:
        dedupe.close()


def test_a_cluster_gets_the_library_on_every_primary_and_doctor_warns_of_two_versions() -> None:
    with services.redis_cluster() as ports:
        client = RedisCluster(host="127.0.0.1", port=ports[0])
        dedupe = Deduplicator(client, namespace="fn-c", lease=5)
        assert [dedupe.run(f"k{i}", lambda i=i: i) for i in range(20)] == list(range(20))
        library = dedupe.store.scripts.flows.library
        for port in ports:
            assert loaded_libraries(redis.Redis(port=port)) == [library]
        checks = {c.name: c for c in diagnose(client)}
        assert not checks["functions"].warn and library in checks["functions"].detail
        # another release's library beside ours (a rolling upgrade): doctor warns
        for port in ports:
            redis.Redis(port=port).function_load("#!lua name=dedupe_00000000\n"
                                                 "redis.register_function('dedupe_00000000_x', function() end)")
        checks = {c.name: c for c in diagnose(client)}
        assert checks["functions"].warn and "dedupe_00000000" in checks["functions"].detail
        dedupe.close()
        client.close()


def test_the_in_memory_double_stays_on_evalsha() -> None:
    fakeredis = pytest.importorskip("fakeredis")
    dedupe = Deduplicator(fakeredis.FakeRedis(), namespace="fn", lease=5)
    assert dedupe.run("a", lambda: 1) == 1 and dedupe.run("a", lambda: 2) == 1
    assert not dedupe.store.scripts.flows.functions
    dedupe.close()


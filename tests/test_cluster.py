"""The same scripts on a 3-master Redis Cluster that the fixture starts on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from redis.cluster import RedisCluster

from dedupe_worker import Deduplicator, LeaseLost, Outcome, Reason, decide_many

from .services import redis_cluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster_ports() -> Iterator[list[int]]:
    with redis_cluster(3) as ports:
        yield ports


@pytest.fixture
def cluster_dedupe(cluster_ports: list[int], namespace: str) -> Iterator[Deduplicator]:
    d = Deduplicator.from_url(f"redis://127.0.0.1:{cluster_ports[0]}/0?cluster=1", namespace=namespace,
                              lease=0.3, result_ttl=30)
    assert isinstance(d.store.client, RedisCluster)
    yield d
    d.close()


def test_keys_spread_over_every_master(cluster_dedupe: Deduplicator) -> None:
    client = cluster_dedupe.store.client
    assert isinstance(client, RedisCluster)
    keys = [f"order-{i}" for i in range(60)]
    slots = {client.keyslot(cluster_dedupe.layout.stem(k)) for k in keys}
    nodes = {client.get_node_from_key(cluster_dedupe.layout.stem(k) + ":started").name for k in keys}
    assert len(slots) > 30 and len(nodes) == 3


def test_state_machine_on_a_cluster(cluster_dedupe: Deduplicator) -> None:
    d = cluster_dedupe
    a = d.begin("k", fingerprint="x")
    assert a.outcome is Outcome.ACQUIRED and a.token > 0
    assert d.begin("k", fingerprint="y").outcome is Outcome.CONFLICT
    assert d.begin("k", fingerprint="x").outcome is Outcome.IN_PROGRESS
    assert d.renew(a)
    time.sleep(0.4)
    b = d.begin("k", fingerprint="x")
    assert b.token > a.token
    d.complete(b, {"by": "b"})
    with pytest.raises(LeaseLost):
        d.complete(a, {"by": "a"})
    assert d.begin("k").result == {"by": "b"}
    c = d.begin("released")
    d.release(c)
    assert d.begin("released").token > c.token
    assert d.status("k").state == "done"


def test_batches_on_a_cluster(cluster_dedupe: Deduplicator) -> None:
    d = cluster_dedupe
    keys = [f"m{i}" for i in range(50)]
    claims = d.begin_many(keys)
    assert all(c.outcome is Outcome.ACQUIRED for c in claims)
    assert d.complete_many([(c, i) for i, c in enumerate(claims)]) == [True] * 50
    assert [c.result for c in d.begin_many(keys)] == list(range(50))
    decisions = decide_many(d, [(k, None, lambda: 0) for k in [*keys[:3], "new", "new"]])
    assert [x.reason for x in decisions] == [Reason.DUPLICATE] * 3 + [Reason.APPLIED, Reason.DUPLICATE]


def getkeys_calls(ports: list[int]) -> int:
    """``COMMAND GETKEYS`` calls the primaries have answered (``INFO commandstats``)."""
    import redis

    total = 0
    for port in ports:
        with redis.Redis(port=port) as node:
            total += int(node.info("commandstats").get("cmdstat_command|getkeys", {}).get("calls", 0))
    return total


def test_script_calls_are_routed_without_asking_the_server_for_their_keys(
        cluster_dedupe: Deduplicator, cluster_ports: list[int]) -> None:
    """redis-py would ask a primary for the keys of every FCALL, single or pipelined (and redis-py
    8.1 for those of every pipelined EVALSHA): one COMMAND GETKEYS round trip per call. The library
    routes its calls itself."""
    d = cluster_dedupe
    d.begin("warm-up")  # the scripts or the function library loaded
    before = getkeys_calls(cluster_ports)
    keys = [f"routed-{i}" for i in range(40)]
    claims = d.begin_many(keys)
    assert d.complete_many([(c, i) for i, c in enumerate(claims)]) == [True] * 40
    single = d.begin("routed-single")
    d.complete(single, "one")
    assert [c.result for c in d.begin_many(keys)] == list(range(40))
    assert d.begin("routed-single").result == "one"
    assert getkeys_calls(cluster_ports) == before


def test_scripts_reload_on_every_master(cluster_dedupe: Deduplicator, cluster_ports: list[int]) -> None:
    import redis

    for port in cluster_ports:
        redis.Redis(port=port).script_flush()
    assert all(c.acquired for c in cluster_dedupe.begin_many([f"after-flush-{i}" for i in range(20)]))


def test_the_asyncio_client_on_a_cluster(cluster_ports: list[int], namespace: str) -> None:
    import asyncio

    import redis
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

    from dedupe_worker.asyncio import AsyncDeduplicator

    async def scenario() -> None:
        d = AsyncDeduplicator.from_url(f"redis://127.0.0.1:{cluster_ports[0]}/0?cluster=1", namespace=namespace,
                                       lease=0.3, result_ttl=30)
        assert isinstance(d.store.client, AsyncRedisCluster)
        a = await d.begin("k", fingerprint="x")
        assert a.acquired and (await d.begin("k", fingerprint="y")).outcome is Outcome.CONFLICT
        await asyncio.sleep(0.4)
        b = await d.begin("k", fingerprint="x")
        assert b.token > a.token
        await d.complete(b, {"by": "b"})
        with pytest.raises(LeaseLost):
            await d.complete(a, {"by": "a"})
        for port in cluster_ports:
            redis.Redis(port=port).script_flush()
        keys = [f"m{i}" for i in range(50)]
        claims = await d.begin_many(keys)  # one pipelined EVALSHA per key, over every master
        assert all(c.acquired for c in claims)
        assert await d.complete_many([(c, i) for i, c in enumerate(claims)]) == [True] * 50
        assert [c.result for c in await d.begin_many(keys)] == list(range(50))

        async def slow() -> str:
            await asyncio.sleep(0.5)  # past the 0.3 s lease: renewed on the cluster
            return "renewed"

        assert await d.run("long", slow) == "renewed"
        await d.aclose()

    asyncio.run(scenario())


@pytest.fixture
def two_of_three_evict(cluster_ports: list[int]) -> Iterator[list[int]]:
    """Two of the three primaries on ``allkeys-lru`` while the test runs."""
    import redis

    nodes = [redis.Redis(port=port) for port in cluster_ports]
    for node in nodes[1:]:
        node.config_set("maxmemory-policy", "allkeys-lru")
    try:
        yield cluster_ports
    finally:
        for node in nodes:
            node.config_set("maxmemory-policy", "noeviction")


def test_every_primary_is_checked_before_the_first_claim(two_of_three_evict: list[int], namespace: str) -> None:
    from dedupe_worker import EvictionPolicyError

    url = f"redis://127.0.0.1:{two_of_three_evict[0]}/0?cluster=1"  # the node asked first is fine
    d = Deduplicator.from_url(url, namespace=namespace)
    with pytest.raises(EvictionPolicyError) as raised:
        d.begin("k")
    assert {node for node, _ in raised.value.evicting} == {f"127.0.0.1:{p}" for p in two_of_three_evict[1:]}
    assert Deduplicator.from_url(url, namespace=namespace, allow_eviction=True).begin("k").acquired


def test_doctor_checks_every_primary(two_of_three_evict: list[int], capsys: pytest.CaptureFixture[str]) -> None:
    from dedupe_worker.cli import main

    url = f"redis://127.0.0.1:{two_of_three_evict[0]}/0?cluster=1"
    assert main(["doctor", "--redis-url", url]) == 1
    out = capsys.readouterr().out
    eviction = next(line for line in out.splitlines() if "eviction" in line)
    assert eviction.startswith("[FAIL]") and eviction.count("allkeys-lru") == 2 and "noeviction" in eviction
    assert "cluster mode, 3 primaries" in out


def test_asyncio_checks_every_primary(two_of_three_evict: list[int], namespace: str) -> None:
    import asyncio

    from dedupe_worker import EvictionPolicyError
    from dedupe_worker.asyncio import AsyncDeduplicator

    async def scenario() -> None:
        d = AsyncDeduplicator.from_url(f"redis://127.0.0.1:{two_of_three_evict[0]}/0?cluster=1", namespace=namespace)
        try:
            with pytest.raises(EvictionPolicyError) as raised:
                await d.begin("k")
            assert len(raised.value.evicting) == 2
        finally:
            await d.aclose()

    asyncio.run(scenario())

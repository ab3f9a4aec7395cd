"""High availability on real processes: a primary, a replica and three sentinels started here.

- tokens stay larger than every earlier one after a failover that lost the last writes, so a
  fenced PostgreSQL ledger refuses the zombie's stale write;
- ``redis+sentinel://`` finds the primary, and ``run()`` carries on after the primary is killed;
- ``wait_replicas=1``: a completion the replica acknowledged survives the failover; without a
  replica to acknowledge, a claim is refused as not durable (and given back).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from dedupe_worker import Deduplicator, StoreUnavailable
from dedupe_worker._transport.connection import redis_from_url

from . import services
from .rabbitmq_fixtures import amqp, queue_name

__all__ = ["amqp", "queue_name"]  # fixtures used by name

pytestmark = pytest.mark.slow


def until(check: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if value := check():
                return value
        except (redis.RedisError, StoreUnavailable):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Topology:
    """A primary, a replica of it, and three sentinels watching it as ``mymaster``."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            services.unavailable("redis-server binary")
        self.primary = services.RedisServer().start()
        self.replica = services.RedisServer(extra=("--replicaof", "127.0.0.1", str(self.primary.port))).start()
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self.sentinel_ports: list[int] = []
        self.dir = tempfile.mkdtemp(prefix="dedupe-sentinel-")

    def start_sentinels(self) -> None:
        for n in range(3):
            port = services.free_port()
            conf = Path(self.dir) / f"sentinel-{n}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor mymaster 127.0.0.1 {self.primary.port} 2\n"
                "sentinel down-after-milliseconds mymaster 500\n"
                "sentinel failover-timeout mymaster 3000\n"
                "sentinel parallel-syncs mymaster 1\n"
            )
            self.sentinels.append(subprocess.Popen([shutil.which("redis-server") or "", str(conf), "--sentinel"],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.sentinel_ports.append(port)
        for port in self.sentinel_ports:
            services.wait_for_port("127.0.0.1", port, 20)

    @property
    def sentinel_url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/mymaster/0"

    def replicated(self) -> bool:
        info = redis.Redis(port=self.primary.port).info("replication")
        return bool(info.get("connected_slaves")) and info.get("slave0", {}).get("state") == "online"

    def stop(self) -> None:
        for proc in self.sentinels:
            proc.kill()
            proc.wait(10)
        self.primary.stop()
        self.replica.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def topology() -> Iterator[Topology]:
    t = Topology()
    try:
        until(t.replicated, what="the replica in sync")
        yield t
    finally:
        t.stop()


def test_a_token_after_a_failover_that_lost_writes_beats_the_zombie(topology: Topology, postgres_dsn: str) -> None:
    import psycopg

    # replication cut: what the primary hands out next never reaches the replica
    redis.Redis(port=topology.replica.port).replicaof("NO", "ONE")
    old = Deduplicator(redis.Redis(port=topology.primary.port), namespace="ha", lease=0.2)
    t1 = old.begin("charge-1")
    time.sleep(0.25)
    t2 = old.begin("charge-1")  # after t1's lease ran out: t2 is the zombie to be
    assert t1.acquired and t2.acquired and t2.token > t1.token
    # the replica (which never saw either claim) is the primary now
    new = Deduplicator(redis.Redis(port=topology.replica.port), namespace="ha", lease=5)
    t3 = new.begin("charge-1")
    assert t3.acquired and t3.token > t2.token
    with psycopg.connect(postgres_dsn, autocommit=True) as db:
        table = f"ledger_{int(time.time() * 1000)}"
        db.execute(f"CREATE TABLE {table} (id text PRIMARY KEY, amount int, fence bigint)")
        try:
            db.execute(f"INSERT INTO {table} VALUES ('charge-1', 0, 0)")
            fenced = f"UPDATE {table} SET amount = amount + %s, fence = %s WHERE id = 'charge-1' AND fence < %s"
            assert db.execute(fenced, (100, t3.token, t3.token)).rowcount == 1  # the new owner writes
            assert db.execute(fenced, (100, t2.token, t2.token)).rowcount == 0  # the zombie is refused
            assert db.execute(f"SELECT amount FROM {table}").fetchone() == (100,)
        finally:
            db.execute(f"DROP TABLE {table}")
    old.close()
    new.close()


def test_sentinel_url_finds_the_primary_and_run_carries_on_after_it_dies(topology: Topology) -> None:
    topology.start_sentinels()
    # acknowledged by the replica before the failover (wait_replicas=1) ...
    durable = Deduplicator.from_url(topology.sentinel_url, namespace="ha", lease=5, wait_replicas=1, wait_timeout=1)
    dedupe = Deduplicator.from_url(topology.sentinel_url, namespace="ha", lease=5)
    try:
        assert durable.run("before", lambda: "done before") == "done before"
        topology.primary.stop()  # the primary dies; the sentinels promote the replica
        value = until(lambda: dedupe.run("after", lambda: "done after"), 30, "run() on the new primary")
        assert value == "done after"
        assert redis.Redis(port=topology.replica.port).info("replication")["role"] == "master"
        # ... so it survived the failover: answered as a duplicate, not run again
        assert dedupe.run("before", lambda: "ran again") == "done before"
    finally:
        durable.close()
        dedupe.close()


def test_the_asyncio_client_finds_the_primary_through_sentinel_and_carries_on_after_it_dies(
        topology: Topology) -> None:
    import asyncio

    from dedupe_worker.asyncio import AsyncDeduplicator

    topology.start_sentinels()

    async def value(text: str) -> str:
        return text

    async def scenario() -> None:
        async with AsyncDeduplicator.from_url(topology.sentinel_url, namespace="ha-async", lease=5,
                                              wait_replicas=1, wait_timeout=1) as durable, \
                AsyncDeduplicator.from_url(topology.sentinel_url, namespace="ha-async", lease=5) as dedupe:
            assert await durable.run("before", value, "done before") == "done before"
            topology.primary.stop()  # the primary dies; the sentinels promote the replica
            deadline = time.monotonic() + 30
            while True:
                try:
                    assert await dedupe.run("after", value, "done after") == "done after"
                    break
                except StoreUnavailable:
                    assert time.monotonic() < deadline, "run() on the new primary"
                    await asyncio.sleep(0.1)
            assert redis.Redis(port=topology.replica.port).info("replication")["role"] == "master"
            assert await dedupe.run("before", value, "ran again") == "done before"  # survived the failover

    asyncio.run(scenario())


def test_wait_replicas_refuses_a_claim_no_replica_acknowledged_and_gives_it_back(topology: Topology) -> None:
    durable = Deduplicator(redis.Redis(port=topology.primary.port), namespace="w", wait_replicas=1, wait_timeout=0.5)
    assert durable.begin("k1").acquired  # the replica acknowledges
    redis.Redis(port=topology.replica.port).replicaof("NO", "ONE")  # now nobody will
    until(lambda: not topology.replicated(), what="the replica gone")
    with pytest.raises(StoreUnavailable, match="not durable"):
        durable.begin("k2")
    assert durable.status("k2").state == "free"  # the claim it took was given back
    with pytest.raises(StoreUnavailable, match="not durable"):
        durable.run("k3", lambda: "never runs")
    durable.close()


def test_a_sentinel_url_is_parsed_with_password_and_tls_options() -> None:
    client = redis_from_url("rediss+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2/mymaster/2"
                            "?sentinel_password=spw&ssl_cert_reqs=none")
    pool = client.connection_pool
    assert pool.service_name == "mymaster"
    assert pool.connection_kwargs["password"] == "s3cret" and pool.connection_kwargs["db"] == 2
    assert pool.connection_kwargs["ssl_cert_reqs"] == "none"
    sentinel = pool.sentinel_manager
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinel.sentinels] == [("10.0.0.1", 26379), ("10.0.0.2", 26379)]
    assert sentinel.sentinels[0].connection_pool.connection_kwargs["password"] == "spw"
    with pytest.raises(ValueError, match="service"):
        redis_from_url("redis+sentinel://127.0.0.1:26379")
    from dedupe_worker.asyncio import async_redis_from_url

    primary = async_redis_from_url("rediss+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2/mymaster/2"
                                   "?sentinel_password=spw&ssl_cert_reqs=none")
    pool = primary.connection_pool
    assert pool.service_name == "mymaster"  # type: ignore[attr-defined]
    assert pool.connection_kwargs["password"] == "s3cret" and pool.connection_kwargs["db"] == 2
    assert pool.connection_kwargs["ssl_cert_reqs"] == "none"
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in pool.sentinel_manager.sentinels] == [("10.0.0.1", 26379), ("10.0.0.2", 26379)]  # type: ignore[attr-defined]


def test_wait_replicas_is_refused_on_a_cluster() -> None:
    from redis.cluster import RedisCluster

    class FakeCluster(RedisCluster):  # construction only: no node is contacted
        def __init__(self) -> None:
            pass

    with pytest.raises(ValueError, match="Cluster"):
        Deduplicator(FakeCluster(), wait_replicas=1)


def test_a_consumer_carries_on_across_a_sentinel_failover(topology: Topology, amqp: Any, queue_name: str) -> None:
    import collections

    import orjson

    from dedupe_worker.rabbitmq import DedupeConsumer

    from .rabbitmq_fixtures import consumer_thread, dead_letters, drained, publish

    topology.start_sentinels()
    dedupe = Deduplicator.from_url(topology.sentinel_url, namespace="ha-consumer", lease=5)
    applied: collections.Counter[str] = collections.Counter()
    consumer = DedupeConsumer(amqp.clone(), [queue_name], lambda body, message: applied.update([body["id"]]),
                              dedupe, outage_cap=0.5)

    def send(ids: list[str]) -> None:
        for ident in ids:
            for _ in range(2):  # every message twice
                publish(amqp, queue_name, orjson.dumps({"id": ident}), headers={"idempotency-key": ident})

    try:
        with consumer_thread(consumer):
            send([f"a{i}" for i in range(10)])
            until(lambda: len(applied) == 10, what="the first half applied")
            topology.primary.stop()  # failover while the consumer runs
            send([f"b{i}" for i in range(10)])
            until(lambda: len(applied) == 20, 40, "the second half applied on the new primary")
            until(lambda: drained(amqp, queue_name), what="queue drained")
    finally:
        dedupe.close()
    assert set(applied) == {f"{p}{i}" for p in "ab" for i in range(10)}
    assert all(n == 1 for n in applied.values()), applied
    assert dead_letters(amqp, queue_name) == []

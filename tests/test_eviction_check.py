"""Every entry point refuses a Redis whose ``maxmemory-policy`` evicts keys (private servers), works
with ``allow_eviction=True``, and only warns where ``CONFIG GET`` is refused (an ACL user)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection

from dedupe_worker import (
    DedupeError,
    DedupeSettings,
    Deduplicator,
    EvictionPolicyError,
    Reason,
    StoreUnavailable,
    decide,
    decide_many,
    idempotent,
)
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.asyncio import _engine as async_engine

from . import services
from .celery_fixtures import WorkerProcess, delete_namespace, delete_queue, effects, make_app

LRU = ("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")


@pytest.fixture
def evicting() -> Iterator[services.RedisServer]:
    """A private redis-server with ``maxmemory-policy allkeys-lru``."""
    if shutil.which("redis-server") is None:
        services.unavailable("redis-server binary")
    server = services.RedisServer(extra=LRU).start()
    yield server
    server.stop()


def build(server: services.RedisServer, **options: Any) -> Deduplicator:
    return Deduplicator.from_url(server.url, namespace=f"ev-{uuid.uuid4().hex[:8]}", lease=2, **options)


def test_the_error_names_the_policy_and_the_fix(evicting: services.RedisServer) -> None:
    d = build(evicting)
    with pytest.raises(EvictionPolicyError) as raised:
        d.run("k", lambda: 1)
    text = str(raised.value)
    assert "allkeys-lru" in text and f"127.0.0.1:{evicting.port}" in text
    assert "noeviction" in text and "allow_eviction=True" in text
    assert isinstance(raised.value, DedupeError)
    assert redis.Redis(port=evicting.port).keys("*") == []  # refused before anything was written
    d.close()


def test_run_and_idempotent_refuse_and_work_when_allowed(evicting: services.RedisServer) -> None:
    refused, allowed = build(evicting), build(evicting, allow_eviction=True)
    calls: list[int] = []

    def charge(order: int) -> int:
        calls.append(order)
        return order * 2

    with pytest.raises(EvictionPolicyError):
        refused.run("k", charge, 1)
    with pytest.raises(EvictionPolicyError):
        idempotent(refused, key="charge:{order}")(charge)(1)
    assert calls == []
    assert allowed.run("k", charge, 1) == 2 and allowed.run("k", charge, 1) == 2
    assert idempotent(allowed, key="charge:{order}")(charge)(3) == 6
    assert calls == [1, 3]
    refused.close()
    allowed.close()


def test_decide_and_decide_many_refuse_and_work_when_allowed(evicting: services.RedisServer) -> None:
    with pytest.raises(EvictionPolicyError):
        decide(build(evicting), "k", lambda: 1)
    with pytest.raises(EvictionPolicyError):
        decide_many(build(evicting), [("a", None, lambda: 1), ("b", None, lambda: 2)])
    allowed = build(evicting, allow_eviction=True)
    assert decide(allowed, "k", lambda: 1).reason is Reason.APPLIED
    assert [x.reason for x in decide_many(allowed, [("k", None, lambda: 1), ("b", None, lambda: 2)])] == [
        Reason.DUPLICATE, Reason.APPLIED]


def test_settings_and_from_settings_carry_allow_eviction(evicting: services.RedisServer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEDUPE_REDIS_URL", evicting.url)
    with pytest.raises(EvictionPolicyError):
        Deduplicator.from_settings().begin("k")
    monkeypatch.setenv("DEDUPE_ALLOW_EVICTION", "1")
    assert DedupeSettings().allow_eviction
    assert Deduplicator.from_settings().begin("k").acquired


def test_asyncio_refuses_and_works_when_allowed(evicting: services.RedisServer) -> None:
    async def scenario() -> None:
        async def charge() -> int:
            return 7

        refused = AsyncDeduplicator.from_url(evicting.url, namespace="ev-async")
        with pytest.raises(EvictionPolicyError):
            await refused.run("k", charge)
        with pytest.raises(EvictionPolicyError):
            await refused.begin_many(["a", "b"])
        with pytest.raises(EvictionPolicyError):  # what the FastStream middleware calls
            await async_engine.decide(refused, "k", charge, integration="faststream")
        await refused.aclose()
        allowed = AsyncDeduplicator.from_url(evicting.url, namespace="ev-async", allow_eviction=True)
        assert await allowed.run("k", charge) == 7
        assert (await async_engine.decide(allowed, "k", charge)).reason is Reason.DUPLICATE
        await allowed.aclose()

    asyncio.run(scenario())


def test_celery_task_called_eagerly_refuses_and_works_when_allowed(evicting: services.RedisServer,
                                                                   redis_url: str) -> None:
    """Eager mode has no worker start and no message to lose: the call raises."""
    namespace = f"ev-celery-{uuid.uuid4().hex[:6]}"
    app = make_app(broker="memory://", backend=redis_url, namespace=namespace, queue=namespace, eager=True,
                   store_url=evicting.url)
    with pytest.raises(EvictionPolicyError):
        app.tasks["dt.charge"].delay(1, 10).get()
    app.close()
    app = make_app(broker="memory://", backend=redis_url, namespace=namespace, queue=namespace, eager=True,
                   store_url=evicting.url)
    app.conf.dedupe_allow_eviction = True
    first = app.tasks["dt.charge"].delay(1, 10).get()
    assert app.tasks["dt.charge"].delay(1, 10).get() == first
    app.close()


def celery_config(store: services.RedisServer, rabbitmq_url: str, redis_url: str) -> dict[str, Any]:
    namespace = f"ev-cw-{uuid.uuid4().hex[:8]}"
    return {"broker": rabbitmq_url, "backend": redis_url, "namespace": namespace, "queue": f"dedupe-test-{namespace}",
            "lease": 2.0, "store_url": store.url}


def test_celery_worker_refuses_to_start(evicting: services.RedisServer, rabbitmq_url: str, redis_url: str,
                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = celery_config(evicting, rabbitmq_url, redis_url)
    worker = WorkerProcess(config, concurrency=1, tmp=tmp_path)
    try:
        assert worker.proc.wait(60) != 0
        assert "allkeys-lru" in worker.output() and "allow_eviction=True" in worker.output()
        assert " ready." not in worker.output()
        monkeypatch.setenv("DEDUPE_ALLOW_EVICTION", "1")
        allowed = WorkerProcess(config, concurrency=1, tmp=tmp_path)
        try:
            allowed.wait_ready()
        finally:
            allowed.stop()
    finally:
        worker.stop()
        app = make_app(**config)
        delete_queue(app, config["queue"])
        app.close()
        delete_namespace(redis_url, config["namespace"])


def test_celery_task_meeting_an_evicting_redis_is_deferred_not_lost(rabbitmq_url: str, redis_url: str,
                                                                   tmp_path: Path) -> None:
    """The start-up check could not run (Redis down at start); Redis comes back evicting: the task
    is deferred until Redis is fixed, then applied once."""
    if shutil.which("redis-server") is None:
        services.unavailable("redis-server binary")
    store = services.RedisServer(extra=LRU)
    config = celery_config(store, rabbitmq_url, redis_url)
    worker = WorkerProcess(config, concurrency=1, tmp=tmp_path).wait_ready()  # its store is down
    app = make_app(**config)
    try:
        store.start()
        result = app.tasks["dt.charge"].delay(1, 10)
        assert services_wait(lambda: "deferring task=dt.charge" in worker.output(), timeout=30), worker.output()
        redis.Redis(port=store.port).config_set("maxmemory-policy", "noeviction")
        assert result.get(timeout=30)["amount"] == 10
        with effects(app) as r:
            assert r.get(f"fx:{config['namespace']}:charge:1") == "1"
            assert int(r.get(f"fx:{config['namespace']}:deferrals") or 0) >= 1
    finally:
        worker.stop()
        store.stop()
        delete_queue(app, config["queue"])
        app.close()
        delete_namespace(redis_url, config["namespace"])


def test_faststream_app_refuses_to_start(evicting: services.RedisServer, rabbitmq_url: str) -> None:
    """The middleware's start-up hook stops ``FastStream(...).start()`` before the broker
    connects; with ``allow_eviction`` the app starts."""
    from faststream import FastStream
    from faststream.rabbit import RabbitBroker

    from dedupe_worker.faststream import dedupe_middleware

    queue = f"ev-fs-{uuid.uuid4().hex[:8]}"

    async def scenario(dedupe: AsyncDeduplicator) -> bool:
        middleware = dedupe_middleware(dedupe)
        broker = RabbitBroker(rabbitmq_url, middlewares=[middleware], logger=None)

        @broker.subscriber(queue)
        async def handle(body: Any) -> None:
            return None

        app = FastStream(broker, on_startup=[middleware.check_at_start], logger=None)
        try:
            await app.start()
            return broker.running
        finally:
            await app.stop()
            await dedupe.aclose()

    refused = AsyncDeduplicator.from_url(evicting.url, namespace="ev-fs")
    with pytest.raises(EvictionPolicyError, match="allkeys-lru"):
        asyncio.run(scenario(refused))
    try:
        assert asyncio.run(scenario(AsyncDeduplicator.from_url(evicting.url, namespace="ev-fs",
                                                               allow_eviction=True)))
    finally:
        with Connection(rabbitmq_url) as conn:
            conn.channel().queue_delete(queue=queue)


def test_faststream_message_meeting_an_evicting_redis_is_deferred(private_redis: services.RedisServer,
                                                                 rabbitmq_url: str) -> None:
    """Not checked at start (no hook): a message that meets an evicting Redis is handed back, not
    failed, and applied once Redis is fixed."""
    from faststream.rabbit import RabbitBroker

    from .faststream_app import RecordingMiddleware

    queue = f"ev-fs-{uuid.uuid4().hex[:8]}"
    admin = redis.Redis(port=private_redis.port)
    admin.config_set("maxmemory-policy", "allkeys-lru")

    async def until(condition: Any, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return bool(condition())

    async def scenario() -> None:
        dedupe = AsyncDeduplicator.from_url(private_redis.url, namespace="ev-fs-msg")
        middleware = RecordingMiddleware(dedupe)
        seen: list[Any] = []
        broker = RabbitBroker(rabbitmq_url, middlewares=[middleware], logger=None)

        @broker.subscriber(queue)
        async def handle(body: Any) -> None:
            seen.append(body)

        async with broker:
            await broker.start()
            await broker.publish({"id": 1}, queue=queue)
            assert await until(lambda: middleware.count("deferred") >= 2)  # refused, handed back, again
            assert seen == []
            admin.config_set("maxmemory-policy", "noeviction")
            assert await until(lambda: bool(seen))
        assert seen == [{"id": 1}] and middleware.count("applied") == 1
        await dedupe.aclose()

    try:
        asyncio.run(scenario())
    finally:
        with Connection(rabbitmq_url) as conn:
            conn.channel().queue_delete(queue=queue)


def test_dramatiq_worker_refuses_to_boot(evicting: services.RedisServer, rabbitmq_url: str) -> None:
    import dramatiq
    from dramatiq.middleware import MiddlewareError

    from .dramatiq_app import build as build_dramatiq

    queue = f"ev-dq-{uuid.uuid4().hex[:8]}"
    app = build_dramatiq(rabbitmq_url, build(evicting), queue, "unused")
    worker = dramatiq.Worker(app.broker, worker_threads=1, worker_timeout=100)
    try:
        with pytest.raises(MiddlewareError, match="allkeys-lru") as raised:  # the one error dramatiq lets through
            worker.start()
        assert isinstance(raised.value.__cause__, EvictionPolicyError)
    finally:
        app.broker.close()
    allowed = build_dramatiq(rabbitmq_url, build(evicting, allow_eviction=True), queue, "unused")
    worker = dramatiq.Worker(allowed.broker, worker_threads=1, worker_timeout=100)
    try:
        worker.start()
        allowed.actors["apply"].send(1, 5)
        assert services_wait(lambda: redis.Redis(port=evicting.port).llen("unused") == 2)
    finally:
        worker.stop()
        allowed.broker.close()
        with Connection(rabbitmq_url) as conn:
            channel = conn.channel()
            for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
                channel.queue_delete(queue=name)


def services_wait(condition: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_dramatiq_worker_refuses_to_boot_without_retries(private_redis: services.RedisServer,
                                                         rabbitmq_url: str) -> None:
    import dramatiq
    from dramatiq.middleware import MiddlewareError, Retries

    from .dramatiq_app import build as build_dramatiq

    app = build_dramatiq(rabbitmq_url, build(private_redis), f"ev-dq-{uuid.uuid4().hex[:8]}", "unused")
    app.broker.middleware[:] = [m for m in app.broker.middleware if not isinstance(m, Retries)]
    try:
        with pytest.raises(MiddlewareError, match="Retries"):  # was logged, and the worker booted
            dramatiq.Worker(app.broker, worker_threads=1, worker_timeout=100).start()
    finally:
        app.broker.close()


def test_rabbitmq_consumer_refuses_to_start(evicting: services.RedisServer, rabbitmq_url: str) -> None:
    from dedupe_worker.rabbitmq import DedupeConsumer, delay_queue, dlq

    queue = f"ev-rmq-{uuid.uuid4().hex[:8]}"
    with Connection(rabbitmq_url) as conn:
        try:
            consumer = DedupeConsumer(conn, [queue], lambda body, message: None, build(evicting))
            with pytest.raises(EvictionPolicyError):
                consumer.run()
        finally:
            channel = conn.channel()
            for name in (queue, delay_queue(queue), dlq(queue)):
                channel.queue_delete(queue=name)


def test_kafka_consumer_refuses_to_start(evicting: services.RedisServer) -> None:
    from dedupe_worker.kafka import DedupeKafkaConsumer

    # The check runs before the consumer subscribes: no broker is contacted.
    consumer = DedupeKafkaConsumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "ev"}, ["t"],
                                   lambda message: None, build(evicting))
    try:
        with pytest.raises(EvictionPolicyError):
            consumer.run(install_signal_handlers=False)
    finally:
        consumer.consumer.close()


def test_volatile_policies_are_refused_too(evicting: services.RedisServer) -> None:
    redis.Redis(port=evicting.port).config_set("maxmemory-policy", "volatile-ttl")
    with pytest.raises(EvictionPolicyError, match="volatile-ttl"):
        build(evicting).begin("k")
    redis.Redis(port=evicting.port).config_set("maxmemory-policy", "noeviction")
    assert build(evicting).begin("k").acquired


def test_the_check_runs_once_per_client(private_redis: services.RedisServer) -> None:
    d = build(private_redis)
    assert not d.store_checked
    d.begin("a")
    assert d.store_checked
    redis.Redis(port=private_redis.port).config_set("maxmemory-policy", "allkeys-lru")
    assert d.begin("b").acquired  # checked at start-up, not on every claim
    with pytest.raises(EvictionPolicyError):
        build(private_redis).begin("c")


def test_clients_made_per_request_on_one_redis_client_ask_once(private_redis: services.RedisServer) -> None:
    shared = redis.Redis(port=private_redis.port)
    for i in range(20):
        assert Deduplicator(shared, namespace="per-request").begin(f"k{i}").acquired
    calls = shared.info("commandstats").get("cmdstat_config|get", {}).get("calls", 0)
    assert calls == 1


def test_config_refused_logs_a_warning_and_works(private_redis: services.RedisServer,
                                                caplog: pytest.LogCaptureFixture) -> None:
    admin = redis.Redis(port=private_redis.port)
    admin.config_set("maxmemory-policy", "allkeys-lru")  # unseen by a user without +config
    admin.acl_setuser("app", enabled=True, passwords=["+secret"], keys=["*"],
                      commands=["+@all", "-config"])
    d = Deduplicator.from_url(f"redis://app:secret@127.0.0.1:{private_redis.port}/0", namespace="acl")
    with caplog.at_level(logging.WARNING, logger="dedupe_worker._transport.eviction"):
        assert d.run("k", lambda: 5) == 5
    assert any("could not read maxmemory-policy" in r.getMessage() and "noeviction" in r.getMessage()
               for r in caplog.records)


def test_unreachable_redis_is_store_unavailable_and_checked_again(private_redis: services.RedisServer) -> None:
    d = build(private_redis)
    private_redis.stop()
    with pytest.raises(StoreUnavailable):
        d.begin("k")
    assert decide(d, "k", lambda: 1).reason is Reason.STORE_UNAVAILABLE
    assert not d.store_checked
    private_redis.start()
    assert d.begin("k").acquired and d.store_checked

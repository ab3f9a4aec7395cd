"""FastStream's ``dedupe_middleware`` on real RabbitMQ, Kafka (tansu) and NATS JetStream, real Redis.

Each scenario runs for the three brokers: the app runs in the test's event loop, except in the
crash test, which SIGKILLs a consumer subprocess mid-handler. Every test has its own queue,
topic or stream (deleted afterwards) and its own Redis namespace.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
import redis
import redis.asyncio
from kombu import Connection

from dedupe_worker import Deduplicator
from dedupe_worker._messages import deadletter
from dedupe_worker.asyncio import AsyncDeduplicator

from . import services
from .faststream_app import App, build
from .kafka_fixtures import Topics, headers_of, read_topic
from .rabbitmq_fixtures import dead_letters as rabbit_dead_letters
from .rabbitmq_fixtures import depth, stop_process
from .recording import entries, record

__all__ = ["record"]

ROOT = Path(__file__).resolve().parent.parent
KINDS = ["rabbit", "kafka", "nats"]


@dataclass
class Target:
    """Where one test's messages go: ``url`` of the broker, ``source`` queue/topic/subject."""

    kind: str
    url: str
    source: str
    rabbitmq_url: str = ""

    def dead_letters(self, expected: int) -> list[dict[str, str]]:
        """The headers of the dead letters of ``source`` (taken off the dead-letter destination)."""
        if self.kind == "rabbit":
            with Connection(self.rabbitmq_url) as conn:
                if not depth(conn, self.source + ".dlq"):  # also when nothing declared it
                    return []
                return [{k: str(v) for k, v in m.headers.items()} for m in rabbit_dead_letters(conn, self.source)]
        if self.kind == "kafka":
            return [headers_of(m) for m in read_topic(self.url, self.source + ".dlq", expected, idle=3.0)]
        return asyncio.run(_nats_dead_letters(self.url, self.source, expected))


async def _nats_dead_letters(url: str, subject: str, expected: int) -> list[dict[str, str]]:
    client = await nats.connect(url)
    try:
        sub = await client.jetstream().pull_subscribe(subject + ".dlq", stream=subject.replace(".", "_"))
        try:
            messages = await sub.fetch(max(expected, 1), timeout=3)
        except nats.errors.TimeoutError:
            return []
        return [dict(m.headers or {}) for m in messages]
    finally:
        await client.close()


@pytest.fixture(params=KINDS)
def target(request: pytest.FixtureRequest, rabbitmq_url: str) -> Iterator[Target]:
    kind = request.param
    if kind == "rabbit":
        with Connection(rabbitmq_url) as conn:
            try:
                conn.ensure_connection(max_retries=2)
            except Exception as exc:
                services.unavailable(f"RabbitMQ at {rabbitmq_url} ({exc})")
            name = f"fs-{uuid.uuid4().hex[:10]}"
            yield Target(kind, rabbitmq_url.rstrip("/") + "/", name, rabbitmq_url)
            channel = conn.channel()
            for queue in (name, name + ".dlq"):
                channel.queue_delete(queue=queue)
    elif kind == "kafka":
        bootstrap = next(iter(request.getfixturevalue("kafka_bootstrap").split(",")))
        topics = Topics(bootstrap)
        yield Target(kind, bootstrap, topics.create(prefix="fs"))
        topics.delete_all()
    else:
        url = request.getfixturevalue("nats_url")
        name = f"fs.{uuid.uuid4().hex[:10]}"
        yield Target(kind, url, name)
        asyncio.run(_delete_stream(url, name.replace(".", "_")))


async def _delete_stream(url: str, stream: str) -> None:
    client = await nats.connect(url)
    try:
        await client.jetstream().delete_stream(stream)
    except nats.js.errors.NotFoundError:
        pass
    finally:
        await client.close()



async def until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def publish(app: App, target: Target, body: dict[str, Any], **options: Any) -> None:
    if target.kind == "rabbit":
        await app.broker.publish(body, queue=target.source, **options)
    elif target.kind == "kafka":
        await app.broker.publish(body, topic=target.source, **options)
    else:
        await app.broker.publish(body, subject=target.source, stream=app.stream, **options)


def scenario(target: Target, redis_url: str, namespace: str, record: str,
             body: Callable[[App], Awaitable[None]], **options: Any) -> None:
    """Run ``body(app)`` with the app of ``target`` started in a fresh event loop."""

    async def main() -> None:
        dedupe = AsyncDeduplicator(redis.asyncio.Redis.from_url(redis_url), namespace=namespace, lease=5.0,
                                   result_ttl=60.0)
        app = build(target.kind, target.url, dedupe, redis_url, target.source, record, **options)
        await app.broker.start()
        try:
            await body(app)
        finally:
            await app.broker.stop()
            await dedupe.aclose()
            await dedupe.store.client.aclose()

    asyncio.run(main())


def test_duplicates_are_applied_once(target: Target, redis_url: str, redis_client: redis.Redis, namespace: str,
                                     record: str) -> None:
    async def body(app: App) -> None:
        for _ in range(3):
            await publish(app, target, {"id": "a1", "amount": 5})
        await until(lambda: app.middleware.count("applied") + app.middleware.count("duplicate") == 3,
                    what="three verdicts")
        assert app.middleware.count("applied") == 1
        assert {value for _, _, value in app.middleware.events} == {10}  # the stored return value

    scenario(target, redis_url, namespace, record, body)
    assert entries(redis_client, record, "applied") == entries(redis_client, record, "started")
    assert [ident for ident, _ in entries(redis_client, record, "applied")] == ["a1"]
    assert target.dead_letters(0) == []


def test_the_default_key_is_the_header_else_the_message_id(target: Target, redis_url: str,
                                                           redis_client: redis.Redis, dedupe: Deduplicator,
                                                           namespace: str, record: str) -> None:
    # The broker's own message identity: RabbitMQ's message_id property, NATS' message_id header;
    # Kafka's record key goes with a hash of the body, so only there the copies' bodies are equal.
    identity = {"rabbit": {"message_id": "m-1"}, "kafka": {"key": b"k-1"},
                "nats": {"headers": {"message_id": "m-1"}}}[target.kind]

    async def body(app: App) -> None:
        for amount in (1, 2):  # other bodies, same key: with the fingerprint off, applied once
            await publish(app, target, {"id": "by-header", "amount": amount}, headers={"idempotency-key": "h-1"})
            await publish(app, target, {"id": "by-identity", "amount": 1 if target.kind == "kafka" else amount},
                          **identity)
        await until(lambda: app.middleware.count("applied") + app.middleware.count("duplicate") == 4,
                    what="four verdicts")
        assert app.middleware.count("applied") == 2

    scenario(target, redis_url, namespace, record, body, key_strategy=None, fingerprint=None)
    assert sorted(ident for ident, _ in entries(redis_client, record, "applied")) == ["by-header", "by-identity"]
    assert dedupe.status("h-1").state == "done"
    if target.kind != "kafka":
        assert dedupe.status("message-id:m-1").state == "done"
    assert target.dead_letters(0) == []


def test_in_progress_copy_is_deferred_not_dropped(target: Target, redis_url: str, redis_client: redis.Redis,
                                                  dedupe: Deduplicator, namespace: str, record: str) -> None:
    holder = dedupe.begin("d1")  # another worker holds the key (the conftest deduplicator: same namespace)

    async def body(app: App) -> None:
        await publish(app, target, {"id": "d1", "amount": 1})
        await until(lambda: app.middleware.count("deferred") >= 2, what="the copy to come back deferred")
        dedupe.complete(holder, 42)
        await until(lambda: app.middleware.count("duplicate") == 1, what="the copy to be answered")
        assert ("duplicate", "duplicate", 42) in app.middleware.events

    # defer_wait=0: no waiting on the key, every delivery is handed back to the broker at once
    scenario(target, redis_url, namespace, record, body, defer_wait=0.0, fingerprint=None)
    assert entries(redis_client, record, "started") == []  # the holder's outcome answered it
    assert target.dead_letters(0) == []


def test_poison_is_dead_lettered_with_the_reason(target: Target, redis_url: str, redis_client: redis.Redis,
                                                 namespace: str, record: str) -> None:
    async def body(app: App) -> None:
        await publish(app, target, {"no_id": 1})  # no key in the body: invalid_key
        await publish(app, target, {"id": "p1", "amount": 1})
        await until(lambda: app.middleware.count("applied") == 1, what="p1 applied")
        await publish(app, target, {"id": "p1", "amount": 2})  # the same key, another body: conflict
        await until(lambda: app.middleware.count("dead_letter") == 2, what="two dead letters")

    scenario(target, redis_url, namespace, record, body)
    letters = {h[deadletter.REASON]: h for h in target.dead_letters(2)}
    assert set(letters) == {"invalid_key", "conflict"}
    assert letters["conflict"][deadletter.KEY] == "p1" and "KeyConflict" in letters["conflict"][deadletter.ERROR]
    assert "MissingKey" in letters["invalid_key"][deadletter.ERROR]
    assert [ident for ident, _ in entries(redis_client, record, "applied")] == ["p1"]


@pytest.mark.slow
def test_consumer_killed_mid_handler_loses_nothing(target: Target, redis_url: str, redis_client: redis.Redis,
                                                   namespace: str, record: str) -> None:
    env = {**os.environ, "TEST_KIND": target.kind, "TEST_URL": target.url, "TEST_REDIS_URL": redis_url,
           "TEST_NAMESPACE": namespace, "TEST_SOURCE": target.source, "TEST_RECORD": record, "TEST_LEASE": "1.0"}

    def consumer(sleep: float) -> subprocess.Popen[bytes]:
        """A consumer subprocess, returned once it consumes (its queue, topic or stream exists)."""
        proc = subprocess.Popen([sys.executable, "-m", "tests.faststream_app"], cwd=ROOT,
                                env={**env, "TEST_SLEEP": str(sleep)}, stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        return proc

    def wait(predicate: Callable[[], Any], what: str) -> None:
        deadline = time.monotonic() + 90
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    first = consumer(sleep=120.0)
    try:
        async def send() -> None:
            dedupe = AsyncDeduplicator(redis.asyncio.Redis.from_url(redis_url), namespace=namespace)
            app = build(target.kind, target.url, dedupe, redis_url, target.source, record)
            await app.broker.connect()
            await publish(app, target, {"id": "k1", "amount": 3})
            await app.broker.stop()
            await dedupe.store.client.aclose()

        asyncio.run(send())
        wait(lambda: entries(redis_client, record, "started"), "the handler to start")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        stop_process(first)
    second = consumer(sleep=0.0)
    try:
        wait(lambda: entries(redis_client, record, "applied"), "the redelivery to be applied")
    finally:
        stop_process(second)
    ((_, killed_token),) = entries(redis_client, record, "started")[:1]
    ((ident, applied_token),) = entries(redis_client, record, "applied")
    assert ident == "k1" and applied_token > killed_token
    assert target.dead_letters(0) == []

"""FastStream batch subscribers (``KafkaBroker``, ``batch=True``) through the asyncio batch engine,
on a real Kafka (tansu) and Redis.

The handler pushes ``call:<ids>`` (the list it was handed) and then ``applied:<id>`` per item to
the Redis list ``record``, and returns each item's ``amount * 2``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import redis
import redis.asyncio
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.nats import ConsumerConfig, JStream, NatsBroker, PullSub

from dedupe_worker import Deduplicator
from dedupe_worker._messages.envelope import Envelope
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.faststream._batch import results
from dedupe_worker.keys import body_fingerprint

from .faststream_app import RecordingMiddleware
from .kafka_fixtures import Topics, produce, read_topic


def record_of(namespace: str) -> str:
    return f"{namespace}:record"


Body = Callable[[RecordingMiddleware, AsyncDeduplicator], Awaitable[None]]


@pytest.fixture
def topic(kafka_bootstrap: str) -> Iterator[str]:
    topics = Topics(kafka_bootstrap)
    yield topics.create(prefix="fsb")
    topics.delete_all()


def value(item_id: str, amount: int = 1) -> bytes:
    return json.dumps({"id": item_id, "amount": amount}).encode()


def send(bootstrap: str, topic: str, *ids: str) -> None:
    produce(bootstrap, topic, [(0, None, value(i), []) for i in ids])


def consume(bootstrap: str, topic: str, redis_url: str, namespace: str, body: Body, *, group: str = "g",
            fail_first: bool = False) -> None:
    """Start a batch subscriber on ``topic`` (consumer group ``group``), run ``body``, stop."""
    record = record_of(namespace)

    async def main() -> None:
        dedupe = AsyncDeduplicator(redis.asyncio.Redis.from_url(redis_url), namespace=namespace, lease=5.0,
                                   result_ttl=60.0)
        middleware = RecordingMiddleware(dedupe, defer_base=0.05, defer_cap=0.2)
        client = redis.asyncio.Redis.from_url(redis_url)
        broker = KafkaBroker(bootstrap, middlewares=[middleware], logger=None)

        @broker.subscriber(topic, batch=True, group_id=f"{topic}-{group}", auto_offset_reset="earliest",
                           ack_policy=AckPolicy.NACK_ON_ERROR, session_timeout_ms=2000, heartbeat_interval_ms=500,
                           max_records=20, batch_timeout_ms=300)
        async def handle(bodies: list[dict[str, Any]]) -> list[int]:
            ids = [b["id"] for b in bodies]
            await client.rpush(record, "call:" + ",".join(ids))
            if fail_first and await client.incr(record + ":fails") == 1:
                raise RuntimeError("first call fails")
            for item_id in ids:
                await client.rpush(record, f"applied:{item_id}")
            return [int(b["amount"]) * 2 for b in bodies]

        await broker.start()
        try:
            await body(middleware, dedupe)
        finally:
            await broker.stop()
            await client.aclose()
            await dedupe.aclose()
            await dedupe.store.client.aclose()

    asyncio.run(main())


async def until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def entries(redis_client: redis.Redis, namespace: str) -> list[str]:
    return [e.decode() for e in redis_client.lrange(record_of(namespace), 0, -1)]


def verdicts(middleware: RecordingMiddleware) -> int:
    return middleware.count("applied") + middleware.count("duplicate")


def test_a_batch_runs_only_its_new_items_and_a_redelivery_runs_nothing(
        kafka_bootstrap: str, topic: str, redis_url: str, redis_client: redis.Redis, namespace: str) -> None:
    send(kafka_bootstrap, topic, "a1", "a2")

    async def first(middleware: RecordingMiddleware, dedupe: AsyncDeduplicator) -> None:
        await until(lambda: verdicts(middleware) == 2, what="the first batch")
        send(kafka_bootstrap, topic, "a1", "a3", "a2", "a3")
        await until(lambda: verdicts(middleware) == 6, what="the second batch")
        # each item's own result: element i of the returned list
        assert sorted(v for hook, _, v in middleware.events if hook == "applied") == [2, 2, 2]

    consume(kafka_bootstrap, topic, redis_url, namespace, first)
    log = entries(redis_client, namespace)
    assert sorted(e for e in log if e.startswith("applied:")) == ["applied:a1", "applied:a2", "applied:a3"]
    assert [e for e in log if e.startswith("call:")][-1] == "call:a3"  # the copies never reached the handler

    async def again(middleware: RecordingMiddleware, dedupe: AsyncDeduplicator) -> None:
        await until(lambda: verdicts(middleware) == 6, what="the redelivered batch")
        assert middleware.count("applied") == 0
        assert sorted(v for hook, _, v in middleware.events if hook == "duplicate") == [2, 2, 2, 2, 2, 2]

    consume(kafka_bootstrap, topic, redis_url, namespace, again, group="second")  # every record again
    assert entries(redis_client, namespace) == log  # nothing ran again


def test_a_handler_error_releases_the_batch_and_the_redelivery_applies_it_once(
        kafka_bootstrap: str, topic: str, redis_url: str, redis_client: redis.Redis, namespace: str) -> None:
    send(kafka_bootstrap, topic, "b1", "b2")

    async def body(middleware: RecordingMiddleware, dedupe: AsyncDeduplicator) -> None:
        await until(lambda: middleware.count("applied") == 2, what="the redelivered batch applied")

    consume(kafka_bootstrap, topic, redis_url, namespace, body, fail_first=True)
    log = entries(redis_client, namespace)
    assert log.count("call:b1,b2") == 2  # failed, then redelivered (NACK_ON_ERROR) and run again
    assert sorted(e for e in log if e.startswith("applied:")) == ["applied:b1", "applied:b2"]


def test_an_item_in_progress_elsewhere_redelivers_the_batch_and_each_item_applies_once(
        kafka_bootstrap: str, topic: str, redis_url: str, redis_client: redis.Redis, namespace: str) -> None:
    async def body(middleware: RecordingMiddleware, dedupe: AsyncDeduplicator) -> None:
        held = await dedupe.begin("c2", fingerprint=body_fingerprint(Envelope(body=value("c2"))))
        assert held.acquired
        send(kafka_bootstrap, topic, "c1", "c2")
        await until(lambda: middleware.count("deferred") >= 2, what="the batch deferred")
        assert middleware.count("applied") == 1  # c1 ran; the batch is handed back for c2
        await dedupe.release(held)  # the holder gives up: the redelivery runs c2
        await until(lambda: middleware.count("applied") == 2, what="c2 applied")

    consume(kafka_bootstrap, topic, redis_url, namespace, body)
    log = entries(redis_client, namespace)
    assert sorted(e for e in log if e.startswith("applied:")) == ["applied:c1", "applied:c2"]
    assert "call:c2" in log


def test_a_bad_record_is_dead_lettered_and_the_rest_of_the_batch_runs(
        kafka_bootstrap: str, topic: str, redis_url: str, redis_client: redis.Redis, namespace: str) -> None:
    produce(kafka_bootstrap, topic, [(0, None, value("d1"), []), (0, None, b"{\"no id\": 1}", [])])

    async def body(middleware: RecordingMiddleware, dedupe: AsyncDeduplicator) -> None:
        await until(lambda: middleware.count("applied") == 1 and middleware.count("dead_letter") == 1,
                    what="one applied, one dead-lettered")

    consume(kafka_bootstrap, topic, redis_url, namespace, body)
    assert [e for e in entries(redis_client, namespace) if e.startswith("call:")] == ["call:d1"]
    dead = read_topic(kafka_bootstrap, topic + ".dlq", 1)
    assert dead[0].value() == b"{\"no id\": 1}"


DOC = Path(__file__).resolve().parent.parent / "docs" / "faststream.md"


def doc_block(name: str) -> str:
    """The block of docs/faststream.md marked ``run by tests/test_faststream_batch.py (name)``."""
    marker = f"<!-- docs-test: run by tests/test_faststream_batch.py ({name}) -->\n```python\n"
    text = DOC.read_text()
    assert marker in text, f"docs/faststream.md has no block {name!r}"
    return text.split(marker, 1)[1].split("```", 1)[0]


def test_the_docs_batch_block_answers_each_record_with_its_own_outcome(
        kafka_bootstrap: str, topic: str, redis_url: str, redis_client: redis.Redis, namespace: str) -> None:
    code = doc_block("batch")
    code = code.replace("redis://127.0.0.1:6379/0", redis_url).replace("127.0.0.1:9092", kafka_bootstrap)
    code = code.replace('namespace="shop"', f'namespace="{namespace}"').replace('"payments"', f'"{topic}"')
    code = code.replace("batch=True,", "batch=True, session_timeout_ms=2000, heartbeat_interval_ms=500,")
    produce(kafka_bootstrap, topic, [(0, None, json.dumps({"amount": amount}).encode(), [("idempotency-key", key)])
                                     for key, amount in ((b"p1", 5), (b"p2", 7), (b"p1", 5))])

    async def main() -> None:
        program: dict[str, Any] = {}
        exec(compile(code, str(DOC), "exec"), program)
        status = program["dedupe"].status
        await program["broker"].start()
        try:
            deadline = time.monotonic() + 30
            while not all([(await status(k)).state == "done" for k in ("p1", "p2")]):
                assert time.monotonic() < deadline, "the batch was not applied"
                await asyncio.sleep(0.1)
        finally:
            await program["broker"].stop()
            await program["dedupe"].aclose()

    asyncio.run(main())
    sync = Deduplicator(redis_client, namespace=namespace)
    assert sync.answer(sync.begin("p1")) == {"charged": 5}  # element i of the returned list
    assert sync.answer(sync.begin("p2")) == {"charged": 7}


def test_a_nats_pull_batch_runs_only_its_new_items_and_an_in_progress_item_redelivers_it(
        nats_url: str, redis_url: str, redis_client: redis.Redis, namespace: str) -> None:
    subject = f"fsb.{uuid.uuid4().hex[:10]}"
    stream = subject.replace(".", "_")
    record = record_of(namespace)

    async def main() -> None:
        dedupe = AsyncDeduplicator(redis.asyncio.Redis.from_url(redis_url), namespace=namespace, lease=5.0,
                                   result_ttl=60.0)
        middleware = RecordingMiddleware(dedupe, defer_base=0.05, defer_cap=0.2)
        client = redis.asyncio.Redis.from_url(redis_url)
        broker = NatsBroker(nats_url, middlewares=[middleware], logger=None)

        @broker.subscriber(subject, stream=JStream(stream, subjects=[subject, subject + ".dlq"]),
                           durable=f"{stream}_c", pull_sub=PullSub(batch_size=10, timeout=0.3, batch=True),
                           config=ConsumerConfig(ack_wait=5.0))
        async def handle(bodies: list[dict[str, Any]]) -> list[int]:
            ids = [b["id"] for b in bodies]
            await client.rpush(record, "call:" + ",".join(ids))
            for item_id in ids:
                await client.rpush(record, f"applied:{item_id}")
            return [int(b["amount"]) * 2 for b in bodies]

        await broker.start()
        try:
            for item_id in ("n1", "n2"):
                await broker.publish(value(item_id), subject=subject, stream=stream)
            await until(lambda: verdicts(middleware) == 2, what="the first batch")
            held = await dedupe.begin("n4", fingerprint=body_fingerprint(Envelope(body=value("n4"))))
            for item_id in ("n1", "n3", "n2", "n4"):
                await broker.publish(value(item_id), subject=subject, stream=stream)
            await until(lambda: middleware.count("deferred") >= 2, what="the batch deferred for n4")
            await dedupe.release(held)
            await until(lambda: middleware.count("applied") == 4, what="n4 applied")
        finally:
            await broker.stop()
            nc = await nats.connect(nats_url)
            await nc.jetstream().delete_stream(stream)
            await nc.close()
            await client.aclose()
            await dedupe.aclose()
            await dedupe.store.client.aclose()

    asyncio.run(main())
    log = entries(redis_client, namespace)
    assert sorted(e for e in log if e.startswith("applied:")) == [f"applied:n{i}" for i in range(1, 5)]
    assert not any("n1" in e or "n2" in e for e in log[log.index("applied:n2") + 1:])  # never run again


def test_a_return_value_that_is_not_a_list_of_the_same_length_is_every_items_result() -> None:
    assert results([1, 2, 3], 3) == [1, 2, 3]
    assert results([1, 2], 3) == [[1, 2]] * 3
    assert results({"ok": True}, 2) == [{"ok": True}] * 2
    assert results(None, 2) == [None, None]

"""A FastStream app on RabbitMQ, Kafka or NATS JetStream with ``dedupe_middleware``, for
``test_faststream.py``.

Built in-process by the tests, and run as a consumer subprocess (``python -m tests.faststream_app``,
configured by ``TEST_*`` environment variables) that a test SIGKILLs mid-handler. The handler
records ``started:<id>:<token>`` and ``applied:<id>:<token>`` in the Redis list ``record``; the
key is the body's ``id`` field.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.nats import ConsumerConfig, JStream, NatsBroker
from faststream.rabbit import RabbitBroker, RabbitQueue

from dedupe_worker import Decision, current_claim
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.faststream import DedupeMiddleware
from dedupe_worker.keys import field_key


class RecordingMiddleware(DedupeMiddleware):
    """Keeps each hook call as ``(hook, reason, value)``. The key is the body's ``id`` unless
    ``key_strategy`` is given (``key_strategy=None``: the middleware's default for the broker)."""

    def __init__(self, dedupe: AsyncDeduplicator, **options: Any) -> None:
        options.setdefault("key_strategy", field_key("id"))
        super().__init__(dedupe, **options)
        self.events: list[tuple[str, str, Any]] = []

    def on_applied(self, message: Any, decision: Decision) -> None:
        self.events.append(("applied", decision.reason.value, decision.value))

    def on_duplicate(self, message: Any, decision: Decision) -> None:
        self.events.append(("duplicate", decision.reason.value, decision.value))

    def on_deferred(self, message: Any, decision: Decision, delay: float) -> None:
        self.events.append(("deferred", decision.reason.value, None))

    def on_dead_letter(self, message: Any, decision: Decision) -> None:
        self.events.append(("dead_letter", decision.reason.value, None))

    def count(self, hook: str) -> int:
        return sum(1 for event in self.events if event[0] == hook)


@dataclass
class App:
    broker: Any
    middleware: RecordingMiddleware
    source: str
    stream: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def build(kind: str, url: str, dedupe: AsyncDeduplicator, redis_url: str, source: str, record: str,
          sleep: float = 0.0, **options: Any) -> App:
    """A broker of ``kind`` (``rabbit``, ``kafka``, ``nats``) consuming ``source`` (a queue, topic or
    subject; NATS: in a JetStream stream named after it that also keeps ``<source>.dlq``)."""
    middleware = RecordingMiddleware(dedupe, **options)
    client = redis.asyncio.Redis.from_url(redis_url)

    async def handle(body: dict[str, Any]) -> int:
        token = current_claim().token  # type: ignore[union-attr]
        await client.rpush(record, f"started:{body['id']}:{token}")
        await asyncio.sleep(sleep)
        await client.rpush(record, f"applied:{body['id']}:{token}")
        return int(body["amount"]) * 2

    if kind == "rabbit":
        broker: Any = RabbitBroker(url, middlewares=[middleware], logger=None)
        broker.subscriber(RabbitQueue(source, durable=True))(handle)
        return App(broker, middleware, source)
    if kind == "kafka":
        broker = KafkaBroker(url, middlewares=[middleware], logger=None)
        broker.subscriber(source, group_id=f"{source}-group", auto_offset_reset="earliest",
                          ack_policy=AckPolicy.NACK_ON_ERROR, session_timeout_ms=2000,
                          heartbeat_interval_ms=500)(handle)
        return App(broker, middleware, source)
    broker = NatsBroker(url, middlewares=[middleware], logger=None)
    stream = source.replace(".", "_")
    broker.subscriber(source, stream=JStream(stream, subjects=[source, source + ".dlq"]), durable=f"{stream}_c",
                      pull_sub=True, config=ConsumerConfig(ack_wait=2.0))(handle)
    return App(broker, middleware, source, stream=stream)


async def serve() -> None:
    """Consume until SIGTERM (``TEST_KIND``, ``TEST_URL``, ``TEST_REDIS_URL``, ``TEST_NAMESPACE``,
    ``TEST_SOURCE``, ``TEST_RECORD``, ``TEST_SLEEP``, ``TEST_LEASE``)."""
    env = os.environ
    dedupe = AsyncDeduplicator.from_url(env["TEST_REDIS_URL"], namespace=env["TEST_NAMESPACE"],
                                        lease=float(env["TEST_LEASE"]), result_ttl=60.0)
    app = build(env["TEST_KIND"], env["TEST_URL"], dedupe, env["TEST_REDIS_URL"], env["TEST_SOURCE"],
                env["TEST_RECORD"], sleep=float(env.get("TEST_SLEEP", "0")))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await app.broker.start()
    print("ready", flush=True)
    await stop.wait()
    await app.broker.stop()
    await dedupe.aclose()


if __name__ == "__main__":
    asyncio.run(serve())

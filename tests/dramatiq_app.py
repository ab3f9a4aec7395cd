"""A Dramatiq app on a real RabbitMQ broker with :class:`DedupeMiddleware`, for ``test_dramatiq.py``.

Imported by the tests (in-process ``dramatiq.Worker``) and run as a worker subprocess
(``python -m tests.dramatiq_app``, configured by ``TEST_*`` environment variables) that a test
SIGKILLs mid-actor. Actors record ``started:<order>:<token>`` and ``applied:<order>:<token>``
in the Redis list ``record``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.rabbitmq import RabbitmqBroker

from dedupe_worker import Decision, Deduplicator, current_claim
from dedupe_worker.dramatiq import DedupeMiddleware


def pika_url(url: str) -> str:
    """kombu writes the default vhost as ``//``; pika wants ``/%2F``."""
    return url[:-1] + "%2F" if url.endswith("//") else url


class RecordingMiddleware(DedupeMiddleware):
    """Keeps each hook call as ``(hook, message_id, reason, retries, deferrals, value)``."""

    def __init__(self, dedupe: Deduplicator, **options: Any) -> None:
        super().__init__(dedupe, **options)
        self.events: list[tuple[str, str, str, int, int, Any]] = []

    def _note(self, hook: str, message: Any, decision: Decision) -> None:
        self.events.append((hook, message.message_id, decision.reason.value, message.options.get("retries", 0),
                            message.options.get("dedupe_deferrals", 0), decision.value))

    def on_applied(self, message: Any, decision: Decision) -> None:
        self._note("applied", message, decision)

    def on_duplicate(self, message: Any, decision: Decision) -> None:
        self._note("duplicate", message, decision)

    def on_deferred(self, message: Any, decision: Decision, delay: float) -> None:
        self._note("deferred", message, decision)

    def on_dead_letter(self, message: Any, decision: Decision) -> None:
        self._note("dead_letter", message, decision)

    def count(self, hook: str) -> int:
        return sum(1 for event in self.events if event[0] == hook)


@dataclass
class App:
    broker: RabbitmqBroker
    middleware: RecordingMiddleware
    actors: dict[str, dramatiq.Actor[Any, Any]] = field(default_factory=dict)


def build(rabbitmq_url: str, dedupe: Deduplicator, queue: str, record: str, sleep: float = 0.0,
          **options: Any) -> App:
    """A broker on ``queue`` with the middleware and three actors:

    * ``apply(order_id, amount)``, key ``order:<order_id>``, ``max_retries=0`` (a deferral that
      spent a retry would dead-letter it), sleeps ``sleep`` seconds mid-actor;
    * ``by_message_id(order_id)``, no key option: the message id is the key;
    * ``picky(payload)``, key ``payload["id"]`` (a payload without it is poison);
    * ``flaky(order_id)``, key ``flaky:<order_id>``, raises on its first run (Dramatiq retries it).
    """
    broker = RabbitmqBroker(url=pika_url(rabbitmq_url))
    middleware = RecordingMiddleware(dedupe, **options)
    broker.add_middleware(middleware)
    client: redis.Redis = dedupe.store.client
    app = App(broker, middleware)

    def apply(order_id: int, amount: int) -> int:
        token = current_claim().token  # type: ignore[union-attr]
        client.rpush(record, f"started:{order_id}:{token}")
        time.sleep(sleep)
        client.rpush(record, f"applied:{order_id}:{token}")
        return amount * 2

    def by_message_id(order_id: int) -> int:
        client.rpush(record, f"applied:{order_id}:{current_claim().token}")  # type: ignore[union-attr]
        return order_id

    def picky(payload: dict[str, Any]) -> str:
        client.rpush(record, f"applied:{payload['id']}:0")
        return str(payload["id"])

    def flaky(order_id: int) -> int:
        token = current_claim().token  # type: ignore[union-attr]
        client.rpush(record, f"started:{order_id}:{token}")
        if client.incr(f"{record}:flaky:{order_id}") == 1:
            raise RuntimeError("first run fails")
        client.rpush(record, f"applied:{order_id}:{token}")
        return order_id

    app.actors["apply"] = dramatiq.actor(apply, broker=broker, queue_name=queue, max_retries=0,
                                         idempotency_key=lambda order_id, amount: f"order:{order_id}")
    app.actors["by_message_id"] = dramatiq.actor(by_message_id, broker=broker, queue_name=queue)
    app.actors["picky"] = dramatiq.actor(picky, broker=broker, queue_name=queue, max_retries=0,
                                         idempotency_key=lambda payload: payload["id"])
    app.actors["flaky"] = dramatiq.actor(flaky, broker=broker, queue_name=queue, max_retries=3, min_backoff=10,
                                         max_backoff=50, idempotency_key=lambda order_id: f"flaky:{order_id}")
    return app


def main() -> None:
    """Run a worker until SIGTERM (``TEST_RABBITMQ_URL``, ``TEST_REDIS_URL``, ``TEST_NAMESPACE``,
    ``TEST_QUEUE``, ``TEST_RECORD``, ``TEST_SLEEP``, ``TEST_LEASE``)."""
    env = os.environ
    dedupe = Deduplicator.from_url(env["TEST_REDIS_URL"], namespace=env["TEST_NAMESPACE"],
                                   lease=float(env["TEST_LEASE"]), result_ttl=60.0)
    app = build(env["TEST_RABBITMQ_URL"], dedupe, env["TEST_QUEUE"], env["TEST_RECORD"],
                sleep=float(env.get("TEST_SLEEP", "0")))
    worker = dramatiq.Worker(app.broker, worker_threads=1, worker_timeout=100)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker.start()
    print("ready", flush=True)
    stop.wait()
    worker.stop()
    app.broker.close()


if __name__ == "__main__":
    main()

"""Fixtures and helpers for the RabbitMQ consumer tests (real broker, real Redis).

Import the fixtures into a test module (``from .rabbitmq_fixtures import amqp, queue_name``).
``record`` and ``fail_always`` are handlers that worker subprocesses load by ``module:function``.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from amqp.exceptions import NotFound
from kombu import Connection, Message

from dedupe_worker.rabbitmq import DedupeConsumer, delay_queue, dlq

from . import services

__all__ = [
    "amqp",
    "consumer_thread",
    "consumers_of",
    "dead_letters",
    "depth",
    "drained",
    "entries",
    "publish",
    "queue_name",
    "record",
    "stop_process",
    "wait_for",
    "worker_env",
]


@pytest.fixture
def amqp(rabbitmq_url: str) -> Iterator[Connection]:
    conn = Connection(rabbitmq_url)
    try:
        conn.ensure_connection(max_retries=2)
    except Exception as exc:
        services.unavailable(f"RabbitMQ at {rabbitmq_url} ({exc})")
    yield conn
    conn.release()


@pytest.fixture
def queue_name(amqp: Connection) -> Iterator[str]:
    """A durable queue of the test's own; it and its .delay and .dlq are deleted afterwards."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    amqp.default_channel.queue_declare(queue=name, durable=True, auto_delete=False)
    yield name
    with amqp.clone() as conn:
        channel = conn.channel()
        for queue in (name, delay_queue(name), dlq(name)):
            channel.queue_delete(queue=queue)


def publish(conn: Connection, queue: str, body: bytes | str, *, headers: dict[str, Any] | None = None,
            content_type: str = "application/json", **properties: Any) -> None:
    """Publish raw ``body`` to ``queue`` via the default exchange, confirmed."""
    channel = conn.default_channel
    raw = body.encode() if isinstance(body, str) else body
    message = channel.prepare_message(raw, properties.pop("priority", None), content_type, "utf-8",
                                      headers or {}, properties)
    channel.basic_publish_confirm(message, exchange="", routing_key=queue)


def depth(conn: Connection, queue: str) -> int:
    """Ready messages in ``queue`` (not counting un-acked ones); 0 when it does not exist."""
    try:
        return int(conn.default_channel.queue_declare(queue=queue, passive=True).message_count)
    except NotFound:
        return 0


def drained(conn: Connection, queue: str) -> bool:
    """Nothing ready in ``queue`` nor waiting in its delay queue."""
    return depth(conn, queue) == 0 and depth(conn, delay_queue(queue)) == 0


def consumers_of(conn: Connection, queue: str) -> int:
    return int(conn.default_channel.queue_declare(queue=queue, passive=True).consumer_count)


def dead_letters(conn: Connection, queue: str) -> list[Message]:
    """Take every message out of ``<queue>.dlq`` (acked)."""
    channel = conn.default_channel
    out = []
    while (message := channel.basic_get(queue=dlq(queue), no_ack=True)) is not None:
        out.append(message)
    return out


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextmanager
def consumer_thread(consumer: DedupeConsumer) -> Iterator[DedupeConsumer]:
    """Run ``consumer`` in a thread; stop it and wait for it on exit."""
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        assert consumer.ready.wait(15), "consumer did not connect"
        yield consumer
    finally:
        consumer.stop()
        thread.join(15)
        consumer.close()
        assert not thread.is_alive(), "consumer did not stop"


# -- handlers for worker subprocesses -------------------------------------------------------------


def worker_env(redis_url: str, record_list: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "TEST_REDIS_URL": redis_url, "TEST_RECORD": record_list, **extra}


_client: redis.Redis | None = None


def record(body: Any, message: Any) -> str:
    """Push ``started:<pid>:<key>`` then (after ``TEST_SLEEP`` seconds, or ``TEST_SLOW_SLEEP`` for
    bodies marked slow) ``applied:<pid>:<key>`` to the list ``TEST_RECORD``."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ["TEST_REDIS_URL"])
    key = body["id"] if isinstance(body, dict) else str(body)
    _client.rpush(os.environ["TEST_RECORD"], f"started:{os.getpid()}:{key}")
    slow = isinstance(body, dict) and body.get("slow") and os.environ.get("TEST_SLOW_SLEEP")
    time.sleep(float(slow or os.environ.get("TEST_SLEEP", "0")))
    _client.rpush(os.environ["TEST_RECORD"], f"applied:{os.getpid()}:{key}")
    return key


def entries(client: redis.Redis, record_list: str, kind: str) -> list[str]:
    """The keys recorded as ``kind`` (``started`` or ``applied``)."""
    return [e.decode().split(":", 2)[2] for e in client.lrange(record_list, 0, -1)
            if e.decode().startswith(kind + ":")]


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

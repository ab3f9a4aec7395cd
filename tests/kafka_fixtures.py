"""Helpers for the Kafka tests: topics, producing with exact positions, reading back, committed
offsets, a consumer running in a thread, and the handler the CLI subprocesses run.

Every test gets topics of its own (``kafka_topics`` fixture), deleted afterwards.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from confluent_kafka import Consumer, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from dedupe_worker.kafka import DedupeKafkaConsumer

#: Group settings that make tansu's group joins take about a second instead of 23.
FAST_GROUP = {"session.timeout.ms": 2000, "heartbeat.interval.ms": 500}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class Topics:
    """Creates topics (and their ``.dlq``) on the broker and deletes them all at the end."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self.created: list[str] = []

    def create(self, partitions: int = 1, prefix: str = "t") -> str:
        name = unique(prefix)
        new = [NewTopic(name, partitions, 1), NewTopic(f"{name}.dlq", 1, 1)]
        for future in self.admin.create_topics(new, operation_timeout=10).values():
            future.result(10)
        self.created += [name, f"{name}.dlq"]
        return name

    def delete_all(self) -> None:
        if self.created:
            for future in self.admin.delete_topics(self.created, operation_timeout=10).values():
                try:
                    future.result(10)
                except Exception:  # already gone, or the broker is shutting down
                    pass


@pytest.fixture
def kafka_topics(kafka_bootstrap: str) -> Iterator[Topics]:
    topics = Topics(kafka_bootstrap)
    yield topics
    topics.delete_all()


Record = tuple[int, bytes | None, bytes, list[tuple[str, bytes]]]  # partition, key, value, headers


def produce(bootstrap: str, topic: str, records: Sequence[Record]) -> list[tuple[int, int]]:
    """Produce ``records`` one by one (``linger.ms=0``); return their ``(partition, offset)``."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "batch.num.messages": 1})
    positions: list[tuple[int, int]] = [(-1, -1)] * len(records)
    for i, (partition, key, value, headers) in enumerate(records):
        def report(err: Any, msg: Message, i: int = i) -> None:
            assert err is None, err
            positions[i] = (msg.partition() or 0, msg.offset() or 0)
        producer.produce(topic, value=value, key=key, headers=headers, partition=partition,
                         on_delivery=report)
        producer.flush(10)
    assert all(p >= 0 for p, _ in positions), positions
    return positions


def ends(positions: Sequence[tuple[int, int]]) -> dict[int, int]:
    """The offset a group has to commit per partition to be past every produced record."""
    out: dict[int, int] = {}
    for partition, offset in positions:
        out[partition] = max(out.get(partition, 0), offset + 1)
    return out


def committed(bootstrap: str, group: str, topic: str, partitions: Sequence[int]) -> dict[int, int]:
    """The group's committed offsets (-1001 when none), read without joining the group."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        found = c.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
        return {tp.partition: tp.offset for tp in found}
    finally:
        c.close()


def read_topic(bootstrap: str, topic: str, expected: int, partitions: int = 1,
               idle: float = 3.0) -> list[Message]:
    """Read ``topic`` from the start by assignment (no group join) until ``expected`` records
    arrived or nothing came for ``idle`` seconds."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": unique("reader"),
                  "enable.auto.commit": False})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    got: list[Message] = []
    last = time.monotonic()
    try:
        while len(got) < expected and time.monotonic() - last < idle:
            batch = [m for m in c.consume(100, 0.2) if m.error() is None]
            if batch:
                got += batch
                last = time.monotonic()
        return got
    finally:
        c.close()


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextmanager
def running(consumer: DedupeKafkaConsumer) -> Iterator[DedupeKafkaConsumer]:
    """Run ``consumer`` in a thread; stop it and wait for it (close included) on exit."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            consumer.run(install_signal_handlers=False)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield consumer
    finally:
        consumer.stop()
        thread.join(30)
    assert not thread.is_alive(), "consumer did not stop"
    assert not errors, errors


def headers_of(msg: Message) -> dict[str, str]:
    """A record's headers as text (the last value of a repeated name wins)."""
    return {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in msg.headers() or ()}


# -- the handler run by the CLI subprocesses ------------------------------------------------------


def record_run(message: Message) -> str:
    """Append ``<id>:<pid>:<fencing token>`` to the Redis list ``$KAFKA_TEST_RUNS_KEY`` (at
    ``$KAFKA_TEST_REDIS_URL``), then sleep ``$KAFKA_TEST_SLEEP`` seconds to make batches slow."""
    from dedupe_worker import current_claim

    client = _client(os.environ["KAFKA_TEST_REDIS_URL"])
    claim = current_claim()
    token = claim.token if claim else 0
    ident = (message.value() or b"").decode()
    client.rpush(os.environ["KAFKA_TEST_RUNS_KEY"], f"{ident}:{os.getpid()}:{token}")
    time.sleep(float(os.environ.get("KAFKA_TEST_SLEEP", "0")))
    return ident


_clients: dict[str, Any] = {}


def _client(url: str) -> Any:
    import redis

    if url not in _clients:
        _clients[url] = redis.Redis.from_url(url)
    return _clients[url]

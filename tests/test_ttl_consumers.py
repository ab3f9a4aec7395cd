"""Per-message retention from a message header on the consumers, on real brokers and a real
Redis: the RabbitMQ consumer (batched and one at a time) and the Kafka consumer read
``x-dedupe-ttl`` (or the header named by ``ttl_header``), a bad value is dead-lettered with the
reason, and the header parser itself."""

from __future__ import annotations

import json
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
import redis
from confluent_kafka import Message
from kombu import Connection

from dedupe_worker import Deduplicator, UndecodableMessage
from dedupe_worker._engine import TtlHeader, header_ttl, parse_ttl
from dedupe_worker._messages.deadletter import REASON
from dedupe_worker.kafka import DedupeKafkaConsumer
from dedupe_worker.keys import header_key
from dedupe_worker.rabbitmq import DedupeConsumer, dlq

from .kafka_fixtures import FAST_GROUP, Topics, ends, headers_of, kafka_topics, produce, read_topic, running, unique
from .kafka_fixtures import wait_until as kafka_wait
from .rabbitmq_fixtures import amqp, consumer_thread, dead_letters, depth, publish, queue_name, wait_for
from .test_ttl import assert_kept, pttl

__all__ = ["amqp", "kafka_topics", "queue_name"]  # fixtures used by name


@pytest.mark.parametrize(("value", "seconds"), [
    ("60", 60.0), (b"0.5", 0.5), (b"2.5e1", 25.0), (30, 30.0), (2.5, 2.5), ("", None), (None, None),
    (Decimal("5"), 5.0), (Decimal("0.25"), 0.25), (Decimal("3600.000"), 3600.0), (Fraction(3, 2), 1.5),
])
def test_the_header_parser_reads_seconds(value: Any, seconds: float | None) -> None:
    assert parse_ttl(value) == seconds
    assert header_ttl({"X-Dedupe-TTL": value}) == seconds  # names are case-insensitive
    assert TtlHeader()({"x-dedupe-ttl": value}) == seconds  # what the consumers read a batch with


@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan", "inf", b"1e400", True, [1], Decimal("-5"),
                                   Decimal("NaN"), Decimal("sNaN"), Decimal("Infinity"), 2**63, 10**400, 1j])
def test_a_bad_header_value_is_undecodable(value: Any) -> None:
    with pytest.raises(UndecodableMessage, match="x-dedupe-ttl header") as raised:
        header_ttl({"x-dedupe-ttl": value})
    assert len(str(raised.value)) < 160  # the reason stays short, however long the value


@pytest.mark.parametrize("prefetch", [1, 10], ids=["one", "batched"])
def test_rabbitmq_consumer_keeps_each_outcome_for_its_header_ttl(
    amqp: Connection, queue_name: str, dedupe: Deduplicator, redis_client: redis.Redis, prefetch: int
) -> None:
    applied: list[str] = []

    def handler(body: Any, message: Any) -> str:
        applied.append(body["id"])
        return str(body["id"])

    for ident, headers in (("a", {"x-dedupe-ttl": "7"}), ("b", {"x-dedupe-ttl": 3600}), ("c", {}),
                           ("d", {"x-dedupe-ttl": Decimal("5")}), ("e", {"x-dedupe-ttl": 12.5}),
                           ("bad", {"x-dedupe-ttl": "forever"})):
        publish(amqp, queue_name, json.dumps({"id": ident}), headers={"idempotency-key": ident, **headers})
    consumer = DedupeConsumer(amqp.clone(), [queue_name], handler, dedupe, prefetch_count=prefetch,
                              key_strategy=header_key())
    with consumer_thread(consumer):
        wait_for(lambda: len(applied) == 5 and depth(amqp, dlq(queue_name)) == 1, what="five applied, one dead")
    assert sorted(applied) == ["a", "b", "c", "d", "e"]
    assert_kept(pttl(redis_client, dedupe, "a"), 7)
    assert_kept(pttl(redis_client, dedupe, "b"), 3600)
    assert_kept(pttl(redis_client, dedupe, "c"), 60)
    assert_kept(pttl(redis_client, dedupe, "d"), 5)  # an AMQP decimal: kombu hands it over as Decimal
    assert_kept(pttl(redis_client, dedupe, "e"), 12.5)  # an AMQP double
    (letter,) = dead_letters(amqp, queue_name)
    assert letter.headers["x-dedupe-reason"] == "undecodable"
    assert "x-dedupe-ttl header: 'forever' is not a positive number" in letter.headers["x-dedupe-error"]
    assert pttl(redis_client, dedupe, "bad") == -2  # never claimed


def test_rabbitmq_consumer_reads_the_header_named_by_ttl_header(
    amqp: Connection, queue_name: str, dedupe: Deduplicator, redis_client: redis.Redis
) -> None:
    applied: list[str] = []
    publish(amqp, queue_name, "{}", headers={"idempotency-key": "k", "retention": "11", "x-dedupe-ttl": "bad"})
    consumer = DedupeConsumer(amqp.clone(), [queue_name], lambda body, message: applied.append("k"), dedupe,
                              key_strategy=header_key(), ttl_header="retention")
    with consumer_thread(consumer):
        wait_for(lambda: applied == ["k"] and depth(amqp, queue_name) == 0, what="applied")
    assert_kept(pttl(redis_client, dedupe, "k"), 11)


def test_kafka_consumer_keeps_each_outcome_for_its_header_ttl(
    kafka_bootstrap: str, kafka_topics: Topics, redis_client: redis.Redis, dedupe: Deduplicator
) -> None:
    topic = kafka_topics.create(partitions=1)
    records = [
        (0, b"a", b"{}", [("idempotency-key", b"a"), ("x-dedupe-ttl", b"7")]),
        (0, b"b", b"{}", [("idempotency-key", b"b"), ("x-dedupe-ttl", b"3600")]),
        (0, b"c", b"{}", [("idempotency-key", b"c")]),
        (0, b"d", b"{}", [("idempotency-key", b"d"), ("x-dedupe-ttl", b"5.000")]),  # a decimal's text
        (0, b"e", b"{}", [("idempotency-key", b"e"), ("x-dedupe-ttl", b"1.25e1")]),
        (0, b"bad", b"{}", [("idempotency-key", b"bad"), ("x-dedupe-ttl", b"-1")]),
    ]
    positions = produce(kafka_bootstrap, topic, records)
    applied: list[str] = []

    def handler(msg: Message) -> str:
        applied.append((msg.key() or b"").decode())
        return applied[-1]

    group = unique("g")
    consumer = DedupeKafkaConsumer({"bootstrap.servers": kafka_bootstrap, "group.id": group, **FAST_GROUP}, [topic],
                                   handler, dedupe, key_strategy=header_key(), poll_timeout=0.2)
    with running(consumer):
        kafka_wait(lambda: consumer.stats["committed"] > 0 and len(applied) == 5, 30, "applied and committed")
    assert sorted(applied) == ["a", "b", "c", "d", "e"]
    assert ends(positions)
    assert_kept(pttl(redis_client, dedupe, "a"), 7)
    assert_kept(pttl(redis_client, dedupe, "b"), 3600)
    assert_kept(pttl(redis_client, dedupe, "c"), 60)
    assert_kept(pttl(redis_client, dedupe, "d"), 5)
    assert_kept(pttl(redis_client, dedupe, "e"), 12.5)
    (letter,) = read_topic(kafka_bootstrap, f"{topic}.dlq", expected=1)
    assert headers_of(letter)[REASON] == "undecodable"
    assert letter.key() == b"bad"

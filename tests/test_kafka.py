"""The Kafka consumer in this process against a real broker (tansu) and real Redis.

Each test joins a consumer group once (tansu joins take about a second with ``FAST_GROUP``).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis
from confluent_kafka import Message

from dedupe_worker import Decision, Deduplicator, Reason
from dedupe_worker._messages.deadletter import (
    ATTEMPTS,
    ERROR,
    KEY,
    ORIGINAL_OFFSET,
    ORIGINAL_PARTITION,
    ORIGINAL_TOPIC,
    REASON,
)
from dedupe_worker.kafka import DedupeKafkaConsumer
from dedupe_worker.keys import field_key, first_of, header_key

from .kafka_fixtures import (
    FAST_GROUP,
    Topics,
    committed,
    ends,
    headers_of,
    kafka_topics,
    produce,
    read_topic,
    running,
    unique,
    wait_until,
)

__all__ = ["kafka_topics"]  # the fixture, imported so pytest finds it


class Recorder(DedupeKafkaConsumer):
    """Keeps what the hooks saw, for assertions."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deferred: list[tuple[int, int, str, float]] = []
        self.dead: list[tuple[int, int, str]] = []

    def on_deferred(self, message: Any, decision: Decision, delay: float) -> None:
        self.deferred.append((message.partition(), message.offset(), decision.reason.value, delay))

    def on_dead_letter(self, message: Any, decision: Decision) -> None:
        self.dead.append((message.partition(), message.offset(), decision.reason.value))


def config(bootstrap: str, group: str | None = None) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "group.id": group or unique("g"), **FAST_GROUP}


def body(ident: str, **extra: Any) -> bytes:
    return json.dumps({"id": ident, **extra}).encode()


def all_committed(bootstrap: str, group: str, topic: str, expected: dict[int, int]) -> bool:
    return committed(bootstrap, group, topic, list(expected)) == expected


def consume_all(consumer: DedupeKafkaConsumer, positions: list[tuple[int, int]]) -> None:
    """Run ``consumer`` until its group has committed past every produced record, then stop it."""
    bootstrap, group = consumer.config["bootstrap.servers"], consumer.config["group.id"]
    with running(consumer):
        wait_until(lambda: all_committed(bootstrap, group, consumer.topics[0], ends(positions)), 30,
                   "offsets committed past every record")


def test_duplicates_across_offsets_and_partitions_apply_once(
    kafka_bootstrap: str, kafka_topics: Topics, dedupe: Deduplicator
) -> None:
    topic = kafka_topics.create(partitions=3)
    hdr = [("idempotency-key", b"order-1")]
    records = [
        (0, None, body("order-1"), hdr),            # the same key at two offsets of p0 ...
        (0, None, body("order-1"), hdr),
        (1, None, body("order-1"), hdr),            # ... and in another partition
        (2, b"acct-7", body("acct-7"), []),         # no header: record key + body hash
        (2, b"acct-7", body("acct-7"), []),
        (1, b"acct-7", body("acct-7"), []),
    ] + [(i % 3, None, body(f"u{i}"), [("idempotency-key", f"u{i}".encode())]) for i in range(30)]
    positions = produce(kafka_bootstrap, topic, records)
    applied: list[str] = []
    lock = threading.Lock()

    def handler(msg: Message) -> str:
        ident = json.loads(msg.value() or b"")["id"]
        with lock:
            applied.append(ident)
        return str(ident)

    group = unique("g")
    class BrokenHooks(DedupeKafkaConsumer):
        def on_duplicate(self, message: Any, decision: Decision) -> None:
            raise RuntimeError("a hook that fails must not stop the loop")

    consumer = BrokenHooks(config(kafka_bootstrap, group), [topic], handler, dedupe,
                           batch_size=500, poll_timeout=0.2)
    consume_all(consumer, positions)
    assert sorted(applied) == sorted({"order-1", "acct-7", *(f"u{i}" for i in range(30))})
    assert consumer.stats["duplicate"] == 4
    assert dedupe.status("order-1").state == "done"


def test_dead_letters_for_each_failure_kind(
    kafka_bootstrap: str, kafka_topics: Topics, redis_client: redis.Redis, namespace: str
) -> None:
    topic = kafka_topics.create(partitions=1)
    trace = [("trace", b"abc")]
    records = [
        (0, b"k0", body("ok-1"), trace),                          # 0 applied
        (0, b"k1", b"not json", trace),                           # 1 undecodable
        (0, b"k2", b'{"note": "no id"}', trace),                  # 2 invalid_key (missing key)
        (0, b"k3", body("c", v=1), [("idempotency-key", b"c")]),  # 3 applied
        (0, b"k4", body("c", v=2), [("idempotency-key", b"c"), *trace]),  # 4 conflict
        (0, b"k5", body("boom"), trace),                          # 5 handler_error x2
        (0, b"k6", body("perm"), trace),                          # 6 permanent_failure
        (0, b"k7", body("ok-2"), trace),                          # 7 applied
    ]
    positions = produce(kafka_bootstrap, topic, records)
    applied: list[str] = []

    def handler(msg: Message) -> str:
        ident = str(json.loads(msg.value() or b"")["id"])
        if ident == "boom":
            raise RuntimeError("boom goes the handler")
        if ident == "perm":
            raise ValueError("never valid")
        applied.append(ident)
        return ident

    dedupe = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0,
                          permanent_errors=(ValueError,))
    group = unique("g")
    consumer = Recorder(config(kafka_bootstrap, group), [topic], handler, dedupe,
                        key_strategy=first_of(header_key(), field_key("id")),
                        batch_size=500, poll_timeout=0.2, max_attempts=2, retry_base=0.05)
    try:
        consume_all(consumer, positions)
    finally:
        dedupe.close()
    assert applied == ["ok-1", "c", "ok-2"]
    letters = read_topic(kafka_bootstrap, f"{topic}.dlq", expected=5)
    assert len(letters) == 5
    by_offset = {int(headers_of(m)[ORIGINAL_OFFSET]): m for m in letters}
    expected = {1: "undecodable", 2: "invalid_key", 4: "conflict", 5: "handler_error", 6: "permanent_failure"}
    assert {o: headers_of(m)[REASON] for o, m in by_offset.items()} == expected
    for offset, msg in by_offset.items():
        headers = headers_of(msg)
        original = records[offset]
        assert msg.key() == original[1] and msg.value() == original[2]
        assert all(headers[name] == value.decode() for name, value in original[3]), headers
        assert headers[ORIGINAL_TOPIC] == topic and headers[ORIGINAL_PARTITION] == "0"
    errors = {o: headers_of(m)[ERROR] for o, m in by_offset.items()}
    assert errors[1].startswith("UndecodableMessage") and errors[2].startswith("MissingKey")
    assert errors[5] == "RuntimeError: boom goes the handler"
    assert errors[6] == "ValueError: never valid"
    assert headers_of(by_offset[5])[ATTEMPTS] == "2" and headers_of(by_offset[6])[ATTEMPTS] == "1"
    assert headers_of(by_offset[4])[KEY] == "c" and headers_of(by_offset[5])[KEY] == "boom"
    assert KEY not in headers_of(by_offset[1])
    # the handler error was retried in place (pause + seek) before it was dead-lettered
    assert [(o, r) for _, o, r, _ in consumer.deferred] == [(5, "handler_error")]
    assert sorted(o for _, o, _ in consumer.dead) == [1, 2, 4, 5, 6]


def test_undelivered_dead_letter_holds_the_partition(
    kafka_bootstrap: str, kafka_topics: Topics, dedupe: Deduplicator
) -> None:
    topic = kafka_topics.create(partitions=2)
    records = [(0, b"a", body("a0"), []), (0, b"b", b"not json", []), (0, b"c", body("a2"), []),
               (1, b"d", body("b0"), []), (1, b"e", body("b1"), [])]
    positions = produce(kafka_bootstrap, topic, records)
    applied: list[str] = []
    group = unique("g")
    consumer = Recorder(config(kafka_bootstrap, group), [topic],
                        lambda m: applied.append(json.loads(m.value())["id"]), dedupe,
                        key_strategy=field_key("id"), poll_timeout=0.2, defer_base=0.2, defer_cap=0.5,
                        dead_letter_topic="{topic} is not a valid topic name", dead_letter_timeout=2.0)
    with running(consumer):
        wait_until(lambda: committed(kafka_bootstrap, group, topic, [1])[1] == 2, 30, "partition 1 done")
        wait_until(lambda: len(applied) >= 4, 10, "the rest applied")
        time.sleep(1.0)  # several more attempts to deliver the dead letter
        assert committed(kafka_bootstrap, group, topic, [0])[0] == 1  # never past offset 1
    assert sorted(applied) == ["a0", "a2", "b0", "b1"]  # a2 was handled behind the hold, once
    assert consumer.dead == [] and consumer.stats["dead_lettered"] == 0
    assert positions[1] == (0, 1)


def test_in_progress_elsewhere_pauses_only_its_partition(
    kafka_bootstrap: str, kafka_topics: Topics, redis_client: redis.Redis, namespace: str
) -> None:
    topic = kafka_topics.create(partitions=2)
    held_body = body("held")
    other = Deduplicator(redis_client, namespace=namespace, lease=2.0, result_ttl=60.0)
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0)
    claimed_at = time.monotonic()  # the lease runs from a moment after this one
    claim = other.begin("held")  # a previous owner still working (it will die without finishing)
    assert claim.acquired
    records = [(0, None, held_body, [("idempotency-key", b"held")]),
               (0, None, body("a1"), [("idempotency-key", b"a1")])]
    records += [(1, None, body(f"b{i}"), [("idempotency-key", f"b{i}".encode())]) for i in range(5)]
    positions = produce(kafka_bootstrap, topic, records)
    applied: dict[str, float] = {}

    def handler(msg: Message) -> None:
        applied[json.loads(msg.value() or b"")["id"]] = time.monotonic()

    group = unique("g")
    consumer = Recorder(config(kafka_bootstrap, group), [topic], handler, dedupe, poll_timeout=0.2)
    try:
        consume_all(consumer, positions)
    finally:
        dedupe.close()
        other.close()
    assert set(applied) == {"held", "a1", *(f"b{i}" for i in range(5))}
    assert applied["held"] >= claimed_at + 2.0  # not before the other owner's lease ran out
    assert max(applied[f"b{i}"] for i in range(5)) < applied["held"]  # partition 1 kept flowing
    assert consumer.deferred and {(p, o, r) for p, o, r, _ in consumer.deferred} == {(0, 0, "in_progress")}


@pytest.mark.slow
def test_redis_outage_never_commits_past_undecided(
    kafka_bootstrap: str, kafka_topics: Topics, private_redis: Any, namespace: str
) -> None:
    topic = kafka_topics.create(partitions=2)
    client = redis.Redis.from_url(private_redis.url, socket_connect_timeout=0.5, socket_timeout=0.5)
    dedupe = Deduplicator(client, namespace=namespace, lease=2.0, result_ttl=60.0)
    applied: list[str] = []
    group = unique("g")
    consumer = Recorder(config(kafka_bootstrap, group), [topic],
                        lambda m: applied.append(json.loads(m.value())["id"]), dedupe,
                        poll_timeout=0.2, defer_base=0.2, defer_cap=1.0)

    def batch(prefix: str) -> list[tuple[int, int]]:
        return produce(kafka_bootstrap, topic, [(i % 2, None, body(f"{prefix}{i}"), []) for i in range(6)])

    try:
        with running(consumer):
            first = batch("before")
            wait_until(lambda: all_committed(kafka_bootstrap, group, topic, ends(first)), 30, "first batch")
            private_redis.stop()
            second = batch("during")
            wait_until(lambda: consumer.stats["store_unavailable"] >= 2, 15, "claims failing")
            time.sleep(1.5)
            assert committed(kafka_bootstrap, group, topic, [0, 1]) == ends(first)
            assert not any(a.startswith("during") for a in applied)
            private_redis.start()
            wait_until(lambda: all_committed(kafka_bootstrap, group, topic, ends(first + second)), 30,
                       "second batch after Redis came back")
    finally:
        dedupe.close()
    assert sorted(applied) == sorted([f"before{i}" for i in range(6)] + [f"during{i}" for i in range(6)])
    assert {r for _, _, r, _ in consumer.deferred} == {Reason.STORE_UNAVAILABLE.value}


def test_batch_handler_gets_only_new_messages_and_retries_as_a_whole(
    kafka_bootstrap: str, kafka_topics: Topics, dedupe: Deduplicator
) -> None:
    topic = kafka_topics.create(partitions=2)
    records = [(i // 8, None, body(f"k{i % 8}"), [("idempotency-key", f"k{i % 8}".encode())])
               for i in range(16)]  # every key twice, the copies in the other partition
    positions = produce(kafka_bootstrap, topic, records)
    calls: list[list[str]] = []

    def batch_handler(messages: list[Message]) -> list[str]:
        ids = [json.loads(m.value() or b"")["id"] for m in messages]
        calls.append(ids)
        if len(calls) == 1:
            raise ConnectionError("database away")  # the whole first batch fails once
        return [f"done-{i}" for i in ids]

    group = unique("g")
    consumer = Recorder(config(kafka_bootstrap, group), [topic], None, dedupe, batch_handler=batch_handler,
                        poll_timeout=0.2, retry_base=0.05)
    consume_all(consumer, positions)
    applied = [ident for call in calls[1:] for ident in call]
    assert sorted(applied) == [f"k{i}" for i in range(8)]  # each once, duplicates never passed in
    assert all(len(set(call)) == len(call) for call in calls)
    # the failed batch is retried in place; copies of its keys in the same batch wait behind it
    reasons = {r for _, _, r, _ in consumer.deferred}
    assert "handler_error" in reasons and reasons <= {"handler_error", "in_progress"}
    assert dedupe.status("k3").value == b'"done-k3"'

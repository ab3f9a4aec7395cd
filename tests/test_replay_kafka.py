"""``dedupe-worker replay kafka`` against a real Kafka-protocol broker (tansu) and Redis, and the
real consumer."""

from __future__ import annotations

import json
import signal
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis
from confluent_kafka import Consumer, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from dedupe_worker import Deduplicator
from dedupe_worker.kafka import DedupeKafkaConsumer

from .kafka_fixtures import FAST_GROUP, headers_of, read_topic, unique, wait_until
from .kafka_fixtures import committed as committed_on
from .replay_fixtures import apply_before, body_of, cli, killed_on_exit, redis_snapshot, replay_process

PARTITIONS = 2


@pytest.fixture
def topic(kafka_bootstrap: str) -> Iterator[str]:
    """A work topic and its ``.dlq`` (two partitions each) of the test's own, deleted afterwards."""
    name = unique("replay")
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    names = [name, name + ".dlq"]
    for future in admin.create_topics([NewTopic(n, PARTITIONS, 1) for n in names]).values():
        future.result(10)
    yield name
    for future in admin.delete_topics(names, operation_timeout=10).values():
        try:
            future.result(10)
        except Exception:  # already gone, or the broker is shutting down
            pass


def dead_letter(bootstrap: str, topic: str, ids: Sequence[int], *, reason: str = "handler_error",
                keyed: bool = True, **extra_headers: str) -> None:
    """Produce records ``k<i>`` into ``<topic>.dlq`` as the consumer dead-letters them (partition
    ``i % 2``, as if from offset ``i`` of that partition of ``topic``), one request per record.
    Without ``keyed`` they carry no ``idempotency-key`` and were keyed on their position."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "batch.num.messages": 1})
    failures: list[Any] = []
    for i in ids:
        headers = {
            "idempotency-key": f"k{i}", "tenant": "acme", "x-dedupe-reason": reason,
            "x-dedupe-error": "RuntimeError: downstream down", "x-dedupe-key": f"k{i}",
            "x-dedupe-attempts": "3", "x-dedupe-original-topic": topic,
            "x-dedupe-original-partition": str(i % PARTITIONS), "x-dedupe-original-offset": str(i),
            **extra_headers,
        }
        if not keyed:
            del headers["idempotency-key"]
            headers["x-dedupe-key"] = f"{topic}/{i % PARTITIONS}/{i}"
        producer.produce(topic + ".dlq", value=body_of(i), key=f"order-{i}".encode(), partition=i % PARTITIONS,
                         headers=list(headers.items()), on_delivery=lambda err, _m: err and failures.append(err))
    assert producer.flush(10) == 0 and not failures, failures


def read_all(bootstrap: str, topic: str) -> list[Message]:
    """Every record of ``topic``, read until nothing came for 1.5 s."""
    return read_topic(bootstrap, topic, expected=10**9, partitions=PARTITIONS, idle=1.5)


def committed(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    return committed_on(bootstrap, group, topic, range(PARTITIONS))


def replay_args(bootstrap: str, topic: str, redis_url: str, namespace: str, *extra: str) -> list[str]:
    return ["replay", "kafka", "--bootstrap", bootstrap, "--from", topic + ".dlq", "--group",
            "replay-" + namespace, "--idle-timeout", "1", "--redis-url", redis_url, "--namespace",
            namespace, *extra]


def consume_all(bootstrap: str, topic: str, dedupe: Deduplicator, expected: int) -> Counter[str]:
    """Run the real consumer on ``topic`` until ``expected`` distinct keys were applied and its
    group committed every record; return how many times the handler ran per key."""
    records = read_all(bootstrap, topic)
    ends = {p: 1 + max((m.offset() for m in records if m.partition() == p), default=-1)
            for p in range(PARTITIONS)}
    runs: Counter[str] = Counter()
    lock = threading.Lock()

    def handler(message: Message) -> str:
        key = json.loads(message.value())["id"]
        with lock:
            runs[key] += 1
        return str(key)

    group = unique("consumer")
    config = {"bootstrap.servers": bootstrap, "group.id": group, **FAST_GROUP}
    consumer = DedupeKafkaConsumer(config, [topic], handler, dedupe, batch_size=50)
    thread = threading.Thread(target=consumer.run, kwargs={"install_signal_handlers": False}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(runs) >= expected, 60, "the consumer to apply every key")
        wait_until(lambda: {p: max(o, 0) for p, o in committed(bootstrap, group, topic).items()} == ends,
                   30, "the consumer to commit every record")
    finally:
        consumer.stop()
        thread.join(30)
    assert not thread.is_alive()
    return runs


def test_replays_exactly_the_unapplied_half(kafka_bootstrap: str, topic: str, redis_url: str,
                                            namespace: str, dedupe: Deduplicator) -> None:
    dead_letter(kafka_bootstrap, topic, range(10))
    for i in range(5):
        apply_before(dedupe, f"k{i}", body_of(i))

    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, "--json"))

    assert status == 0
    assert json.loads(out) == {"dry_run": False, "examined": 10, "replayed": 5, "already_applied": 5,
                               "left_in_place": 0, "failed": 0}
    replayed = read_all(kafka_bootstrap, topic)
    assert sorted(headers_of(m)["idempotency-key"] for m in replayed) == [f"k{i}" for i in range(5, 10)]
    for m in replayed:
        i = int(headers_of(m)["idempotency-key"][1:])
        headers = headers_of(m)
        assert (m.value(), m.key(), m.partition()) == (body_of(i), f"order-{i}".encode(), i % PARTITIONS)
        assert "x-dedupe-attempts" not in headers and headers["x-dedupe-replayed"] == "1"
        assert headers["tenant"] == "acme" and headers["x-dedupe-original-offset"] == str(i)
    assert committed(kafka_bootstrap, "replay-" + namespace, topic + ".dlq") == {0: 5, 1: 5}
    # A second run continues where the first stopped: nothing left to examine.
    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, "--json"))
    assert json.loads(out)["examined"] == 0
    # The real consumer then applies each of them once: every message is applied exactly once.
    runs = consume_all(kafka_bootstrap, topic, dedupe, expected=5)
    assert runs == Counter({f"k{i}": 1 for i in range(5, 10)})
    assert all(dedupe.status(f"k{i}").state == "done" for i in range(10))


def fill_mixed(bootstrap: str, topic: str, redis_url: str, namespace: str) -> None:
    holder = Deduplicator(redis.Redis.from_url(redis_url), namespace=namespace, lease=60.0)
    try:
        dead_letter(bootstrap, topic, [0, 1, 2, 3])
        apply_before(holder, "k0", body_of(0))                 # applied -> drop
        apply_before(holder, "k1", body_of(1), fail=True)      # permanent failure -> leave
        assert holder.begin("k2").acquired                     # in progress -> leave
        dead_letter(bootstrap, topic, [5], reason="conflict")  # not selected by --filter -> leave
        dead_letter(bootstrap, topic, [6], **{"x-dedupe-key": "other"})  # key mismatch -> leave
    finally:
        holder.close()


EXPECTED_PLAN = {
    "k0": ("applied", "drop"), "k1": ("failed", "leave"), "k2": ("in_progress", "leave"),
    "k3": ("free", "replay"), "k5": ("filtered", "leave"), "k6": ("key_mismatch", "leave"),
}


@pytest.mark.slow
def test_dry_run_changes_nothing_then_the_real_run_follows_the_plan(
        kafka_bootstrap: str, topic: str, redis_url: str, namespace: str, redis_client: redis.Redis) -> None:
    fill_mixed(kafka_bootstrap, topic, redis_url, namespace)
    before = redis_snapshot(redis_client, namespace)
    dlq_before = sorted((m.partition(), m.offset(), m.value(), m.headers())
                        for m in read_all(kafka_bootstrap, topic + ".dlq"))
    group = "replay-" + namespace
    options = ("--filter", "handler_error")

    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, "--dry-run", "--json", *options))

    plan = json.loads(out)
    assert status == 0 and plan["dry_run"] is True
    assert {e["key"]: (e["state"], e["action"]) for e in plan["plan"]} == EXPECTED_PLAN
    assert (plan["replayed"], plan["already_applied"], plan["left_in_place"]) == (1, 1, 4)
    assert read_all(kafka_bootstrap, topic) == []
    assert sorted((m.partition(), m.offset(), m.value(), m.headers())
                  for m in read_all(kafka_bootstrap, topic + ".dlq")) == dlq_before
    assert committed(kafka_bootstrap, group, topic + ".dlq") == {0: -1001, 1: -1001}
    assert redis_snapshot(redis_client, namespace) == before

    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, "--json", *options))

    assert status == 0 and json.loads(out)["replayed"] == 1 and json.loads(out)["left_in_place"] == 4
    assert [headers_of(m)["idempotency-key"] for m in read_all(kafka_bootstrap, topic)] == ["k3"]
    # Left records were copied, untouched, to the end of the dead-letter topic, past the commit.
    dlq_after = read_all(kafka_bootstrap, topic + ".dlq")
    copies = [m for m in dlq_after if (m.partition(), m.offset()) not in {p[:2] for p in dlq_before}]
    assert sorted(headers_of(m)["idempotency-key"] for m in copies) == ["k1", "k2", "k5", "k6"]
    assert all(headers_of(m)["x-dedupe-attempts"] == "3" and "x-dedupe-replayed" not in headers_of(m)
               for m in copies)
    ends = {p: 1 + max(m.offset() for m in dlq_after if m.partition() == p) for p in range(PARTITIONS)}
    first_copy = {p: min(m.offset() for m in copies if m.partition() == p) for p in range(PARTITIONS)}
    assert committed(kafka_bootstrap, group, topic + ".dlq") == first_copy
    assert redis_snapshot(redis_client, namespace) == before
    # The next run sees only the copies, and leaves them again.
    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, "--json", *options))
    assert json.loads(out)["left_in_place"] == 4 and json.loads(out)["examined"] == 4
    assert committed(kafka_bootstrap, group, topic + ".dlq") == ends


def test_conflicts_and_undecodable_are_left_in_place_and_nothing_is_deleted(
        kafka_bootstrap: str, topic: str, redis_url: str, namespace: str, dedupe: Deduplicator,
        redis_client: redis.Redis) -> None:
    """Only a payload whose own outcome is stored is dropped (see the RabbitMQ twin of this test)."""
    dead_letter(kafka_bootstrap, topic, [0], reason="conflict")     # the key holds another payload's outcome
    apply_before(dedupe, "k0", b'{"id": "k0", "amount": 999}')
    dead_letter(kafka_bootstrap, topic, [1], reason="undecodable")  # key free
    dead_letter(kafka_bootstrap, topic, [2, 3])                     # handler_error
    apply_before(dedupe, "k2", b'{"id": "k2", "amount": 999}')      # another payload's outcome
    apply_before(dedupe, "k3", body_of(3))                          # this very payload's outcome
    before = redis_snapshot(redis_client, namespace)
    dlq_before = {(m.partition(), m.offset()) for m in read_all(kafka_bootstrap, topic + ".dlq")}

    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, "--dry-run", "--json"))

    plan = {e["key"]: e for e in json.loads(out)["plan"]}
    assert status == 0
    assert {k: (e["state"], e["action"]) for k, e in plan.items()} == {
        "k0": ("filtered", "leave"), "k1": ("filtered", "leave"), "k2": ("conflict", "leave"),
        "k3": ("applied", "drop")}
    assert "dead-lettered as conflict" in plan["k0"]["note"] and "different payload" in plan["k2"]["note"]

    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, "--json"))

    assert status == 0
    assert json.loads(out) == {"dry_run": False, "examined": 4, "replayed": 0, "already_applied": 1,
                               "left_in_place": 3, "failed": 0}
    assert read_all(kafka_bootstrap, topic) == []
    # Kafka cannot keep a record in place while the group moves on: each left record was copied,
    # untouched, to the end of the dead-letter topic for the next run.
    copies = [m for m in read_all(kafka_bootstrap, topic + ".dlq") if (m.partition(), m.offset()) not in dlq_before]
    assert sorted((headers_of(m)["idempotency-key"], m.value()) for m in copies) == [
        ("k0", body_of(0)), ("k1", body_of(1)), ("k2", body_of(2))]
    assert all(headers_of(m)["x-dedupe-attempts"] == "3" and "x-dedupe-replayed" not in headers_of(m)
               for m in copies)
    assert redis_snapshot(redis_client, namespace) == before


def test_missing_origin_is_a_failure_that_stops_the_partition(
        kafka_bootstrap: str, topic: str, redis_url: str, namespace: str) -> None:
    dead_letter(kafka_bootstrap, topic, [0, 2], **{"x-dedupe-original-topic": ""})
    dead_letter(kafka_bootstrap, topic, [1])
    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, "--json", "--dry-run"))
    assert status == 1 and (json.loads(out)["failed"], json.loads(out)["replayed"]) == (1, 1)

    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, "--json"))

    assert status == 1
    assert (json.loads(out)["failed"], json.loads(out)["replayed"]) == (1, 1)
    assert committed(kafka_bootstrap, "replay-" + namespace, topic + ".dlq") == {0: -1001, 1: 1}
    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, "--json", "--to", topic))
    assert status == 0 and json.loads(out)["replayed"] == 2


def test_position_fallback_looks_up_the_original_position(
        kafka_bootstrap: str, topic: str, redis_url: str, namespace: str, dedupe: Deduplicator) -> None:
    dead_letter(kafka_bootstrap, topic, [3, 4], keyed=False)
    apply_before(dedupe, f"{topic}/1/3", body_of(3))
    options = ("--key-header", "idempotency-key", "--dry-run", "--json")

    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, *options, "--position-fallback"))

    assert status == 0
    assert {e["key"]: e["state"] for e in json.loads(out)["plan"]} == {
        f"{topic}/1/3": "applied", f"{topic}/0/4": "free"}
    _, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, *options))
    assert [e["state"] for e in json.loads(out)["plan"]] == ["no_key", "no_key"]


def test_a_missing_dead_letter_topic_exits_2(kafka_bootstrap: str, redis_url: str, namespace: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    status, _ = cli(replay_args(kafka_bootstrap, unique("absent"), redis_url, namespace))
    assert status == 2 and "not found" in capsys.readouterr().err


@pytest.mark.slow
def test_sigkill_mid_replay_then_rerun_loses_nothing_and_applies_once(
        kafka_bootstrap: str, topic: str, redis_url: str, namespace: str, dedupe: Deduplicator) -> None:
    total = 200
    dead_letter(kafka_bootstrap, topic, range(total))
    args = replay_args(kafka_bootstrap, topic, redis_url, namespace, "--rate", "100/s")
    group = "replay-" + namespace
    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": unique("reader")})
    reader.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    seen = [0]

    def progress() -> int:
        return sum(max(o, 0) for o in committed(kafka_bootstrap, group, topic + ".dlq").values())

    def mid_batch() -> bool:
        """Some records committed, and at least 20 more delivered but not yet committed."""
        seen[0] += sum(1 for m in reader.consume(100, 0.05) if m.error() is None)
        done = progress()
        return 0 < done and seen[0] >= done + 20

    try:
        with killed_on_exit(replay_process(args)) as proc:
            wait_until(lambda: mid_batch() or proc.poll() is not None, 60, "replay progress")
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    finally:
        reader.close()
    done = progress()
    assert 0 < done < total

    status, out = cli(replay_args(kafka_bootstrap, topic, redis_url, namespace, "--json"))

    summary = json.loads(out)
    assert status == 0 and summary["failed"] == 0 and summary["examined"] <= total - done
    assert committed(kafka_bootstrap, group, topic + ".dlq") == {0: total // 2, 1: total // 2}
    delivered = Counter(headers_of(m)["idempotency-key"] for m in read_all(kafka_bootstrap, topic))
    assert set(delivered) == {f"k{i}" for i in range(total)}          # nothing lost
    # The kill came between delivery reports and their commit: some records went out twice.
    assert sum(delivered.values()) > total
    runs = consume_all(kafka_bootstrap, topic, dedupe, expected=total)
    assert runs == Counter({f"k{i}": 1 for i in range(total)})        # nothing applied twice

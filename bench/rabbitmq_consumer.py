"""RabbitMQ consumer messages/s and client CPU per message with deduplication, against bare kombu.

    python -m bench.rabbitmq_consumer [--url AMQP_URL] [--redis-url URL] [--messages N] [--rounds R]

Same broker, same run, same message bodies, at prefetch 1 and 100. The baseline (``kombu``) is
the consumer a kombu user writes without us: a ``ConsumerMixin`` whose callback decodes the body,
calls the handler and acks. ``dedupe`` is :class:`~dedupe_worker.rabbitmq.DedupeConsumer` (at
prefetch 100 the prefetched messages are claimed in one Redis round trip and completed in
another). ``loop only`` is ``DedupeConsumer`` with the decision short-cut (no Redis), to show what
the loop itself costs. ``duplicates`` is a second pass over keys already applied (all acked
unhandled). The handler does nothing. Each measurement consumes a freshly filled queue; the clock
runs from the first delivery to the last ack. Beside msg/s each case shows the client's CPU per
message (``time.process_time`` over the same span, every thread of the process) and the bare
kombu loop's. The variants take turns; medians are printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis
from kombu import Connection, Queue
from kombu.mixins import ConsumerMixin

from bench.ratios import print_ratios
from dedupe_worker import Decision, Deduplicator, Reason
from dedupe_worker.rabbitmq import DedupeConsumer, delay_queue, dlq

BODY = b'{"order": 1, "amount": 100}'


def handler(body: Any, message: Any) -> None:
    return None


class Counting:
    """Mixed into each variant: stop after ``target`` acks; remember the first and last time."""

    target = 0
    count = 0
    started = 0.0
    finished = 0.0
    cpu_started = 0.0
    cpu_finished = 0.0

    def start(self) -> None:
        if not self.started:
            self.started, self.cpu_started = time.perf_counter(), time.process_time()

    def tick(self, n: int = 1) -> None:
        self.start()
        self.count += n
        if self.count >= self.target:
            self.finished, self.cpu_finished = time.perf_counter(), time.process_time()
            self.should_stop = True

    def rate(self) -> tuple[float, float]:
        """msg/s, and client CPU µs per message."""
        return (self.count / (self.finished - self.started),
                1e6 * (self.cpu_finished - self.cpu_started) / self.count)


class Kombu(Counting, ConsumerMixin):  # type: ignore[misc]
    """The baseline: decode, handle, ack."""

    def __init__(self, connection: Connection, queue: str, prefetch: int) -> None:
        self.connection = connection
        self.queue = Queue(queue, durable=True)
        self.prefetch = prefetch

    def get_consumers(self, consumer_cls: Any, channel: Any) -> list[Any]:
        return [consumer_cls(queues=[self.queue], callbacks=[self.on_message], accept=["json"],
                             prefetch_count=self.prefetch)]

    def on_message(self, body: Any, message: Any) -> None:
        self.start()
        handler(body, message)
        message.ack()
        self.tick()


class Dedupe(Counting, DedupeConsumer):
    def handle(self, batch: Sequence[tuple[str, Any, BaseException | None]]) -> None:
        self.start()
        super().handle(batch)
        self.tick(len(batch))


class LoopOnly(Dedupe):
    """``DedupeConsumer`` with the decision short-cut: every message APPLIED, no Redis."""

    def handle(self, batch: Sequence[tuple[str, Any, BaseException | None]]) -> None:
        self.start()
        for _queue, message, _ in batch:
            body = message.decode()
            self.settle_applied(message, Decision(Reason.APPLIED, None, handler(body, message)))
        self.tick(len(batch))

    def settle_applied(self, message: Any, decision: Decision) -> None:
        message.ack()


def fill(conn: Connection, queue: str, count: int, prefix: str) -> None:
    channel = conn.channel()
    channel.queue_declare(queue=queue, durable=True, auto_delete=False)
    for i in range(count):
        message = channel.prepare_message(BODY, None, "application/json", "utf-8",
                                          {"idempotency-key": f"{prefix}-{i}"}, {"delivery_mode": 1})
        channel.basic_publish(message, exchange="", routing_key=queue)
    while channel.queue_declare(queue=queue, passive=True).message_count < count:
        time.sleep(0.01)
    channel.close()


def measure(make: Callable[[Connection, str], Counting], conn: Connection, count: int,
            prefix: str) -> tuple[float, float]:
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    fill(conn, queue, count, prefix)
    consumer = make(conn.clone(), queue)
    consumer.target = count
    try:
        consumer.run()  # type: ignore[attr-defined]
    finally:
        channel = conn.channel()
        for name in (queue, delay_queue(queue), dlq(queue)):
            channel.queue_delete(queue=name)
        channel.close()
        consumer.connection.release()  # type: ignore[attr-defined]
    return consumer.rate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("DEDUPE_RABBITMQ_URL",
                                                        "amqp://guest:guest@127.0.0.1:5672//"))
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--messages", type=int, default=10000, help="messages per measurement at prefetch 100")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per case (median shown)")
    parser.add_argument("--label", default=f"pid {os.getpid()}, cpus {sorted(os.sched_getaffinity(0))}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    client = redis.Redis.from_url(args.redis_url)
    print(f"RabbitMQ consumer ({args.label})", flush=True)
    with Connection(args.url) as conn:
        for prefetch, count in ((1, max(1, args.messages // 5)), (100, args.messages)):
            rates: dict[str, list[float]] = {"kombu": [], "loop only": [], "dedupe": [], "duplicates": []}
            cpu: dict[str, list[float]] = {name: [] for name in rates}
            for _ in range(args.rounds):
                run = uuid.uuid4().hex[:8]
                dedupe = Deduplicator(client, namespace=f"bench-{run}", result_ttl=300)

                def ours(cls: type[Dedupe], dedupe: Deduplicator = dedupe,
                         prefetch: int = prefetch) -> Callable[[Connection, str], Counting]:
                    return lambda c, q: cls(c, [q], handler, dedupe, prefetch_count=prefetch)

                def kombu(c: Connection, q: str, prefetch: int = prefetch) -> Counting:
                    return Kombu(c, q, prefetch)

                for name, make in (("kombu", kombu), ("loop only", ours(LoopOnly)), ("dedupe", ours(Dedupe)),
                                   ("duplicates", ours(Dedupe))):
                    rate, per_message = measure(make, conn, count, run)
                    rates[name].append(rate)
                    cpu[name].append(per_message)
                dedupe.close()
            print_ratios(f"prefetch {prefetch:>3}", rates, "kombu", count, cpu=cpu)


if __name__ == "__main__":
    main()

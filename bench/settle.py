"""Time to settle copies of work in flight: from the holder's completion to each copy's ack.

    python -m bench.settle [--url AMQP_URL] [--redis-url URL] [--keys N] [--consumers 3]

``--keys`` keys are each published 5 times, the copies of a key back to back, to one queue that
``--consumers`` :class:`~dedupe_worker.rabbitmq.DedupeConsumer` threads consume (each with its own
connection, prefetch 10; one ``Deduplicator`` with the default 30 s lease). The handler takes
1 ms or 50 ms. For each key the holder's completion is when its handler returned; a copy settles
when it is acked (as a duplicate). Printed: p50 and p99 of settle times over every copy acked after
its holder completed, for two variants measured in the same run:

- ``before``: the deferral of the previous release: no waiting; a copy of work in flight goes to
  the delay queue for the holder's remaining lease plus a backoff (``defer_base`` 0.5 s);
- ``after``: this release: copies wait on the key (``defer_wait`` 5 s) and are answered when the
  holder's outcome is stored.

A last line counts the Redis round trips of ``run()`` when no copy is in flight (first seen,
duplicate), to show that waiting costs the common path nothing.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from kombu import Connection

from dedupe_worker import Deduplicator
from dedupe_worker._engine.policy import backoff
from dedupe_worker.rabbitmq import DedupeConsumer, delay_queue, dlq

COPIES = 5


class Recording(DedupeConsumer):
    """Records, per key, when each copy was acked as a duplicate (or as the one applied)."""

    acks: dict[str, list[float]]
    lock: threading.Lock

    def on_duplicate(self, message: Any, decision: Any) -> None:
        with self.lock:
            self.acks.setdefault(message.headers["idempotency-key"], []).append(time.monotonic())


class Before(Recording):
    """The previous release's deferral: no waiting, and never back before the holder's lease ends."""

    defer_wait = 0.0
    defer_base = 0.5

    def defer_delay(self, deferrals: int, holder_left: float | None = None) -> float:
        return backoff(deferrals, base=self.defer_base, cap=self.defer_cap, floor=holder_left or 0.0)


def measure(variant: type[Recording], url: str, redis_url: str, keys: int, consumers: int,
            work: float) -> list[float]:
    """Settle times (seconds) of every copy acked after its holder completed."""
    client = redis.Redis.from_url(redis_url)
    dedupe = Deduplicator(client, namespace=f"bench-settle-{uuid.uuid4().hex[:8]}")  # lease 30 s
    queue = f"bench-settle-{uuid.uuid4().hex[:8]}"
    done: dict[str, float] = {}
    acks: dict[str, list[float]] = {}
    lock = threading.Lock()

    def handler(body: Any, message: Any) -> None:
        time.sleep(work)
        done[message.headers["idempotency-key"]] = time.monotonic()

    with Connection(url) as conn:
        channel = conn.channel()
        channel.queue_declare(queue=queue, durable=True, auto_delete=False)
        running = [variant(conn.clone(), [queue], handler, dedupe, prefetch_count=10) for _ in range(consumers)]
        for consumer in running:
            consumer.acks, consumer.lock = acks, lock
        threads = [threading.Thread(target=c.run, daemon=True) for c in running]
        for thread in threads:
            thread.start()
        for consumer in running:
            consumer.ready.wait(15)
        for k in range(keys):
            for _ in range(COPIES):
                message = channel.prepare_message(b'{"n": 1}', None, "application/json", "utf-8",
                                                  {"idempotency-key": f"k{k}"}, {})
                channel.basic_publish_confirm(message, exchange="", routing_key=queue)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sum(len(v) for v in acks.values()) < keys * (COPIES - 1):
            time.sleep(0.05)
        for consumer in running:
            consumer.stop()
        for thread in threads:
            thread.join(15)
        for name in (queue, delay_queue(queue), dlq(queue)):
            channel.queue_delete(queue=name)
    dedupe.close()
    return [max(0.0, t - done[key]) for key, times in acks.items() for t in times if t >= done.get(key, t + 1)]


def round_trips(redis_url: str) -> tuple[int, int]:
    """Round trips of ``run()`` for a first-seen key and for its duplicate."""
    sent: list[int] = []

    class Counting(redis.Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            sent.append(1)
            super().send_packed_command(command, check_health)

    kwargs = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    client = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=Counting, **kwargs))
    dedupe = Deduplicator(client, namespace=f"bench-rt-{uuid.uuid4().hex[:8]}")
    dedupe.run("warm-up", lambda: None)
    counts = []
    for _ in range(2):
        sent.clear()
        dedupe.run("key", lambda: None)
        counts.append(len(sent))
    dedupe.close()
    return counts[0], counts[1]


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--keys", type=int, default=60, help="distinct keys, each published 5 times")
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    print(f"Settle time of copies in flight ({args.keys} keys x {COPIES}, {args.consumers} consumers, "
          f"lease 30 s) {args.label}", flush=True)
    variants: list[tuple[str, type[Recording]]] = [("before", Before), ("after", Recording)]
    for work in (0.001, 0.050):
        for name, variant in variants:
            settle = measure(variant, args.url, args.redis_url, args.keys, args.consumers, work)
            show: Callable[[float], str] = lambda s: f"{s * 1000:>9,.1f} ms"  # noqa: E731
            print(f"  handler {work * 1000:>4.0f} ms  {name:<6}  p50 {show(percentile(settle, 50))}  "
                  f"p99 {show(percentile(settle, 99))}  ({len(settle)} copies)", flush=True)
    first, duplicate = round_trips(args.redis_url)
    print(f"  run() with no copy in flight: {first} round trips first seen, {duplicate} for a duplicate", flush=True)


if __name__ == "__main__":
    main()

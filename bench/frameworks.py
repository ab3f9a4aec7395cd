"""FastStream and Dramatiq on RabbitMQ, each with and without deduplication, in one run.

    python -m bench.frameworks [--rabbitmq-url URL] [--redis-url URL] [--messages N] [--rounds R]

Cases, each in messages/s from the first publish to the last message handled (publishing
included, the same for both sides of a pair), on a queue of its own, every message a new key
(claim + handler + complete: two Lua scripts), the cases taking turns in rounds, each the median
of its rounds:

- ``faststream``: a ``RabbitBroker`` subscriber that returns at once;
- ``faststream + dedupe``: the same with ``dedupe_middleware`` (key: the body's ``id``);
- ``dramatiq``: a ``dramatiq.Worker`` (1 thread) running an actor that returns at once;
- ``dramatiq + dedupe``: the same with ``DedupeMiddleware`` (key from the actor's argument).

Printed with the per-message overhead of deduplication in µs and the ratio of each pair.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable

import dramatiq
import pika
import redis
import redis.asyncio
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from faststream.rabbit import RabbitBroker, RabbitQueue

from dedupe_worker import Deduplicator
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.dramatiq import DedupeMiddleware
from dedupe_worker.faststream import dedupe_middleware
from dedupe_worker.keys import field_key

#: A case: handle ``n`` messages, return the seconds it took.
Case = Callable[[int], float]


def faststream_case(amqp_url: str, redis_url: str, dedupe: bool) -> Case:
    def case(n: int) -> float:
        async def main() -> float:
            queue = f"bench-fs-{uuid.uuid4().hex[:8]}"
            client = AsyncDeduplicator(redis.asyncio.Redis.from_url(redis_url), namespace=f"bench-{queue}",
                                       result_ttl=60.0)
            middlewares = [dedupe_middleware(client, key=field_key("id"))] if dedupe else []
            broker = RabbitBroker(amqp_url, middlewares=middlewares, logger=None)
            done = asyncio.Event()
            handled = 0

            @broker.subscriber(RabbitQueue(queue, auto_delete=True))
            async def handle(body: dict[str, int]) -> int:
                nonlocal handled
                handled += 1
                if handled == n:
                    done.set()
                return body["id"]

            await broker.start()
            began = time.perf_counter()
            for i in range(n):
                await broker.publish({"id": i}, queue=queue)
            await asyncio.wait_for(done.wait(), 300)
            elapsed = time.perf_counter() - began
            await broker.stop()
            await client.aclose()
            await client.store.client.aclose()
            return elapsed

        return asyncio.run(main())

    return case


def dramatiq_case(amqp_url: str, redis_url: str, dedupe: bool) -> Case:
    def case(n: int) -> float:
        queue = f"bench-dq-{uuid.uuid4().hex[:8]}"
        broker = RabbitmqBroker(url=amqp_url.rstrip("/") + "/%2F")
        client = Deduplicator(redis.Redis.from_url(redis_url), namespace=f"bench-{queue}", result_ttl=60.0)
        if dedupe:
            broker.add_middleware(DedupeMiddleware(client))
        done = threading.Event()
        handled = [0]
        lock = threading.Lock()

        def work(i: int) -> None:
            with lock:
                handled[0] += 1
                if handled[0] == n:
                    done.set()

        options = {"idempotency_key": lambda i: f"bench:{i}"} if dedupe else {}
        actor = dramatiq.actor(work, broker=broker, queue_name=queue, **options)
        worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
        worker.start()
        try:
            began = time.perf_counter()
            for i in range(n):
                actor.send(i)
            assert done.wait(300), "dramatiq bench did not finish"
            return time.perf_counter() - began
        finally:
            worker.stop()
            with pika.BlockingConnection(pika.URLParameters(amqp_url.rstrip("/") + "/%2F")) as conn:
                channel = conn.channel()
                for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
                    channel.queue_delete(queue=name)
            broker.close()
            client.close()

    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rabbitmq-url",
                        default=os.environ.get("DEDUPE_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/"))
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    amqp = args.rabbitmq_url.rstrip("/") + "/"
    cases = {
        "faststream": faststream_case(amqp, args.redis_url, False),
        "faststream + dedupe": faststream_case(amqp, args.redis_url, True),
        "dramatiq": dramatiq_case(amqp, args.redis_url, False),
        "dramatiq + dedupe": dramatiq_case(amqp, args.redis_url, True),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            samples[name].append(args.messages / case(args.messages))
    rates = {name: statistics.median(values) for name, values in samples.items()}
    print(f"FastStream and Dramatiq on RabbitMQ, {args.messages} messages x {args.rounds} rounds"
          f"{' (' + args.label + ')' if args.label else ''}")
    for plain in ("faststream", "dramatiq"):
        ours = plain + " + dedupe"
        overhead = (1 / rates[ours] - 1 / rates[plain]) * 1e6
        print(f"  {plain:<11} {rates[plain]:8.0f} msg/s   + dedupe {rates[ours]:8.0f} msg/s   "
              f"{overhead:+7.0f} µs/msg   ratio {rates[ours] / rates[plain]:.2f}")


if __name__ == "__main__":
    main()

"""The sender's side of ``dedupe_on_send``: what a ``delay()`` costs with and without the check.

    python -m bench.celery_send [--broker URL] [--redis-url URL] [--sends N] [--rounds R]

No worker runs: the messages stay in a queue of the bench's own (deleted afterwards). Each round
times ``N`` calls of each variant, in turns, and each variant reports its best round:

* ``plain``: ``delay()`` of an ``IdempotentTask`` with the option off (publishes every time);
* ``first``: ``delay()`` with ``dedupe_on_send``, every call a new key (``send.lua`` answers
  "publish": one round trip to Redis, then the publish);
* ``queued``: a duplicate ``delay()`` of a key already sent (``send.lua`` answers "queued":
  nothing is published);
* ``done``: a duplicate ``delay()`` of a key whose outcome is stored (the stored value is
  returned, nothing is published).

Printed: µs per ``delay()`` of each, the duplicates' speed-up over ``plain`` (goal: above 1), the
first send's extra cost over ``plain``, and the Redis round trips a checked send makes (goal: 1),
counted in this process.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery

from dedupe_worker._transport.scripts import ScriptRunner
from dedupe_worker.celery import IdempotentTask


def make_app(broker: str, redis_url: str, namespace: str, queue: str) -> Celery:
    app = Celery("bench-send", broker=broker, backend=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, broker_connection_retry_on_startup=True,
                    dedupe_redis_url=redis_url, dedupe_namespace=namespace, dedupe_lease=30, dedupe_result_ttl=600)

    @app.task(base=IdempotentTask, bind=True, shared=False, name="bench.charge",
              idempotency_key="charge:{order_id}")
    def charge(self: IdempotentTask, order_id: int, amount: int) -> int:
        return amount

    return app


def timed(n: int, send: Callable[[int], Any]) -> float:
    began = time.perf_counter()
    for i in range(n):
        send(i)
    return (time.perf_counter() - began) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default=os.environ.get("DEDUPE_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//"))
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--sends", type=int, default=500, help="delay() calls per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    namespace = f"bench-send-{uuid.uuid4().hex[:8]}"
    queue = f"bench-send-{uuid.uuid4().hex[:8]}"
    app = make_app(args.broker, args.redis_url, namespace, queue)
    charge = app.tasks["bench.charge"]
    n = args.sends
    charge.delay(0, 1)  # connect to the broker and Redis, declare the queue, load the scripts
    charge.apply_async((-1, 1), dedupe_on_send=True)  # sent once: later sends of it find it queued
    charge.apply((-2, 1))  # run here as a worker would: its outcome is stored
    calls = 0
    original = ScriptRunner.call

    def counting(self: ScriptRunner, *a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(self, *a, **kw)

    best: dict[str, float] = {}
    fresh = iter(range(1, 10**9))
    variants: dict[str, Callable[[int], Any]] = {
        "plain": lambda i: charge.delay(1, 1),
        "first": lambda i: charge.apply_async((next(fresh), 1), dedupe_on_send=True),
        "queued": lambda i: charge.apply_async((-1, 1), dedupe_on_send=True),
        "done": lambda i: charge.apply_async((-2, 1), dedupe_on_send=True),
    }
    try:
        for _ in range(args.rounds):
            for name, send in variants.items():
                best[name] = min(best.get(name, float("inf")), timed(n, send))
        ScriptRunner.call = counting  # type: ignore[method-assign]
        charge.apply_async((next(fresh), 1), dedupe_on_send=True)
        first_trips, calls = calls, 0
        charge.apply_async((-1, 1), dedupe_on_send=True)
        queued_trips = calls
    finally:
        ScriptRunner.call = original  # type: ignore[method-assign]
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
        with charge.deduplicator.store.client as r:
            keys = list(r.scan_iter(f"{namespace}:*", count=1000))
            if keys:
                r.delete(*keys)
        app.close()

    plain = best["plain"]
    print(f"delay() on one process, best of {args.rounds} rounds of {n} (shared machine: compare within this run)")
    for name in variants:
        print(f"  {name:7s} {best[name] * 1e6:8.1f} µs/send")
    print(f"duplicate vs plain: queued {plain / best['queued']:.2f}x, done {plain / best['done']:.2f}x faster "
          "(nothing published)")
    print(f"first send's extra cost: {(best['first'] - plain) * 1e6:+.1f} µs; Redis round trips per checked send: "
          f"first {first_trips}, duplicate {queued_trips}")


if __name__ == "__main__":
    main()

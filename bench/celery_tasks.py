"""Celery tasks/s on a real worker: a plain task, ``IdempotentTask`` and celery-once's ``QueueOnce``.

    python -m bench.celery_tasks [--broker URL] [--redis-url URL] [--tasks N] [--rounds R] [--pool P]

One ``celery worker`` subprocess (``-P solo`` by default: one process, so per-task cost is not
blurred by pool scheduling) consumes a queue of its own on the RabbitMQ broker; Redis is the
result backend of all three variants, the claim store of ``IdempotentTask`` and the lock store of
``QueueOnce``. Each round sends ``N`` tasks of one variant with distinct arguments (so nothing is
deduplicated or locked out) and waits for the last result; the worker runs them in order, so that
is when all are done. The variants take turns for ``R`` rounds and each reports its best round
(the median is printed too): on a shared machine the broker now and then holds deliveries back
for seconds, which can only make a round slower, never faster.

Printed: tasks/s per variant, the per-task overhead over the plain task in microseconds
(``1/rate - 1/plain_rate``, producer-side work included: QueueOnce takes its lock when sending),
and the ratio of our overhead to celery-once's (below 1: cheaper).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery_once import QueueOnce

from dedupe_worker.celery import IdempotentTask

ENV = "DEDUPE_BENCH_CELERY"
ROOT = Path(__file__).resolve().parent.parent


def make_app(broker: str, redis_url: str, namespace: str, queue: str) -> Celery:
    app = Celery("bench", broker=broker, backend=redis_url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        result_expires=600,
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=16,
        dedupe_redis_url=redis_url,
        dedupe_namespace=namespace,
        dedupe_lease=30,
        dedupe_result_ttl=600,
        ONCE={"backend": "celery_once.backends.Redis",
              "settings": {"url": redis_url, "default_timeout": 600}},
    )

    # acks_late on all three, so they differ only in the deduplication.
    @app.task(name="bench.plain", shared=False, acks_late=True)
    def plain(i: int) -> int:
        return i

    @app.task(name="bench.idempotent", shared=False, base=IdempotentTask,
              idempotency_key=lambda i: f"bench:{i}")
    def idempotent(i: int) -> int:
        return i

    @app.task(name="bench.once", shared=False, base=QueueOnce, acks_late=True, once={"graceful": True})
    def once(i: int) -> int:
        return i

    return app


app = make_app(**json.loads(os.environ[ENV])) if ENV in os.environ else None


def start_worker(config: dict[str, Any], pool: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, ENV: json.dumps(config), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "bench.celery_tasks:app", "worker", "-P", pool, "-c", "1",
         "-Q", config["queue"], "-n", f"{config['namespace']}@%h", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "-l", "WARNING", "-f", str(log)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited: {log.read_text() if log.exists() else ''}")
        try:
            if app_for(config).control.ping([f"{config['namespace']}@{socket.gethostname()}"], timeout=0.5):
                return proc
        except Exception:
            pass
    raise TimeoutError("worker did not answer a ping within 60s")


_apps: dict[str, Celery] = {}


def app_for(config: dict[str, Any]) -> Celery:
    if config["namespace"] not in _apps:
        _apps[config["namespace"]] = make_app(**config)
    return _apps[config["namespace"]]


def one_round(sender: Celery, name: str, start: int, n: int) -> float:
    task = sender.tasks[name]
    began = time.perf_counter()
    last = None
    for i in range(start, start + n):
        last = task.apply_async((i,))
    assert last is not None
    last.get(timeout=120)
    return n / (time.perf_counter() - began)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default=os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//"))
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--tasks", type=int, default=1000, help="tasks per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pool", default="solo", help="worker pool (solo, prefork)")
    args = parser.parse_args(argv)

    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    config = {"broker": args.broker, "redis_url": args.redis_url, "namespace": namespace,
              "queue": f"bench-{namespace}"}
    sender = app_for(config)
    log = Path(tempfile.gettempdir()) / f"{namespace}.log"
    worker = start_worker(config, args.pool, log)
    variants = {"plain": "bench.plain", "IdempotentTask": "bench.idempotent", "QueueOnce": "bench.once"}
    samples: dict[str, list[float]] = {v: [] for v in variants}
    try:
        counter = 0
        for name in variants.values():  # warm-up: connections, script cache, imports
            one_round(sender, name, -10_000_000 - counter, 50)
            counter += 50
        for _ in range(args.rounds):
            for label, name in variants.items():
                samples[label].append(one_round(sender, name, counter, args.tasks))
                counter += args.tasks
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(30)
        with sender.connection_for_write() as conn:
            conn.default_channel.queue_delete(config["queue"])
        client = redis.Redis.from_url(args.redis_url)
        for pattern in (f"{namespace}:*", "qo_bench.once*"):
            for batch in _chunks(list(client.scan_iter(pattern, count=1000)), 1000):
                client.delete(*batch)

    rates = {label: max(values) for label, values in samples.items()}
    medians = {label: statistics.median(values) for label, values in samples.items()}
    plain = rates["plain"]
    overhead = {label: 1e6 * (1 / rate - 1 / plain) for label, rate in rates.items()}
    print(f"celery worker -P {args.pool}, {args.tasks} tasks x {args.rounds} rounds, RabbitMQ broker, "
          f"Redis backend/store (best round; median in brackets)")
    for label, rate in rates.items():
        extra = "" if label == "plain" else f"  overhead {overhead[label]:7.0f} us/task"
        print(f"  {label:<15} {rate:8.0f} tasks/s [{medians[label]:6.0f}]{extra}")
    ratio = overhead["IdempotentTask"] / overhead["QueueOnce"] if overhead["QueueOnce"] > 0 else float("nan")
    print(f"  overhead ratio IdempotentTask / QueueOnce: {ratio:.2f}")


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


if __name__ == "__main__":
    main()

"""Everything on top runs unchanged on a PostgreSQL-only configuration (no Redis at all:
``DEDUPE_REDIS_URL`` points at a closed port): a Celery worker, a RabbitMQ ``DedupeConsumer``, the
HTTP middleware on uvicorn and ``dedupe-worker replay`` each apply a duplicated stream once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
import pytest
from kombu import Connection

from dedupe_worker import Deduplicator
from dedupe_worker.rabbitmq import DedupeConsumer

from . import services
from .celery_fixtures import WorkerProcess
from .http_servers import ROOT
from .rabbitmq_fixtures import amqp, consumer_thread, depth, publish, queue_name, wait_for
from .replay_fixtures import apply_before, body_of, cli, unique
from .sql_only_apps import make_celery
from .store_fixtures import postgres_store

__all__ = ["amqp", "queue_name"]

NO_REDIS = "redis://127.0.0.1:1/0"


@pytest.fixture
def pg_only(postgres_dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The store's URL; the environment (ours and our subprocesses') names it and no Redis."""
    for url in postgres_store(postgres_dsn):
        with psycopg.connect("postgresql://" + url.split("://", 1)[1], autocommit=True) as conn:
            conn.execute("CREATE TABLE sql_effects (kind text NOT NULL, key text NOT NULL)")
        monkeypatch.setenv("DEDUPE_STORE_URL", url)
        monkeypatch.setenv("DEDUPE_REDIS_URL", NO_REDIS)
        yield url


def effects(url: str, kind: str) -> Counter[str]:
    with psycopg.connect("postgresql://" + url.split("://", 1)[1]) as conn:
        rows = conn.execute("SELECT key FROM sql_effects WHERE kind = %s", (kind,)).fetchall()
    return Counter(key for (key,) in rows)


def test_a_celery_worker_applies_each_task_once(pg_only: str, rabbitmq_url: str, tmp_path: Path) -> None:
    namespace, queue = unique("sq"), unique("sq-queue")
    os.environ.update(SQL_TEST_BROKER=rabbitmq_url, SQL_TEST_QUEUE=queue, SQL_TEST_NAMESPACE=namespace)
    try:
        worker = WorkerProcess({"namespace": namespace, "queue": queue}, concurrency=2, tmp=tmp_path,
                               app="tests.sql_only_apps:app")
        app = make_celery(rabbitmq_url, queue, namespace)
        try:
            worker.wait_ready()
            charge = app.tasks["sq.charge"]
            sent = [charge.delay(order, 10 * order) for _ in range(3) for order in range(8)]
            results = [r.get(timeout=60) for r in sent]
        finally:
            worker.stop()
            with app.connection_for_write() as conn:
                conn.default_channel.queue_delete(queue)
            app.close()
    finally:
        for name in ("SQL_TEST_BROKER", "SQL_TEST_QUEUE", "SQL_TEST_NAMESPACE"):
            os.environ.pop(name, None)
    assert effects(pg_only, "charge") == Counter({str(order): 1 for order in range(8)})
    by_order: dict[int, set[Any]] = {}
    for result in results:
        by_order.setdefault(result["order_id"], set()).add(result["token"])
    assert all(len(tokens) == 1 for tokens in by_order.values())  # duplicates answered with the stored result


def test_a_rabbitmq_consumer_applies_each_message_once(pg_only: str, amqp: Connection, queue_name: str) -> None:
    applied: Counter[str] = Counter()
    lock = threading.Lock()

    def handler(body: Any, message: Any) -> str:
        with lock:
            applied[body["id"]] += 1
        return str(body["id"])

    for _copy in range(3):
        for n in range(12):
            publish(amqp, queue_name, orjson.dumps({"id": f"m{n}"}), message_id=f"mid-{n}")
    dedupe = Deduplicator.from_settings(namespace=unique("sq"))
    consumer = DedupeConsumer(amqp.clone(), [queue_name], handler, dedupe, prefetch_count=10)
    with consumer_thread(consumer):
        wait_for(lambda: sum(applied.values()) >= 12 and depth(amqp, queue_name) == 0, what="all applied")
        wait_for(lambda: depth(amqp, queue_name + ".delay") == 0, what="delay queue empty")
    assert applied == Counter({f"m{n}": 1 for n in range(12)})


def test_the_http_middleware_on_uvicorn_answers_retries_from_the_store(pg_only: str) -> None:
    port = services.free_port()
    env = {**os.environ, "SQL_TEST_HTTP": "1", "SQL_TEST_NAMESPACE": unique("sq"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.sql_only_apps:asgi", "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "2", "--log-level", "warning"],
                            cwd=ROOT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(base), 60, "uvicorn")
        keys = [f"order-{uuid.uuid4().hex[:6]}" for _ in range(6)]

        def post(key: str) -> httpx.Response:
            return httpx.post(base + "/orders", headers={"Idempotency-Key": key}, content=b'{"n": 1}',
                              timeout=30)

        with ThreadPoolExecutor(8) as pool:  # copies at once: one runs, the others 201 or 409 (in flight)
            burst = list(pool.map(post, [k for _ in range(3) for k in keys]))
        retries = [post(k) for _ in range(2) for k in keys]  # later retries: the stored response
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(15)
    assert effects(pg_only, "order") == Counter({k: 1 for k in keys})
    assert {r.status_code for r in burst} <= {201, 409}
    by_key: dict[str, set[bytes]] = {}
    for reply in [*burst, *retries]:
        if reply.status_code == 201:
            by_key.setdefault(reply.json()["key"], set()).add(reply.content)
    assert all(r.status_code == 201 for r in retries)
    assert set(by_key) == set(keys) and all(len(bodies) == 1 for bodies in by_key.values())


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_replay_leaves_what_the_store_says_is_applied(pg_only: str, amqp: Connection, rabbitmq_url: str) -> None:
    queue, namespace = unique("sq-replay"), unique("sq")
    channel = amqp.default_channel
    for q in (queue, queue + ".dlq"):
        channel.queue_declare(queue=q, durable=True, auto_delete=False)
    try:
        for i in range(6):
            message = channel.prepare_message(body_of(i), 3, "application/json", "utf-8",
                                              {"idempotency-key": f"k{i}", "x-dedupe-key": f"k{i}",
                                               "x-dedupe-reason": "handler_error",
                                               "x-dedupe-original-queue": queue,
                                               "x-dedupe-original-exchange": "",
                                               "x-dedupe-original-routing-key": queue}, {"delivery_mode": 2})
            channel.basic_publish_confirm(message, exchange="", routing_key=queue + ".dlq")
        dedupe = Deduplicator.from_settings(namespace=namespace)
        for i in range(3):
            apply_before(dedupe, f"k{i}", body_of(i))
        status, out = cli(["replay", "rabbitmq", "--url", rabbitmq_url, "--from", queue + ".dlq",
                           "--store-url", pg_only, "--namespace", namespace, "--json"])
        assert status == 0, out
        summary = orjson.loads(out)
        assert (summary["replayed"], summary["already_applied"]) == (3, 3)
        applied: Counter[str] = Counter()
        consumer = DedupeConsumer(amqp.clone(), [queue], lambda body, message: applied.update([body["id"]]),
                                  dedupe)
        with consumer_thread(consumer):
            wait_for(lambda: sum(applied.values()) >= 3 and depth(amqp, queue) == 0, what="replayed applied")
        assert applied == Counter({f"k{i}": 1 for i in range(3, 6)})
    finally:
        for q in (queue, queue + ".dlq", queue + ".delay"):
            channel.queue_delete(queue=q)

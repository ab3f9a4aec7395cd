"""Dramatiq's ``DedupeMiddleware`` on a real RabbitMQ broker and real Redis.

Workers run in-process (``dramatiq.Worker``) except for the crash test, which SIGKILLs a worker
subprocess mid-actor. Every test has its own queue (deleted afterwards) and Redis namespace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dramatiq
import pika
import pytest
import redis
from dramatiq.common import dq_name, xq_name

from dedupe_worker import Deduplicator
from dedupe_worker._messages import deadletter
from dedupe_worker.keys import fingerprint_of

from . import services
from .dramatiq_app import App, build, pika_url
from .rabbitmq_fixtures import stop_process, wait_for
from .recording import entries, record

__all__ = ["record"]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def queue(rabbitmq_url: str) -> Iterator[str]:
    """A queue name of the test's own; it, its .DQ and its .XQ are deleted afterwards."""
    try:
        connection = pika.BlockingConnection(pika.URLParameters(pika_url(rabbitmq_url)))
    except Exception as exc:
        services.unavailable(f"RabbitMQ at {rabbitmq_url} ({exc})")
    name = f"dq-test-{uuid.uuid4().hex[:10]}"
    yield name
    channel = connection.channel()
    for queue_name in (name, dq_name(name), xq_name(name)):
        channel.queue_delete(queue=queue_name)
    connection.close()



def dead_letters(rabbitmq_url: str, queue: str) -> list[tuple[dict[str, Any], bytes]]:
    """Take every message out of ``<queue>.XQ``: ``(headers, body)``."""
    connection = pika.BlockingConnection(pika.URLParameters(pika_url(rabbitmq_url)))
    out = []
    try:
        channel = connection.channel()
        while True:
            method, properties, body = channel.basic_get(queue=xq_name(queue), auto_ack=True)
            if method is None:
                return out
            out.append((properties.headers or {}, body))
    finally:
        connection.close()


@contextmanager
def running(app: App, threads: int = 2) -> Iterator[App]:
    worker = dramatiq.Worker(app.broker, worker_threads=threads, worker_timeout=100)
    worker.start()
    try:
        yield app
    finally:
        worker.stop()
        app.broker.close()


def test_duplicates_are_applied_once(rabbitmq_url: str, dedupe: Deduplicator, redis_client: redis.Redis,
                                     queue: str, record: str) -> None:
    app = build(rabbitmq_url, dedupe, queue, record)
    with running(app):
        for _ in range(3):  # three sends of the same work: one key, three message ids
            app.actors["apply"].send(1, 10)
        message = app.actors["by_message_id"].message(2)
        app.broker.enqueue(message)  # the same message twice: the message id is the key
        app.broker.enqueue(message)
        wait_for(lambda: app.middleware.count("applied") + app.middleware.count("duplicate") == 5, what="5 verdicts")
    assert sorted(order for order, _ in entries(redis_client, record, "applied")) == ["1", "2"]
    assert app.middleware.count("applied") == 2
    # the actor's return value is the outcome, stored and given to every duplicate
    assert {e[5] for e in app.middleware.events if e[2] != "in_progress"} == {20, 2}
    assert dead_letters(rabbitmq_url, queue) == []


def test_in_progress_copy_is_deferred_without_spending_retries(rabbitmq_url: str, dedupe: Deduplicator,
                                                               redis_client: redis.Redis, queue: str,
                                                               record: str) -> None:
    # Another worker holds the key (same payload fingerprint as the actor's). defer_wait=0: the
    # copy does not wait on the key, it goes back through Retries each time. The actor has
    # max_retries=0, so a deferral that spent a retry would be dead-lettered instead.
    holder = dedupe.begin("order:3", fingerprint=fingerprint_of(["apply", [3, 5], {}]))
    app = build(rabbitmq_url, dedupe, queue, record, defer_wait=0.0)
    with running(app):
        app.actors["apply"].send(3, 5)
        wait_for(lambda: app.middleware.count("deferred") >= 2, what="the copy to come back deferred twice")
        dedupe.complete(holder, 42)
        wait_for(lambda: app.middleware.count("duplicate") == 1, timeout=30, what="the copy to be answered")
    deferred = [e for e in app.middleware.events if e[0] == "deferred"]
    assert all(e[2] == "in_progress" for e in deferred)
    (duplicate,) = [e for e in app.middleware.events if e[0] == "duplicate"]
    _, copy_id, _, retries, deferrals, value = duplicate
    assert copy_id == deferred[0][1] and retries == 0 and deferrals == len(deferred) and value == 42
    assert entries(redis_client, record, "started") == []  # the holder's outcome answered it
    assert dead_letters(rabbitmq_url, queue) == []


def test_poison_is_dead_lettered_with_the_reason(rabbitmq_url: str, dedupe: Deduplicator,
                                                 redis_client: redis.Redis, queue: str, record: str) -> None:
    app = build(rabbitmq_url, dedupe, queue, record)
    with running(app):
        app.actors["picky"].send({"no_id": 1})  # the key function fails: invalid_key
        app.actors["apply"].send(7, 10)
        wait_for(lambda: app.middleware.count("applied") == 1, what="order 7 applied")
        app.actors["apply"].send(7, 99)  # the same key for other arguments: conflict
        wait_for(lambda: app.middleware.count("dead_letter") == 2, what="two dead letters")
    letters = {headers[deadletter.REASON]: (headers, body) for headers, body in dead_letters(rabbitmq_url, queue)}
    assert set(letters) == {"invalid_key", "conflict"}
    headers, body = letters["conflict"]
    assert headers[deadletter.KEY] == "order:7" and "KeyConflict" in headers[deadletter.ERROR]
    assert headers[deadletter.ORIGINAL_QUEUE] == queue
    assert b'"dedupe_reason":"conflict"' in body  # Dramatiq's own view: the message options
    assert "KeyError" in letters["invalid_key"][0][deadletter.ERROR]
    assert entries(redis_client, record, "applied") == [("7", entries(redis_client, record, "applied")[0][1])]


def test_a_failing_actor_releases_its_claim_and_is_retried_by_dramatiq(rabbitmq_url: str, dedupe: Deduplicator,
                                                                    redis_client: redis.Redis, queue: str,
                                                                    record: str) -> None:
    app = build(rabbitmq_url, dedupe, queue, record)
    with running(app):
        app.actors["flaky"].send(9)
        wait_for(lambda: app.middleware.count("applied") == 1, what="the retry to be applied")
    (first, second) = entries(redis_client, record, "started")
    assert entries(redis_client, record, "applied") == [second]
    assert second[1] > first[1]  # the failed run released the key; the retry claimed it anew
    assert dedupe.status("flaky:9").state == "done"
    assert dead_letters(rabbitmq_url, queue) == []


@pytest.mark.slow
def test_worker_killed_mid_actor_loses_nothing(rabbitmq_url: str, redis_url: str, redis_client: redis.Redis,
                                               namespace: str, queue: str, record: str) -> None:
    env = {**os.environ, "TEST_RABBITMQ_URL": rabbitmq_url, "TEST_REDIS_URL": redis_url,
           "TEST_NAMESPACE": namespace, "TEST_QUEUE": queue, "TEST_RECORD": record, "TEST_LEASE": "1.0"}

    def worker(sleep: float) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "tests.dramatiq_app"], cwd=ROOT,
                                env={**env, "TEST_SLEEP": str(sleep)}, stdout=subprocess.DEVNULL)

    dedupe = Deduplicator(redis_client, namespace=namespace, lease=1.0)
    sender = build(rabbitmq_url, dedupe, queue, record)
    first = worker(sleep=60.0)
    try:
        sender.actors["apply"].send(5, 1)
        wait_for(lambda: entries(redis_client, record, "started"), timeout=60, what="the actor to start")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        stop_process(first)
    second = worker(sleep=0.0)
    try:
        wait_for(lambda: entries(redis_client, record, "applied"), timeout=60, what="the redelivery to apply")
        wait_for(lambda: dedupe.status("order:5").state == "done", what="the outcome stored")
    finally:
        stop_process(second)
        sender.broker.close()
    ((_, killed_token),) = [e for e in entries(redis_client, record, "started") if e[1] not in
                            {t for _, t in entries(redis_client, record, "applied")}]
    ((order, applied_token),) = entries(redis_client, record, "applied")
    assert order == "5" and applied_token > killed_token
    assert dead_letters(rabbitmq_url, queue) == []

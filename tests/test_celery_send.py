"""Send-side deduplication (``dedupe_on_send``) with a real ``celery worker``, RabbitMQ and Redis.

Messages are counted twice: by a ``before_task_publish`` handler in this (the sending) process,
and by RabbitMQ itself (a passive ``queue_declare`` before any worker consumes).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chain
from celery.beat import ScheduleEntry, Scheduler
from celery.result import AsyncResult, EagerResult
from celery.signals import before_task_publish
from kombu.exceptions import OperationalError

from dedupe_worker import KeyConflict, PreviouslyFailed
from dedupe_worker.observe import current
from dedupe_worker.observe._metrics import MetricsObserver

from . import celery_fixtures
from .celery_fixtures import PermanentError, WorkerProcess, delete_queue, effects, make_app
from .test_celery import TIMEOUT, count, wait_until

celery_config = celery_fixtures.celery_config
celery_app = celery_fixtures.celery_app


class Published:
    """The tasks this process published to one queue, by name."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.names: list[str] = []
        before_task_publish.connect(self.record, weak=False)

    def record(self, sender: Any = None, routing_key: str = "", headers: Any = None, **_: Any) -> None:
        if routing_key == self.queue:
            self.names.append((headers or {}).get("task", sender))

    def __call__(self, name: str) -> int:
        return self.names.count(name)

    def close(self) -> None:
        before_task_publish.disconnect(self.record)


@pytest.fixture
def published(celery_config: dict[str, Any]) -> Iterator[Published]:
    counter = Published(celery_config["queue"])
    yield counter
    counter.close()


@pytest.fixture
def sender(celery_app: Celery) -> Celery:
    celery_app.conf.dedupe_on_send = True
    return celery_app


def queued(app: Celery, queue: str) -> int:
    """Messages RabbitMQ holds in ``queue`` (none consumed yet)."""
    with app.connection_for_write() as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


def start_worker(config: dict[str, Any], tmp: Path) -> WorkerProcess:
    return WorkerProcess(config, concurrency=2, tmp=tmp).wait_ready()


def test_twenty_concurrent_sends_publish_one_message_and_all_get_its_value(
        sender: Celery, celery_config: dict[str, Any], published: Published, tmp_path: Path) -> None:
    charge = sender.tasks["dt.charge"]
    registry = __import__("prometheus_client").CollectorRegistry()
    observer = current.enable(MetricsObserver(registry))
    try:
        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(lambda _: charge.delay(5, 50), range(20)))
    finally:
        current.disable(observer)

    assert published("dt.charge") == 1
    assert queued(sender, celery_config["queue"]) == 1  # what RabbitMQ received
    assert len({r.id for r in results}) == 1
    assert registry.get_sample_value("dedupe_sends_total", {"integration": "celery", "outcome": "published"}) == 1
    assert registry.get_sample_value("dedupe_sends_total",
                                     {"integration": "celery", "outcome": "skipped_queued"}) == 19
    worker = start_worker(celery_config, tmp_path)
    try:
        values = [r.get(timeout=TIMEOUT) for r in results]
    finally:
        worker.stop()
    assert all(v == values[0] for v in values) and values[0]["amount"] == 50
    assert count(sender, "charge", 5) == 1


def test_a_send_after_completion_publishes_nothing_and_returns_the_stored_value(
        sender: Celery, celery_config: dict[str, Any], published: Published, tmp_path: Path) -> None:
    charge, doomed = sender.tasks["dt.charge"], sender.tasks["dt.doomed"]
    worker = start_worker(celery_config, tmp_path)
    try:
        first = charge.delay(6, 60)
        value = first.get(timeout=TIMEOUT)
        with pytest.raises(PermanentError):
            doomed.delay("d6").get(timeout=TIMEOUT)
    finally:
        worker.stop()
    before = len(published.names)

    again = charge.delay(6, 60)
    failed = doomed.delay("d6")

    assert len(published.names) == before  # nothing published, the worker is gone anyway
    assert isinstance(again, EagerResult) and again.get() == value and again.id == first.id
    with pytest.raises(PreviouslyFailed, match="d6 can never work"):  # as a worker's duplicate raises it
        failed.get()
    with pytest.raises(KeyConflict):  # same key, other arguments: refused at once
        charge.delay(6, 61)
    assert len(published.names) == before


def test_a_send_while_the_task_runs_returns_the_running_task(
        sender: Celery, celery_config: dict[str, Any], published: Published, tmp_path: Path) -> None:
    slow = sender.tasks["dt.slow"]
    worker = start_worker(celery_config, tmp_path)
    try:
        running = slow.delay("s1", 1.5)
        wait_until(lambda: count(sender, "slow", "s1"), what="the task to start")
        again = slow.apply_async(("s1", 1.5))
        assert again.id == running.id and not isinstance(again, EagerResult)
        assert published("dt.slow") == 1
        assert again.get(timeout=TIMEOUT) == running.get(timeout=TIMEOUT)
    finally:
        worker.stop()
    assert count(sender, "slow", "s1") == 1


def test_a_killed_worker_blocks_sends_no_longer_than_the_send_ttl(
        sender: Celery, celery_config: dict[str, Any], published: Published, tmp_path: Path) -> None:
    sender.conf.dedupe_send_ttl = 1.0  # the lease is 2 s
    slow = sender.tasks["dt.slow"]
    worker = start_worker(celery_config, tmp_path)
    try:
        first = slow.delay("k1", 30)
        wait_until(lambda: count(sender, "slow", "k1"), what="the task to start")
        os.killpg(worker.proc.pid, signal.SIGKILL)  # the worker and its pool, mid-task
        worker.proc.wait(10)
        assert slow.delay("k1", 30).id == first.id  # its lease still runs: no publish
        assert published("dt.slow") == 1
        began = time.monotonic()
        again = wait_until(lambda: (r := slow.delay("k1", 30)).id != first.id and r, timeout=10,
                           what="a send that publishes again")
        assert time.monotonic() - began <= 2.0 + 0.5  # the rest of the lease, then the mark is stale
    finally:
        worker.stop()
    assert published("dt.slow") == 2 and isinstance(again, AsyncResult)


def test_a_send_with_redis_down_publishes(celery_config: dict[str, Any], private_redis: Any,
                                         published: Published, caplog: pytest.LogCaptureFixture) -> None:
    config = {**celery_config, "store_url": private_redis.url}
    app = make_app(**config)
    try:
        private_redis.stop()
        result = app.tasks["dt.charge"].apply_async((9, 90), dedupe_on_send=True)
        assert published("dt.charge") == 1 and queued(app, config["queue"]) == 1
        assert isinstance(result, AsyncResult) and not isinstance(result, EagerResult)
        assert any("Redis unavailable before sending" in r.getMessage() for r in caplog.records)
    finally:
        delete_queue(app, config["queue"])
        app.close()


def test_countdown_sends_stay_queued_for_their_countdown(sender: Celery, published: Published) -> None:
    sender.conf.dedupe_send_ttl = 0.5
    charge = sender.tasks["dt.charge"]
    first = charge.apply_async((10, 100), countdown=3)
    time.sleep(0.8)  # past the send TTL, not past the countdown
    assert charge.apply_async((10, 100), countdown=3).id == first.id
    assert published("dt.charge") == 1


def test_the_per_call_option_and_plain_sends(celery_app: Celery, published: Published) -> None:
    charge = celery_app.tasks["dt.charge"]
    first = charge.apply_async((11, 110), dedupe_on_send=True)
    assert charge.apply_async((11, 110), dedupe_on_send=True).id == first.id
    assert charge.delay(11, 110).id != first.id  # the option is off for this app
    assert published("dt.charge") == 2


def test_chain_members_are_deduplicated(sender: Celery, celery_config: dict[str, Any], published: Published,
                                        tmp_path: Path) -> None:
    charge, total, tagged = sender.tasks["dt.charge"], sender.tasks["dt.total"], sender.tasks["dt.tagged"]
    worker = start_worker(celery_config, tmp_path)
    try:
        assert chain(charge.s(12, 21), total.s()).apply_async().get(timeout=TIMEOUT) == 42
        first = chain(charge.s(13, 5), tagged.si("t13")).apply_async().get(timeout=TIMEOUT)
        names = list(published.names)

        assert chain(charge.s(12, 21), total.s()).apply_async().get(timeout=TIMEOUT) == 42
        assert chain(charge.s(13, 5), tagged.si("t13")).apply_async().get(timeout=TIMEOUT) == first
    finally:
        worker.stop()
    # the done steps were not sent again; the plain task after one was, with the stored value
    assert published.names[len(names):] == ["dt.total"]
    assert count(sender, "charge", 12) == 1 and count(sender, "total", 12) == 2


def test_beat_entries_are_deduplicated(sender: Celery, published: Published) -> None:
    entry = ScheduleEntry(name="charge-often", task="dt.charge", schedule=timedelta(seconds=1), args=(14, 140),
                          app=sender)
    scheduler = Scheduler(sender, lazy=True)
    first = scheduler.apply_async(entry)
    second = scheduler.apply_async(entry)  # the next tick, while the first still waits in the queue
    assert second.id == first.id
    assert published("dt.charge") == 1
    with effects(sender) as r:  # the mark lives in the key's hash slot, with a TTL
        mark = f"{sender.conf.dedupe_namespace}:{{charge:14}}:sent"
        assert r.hget(mark, "id") == first.id and 0 < r.pttl(mark)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_send_during_a_broker_outage_leaves_no_mark_and_the_retry_publishes_once(
        sender: Celery, celery_config: dict[str, Any], published: Published) -> None:
    down = make_app(**{**celery_config, "broker": f"amqp://guest:guest@127.0.0.1:{closed_port()}//"})
    down.conf.update(dedupe_on_send=True, broker_connection_timeout=0.5,
                     task_publish_retry_policy={"max_retries": 0})
    try:
        with pytest.raises(OperationalError):  # the producer sees the outage, as without the check
            down.tasks["dt.charge"].delay(15, 150)
    finally:
        down.close()
    with effects(sender) as r:  # the failed publish took its mark back
        assert not r.exists(f"{sender.conf.dedupe_namespace}:{{charge:15}}:sent")

    before = published("dt.charge")  # the signal fired for the failed attempt too

    retried = sender.tasks["dt.charge"].delay(15, 150)  # the producer's retry, the broker back
    assert sender.tasks["dt.charge"].delay(15, 150).id == retried.id  # and one more: still one
    assert published("dt.charge") == before + 1 and queued(sender, celery_config["queue"]) == 1
    assert not isinstance(retried, EagerResult)


def test_a_send_after_a_release_publishes(sender: Celery, celery_config: dict[str, Any], published: Published,
                                          tmp_path: Path) -> None:
    flaky = sender.tasks["dt.flaky"]  # autoretry_for, max_retries=3
    worker = start_worker(celery_config, tmp_path)
    try:
        first = flaky.delay("r1", 99)  # fails every attempt: each failure releases the key
        with pytest.raises(ValueError):
            first.get(timeout=TIMEOUT)
        assert count(sender, "flaky", "r1") == 4

        again = flaky.delay("r1", 99)  # well within dedupe_send_ttl of the first: the key is free

        assert again.id != first.id and published("dt.flaky") == 2  # Celery's retries are the worker's
        with pytest.raises(ValueError):
            again.get(timeout=TIMEOUT)
    finally:
        worker.stop()
    assert count(sender, "flaky", "r1") == 8  # the second send ran its four attempts


def test_two_racing_senders_publish_once_per_key(sender: Celery, celery_config: dict[str, Any],
                                                 published: Published) -> None:
    other = make_app(**celery_config)  # a second producer: its own connections to RabbitMQ and Redis
    other.conf.dedupe_on_send = True
    keys = range(100, 140)
    try:
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(lambda app: [app.tasks["dt.charge"].delay(k, k) for k in keys], (sender, other))
    finally:
        other.close()
    assert [x.id for x in a] == [y.id for y in b]  # every key: both hold the one task sent for it
    assert published("dt.charge") == len(keys) and queued(sender, celery_config["queue"]) == len(keys)

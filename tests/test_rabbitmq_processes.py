"""``dedupe-worker rabbitmq`` worker processes: two on one queue, SIGKILL mid-handler, SIGTERM."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
import redis
from kombu import Connection

from . import services
from .rabbitmq_fixtures import (
    amqp,
    consumers_of,
    dead_letters,
    depth,
    drained,
    entries,
    publish,
    queue_name,
    stop_process,
    wait_for,
    worker_env,
)

__all__ = ["amqp", "queue_name"]  # fixtures used by name

ROOT = Path(__file__).resolve().parents[1]
Spawn = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def spawn(rabbitmq_url: str, redis_url: str, namespace: str, queue_name: str) -> Iterator[Spawn]:
    """Start CLI workers on ``queue_name`` (stderr to a file each); all are stopped afterwards."""
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def start(*extra: str, **env: str) -> subprocess.Popen[bytes]:
        log = Path(tempfile.mkstemp(prefix="rabbitmq-worker-", suffix=".log")[1])
        logs.append(log)
        with log.open("wb") as err:
            proc = subprocess.Popen(
                [services.python(), "-m", "dedupe_worker", "-v", "rabbitmq", "--url", rabbitmq_url,
                 "--queue", queue_name, "--redis-url", redis_url, "--namespace", namespace, "--lease", "1.5",
                 *extra, "tests.rabbitmq_fixtures:record"],
                cwd=ROOT, env=worker_env(redis_url, f"{namespace}:record", **env),
                stdout=subprocess.DEVNULL, stderr=err,
            )
        proc.log = log  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        stop_process(proc)
    for log in logs:
        log.unlink(missing_ok=True)


def log_of(proc: subprocess.Popen[bytes]) -> str:
    return Path(proc.log).read_text()  # type: ignore[attr-defined]


def test_two_workers_with_copies_in_flight_apply_each_key_once(
    amqp: Connection, queue_name: str, spawn: Spawn, redis_client: redis.Redis, namespace: str
) -> None:
    # two processes, the second with two consumer threads (each its own connection)
    workers = [spawn("--prefetch", "4", *extra, TEST_SLEEP="0.2") for extra in ((), ("--concurrency", "2"))]
    wait_for(lambda: consumers_of(amqp, queue_name) == 3, what="three consumers")
    for n in range(15):
        for _copy in range(3):  # consecutive copies land on both workers at once
            publish(amqp, queue_name, orjson.dumps({"id": f"k{n}"}), headers={"idempotency-key": f"k{n}"})
    record = f"{namespace}:record"
    wait_for(lambda: len(set(entries(redis_client, record, "applied"))) == 15, timeout=60, what="15 keys")
    wait_for(lambda: drained(amqp, queue_name),
             timeout=30, what="queues drained")
    for proc in workers:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    assert collections.Counter(entries(redis_client, record, "applied")) == {f"k{n}": 1 for n in range(15)}
    assert collections.Counter(entries(redis_client, record, "started")) == {f"k{n}": 1 for n in range(15)}
    logs = "".join(log_of(p) for p in workers)
    assert "reason=in_progress" in logs, "no copy was ever in flight while another held the key"
    assert depth(amqp, queue_name) == 0  # nothing requeued when the workers stopped
    assert dead_letters(amqp, queue_name) == []


def test_worker_killed_mid_handler_message_redelivered_and_applied_once(
    amqp: Connection, queue_name: str, spawn: Spawn, redis_client: redis.Redis, namespace: str
) -> None:
    victim = spawn("--prefetch", "1", TEST_SLOW_SLEEP="60")
    wait_for(lambda: consumers_of(amqp, queue_name) == 1, what="the first worker")
    publish(amqp, queue_name, b'{"id": "victim", "slow": true}', headers={"idempotency-key": "victim"})
    record = f"{namespace}:record"
    wait_for(lambda: entries(redis_client, record, "started") == ["victim"], what="the slow handler")
    survivor = spawn("--prefetch", "1")
    wait_for(lambda: consumers_of(amqp, queue_name) == 2, what="the second worker")
    os.kill(victim.pid, signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL
    # The broker redelivers at once; the dead worker's lease still runs, so the survivor defers
    # the message, then claims it once the lease is out and applies it.
    wait_for(lambda: entries(redis_client, record, "applied") == ["victim"], timeout=30, what="applied")
    starts = [e.decode() for e in redis_client.lrange(record, 0, -1) if e.startswith(b"started:")]
    assert [s.split(":")[1] for s in starts] == [str(victim.pid), str(survivor.pid)]
    applied = [e.decode() for e in redis_client.lrange(record, 0, -1) if e.startswith(b"applied:")]
    assert applied == [f"applied:{survivor.pid}:victim"]
    wait_for(lambda: "reason=in_progress" in log_of(survivor), what="the in-progress deferral logged")
    wait_for(lambda: drained(amqp, queue_name))
    assert dead_letters(amqp, queue_name) == []


def test_sigterm_finishes_the_message_in_hand_and_requeues_the_rest(
    amqp: Connection, queue_name: str, spawn: Spawn, redis_client: redis.Redis, namespace: str
) -> None:
    worker = spawn("--prefetch", "10", TEST_SLEEP="0.5")
    wait_for(lambda: consumers_of(amqp, queue_name) == 1, what="the worker")
    for n in range(5):
        publish(amqp, queue_name, orjson.dumps({"id": f"t{n}"}), headers={"idempotency-key": f"t{n}"})
    record = f"{namespace}:record"
    wait_for(lambda: entries(redis_client, record, "started"), what="the first handler")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(15) == 0
    assert entries(redis_client, record, "applied") == ["t0"]  # the one in hand, finished
    assert depth(amqp, queue_name) == 4  # the others, back in the queue
    again = spawn("--prefetch", "10")
    wait_for(lambda: sorted(entries(redis_client, record, "applied")) == [f"t{n}" for n in range(5)],
             what="the rest applied by the next worker")
    again.send_signal(signal.SIGTERM)
    assert again.wait(15) == 0
    assert dead_letters(amqp, queue_name) == []


def test_cli_key_header_option_is_the_only_key_source(
    amqp: Connection, queue_name: str, spawn: Spawn, redis_client: redis.Redis, namespace: str
) -> None:
    worker = spawn("--key-header", "order-id", "--max-attempts", "2")
    wait_for(lambda: consumers_of(amqp, queue_name) == 1, what="the worker")
    publish(amqp, queue_name, b'{"id": "with-header"}', headers={"order-id": "o-1"})
    publish(amqp, queue_name, b'{"id": "with-header"}', headers={"order-id": "o-1"})
    publish(amqp, queue_name, b'{"id": "no-header"}', message_id="m-1")  # message_id is not consulted
    wait_for(lambda: depth(amqp, f"{queue_name}.dlq") == 1, what="the keyless message dead-lettered")
    wait_for(lambda: depth(amqp, queue_name) == 0)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(15) == 0
    assert entries(redis_client, f"{namespace}:record", "applied") == ["with-header"]
    [letter] = dead_letters(amqp, queue_name)
    assert letter.headers["x-dedupe-reason"] == "invalid_key"
    assert "order-id" in letter.headers["x-dedupe-error"]

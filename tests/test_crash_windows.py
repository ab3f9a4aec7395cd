"""Issue 9's crash story on the real brokers: a consumer SIGKILLed at several instants inside a
batch of slow handlers, then restarted, applies every message's effect exactly once and loses none.

Each handler works 0.4 s and then records its effect (``tests/crash_handlers.py``). Before the
engine stored outcomes one by one, a kill in the middle of a batch threw away the outcomes of the
handlers that had finished, and the restart applied them a second time.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis
from kombu import Connection

from .kafka_fixtures import Topics, committed, kafka_topics, produce, unique, wait_until
from .rabbitmq_fixtures import amqp, consumers_of, dead_letters, drained, publish, queue_name
from .services import ProcessGroup

__all__ = ["amqp", "kafka_topics", "queue_name"]  # fixtures used by name

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
MESSAGES = 10
WORK = 0.4
#: Seconds after the first handler started: inside the first, the third and the seventh handler.
KILL_AFTER = (0.2, 1.0, 2.6)


def effects(client: redis.Redis, key: str, kind: str) -> list[str]:
    """The message ids of the ``kind`` entries (``started`` or ``applied``), in order."""
    return [e.decode().split(":")[1] for e in client.lrange(key, 0, -1) if e.decode().startswith(kind + ":")]


@pytest.fixture
def processes() -> Iterator[list[ProcessGroup]]:
    made: list[ProcessGroup] = []
    yield made
    for p in made:
        p.cleanup()


def kill_inside_the_batch(client: redis.Redis, key: str, victim: subprocess.Popen[bytes], after: float) -> int:
    """SIGKILL ``victim`` ``after`` seconds into its first handler; return how many effects it made."""
    wait_until(lambda: effects(client, key, "started"), 30, "the first handler started")
    time.sleep(after)
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    return len(effects(client, key, "applied"))


def assert_each_applied_once(client: redis.Redis, key: str, ids: list[str], finished_before_kill: int,
                             kill_after: float) -> None:
    applied = collections.Counter(effects(client, key, "applied"))
    assert applied == {i: 1 for i in ids}, f"applied twice or lost: {applied}"
    # the kill fell inside the batch, after as many handlers as its instant allows
    assert finished_before_kill < len(ids)
    assert finished_before_kill >= int(kill_after / WORK) - 1


@pytest.mark.parametrize("kill_after", KILL_AFTER)
def test_rabbitmq_consumer_killed_inside_a_batch_applies_each_message_once(
        kill_after: float, amqp: Connection, queue_name: str, processes: list[ProcessGroup], redis_url: str,
        redis_client: redis.Redis, namespace: str) -> None:
    key = f"{namespace}:effects"
    args = [sys.executable, "-m", "dedupe_worker", "rabbitmq", "--url", amqp.as_uri(include_password=True),
            "--queue", queue_name, "--redis-url", redis_url, "--namespace", namespace, "--lease", "1.5",
            "--prefetch", str(MESSAGES), "tests.crash_handlers:rabbit_effect"]
    env = {**os.environ, "TEST_REDIS_URL": redis_url, "TEST_EFFECTS": key, "TEST_WORK": str(WORK),
           "PYTHONPATH": str(ROOT)}
    workers = ProcessGroup(args, env, ROOT)
    processes.append(workers)
    ids = [f"r{i}" for i in range(MESSAGES)]
    for ident in ids:  # all waiting before the consumer starts: one prefetched batch
        publish(amqp, queue_name, orjson.dumps({"id": ident}), headers={"idempotency-key": ident})
    victim = workers.start()
    finished = kill_inside_the_batch(redis_client, key, victim, kill_after)
    workers.start()
    try:
        wait_until(lambda: set(effects(redis_client, key, "applied")) == set(ids), 60, "every message applied")
        wait_until(lambda: drained(amqp, queue_name) and consumers_of(amqp, queue_name) == 1, 30, "queue drained")
    except AssertionError:
        print(workers.output())
        raise
    assert_each_applied_once(redis_client, key, ids, finished, kill_after)
    assert dead_letters(amqp, queue_name) == []


@pytest.mark.parametrize("kill_after", KILL_AFTER)
def test_kafka_consumer_killed_inside_a_batch_applies_each_message_once(
        kill_after: float, kafka_bootstrap: str, kafka_topics: Topics, processes: list[ProcessGroup], redis_url: str,
        redis_client: redis.Redis, namespace: str) -> None:
    key = f"{namespace}:effects"
    topic, group = kafka_topics.create(partitions=1), unique("g")
    args = [sys.executable, "-m", "dedupe_worker", "kafka", "tests.crash_handlers:kafka_effect",
            "--bootstrap", kafka_bootstrap, "--topic", topic, "--group", group, "--redis-url", redis_url,
            "--namespace", namespace, "--lease", "1.5", "--batch-size", str(MESSAGES),
            "-X", "session.timeout.ms=2000", "-X", "heartbeat.interval.ms=500"]
    env = {**os.environ, "TEST_REDIS_URL": redis_url, "TEST_EFFECTS": key, "TEST_WORK": str(WORK),
           "PYTHONPATH": str(ROOT)}
    workers = ProcessGroup(args, env, ROOT)
    processes.append(workers)
    ids = [f"k{i}" for i in range(MESSAGES)]
    positions = produce(kafka_bootstrap, topic, [(0, None, i.encode(), [("idempotency-key", i.encode())])
                                                 for i in ids])
    victim = workers.start()
    finished = kill_inside_the_batch(redis_client, key, victim, kill_after)
    survivor = workers.start()
    try:
        wait_until(lambda: set(effects(redis_client, key, "applied")) == set(ids), 60, "every message applied")
        wait_until(lambda: committed(kafka_bootstrap, group, topic, [0]) == {0: positions[-1][1] + 1}, 30,
                   "offsets committed past every record")
    except AssertionError:
        print(workers.output())
        raise
    survivor.send_signal(signal.SIGTERM)
    assert survivor.wait(20) == 0, workers.output()
    assert_each_applied_once(redis_client, key, ids, finished, kill_after)


def test_a_second_consumer_is_not_deferred_by_claims_the_first_has_not_started(
        amqp: Connection, queue_name: str, redis_client: redis.Redis, namespace: str) -> None:
    from dedupe_worker import Deduplicator
    from dedupe_worker.rabbitmq import DedupeConsumer

    from .rabbitmq_fixtures import consumer_thread, wait_for

    dedupe = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0)
    other_queue = f"{queue_name}-b"
    amqp.default_channel.queue_declare(queue=other_queue, durable=True, auto_delete=False)
    verdicts: dict[str, list[tuple[str, str]]] = {"slow": [], "fast": []}

    class Recording(DedupeConsumer):
        def __init__(self, name: str, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            self.name = name

        def on_applied(self, message: object, decision: object) -> None:
            verdicts[self.name].append((decision.claim.key, "applied"))  # type: ignore[attr-defined]

        def on_duplicate(self, message: object, decision: object) -> None:
            verdicts[self.name].append((decision.claim.key, "duplicate"))  # type: ignore[attr-defined]

        def on_deferred(self, message: object, decision: object, delay: float) -> None:
            verdicts[self.name].append((decision.claim.key if decision.claim else "?",  # type: ignore[attr-defined]
                                        "deferred"))

    started: list[str] = []

    def slow(body: dict[str, str], message: object) -> str:
        started.append(body["id"])
        time.sleep(0.3)
        return body["id"]

    ids = [f"s{i}" for i in range(8)]
    for ident in ids:  # one prefetched batch for the slow consumer
        publish(amqp, queue_name, orjson.dumps({"id": ident}), headers={"idempotency-key": ident})
    first = Recording("slow", amqp.clone(), [queue_name], slow, dedupe, prefetch_count=len(ids))
    second = Recording("fast", amqp.clone(), [other_queue], lambda body, message: body["id"], dedupe)
    try:
        with consumer_thread(first), consumer_thread(second):
            wait_for(lambda: started, what="the slow consumer started its batch")
            # copies of the batch's tail reach the other consumer while the first one works on s0
            for ident in ids[4:]:
                publish(amqp, other_queue, orjson.dumps({"id": ident}), headers={"idempotency-key": ident})
            wait_for(lambda: len(verdicts["fast"]) == 4, what="the copies decided")
            assert len(started) < 4, "the slow consumer reached the tail before its copies were decided"
            wait_for(lambda: len(verdicts["slow"]) == len(ids), timeout=30, what="the batch decided")
            wait_for(lambda: drained(amqp, queue_name) and drained(amqp, other_queue), what="queues drained")
    finally:
        amqp.default_channel.queue_delete(queue=other_queue)
        for suffix in (".delay", ".dlq"):
            amqp.default_channel.queue_delete(queue=other_queue + suffix)
    # nobody was working on s4..s7 yet: the fast consumer applied them at once, never deferred
    assert sorted(verdicts["fast"]) == [(i, "applied") for i in ids[4:]]
    assert sorted(verdicts["slow"]) == sorted([(i, "applied") for i in ids[:4]] + [(i, "duplicate") for i in ids[4:]])
    assert started == ids[:4]

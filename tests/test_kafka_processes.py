"""Consumer processes (the ``dedupe-worker kafka`` CLI) joining, leaving and being SIGKILLed.

The handler (:func:`tests.kafka_fixtures.record_run`) appends ``<id>:<pid>:<token>`` to a Redis
list for every run, so the test sees every execution, not only the stored outcomes. What must
hold: every message ran at least once (none lost), a message ran more than once only when an
earlier run was in a process that was killed, and the group's offsets end past every record.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from .kafka_fixtures import Topics, committed, ends, kafka_topics, produce, unique, wait_until
from .services import ProcessGroup

__all__ = ["kafka_topics"]

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


class Workers(ProcessGroup):
    """``dedupe-worker kafka`` processes on one topic and group."""

    def __init__(self, bootstrap: str, topic: str, group: str, redis_url: str, namespace: str,
                 runs_key: str) -> None:
        self.bootstrap, self.topic, self.group, self.runs_key = bootstrap, topic, group, runs_key
        args = [sys.executable, "-m", "dedupe_worker", "-v", "kafka", "tests.kafka_fixtures:record_run",
                "--bootstrap", bootstrap, "--topic", topic, "--group", group,
                "--redis-url", redis_url, "--namespace", namespace, "--lease", "2",
                "--batch-size", "20", "-X", "session.timeout.ms=2000",
                "-X", "heartbeat.interval.ms=500"]
        env = {**os.environ, "KAFKA_TEST_REDIS_URL": redis_url, "KAFKA_TEST_RUNS_KEY": runs_key,
               "KAFKA_TEST_SLEEP": "0.01", "PYTHONPATH": str(ROOT)}
        super().__init__(args, env, ROOT)


@pytest.fixture
def workers(kafka_bootstrap: str, kafka_topics: Topics, redis_url: str, namespace: str) -> Iterator[Workers]:
    topic = kafka_topics.create(partitions=4)
    w = Workers(kafka_bootstrap, topic, unique("g"), redis_url, namespace, f"{namespace}:runs")
    yield w
    w.cleanup()


def runs(client: redis.Redis, key: str) -> dict[str, list[tuple[int, int]]]:
    """``id -> [(pid, token), ...]`` in the order the runs happened."""
    out: dict[str, list[tuple[int, int]]] = {}
    for raw in client.lrange(key, 0, -1):
        ident, pid, token = raw.decode().rsplit(":", 2)
        out.setdefault(ident, []).append((int(pid), int(token)))
    return out


def messages(prefix: str, count: int) -> list[tuple[int, bytes | None, bytes, list[tuple[str, bytes]]]]:
    return [(i % 4, None, f"{prefix}{i}".encode(), [("idempotency-key", f"{prefix}{i}".encode())])
            for i in range(count)]


def check(seen: dict[str, list[tuple[int, int]]], expected: set[str], killed: set[int]) -> None:
    assert set(seen) == expected, f"lost: {sorted(expected - set(seen))[:10]}"
    for ident, history in seen.items():
        # every run but the last one was cut short by a SIGKILL; tokens only grow
        assert all(pid in killed for pid, _ in history[:-1]), (ident, history)
        assert [t for _, t in history] == sorted({t for _, t in history}), (ident, history)


def finish(w: Workers, positions: list[tuple[int, int]], client: redis.Redis, expected: set[str]) -> None:
    try:
        wait_until(lambda: len(runs(client, w.runs_key)) == len(expected), 60, "every message applied")
        wait_until(lambda: committed(w.bootstrap, w.group, w.topic, range(4)) == ends(positions), 30,
                   "offsets committed past every record")
    except AssertionError:
        print(w.output())
        raise


def test_rebalance_join_then_sigkill(workers: Workers, kafka_bootstrap: str, redis_client: redis.Redis) -> None:
    key, topic = workers.runs_key, workers.topic
    positions = produce(kafka_bootstrap, topic, messages("a", 120))
    first = workers.start()
    wait_until(lambda: redis_client.llen(key) >= 20, 30, "the first worker started applying")
    second = workers.start()  # joins mid-stream: the group rebalances
    positions += produce(kafka_bootstrap, topic, messages("b", 120))
    wait_until(lambda: any(pid == second.pid for h in runs(redis_client, key).values() for pid, _ in h),
               30, "the second worker got partitions")
    positions += produce(kafka_bootstrap, topic, messages("c", 60))
    first.send_signal(signal.SIGKILL)  # mid-batch: its handler sleeps between records
    first.wait(10)
    positions += produce(kafka_bootstrap, topic, messages("d", 60))
    expected = {f"{p}{i}" for p, n in (("a", 120), ("b", 120), ("c", 60), ("d", 60)) for i in range(n)}
    finish(workers, positions, redis_client, expected)
    second.send_signal(signal.SIGTERM)
    assert second.wait(20) == 0, workers.output()
    check(runs(redis_client, key), expected, killed={first.pid})


def test_killed_mid_batch_then_restarted(workers: Workers, kafka_bootstrap: str,
                                         redis_client: redis.Redis) -> None:
    key, topic = workers.runs_key, workers.topic
    positions = produce(kafka_bootstrap, topic, messages("m", 200))
    first = workers.start()
    wait_until(lambda: redis_client.llen(key) >= 50, 30, "the worker is mid-stream")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    killed_at = time.monotonic()
    restarted = workers.start()
    expected = {f"m{i}" for i in range(200)}
    finish(workers, positions, redis_client, expected)
    restarted.send_signal(signal.SIGTERM)
    assert restarted.wait(20) == 0, workers.output()
    seen = runs(redis_client, key)
    check(seen, expected, killed={first.pid})
    assert any(len(h) == 1 and h[0][0] == first.pid for h in seen.values())  # its completed work held
    assert time.monotonic() - killed_at < 60

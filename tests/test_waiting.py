"""Copies of work in flight: waiting on a key (``begin``/``run(wait=...)``) is woken by the holder's
completion or release, takes over after a dead holder's lease, and never outlasts its bound.
The common path (no copy in flight) writes nothing for waiters. Real Redis and Kafka (tansu)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from dedupe_worker import Deduplicator, InProgress, Outcome, State
from dedupe_worker.kafka import DedupeKafkaConsumer
from dedupe_worker.keys import field_key

from .kafka_fixtures import Topics, committed, kafka_topics, produce, running, unique, wait_until

__all__ = ["kafka_topics"]


@pytest.fixture
def holder(redis_client: redis.Redis, namespace: str) -> Iterator[Deduplicator]:
    """Another worker, with the default 30 s lease."""
    d = Deduplicator(redis_client, namespace=namespace)
    yield d
    d.close()


def later(seconds: float, action: Callable[[], Any]) -> dict[str, float]:
    """Run ``action`` in ``seconds`` on a thread; the returned dict gets the time it was started
    (``"at"``), set before the action runs: a waiter the action wakes may return before the
    action's own call does."""
    when: dict[str, float] = {}

    def go() -> None:
        time.sleep(seconds)
        when["at"] = time.monotonic()
        action()

    threading.Thread(target=go, daemon=True).start()
    return when


def test_run_with_wait_returns_the_holders_value_as_soon_as_it_is_stored(
        dedupe: Deduplicator, holder: Deduplicator) -> None:
    claim = holder.begin("order-1")
    completed = later(1.0, lambda: holder.complete(claim, {"charged": 100}))
    calls: list[int] = []
    began = time.monotonic()
    value = dedupe.run("order-1", lambda: calls.append(1), wait=5)
    returned = time.monotonic()
    assert value == {"charged": 100} and calls == []
    assert returned - began >= 0.9  # it did wait
    assert returned - completed["at"] < 0.5  # ... and was woken by the completion, not by a timer


def test_a_released_key_is_claimed_by_the_waiter(dedupe: Deduplicator, holder: Deduplicator) -> None:
    claim = holder.begin("order-2")
    later(0.5, lambda: holder.release(claim))
    began = time.monotonic()
    assert dedupe.run("order-2", lambda: "ran here", wait=5) == "ran here"
    assert time.monotonic() - began < 1.0
    assert dedupe.status("order-2").token > claim.token


def test_a_dead_holder_is_waited_out_for_its_lease_then_taken_over(
        dedupe: Deduplicator, redis_client: redis.Redis, namespace: str) -> None:
    dying = Deduplicator(redis_client, namespace=namespace, lease=1.0)
    claim = dying.begin("order-3")  # then nothing: the holder died, nobody renews its lease
    began = time.monotonic()
    took_over = dedupe.begin("order-3", wait=5)
    waited = time.monotonic() - began
    assert took_over.outcome is Outcome.ACQUIRED and took_over.token > claim.token
    assert 0.8 <= waited < 1.6  # the rest of its lease, not the whole wait
    dying.close()


def test_no_wait_outlasts_its_bound(dedupe: Deduplicator, holder: Deduplicator) -> None:
    holder.begin("order-4")
    began = time.monotonic()
    with pytest.raises(InProgress):
        dedupe.run("order-4", lambda: None, wait=0.3)
    assert time.monotonic() - began < 0.6  # Redis ends a blocking wait up to ~100 ms late
    claim = dedupe.begin("order-4", wait=0.2)
    assert claim.outcome is Outcome.IN_PROGRESS and claim.retry_after > 25  # the 30 s lease


def test_begin_many_waits_on_every_held_key_within_one_bound(dedupe: Deduplicator, holder: Deduplicator) -> None:
    claims = [holder.begin(k) for k in ("a", "b")]
    later(0.3, lambda: holder.complete(claims[0], "A"))
    later(0.6, lambda: holder.complete(claims[1], "B"))
    got = dedupe.begin_many(["a", "b", "free"], wait=5)
    assert [c.outcome for c in got] == [Outcome.DUPLICATE, Outcome.DUPLICATE, Outcome.ACQUIRED]
    assert [c.result for c in got[:2]] == ["A", "B"]


def test_the_common_path_writes_nothing_for_waiters(dedupe: Deduplicator, redis_client: redis.Redis,
                                                   namespace: str) -> None:
    dedupe.run("plain", lambda: 1)
    claim = dedupe.begin("held")
    dedupe.release(claim)
    keys = {k.decode() for k in redis_client.keys(f"{namespace}:*")}
    assert not any(k.endswith(":notice") for k in keys)
    assert b"w" not in redis_client.hgetall(f"{namespace}:{{held}}:started")


def test_notices_expire_when_nobody_takes_them(dedupe: Deduplicator, holder: Deduplicator,
                                               redis_client: redis.Redis, namespace: str) -> None:
    claim = holder.begin("gave-up")
    assert dedupe.begin("gave-up", wait=0.1).outcome is Outcome.IN_PROGRESS  # waited, gave up
    holder.complete(claim, 1)
    ttl = redis_client.pttl(f"{namespace}:{{gave-up}}:notice")
    assert 0 < ttl <= 10_000
    assert dedupe.status("gave-up").state is State.DONE


def test_a_kafka_partition_held_by_a_key_in_flight_resumes_when_it_is_decided(
        kafka_bootstrap: str, kafka_topics: Topics, dedupe: Deduplicator, holder: Deduplicator) -> None:
    topic = kafka_topics.create(partitions=1)
    claim = holder.begin("k-held", fingerprint=None)
    duplicates: dict[str, float] = {}
    applied: list[str] = []

    class Watching(DedupeKafkaConsumer):
        def on_duplicate(self, message: Any, decision: Any) -> None:
            duplicates[json.loads(message.value())["id"]] = time.monotonic()

    positions = produce(kafka_bootstrap, topic, [(0, None, json.dumps({"id": "k-held"}).encode(), [])])
    group = unique("g")
    consumer = Watching({"bootstrap.servers": kafka_bootstrap, "group.id": group, "session.timeout.ms": 2000,
                         "heartbeat.interval.ms": 500}, [topic], lambda m: applied.append("ran"), dedupe,
                        key_strategy=field_key("id"), fingerprint=None, poll_timeout=0.2)
    with running(consumer):
        wait_until(lambda: consumer.stats["in_progress"] >= 1, 30, "the copy held")
        time.sleep(1.0)
        holder.complete(claim, "done elsewhere")
        completed_at = time.monotonic()
        wait_until(lambda: "k-held" in duplicates, 10, "the copy acked as a duplicate")
        wait_until(lambda: committed(kafka_bootstrap, group, topic, [0]) == {0: positions[-1][1] + 1}, 10,
                   "committed past it")
    assert applied == []
    assert duplicates["k-held"] - completed_at < 0.5
    assert consumer.stats["in_progress"] <= 3  # woken by the completion, not re-polled meanwhile

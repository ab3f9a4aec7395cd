"""``dedupe-worker replay rabbitmq`` against a real RabbitMQ and Redis, and the real consumer."""

from __future__ import annotations

import json
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection

from dedupe_worker import Deduplicator
from dedupe_worker.rabbitmq import DedupeConsumer

from .rabbitmq_fixtures import amqp, consumer_thread, depth, drained, publish, wait_for
from .replay_fixtures import apply_before, body_of, cli, killed_on_exit, redis_snapshot, replay_process, unique

__all__ = ["amqp"]  # a fixture, imported for pytest


@pytest.fixture
def queue(amqp: Connection) -> Iterator[str]:
    """A work queue and its ``.dlq`` of the test's own; every queue named after it is deleted."""
    name = unique("replay")
    channel = amqp.default_channel
    for q in (name, name + ".dlq"):
        channel.queue_declare(queue=q, durable=True, auto_delete=False)
    yield name
    with amqp.clone() as conn:
        channel = conn.channel()
        for q in (name, name + ".dlq", name + ".delay", name + ".src"):
            channel.queue_delete(queue=q)


def dead_letter(conn: Connection, queue: str, i: int, *, key: bool = True, reason: str = "handler_error",
                **extra_headers: str) -> None:
    """Publish message ``k<i>`` into ``<queue>.dlq`` as the consumer dead-letters it."""
    headers: dict[str, Any] = {
        "x-dedupe-reason": reason, "x-dedupe-error": "RuntimeError: downstream down",
        "x-dedupe-attempts": "5", "x-dedupe-original-queue": queue,
        "x-dedupe-original-exchange": "", "x-dedupe-original-routing-key": queue,
        "tenant": "acme",
    }
    if key:
        headers["idempotency-key"] = f"k{i}"
        headers["x-dedupe-key"] = f"k{i}"
    headers.update(extra_headers)
    channel = conn.default_channel
    message = channel.prepare_message(body_of(i), 3, "application/json", "utf-8", headers,
                                      {"message_id": f"m{i}", "correlation_id": f"c{i}", "delivery_mode": 2})
    channel.basic_publish_confirm(message, exchange="", routing_key=queue + ".dlq")


def peek_all(conn: Connection, queue: str) -> list[Any]:
    """Every ready message of ``queue``, left in it (un-acked, then requeued by closing the channel)."""
    with conn.clone() as other:
        channel = other.channel()
        out = []
        while (message := channel.basic_get(queue=queue, no_ack=False)) is not None:
            out.append(message)
        channel.close()
    return out


def take_all(conn: Connection, queue: str) -> list[Any]:
    """Every ready message of ``queue`` (acked, so removed)."""
    channel = conn.default_channel
    out = []
    while (message := channel.basic_get(queue=queue, no_ack=True)) is not None:
        out.append(message)
    return out


def raw_body(message: Any) -> bytes:
    """py-amqp decodes bodies that name a content encoding; compare bytes."""
    body = message.body
    return body.encode(message.properties.get("content_encoding") or "utf-8") if isinstance(body, str) else body


def replay_args(url: str, queue: str, redis_url: str, namespace: str, *extra: str) -> list[str]:
    return ["replay", "rabbitmq", "--url", url, "--from", queue + ".dlq", "--redis-url", redis_url,
            "--namespace", namespace, *extra]


def consume_all(conn: Connection, queue: str, dedupe: Deduplicator, expected: int) -> Counter[str]:
    """Run the real consumer on ``queue`` until it holds no message and ``expected`` distinct keys
    were applied; return how many times the handler ran per key."""
    runs: Counter[str] = Counter()
    lock = threading.Lock()

    def handler(body: Any, message: Any) -> str:
        with lock:
            runs[body["id"]] += 1
        return str(body["id"])

    consumer = DedupeConsumer(conn.clone(), [queue], handler, dedupe)
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(runs) >= expected and depth(conn, queue) == 0, 60, "the consumer to drain")
    finally:
        consumer.stop()
        thread.join(15)
        consumer.connection.release()
    assert not thread.is_alive()
    return runs


def test_replays_exactly_the_unapplied_half(amqp: Connection, rabbitmq_url: str, queue: str,
                                            redis_url: str, namespace: str, dedupe: Deduplicator) -> None:
    for i in range(10):
        dead_letter(amqp, queue, i)
    for i in range(5):
        apply_before(dedupe, f"k{i}", body_of(i))

    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--json"))

    summary = json.loads(out)
    assert status == 0
    assert summary == {"dry_run": False, "examined": 10, "replayed": 5, "already_applied": 5,
                       "left_in_place": 0, "failed": 0}
    assert depth(amqp, queue + ".dlq") == 0
    replayed = peek_all(amqp, queue)
    assert sorted(m.headers["idempotency-key"] for m in replayed) == [f"k{i}" for i in range(5, 10)]
    for m in replayed:
        i = int(m.headers["idempotency-key"][1:])
        assert raw_body(m) == body_of(i)
        assert "x-dedupe-attempts" not in m.headers
        assert m.headers["x-dedupe-replayed"] == "1"
        assert m.headers["tenant"] == "acme"
        assert m.headers["x-dedupe-reason"] == "handler_error"
        assert (m.properties["message_id"], m.properties["correlation_id"]) == (f"m{i}", f"c{i}")
        assert (m.properties["priority"], m.properties["delivery_mode"]) == (3, 2)
        assert m.properties["content_type"] == "application/json"
    # The real consumer then applies each of them once: every message is applied exactly once.
    runs = consume_all(amqp, queue, dedupe, expected=5)
    assert runs == Counter({f"k{i}": 1 for i in range(5, 10)})
    assert all(dedupe.status(f"k{i}").state == "done" for i in range(10))


def fill_mixed(conn: Connection, queue: str, redis_url: str, namespace: str) -> None:
    """A dead-letter queue with one message in each state the planner knows, plus one that RabbitMQ
    itself dead-lettered (``x-death`` only) from ``<queue>.src``."""
    holder = Deduplicator(redis.Redis.from_url(redis_url), namespace=namespace, lease=60.0)
    try:
        dead_letter(conn, queue, 0)                          # applied -> drop
        apply_before(holder, "k0", body_of(0))
        dead_letter(conn, queue, 1)                          # permanent failure -> leave
        apply_before(holder, "k1", body_of(1), fail=True)
        dead_letter(conn, queue, 2)                          # in progress -> leave
        assert holder.begin("k2").acquired
        dead_letter(conn, queue, 3)                          # free -> replay
        dead_letter(conn, queue, 4, key=False)               # no idempotency-key header -> leave
        dead_letter(conn, queue, 5, reason="conflict")       # not selected by --filter -> leave
        dead_letter(conn, queue, 6, **{"x-dedupe-key": "other"})  # key mismatch -> leave
    finally:
        holder.close()
    channel = conn.default_channel
    source = queue + ".src"
    channel.queue_declare(queue=source, durable=True, auto_delete=False, arguments={
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue + ".dlq"})
    message = channel.prepare_message(body_of(7), None, "application/json", "utf-8",
                                      {"idempotency-key": "k7"}, {})
    channel.basic_publish_confirm(message, exchange="", routing_key=source)
    got = wait_for(lambda: channel.basic_get(queue=source, no_ack=False), 10, "the source message")
    channel.basic_reject(got.delivery_tag, requeue=False)   # RabbitMQ dead-letters it with x-death
    wait_for(lambda: depth(conn, queue + ".dlq") == 8, 10, "RabbitMQ's dead-lettering")


EXPECTED_PLAN = {
    "k0": ("applied", "drop"), "k1": ("failed", "leave"), "k2": ("in_progress", "leave"),
    "k3": ("free", "replay"), None: ("no_key", "leave"), "k5": ("filtered", "leave"),
    "k6": ("key_mismatch", "leave"), "k7": ("free", "replay"),
}


def test_dry_run_changes_nothing_then_the_real_run_follows_the_plan(
        amqp: Connection, rabbitmq_url: str, queue: str, redis_url: str, namespace: str,
        redis_client: redis.Redis) -> None:
    fill_mixed(amqp, queue, redis_url, namespace)
    before = redis_snapshot(redis_client, namespace)
    options = ("--key-header", "idempotency-key", "--filter", "handler_error,rejected")

    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--dry-run", "--json", *options))

    plan = json.loads(out)
    assert status == 0 and plan["dry_run"] is True
    by_key = {e["key"]: (e["state"], e["action"]) for e in plan["plan"]}
    assert by_key == EXPECTED_PLAN
    assert (plan["replayed"], plan["already_applied"], plan["left_in_place"]) == (2, 1, 5)
    assert depth(amqp, queue) == 0 and depth(amqp, queue + ".src") == 0
    assert depth(amqp, queue + ".dlq") == 8
    assert redis_snapshot(redis_client, namespace) == before
    status, text = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--dry-run", *options))
    assert "KEY" in text.splitlines()[0] and "would have: replayed 2" in text

    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--json", *options))

    assert json.loads(out)["replayed"] == 2 and status == 0
    assert [m.headers["idempotency-key"] for m in take_all(amqp, queue)] == ["k3"]
    from_source = take_all(amqp, queue + ".src")
    assert [raw_body(m) for m in from_source] == [body_of(7)] and "x-death" in from_source[0].headers
    left = take_all(amqp, queue + ".dlq")
    assert sorted(raw_body(m) for m in left) == sorted(body_of(i) for i in (1, 2, 4, 5, 6))
    assert all(m.headers["x-dedupe-attempts"] == "5" for m in left)   # left untouched
    assert redis_snapshot(redis_client, namespace) == before


def test_unroutable_or_unknown_destination_is_counted_failed_and_kept(
        amqp: Connection, rabbitmq_url: str, queue: str, redis_url: str, namespace: str) -> None:
    dead_letter(amqp, queue, 0, **{"x-dedupe-original-queue": queue + "-gone"})
    dead_letter(amqp, queue, 1)
    dead_letter(amqp, queue, 2, **{"x-dedupe-original-queue": ""})
    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--json", "--dry-run"))
    assert status == 1 and "no destination" in json.loads(out)["plan"][2]["note"]

    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--json"))

    assert status == 1
    assert json.loads(out)["failed"] == 2 and json.loads(out)["replayed"] == 1
    assert sorted(raw_body(m) for m in take_all(amqp, queue + ".dlq")) == [body_of(0), body_of(2)]


def test_a_missing_dead_letter_queue_exits_2(rabbitmq_url: str, redis_url: str, namespace: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    status, _ = cli(replay_args(rabbitmq_url, unique("absent"), redis_url, namespace))
    assert status == 2 and "not found" in capsys.readouterr().err


def test_to_overrides_the_destination_and_limit_bounds_the_run(
        amqp: Connection, rabbitmq_url: str, queue: str, redis_url: str, namespace: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    for i in range(4):
        dead_letter(amqp, queue, i)
    other = queue + ".src"
    amqp.default_channel.queue_declare(queue=other, durable=True, auto_delete=False)

    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--json", "--limit", "3",
                                  "--to", "/" + other, "--progress"))

    assert status == 0 and json.loads(out)["replayed"] == 3
    bar = capsys.readouterr().err.rstrip("\n").split("\r")[-1]
    assert bar.endswith("3/3 replayed=3 applied=0 left=0 failed=0")
    assert depth(amqp, other) == 3 and depth(amqp, queue) == 0 and depth(amqp, queue + ".dlq") == 1


#: The replay's batch (``replay_rabbitmq``'s ``batch_size`` default): copies published, then acked.
BATCH = 100


def test_sigkill_mid_replay_then_rerun_loses_nothing_and_applies_once(
        amqp: Connection, rabbitmq_url: str, queue: str, redis_url: str, namespace: str,
        dedupe: Deduplicator) -> None:
    total = 300
    channel = amqp.default_channel
    for i in range(total):
        dead_letter(amqp, queue, i)
    args = replay_args(rabbitmq_url, queue, redis_url, namespace, "--rate", "300/s")

    with killed_on_exit(replay_process(args)) as proc:
        wait_for(lambda: depth(amqp, queue) >= 60 or proc.poll() is not None, 30, "replay progress")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # The broker requeues what the killed replay held: nothing is lost. A batch's originals are
    # acked only once its copies are confirmed, so a kill between the two leaves the whole batch
    # in the dead-letter queue as well as its copies in the queue.
    wait_for(lambda: depth(amqp, queue) + depth(amqp, queue + ".dlq") >= total, 30, "requeue")
    assert 0 < depth(amqp, queue + ".dlq") <= total

    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--json"))

    assert status == 0 and json.loads(out)["failed"] == 0
    assert depth(amqp, queue + ".dlq") == 0
    delivered = depth(amqp, queue)
    assert total <= delivered <= total + BATCH   # at most the batch in flight at the kill is doubled
    runs = consume_all(amqp, queue, dedupe, expected=total)
    assert runs == Counter({f"k{i}": 1 for i in range(total)})
    assert channel.queue_declare(queue=queue, passive=True).message_count == 0


def test_conflicts_and_undecodable_are_left_in_place_and_nothing_is_deleted(
        amqp: Connection, rabbitmq_url: str, queue: str, redis_url: str, namespace: str, dedupe: Deduplicator,
        redis_client: redis.Redis) -> None:
    """Only a payload whose own outcome is stored is dropped: a conflict (its key holds another
    payload's outcome) never ran, and neither did an undecodable message."""
    dead_letter(amqp, queue, 0, reason="conflict")     # the key's outcome is another payload's
    apply_before(dedupe, "k0", b'{"id": "k0", "amount": 999}')
    dead_letter(amqp, queue, 1, reason="undecodable")  # key free: replayed unchanged it bounces back
    dead_letter(amqp, queue, 2)                        # handler_error, but the stored outcome is another payload's
    apply_before(dedupe, "k2", b'{"id": "k2", "amount": 999}')
    dead_letter(amqp, queue, 3)                        # this very payload's outcome: dropped
    apply_before(dedupe, "k3", body_of(3))
    before = redis_snapshot(redis_client, namespace)

    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--dry-run", "--json"))

    plan = {e["key"]: e for e in json.loads(out)["plan"]}
    assert status == 0
    assert {k: (e["state"], e["action"]) for k, e in plan.items()} == {
        "k0": ("filtered", "leave"), "k1": ("filtered", "leave"), "k2": ("conflict", "leave"),
        "k3": ("applied", "drop")}
    assert "dead-lettered as conflict" in plan["k0"]["note"] and "--filter conflict" in plan["k0"]["note"]
    assert "dead-lettered as undecodable" in plan["k1"]["note"]
    assert "different payload" in plan["k2"]["note"]
    _, table = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--dry-run"))
    assert "dead-lettered as conflict" in table and "different payload" in table  # the dry run says why

    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--json"))

    assert status == 0
    assert json.loads(out) == {"dry_run": False, "examined": 4, "replayed": 0, "already_applied": 1,
                               "left_in_place": 3, "failed": 0}
    assert depth(amqp, queue) == 0
    left = peek_all(amqp, queue + ".dlq")
    assert sorted(raw_body(m) for m in left) == [body_of(0), body_of(1), body_of(2)]
    assert all(m.headers["x-dedupe-attempts"] == "5" and "x-dedupe-replayed" not in m.headers for m in left)
    # Naming them replays what is free and still never drops another payload's conflict.
    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--json",
                                  "--filter", "conflict,undecodable"))
    assert json.loads(out)["replayed"] == 1 and json.loads(out)["already_applied"] == 0
    assert [m.headers["idempotency-key"] for m in take_all(amqp, queue)] == ["k1"]
    assert sorted(raw_body(m) for m in take_all(amqp, queue + ".dlq")) == [body_of(0), body_of(2)]
    assert redis_snapshot(redis_client, namespace) == before


def test_the_consumers_own_dead_letters_are_judged_by_the_fingerprints_it_stored(
        amqp: Connection, rabbitmq_url: str, queue: str, redis_url: str, namespace: str,
        dedupe: Deduplicator) -> None:
    """End to end: the real consumer dead-letters a conflict and a handler error, then applies the
    handler error's payload on a later copy. The replay computes the fingerprints the consumer
    stored from the dead-lettered bytes: it drops the applied payload and keeps the conflict."""
    failing = threading.Event()
    failing.set()
    ran: list[bytes] = []

    def handler(body: Any, message: Any) -> str:
        if body["id"] == "b" and failing.is_set():
            raise RuntimeError("downstream down")
        ran.append(message.body)
        return str(body["id"])

    consumer = DedupeConsumer(amqp.clone(), [queue], handler, dedupe, max_attempts=1)
    with consumer_thread(consumer):
        publish(amqp, queue, '{"id": "a", "amount": 1}', headers={"idempotency-key": "a"})
        wait_for(lambda: len(ran) == 1, what="the first payload of key a")
        publish(amqp, queue, '{"id": "a", "amount": 2}', headers={"idempotency-key": "a"})  # -> conflict
        publish(amqp, queue, '{"id": "b", "amount": 3}', headers={"idempotency-key": "b"})  # -> handler_error
        wait_for(lambda: depth(amqp, queue + ".dlq") == 2, what="two dead letters")
        failing.clear()
        publish(amqp, queue, '{"id": "b", "amount": 3}', headers={"idempotency-key": "b"})  # the same payload
        wait_for(lambda: len(ran) == 2 and drained(amqp, queue), what="the copy of b applied")
    reasons = sorted(m.headers["x-dedupe-reason"] for m in peek_all(amqp, queue + ".dlq"))
    assert reasons == ["conflict", "handler_error"]

    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--json"))

    assert status == 0
    assert json.loads(out) == {"dry_run": False, "examined": 2, "replayed": 0, "already_applied": 1,
                               "left_in_place": 1, "failed": 0}
    (left,) = peek_all(amqp, queue + ".dlq")
    assert left.headers["x-dedupe-reason"] == "conflict" and raw_body(left) == b'{"id": "a", "amount": 2}'
    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--json", "--dry-run",
                                  "--filter", "conflict"))
    assert [(e["key"], e["state"], e["action"]) for e in json.loads(out)["plan"]] == [("a", "conflict", "leave")]


def test_key_only_drops_outcomes_stored_without_a_fingerprint_and_still_keeps_conflicts(
        amqp: Connection, rabbitmq_url: str, queue: str, redis_url: str, namespace: str, dedupe: Deduplicator,
        redis_client: redis.Redis) -> None:
    """A consumer run with ``fingerprint=None`` (or ``run()``) stores outcomes with no fingerprint:
    only ``--key-only`` counts them as applied; another payload's outcome stays a conflict."""
    dead_letter(amqp, queue, 0)
    dedupe.run("k0", lambda: "done")                           # stored without a fingerprint
    dead_letter(amqp, queue, 1)
    apply_before(dedupe, "k1", b'{"id": "k1", "amount": 999}')  # another payload's outcome
    dead_letter(amqp, queue, 2)                                # free
    before = redis_snapshot(redis_client, namespace)

    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--dry-run", "--json"))
    plan = {e["key"]: (e["state"], e["action"]) for e in json.loads(out)["plan"]}
    assert status == 0 and plan == {"k0": ("unproven", "leave"), "k1": ("conflict", "leave"),
                                    "k2": ("free", "replay")}
    assert "--key-only" in {e["key"]: e["note"] for e in json.loads(out)["plan"]}["k0"]  # the way out, named

    status, out = cli(replay_args(rabbitmq_url, queue, redis_url, namespace, "--json", "--key-only"))

    assert status == 0
    assert json.loads(out) == {"dry_run": False, "examined": 3, "replayed": 1, "already_applied": 1,
                               "left_in_place": 1, "failed": 0}
    assert [m.headers["idempotency-key"] for m in take_all(amqp, queue)] == ["k2"]
    assert [raw_body(m) for m in take_all(amqp, queue + ".dlq")] == [body_of(1)]  # the conflict stays
    assert redis_snapshot(redis_client, namespace) == before

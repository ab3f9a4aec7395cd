"""The RabbitMQ consumer in-process, against the real broker and real Redis."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import orjson
import pytest
import redis
from kombu import Connection

import dedupe_worker.rabbitmq as rabbitmq
from dedupe_worker import Deduplicator, Envelope, Reason
from dedupe_worker.keys import body_fingerprint, field_key, first_of, header_key
from dedupe_worker.rabbitmq import DedupeConsumer, delay_queue, dlq

from .rabbitmq_fixtures import amqp, consumer_thread, dead_letters, depth, drained, publish, queue_name, wait_for

__all__ = ["amqp", "queue_name"]  # fixtures used by name


class Recorder:
    """A handler that counts applications per ``id`` of the JSON body (thread-safe)."""

    def __init__(self) -> None:
        self.applied: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self.headers: dict[str, dict[str, Any]] = {}

    def __call__(self, body: Any, message: Any) -> str:
        with self.lock:
            self.applied[body["id"]] += 1
            self.headers[body["id"]] = dict(message.headers)
        return str(body["id"])

    def total(self) -> int:
        with self.lock:
            return sum(self.applied.values())


def test_public_names() -> None:
    assert set(rabbitmq.__all__) == {
        "DedupeConsumer", "Handler", "Republisher", "PublishFailed", "delay_queue", "dlq",
        "DEFERRALS", "DELAY_SUFFIX", "DLQ_SUFFIX", "ORIGINAL_USER_ID"}
    for name in rabbitmq.__all__:
        assert hasattr(rabbitmq, name)


def test_options_are_checked(dedupe: Deduplicator) -> None:
    consumer = DedupeConsumer(Connection("amqp://"), ["q"], Recorder(), dedupe, prefetch_count=7, max_attempts=2)
    assert (consumer.prefetch_count, consumer.max_attempts, consumer.batch) == (7, 2, True)
    with pytest.raises(TypeError, match="unknown option 'handle'"):
        DedupeConsumer(Connection("amqp://"), ["q"], Recorder(), dedupe, handle=print)


@pytest.mark.parametrize("prefetch", [1, 10])
def test_duplicates_applied_once_and_queue_drained(
    amqp: Connection, queue_name: str, dedupe: Deduplicator, prefetch: int
) -> None:
    # Three ways a key is found (header, message_id, body hash), each message sent three times.
    sent = []
    for n in range(12):
        body = orjson.dumps({"id": f"m{n}"})
        if n % 3 == 0:
            sent.append((body, {"headers": {"idempotency-key": f"order-{n}"}}))
        elif n % 3 == 1:
            sent.append((body, {"message_id": f"mid-{n}"}))
        else:
            sent.append((body, {}))
    for _copy in range(3):
        for body, props in sent:
            publish(amqp, queue_name, body, **props)
    handler = Recorder()
    consumer = DedupeConsumer(amqp.clone(), [queue_name], handler, dedupe, prefetch_count=prefetch)
    with consumer_thread(consumer):
        wait_for(lambda: handler.total() >= 12 and depth(amqp, queue_name) == 0, what="all applied")
        # Give a stray duplicate the chance to be (wrongly) applied before judging.
        wait_for(lambda: depth(amqp, delay_queue(queue_name)) == 0, what="delay queue empty")
    assert handler.applied == {f"m{n}": 1 for n in range(12)}
    assert depth(amqp, queue_name) == 0
    assert dead_letters(amqp, queue_name) == []


class Permanent(ValueError):
    """Stored as a permanent failure by the deduplicator below."""


@pytest.fixture
def strict_dedupe(redis_client: redis.Redis, namespace: str) -> Any:
    d = Deduplicator(redis_client, namespace=namespace, lease=2.0, result_ttl=60.0,
                     permanent_errors=(Permanent,))
    yield d
    d.close()


def test_every_poison_kind_is_dead_lettered_with_its_reason(
    amqp: Connection, queue_name: str, strict_dedupe: Deduplicator
) -> None:
    applied: list[str] = []

    def handler(body: Any, message: Any) -> Any:
        if body.get("fail") == "permanent":
            raise Permanent("cannot ever apply")
        if body.get("fail") == "always":
            raise RuntimeError("flaky downstream")
        applied.append(body["id"])
        return body["id"]

    props = dict(message_id="mid-1", correlation_id="corr-1", priority=3, app_id="tests", type="order",
                 timestamp=1_700_000_000, delivery_mode=2)
    # header or the "id" field of the JSON body; no content-hash fallback, so a key can be missing
    strategy = first_of(header_key(), field_key("id"))
    consumer = DedupeConsumer(amqp.clone(), [queue_name], handler, strict_dedupe, key_strategy=strategy,
                              max_attempts=2, retry_base=0.05, retry_cap=0.1)
    with consumer_thread(consumer):
        publish(amqp, queue_name, '{"id": "conflict", "v": 1}')
        wait_for(lambda: applied == ["conflict"], what="first use of the key")
        publish(amqp, queue_name, '{"id": "conflict", "v": 2}', headers={"x-trace": "t1"}, **props)
        publish(amqp, queue_name, "not json at all", content_type="text/plain")
        publish(amqp, queue_name, "{broken", headers={"idempotency-key": "k-json"})
        publish(amqp, queue_name, '{"no_id": 1}')
        publish(amqp, queue_name, '{"id": 1}', headers={"idempotency-key": "x" * 9000})
        publish(amqp, queue_name, '{"id": "perm", "fail": "permanent"}')
        publish(amqp, queue_name, '{"id": "flaky", "fail": "always"}')
        publish(amqp, queue_name, '{"id": "good"}')
        wait_for(lambda: depth(amqp, dlq(queue_name)) >= 7, what="seven dead letters")
        wait_for(lambda: "good" in applied, what="the loop to keep going")
    letters = dead_letters(amqp, queue_name)
    by_reason = {m.headers["x-dedupe-reason"]: m for m in letters}
    assert len(letters) == 7
    assert set(by_reason) == {r.value for r in (
        Reason.CONFLICT, Reason.UNDECODABLE, Reason.INVALID_KEY, Reason.PERMANENT_FAILURE,
        Reason.HANDLER_ERROR)}
    reasons = collections.Counter(m.headers["x-dedupe-reason"] for m in letters)
    assert reasons["undecodable"] == 2 and reasons["invalid_key"] == 2
    for m in letters:
        assert m.headers["x-dedupe-error"], m.headers
        assert m.headers["x-dedupe-original-queue"] == queue_name
        assert m.headers["x-dedupe-original-exchange"] == ""
        assert m.headers["x-dedupe-original-routing-key"] == queue_name
        assert m.properties.get("expiration") is None
    # body, properties and the original headers travel intact
    conflict = by_reason["conflict"]
    assert conflict.body in ('{"id": "conflict", "v": 2}', b'{"id": "conflict", "v": 2}')
    assert conflict.headers["x-trace"] == "t1"
    assert conflict.headers["x-dedupe-key"] == "conflict"
    for name, value in props.items():
        got = conflict.properties[name]
        assert (got.timestamp() if hasattr(got, "timestamp") else got) == value, name
    assert conflict.properties["content_type"] == "application/json"
    assert conflict.properties["content_encoding"] == "utf-8"
    # handler errors were retried until the attempt limit; the permanent failure ran once
    assert by_reason["handler_error"].headers["x-dedupe-attempts"] == "2"
    assert "flaky downstream" in by_reason["handler_error"].headers["x-dedupe-error"]
    assert by_reason["permanent_failure"].headers["x-dedupe-attempts"] == "1"
    assert by_reason["undecodable"].headers["x-dedupe-error"].startswith("UndecodableMessage")
    assert applied == ["conflict", "good"]
    assert depth(amqp, queue_name) == 0 and depth(amqp, delay_queue(queue_name)) == 0


def test_handler_errors_are_retried_with_backoff_then_applied_once(
    amqp: Connection, queue_name: str, strict_dedupe: Deduplicator
) -> None:
    calls: list[dict[str, Any]] = []

    def handler(body: Any, message: Any) -> str:
        calls.append(dict(message.headers))
        if len(calls) < 3:
            raise RuntimeError(f"attempt {len(calls)} fails")
        return "ok"

    consumer = DedupeConsumer(amqp.clone(), [queue_name], handler, strict_dedupe, max_attempts=3,
                              retry_base=0.05, retry_cap=0.1)
    with consumer_thread(consumer):
        publish(amqp, queue_name, '{"id": "r1"}', headers={"idempotency-key": "r1"})
        wait_for(lambda: len(calls) == 3, what="three attempts")
        publish(amqp, queue_name, '{"id": "r1"}', headers={"idempotency-key": "r1"})  # a late duplicate
        wait_for(lambda: drained(amqp, queue_name))
    assert [c.get("x-dedupe-attempts") for c in calls] == [None, "1", "2"]
    assert strict_dedupe.status("r1").state == "done"
    assert len(calls) == 3
    assert dead_letters(amqp, queue_name) == []


def test_a_copy_in_flight_waits_on_its_key_and_is_acked_when_the_holder_finishes(
    amqp: Connection, queue_name: str, strict_dedupe: Deduplicator, redis_client: redis.Redis, namespace: str
) -> None:
    """Two keys held by "another worker": one with the default 30 s lease, completed 1 s later
    (its copy is acked as a duplicate within 0.5 s of that), one whose holder vanished with a 2 s
    lease (its copy is applied once that lease has run out). Neither goes through the delay queue."""
    bodies = {"done-elsewhere": b'{"id": "done-elsewhere"}', "holder-died": b'{"id": "holder-died"}'}
    holders = {"done-elsewhere": Deduplicator(redis_client, namespace=namespace),  # lease 30 s
               "holder-died": Deduplicator(redis_client, namespace=namespace, lease=2.0)}
    held = {key: holders[key].begin(key, fingerprint=body_fingerprint(Envelope(body=body)))
            for key, body in bodies.items()}
    assert all(c.acquired for c in held.values())
    handler = Recorder()
    settled: dict[str, tuple[str, float]] = {}

    class Watching(DedupeConsumer):
        def on_duplicate(self, message: Any, decision: Any) -> None:
            settled[message.headers["idempotency-key"]] = ("duplicate", time.monotonic())

        def on_applied(self, message: Any, decision: Any) -> None:
            settled[message.headers["idempotency-key"]] = ("applied", time.monotonic())

    consumer = Watching(amqp.clone(), [queue_name], handler, strict_dedupe)
    with consumer_thread(consumer):
        for key, body in bodies.items():
            publish(amqp, queue_name, body, headers={"idempotency-key": key})
        time.sleep(1.0)
        assert handler.total() == 0 and not settled
        holders["done-elsewhere"].complete(held["done-elsewhere"], "done by the other worker")
        completed_at = time.monotonic()
        wait_for(lambda: "done-elsewhere" in settled, timeout=5, what="the copy acked")
        assert settled["done-elsewhere"][0] == "duplicate"
        assert settled["done-elsewhere"][1] - completed_at < 0.5
        wait_for(lambda: handler.applied["holder-died"] == 1, timeout=15, what="the orphaned key applied")
        wait_for(lambda: drained(amqp, queue_name))
    assert handler.applied == {"holder-died": 1}
    assert depth(amqp, delay_queue(queue_name)) == 0
    assert strict_dedupe.status("done-elsewhere").state == "done"
    assert dead_letters(amqp, queue_name) == []
    for holder in holders.values():
        holder.close()


def test_without_waiting_a_copy_is_deferred_on_a_short_backoff_capped_by_the_holder_lease(
    amqp: Connection, queue_name: str, strict_dedupe: Deduplicator
) -> None:
    """``defer_wait=0``: the copy goes through the delay queue, coming back after tens of
    milliseconds at first, and never later than the holder's lease (2 s) can have run out."""
    body = b'{"id": "holder-died"}'
    held = strict_dedupe.begin("holder-died", fingerprint=body_fingerprint(Envelope(body=body)))
    handler = Recorder()
    deferred: list[tuple[str, float]] = []

    class Watching(DedupeConsumer):
        def on_deferred(self, message: Any, decision: Any, delay: float) -> None:
            deferred.append((decision.reason.value, delay))

    consumer = Watching(amqp.clone(), [queue_name], handler, strict_dedupe, defer_wait=0.0)
    with consumer_thread(consumer):
        publish(amqp, queue_name, body, headers={"idempotency-key": "holder-died"})
        wait_for(lambda: handler.applied["holder-died"] == 1, timeout=15, what="applied after the lease")
        wait_for(lambda: drained(amqp, queue_name))
    assert held.acquired and handler.applied == {"holder-died": 1}
    assert deferred and all(reason == "in_progress" for reason, _ in deferred)
    assert deferred[0][1] <= 0.06  # the first backoff: tens of milliseconds
    assert all(delay <= 2.02 for _, delay in deferred)  # never past the holder's lease
    assert int(handler.headers["holder-died"]["x-dedupe-deferrals"]) == len(deferred)
    assert "x-dedupe-attempts" not in handler.headers["holder-died"]  # a deferral is not an attempt
    assert dead_letters(amqp, queue_name) == []


def test_attempts_are_counted_from_the_header_and_a_message_without_it_gets_a_fresh_budget(
    amqp: Connection, queue_name: str, strict_dedupe: Deduplicator
) -> None:
    seen: list[str | None] = []

    def handler(body: Any, message: Any) -> None:
        seen.append(message.headers.get("x-dedupe-attempts"))
        raise RuntimeError("still failing")

    consumer = DedupeConsumer(amqp.clone(), [queue_name], handler, strict_dedupe, max_attempts=3,
                              retry_base=0.01, retry_cap=0.02)
    with consumer_thread(consumer):
        # four attempts already spent elsewhere: one more and it is dead-lettered
        publish(amqp, queue_name, '{"id": "spent"}', headers={"idempotency-key": "spent", "x-dedupe-attempts": "4"})
        wait_for(lambda: depth(amqp, dlq(queue_name)) == 1, what="the exhausted message dead-lettered")
        # as a replay republishes it: same message, no attempts header -> a full budget again
        publish(amqp, queue_name, '{"id": "spent"}', headers={"idempotency-key": "spent"})
        wait_for(lambda: depth(amqp, dlq(queue_name)) == 2, what="the replayed message dead-lettered")
    assert seen == ["4", None, "1", "2"]
    letters = dead_letters(amqp, queue_name)
    assert [m.headers["x-dedupe-attempts"] for m in letters] == ["5", "3"]
    assert [m.headers["x-dedupe-reason"] for m in letters] == ["handler_error", "handler_error"]


def test_lease_lost_while_handling_is_deferred_and_comes_back_a_duplicate(
    amqp: Connection, queue_name: str, strict_dedupe: Deduplicator
) -> None:
    """The handler's claim is taken over mid-run (released and re-claimed by "another worker"),
    so its outcome is refused; the message is deferred, not acked as applied."""
    from dedupe_worker import current_claim

    takeover: dict[str, Any] = {}
    lost: list[str] = []
    calls: list[str] = []

    def handler(body: Any, message: Any) -> str:
        calls.append(body["id"])
        if "claim" not in takeover:
            mine = current_claim()
            assert mine is not None
            strict_dedupe.release(mine)
            takeover["claim"] = strict_dedupe.begin(mine.key, fingerprint=mine.fingerprint)
        return "mine"

    class Watching(DedupeConsumer):
        def on_lease_lost(self, message: Any, decision: Any) -> None:
            lost.append(decision.claim.key)

    consumer = Watching(amqp.clone(), [queue_name], handler, strict_dedupe, defer_base=0.05, prefetch_count=1)
    with consumer_thread(consumer):
        publish(amqp, queue_name, '{"id": "taken"}', headers={"idempotency-key": "taken"})
        wait_for(lambda: lost == ["taken"], what="the lease loss")
        assert takeover["claim"].acquired
        strict_dedupe.complete(takeover["claim"], "theirs")
        wait_for(lambda: drained(amqp, queue_name),
                 timeout=10, what="the deferred copy acked as a duplicate")
    assert calls == ["taken"]
    assert strict_dedupe.run("taken", lambda: "never") == "theirs"
    assert dead_letters(amqp, queue_name) == []


def test_a_deleted_dead_letter_queue_is_redeclared_and_nothing_is_dropped(
    amqp: Connection, queue_name: str, dedupe: Deduplicator
) -> None:
    consumer = DedupeConsumer(amqp.clone(), [queue_name], Recorder(), dedupe,
                              key_strategy=header_key())
    with consumer_thread(consumer):
        amqp.default_channel.queue_delete(queue=dlq(queue_name))
        publish(amqp, queue_name, '{"id": "no-key"}')
        # the first copy is returned unroutable: the original is requeued, the queue redeclared
        wait_for(lambda: depth(amqp, dlq(queue_name)) == 1, timeout=15, what="the dead letter")
    [letter] = dead_letters(amqp, queue_name)
    assert letter.headers["x-dedupe-reason"] == "invalid_key"
    assert depth(amqp, queue_name) == 0


def test_several_queues_keep_their_own_delay_and_dead_letter_queues(
    amqp: Connection, queue_name: str, dedupe: Deduplicator
) -> None:
    other = f"{queue_name}-b"
    amqp.default_channel.queue_declare(queue=other, durable=True, auto_delete=False)
    handler = Recorder()
    try:
        consumer = DedupeConsumer(amqp.clone(), [queue_name, other], handler, dedupe,
                                  key_strategy=first_of(header_key(), field_key("id")))
        with consumer_thread(consumer):
            publish(amqp, other, "garbage", content_type="text/plain")
            publish(amqp, queue_name, '{"id": "a"}')
            publish(amqp, other, '{"id": "a"}')  # the same key through another queue: a duplicate
            wait_for(lambda: depth(amqp, dlq(other)) == 1 and handler.total() == 1, what="both handled")
            wait_for(lambda: depth(amqp, other) == 0 and depth(amqp, queue_name) == 0)
        [letter] = dead_letters(amqp, other)
        assert letter.headers["x-dedupe-original-queue"] == other
        assert letter.headers["x-dedupe-reason"] == "undecodable"
        assert handler.applied == {"a": 1}
        assert dead_letters(amqp, queue_name) == []
    finally:
        for name in (other, delay_queue(other), dlq(other)):
            amqp.default_channel.queue_delete(queue=name)


def test_republished_copy_keeps_properties_and_moves_a_foreign_user_id_to_a_header(
    amqp: Connection, queue_name: str
) -> None:
    """RabbitMQ refuses a user_id other than the login; a copy of such a message must still go out."""
    from types import SimpleNamespace

    from dedupe_worker.rabbitmq import Republisher

    with amqp.clone() as conn:
        publisher = Republisher(conn.channel(), conn.userid)
        publisher.declare(queue_name)
        consumed = SimpleNamespace(body=b"{}", properties={
            "content_type": "application/json", "content_encoding": "utf-8", "user_id": "mallory",
            "message_id": "m-9", "priority": 4, "expiration": "60000", "application_headers": {"a": "1"},
        })
        publisher.publish(consumed, dlq(queue_name), {"a": "1", "b": "2"})
        consumed.properties["user_id"] = conn.userid  # our own login stays a property
        publisher.publish(consumed, dlq(queue_name), {})
    first, second = dead_letters(amqp, queue_name)
    assert first.headers == {"a": "1", "b": "2", "x-dedupe-original-user-id": "mallory"}
    assert "user_id" not in first.properties and "expiration" not in first.properties
    assert (first.properties["message_id"], first.properties["priority"]) == ("m-9", 4)
    assert first.properties["content_type"] == "application/json"
    assert second.properties["user_id"] == "guest" or second.properties["user_id"] == amqp.userid


@pytest.mark.parametrize("prefetch", [1, 10])
def test_a_handler_that_acks_by_itself_does_not_break_the_loop(
    amqp: Connection, queue_name: str, dedupe: Deduplicator, prefetch: int
) -> None:
    recorder = Recorder()

    def handler(body: Any, message: Any) -> str:
        if body["id"].startswith("self-acking"):
            message.ack()
        return recorder(body, message)

    consumer = DedupeConsumer(amqp.clone(), [queue_name], handler, dedupe, prefetch_count=prefetch)
    for n in range(6):
        name = f"self-acking-{n}" if n % 2 else f"plain-{n}"
        publish(amqp, queue_name, orjson.dumps({"id": name}), headers={"idempotency-key": name})
    with consumer_thread(consumer):
        wait_for(lambda: recorder.total() == 6 and drained(amqp, queue_name), what="all six handled")
        publish(amqp, queue_name, b'{"id": "later"}', headers={"idempotency-key": "later"})
        wait_for(lambda: recorder.applied["later"] == 1, what="the loop to go on")
    assert consumer.ready.is_set() is False  # stopped cleanly, not crashed
    assert set(recorder.applied.values()) == {1}
    assert depth(amqp, queue_name) == 0

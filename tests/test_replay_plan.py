"""The broker-neutral half of the replay: planner verdicts against real Redis states, header
rewriting, pacing, summaries, destinations and the CLI's argument parsing."""

from __future__ import annotations

import argparse
import io
import json
import time
from typing import Any

import pytest
import redis

from dedupe_worker import Deduplicator, Envelope, StoreUnavailable
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker.cli._replay import parse_rate
from dedupe_worker.keys import KAFKA_DEFAULT, RABBITMQ_DEFAULT, field_key, header_key, position_key
from dedupe_worker.replay import (
    REPLAYED,
    Destination,
    Entry,
    Pacer,
    Planner,
    Progress,
    ReplayOptions,
    Step,
    Summary,
    format_table,
    replay_headers,
)
from dedupe_worker.replay import __all__ as exported
from dedupe_worker.replay._kafka import lookup_envelope
from dedupe_worker.replay._rabbitmq import dead_letter_reason, original_destination

from .replay_fixtures import apply_before
from .services import RedisServer


def envelope(key: str | None, body: bytes = b'{"id": 1}', **headers: str) -> Envelope:
    if key is not None:
        headers["idempotency-key"] = key
    return Envelope(body=body, headers=headers)


def test_each_key_state_gets_its_step(dedupe: Deduplicator) -> None:
    apply_before(dedupe, "applied", b'{"id": 1}')
    apply_before(dedupe, "failed", b"x", fail=True)
    assert dedupe.begin("held").acquired
    planner = Planner(dedupe, header_key())

    verdicts = {key: planner.judge(envelope(key), "handler_error") for key in ("applied", "failed", "held", "new")}

    assert {k: (e.state, e.step) for k, e in verdicts.items()} == {
        "applied": ("applied", Step.DROP), "failed": ("failed", Step.LEAVE),
        "held": ("in_progress", Step.LEAVE), "new": ("free", Step.REPLAY),
    }
    assert all(e.reason == "handler_error" and e.key == k for k, e in verdicts.items())
    assert not any(e.unavailable for e in verdicts.values())


def test_an_outcome_is_applied_only_for_the_payload_that_ran(dedupe: Deduplicator) -> None:
    """Same key, other body: the outcome stored is not this payload's, so it is never dropped."""
    apply_before(dedupe, "order-7", b'{"amount": 1}')
    planner = Planner(dedupe, header_key())

    ran = planner.judge(envelope("order-7", b'{"amount": 1}'), "handler_error")
    other = planner.judge(envelope("order-7", b'{"amount": 2}'), "handler_error")

    assert (ran.state, ran.step) == ("applied", Step.DROP)
    assert (other.state, other.step) == ("conflict", Step.LEAVE)
    assert "different payload" in other.note and other.token == ran.token > 0
    # a consumer run without conflict detection answers any payload of a done key as a duplicate
    blind = Planner(dedupe, header_key(), fingerprint=None).judge(envelope("order-7", b'{"amount": 2}'))
    assert (blind.state, blind.step) == ("applied", Step.DROP)


def test_an_outcome_stored_without_a_fingerprint_proves_nothing(dedupe: Deduplicator) -> None:
    dedupe.run("plain", lambda: "done")  # no fingerprint stored with it
    entry = Planner(dedupe, header_key()).judge(envelope("plain"), "handler_error")
    assert (entry.state, entry.step) == ("unproven", Step.LEAVE)
    assert "without a fingerprint" in entry.note


def test_a_failing_fingerprint_function_leaves_the_message(dedupe: Deduplicator) -> None:
    apply_before(dedupe, "k", b'{"id": 1}')

    def broken(_envelope: Envelope) -> str:
        raise ValueError("no fingerprint today")

    entry = Planner(dedupe, header_key(), fingerprint=broken).judge(envelope("k"))
    assert (entry.state, entry.step) == ("unproven", Step.LEAVE) and "no fingerprint today" in entry.note


@pytest.mark.parametrize("reason", ["conflict", "undecodable"])
def test_conflict_and_undecodable_stay_unless_filter_names_them(reason: str, dedupe: Deduplicator) -> None:
    apply_before(dedupe, "done", b'{"id": 1}')
    default = Planner(dedupe, header_key())
    for key in ("done", "free"):
        held = default.judge(envelope(key), reason)
        assert (held.key, held.state, held.step, held.reason) == (key, "filtered", Step.LEAVE, reason)
        assert f"dead-lettered as {reason}" in held.note and f"--filter {reason}" in held.note
    named = Planner(dedupe, header_key(), reasons={reason})
    assert named.judge(envelope("free"), reason).step is Step.REPLAY
    assert named.judge(envelope("done"), reason).step is Step.DROP  # this very payload's outcome is stored
    assert named.judge(envelope("done", b'{"id": 2}'), reason).step is Step.LEAVE


def test_a_key_whose_lease_ran_out_is_replayed(redis_client: redis.Redis, namespace: str) -> None:
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=0.2)
    try:
        assert dedupe.begin("abandoned").acquired
        planner = Planner(dedupe, header_key())
        assert planner.judge(envelope("abandoned")).state == "in_progress"
        time.sleep(0.3)
        assert planner.judge(envelope("abandoned")).step is Step.REPLAY
    finally:
        dedupe.close()


def test_no_key_mismatch_and_filter_leave_the_message(dedupe: Deduplicator) -> None:
    planner = Planner(dedupe, field_key("order.id"), reasons={"handler_error"})
    no_key = planner.judge(Envelope(body=b"not json"), "handler_error")
    assert (no_key.key, no_key.state, no_key.step) == (None, "no_key", Step.LEAVE)
    assert "UndecodableMessage" in no_key.note
    body = b'{"order": {"id": "o-1"}}'
    assert planner.judge(Envelope(body=body), "handler_error").state == "free"
    filtered = planner.judge(Envelope(body=body), "conflict")
    assert (filtered.key, filtered.state, filtered.step) == ("o-1", "filtered", Step.LEAVE)
    mismatch = planner.judge(Envelope(body=body, headers={"x-dedupe-key": "o-2"}), "handler_error")
    assert (mismatch.state, mismatch.step) == ("key_mismatch", Step.LEAVE)


def test_redis_down_leaves_the_message_and_counts_it_failed(private_redis: RedisServer) -> None:
    dedupe = Deduplicator(redis.Redis.from_url(private_redis.url, socket_timeout=0.5), namespace="t")
    try:
        private_redis.stop()
        entry = Planner(dedupe, header_key()).judge(envelope("k"))
        assert (entry.state, entry.step, entry.unavailable) == ("unavailable", Step.LEAVE, True)
        summary = Summary()
        assert summary.record(entry) == "failed"
        with pytest.raises(StoreUnavailable):
            dedupe.status("k")
    finally:
        dedupe.close()


def test_a_batch_is_judged_in_one_round_trip_and_a_failed_call_leaves_only_its_message(
        dedupe: Deduplicator, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    apply_before(dedupe, "applied", b'{"id": 1}')
    apply_before(dedupe, "other", b'{"id": 9}')
    redis_client.sadd(KeyLayout.result(dedupe.request("broken").stem), "x")  # another type, in either format
    planner = Planner(dedupe, header_key())
    sent: list[int] = []  # commands per round trip, on the held connection or a pipeline
    real_pipeline = redis_client.pipeline

    def counting_pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute
        pipe.execute = lambda *a, **k: sent.append(len(pipe.command_stack)) or real_execute(*a, **k)
        return pipe

    monkeypatch.setattr(redis_client, "pipeline", counting_pipeline)
    held = dedupe.store.scripts.held
    if held is not None:
        real_many = type(held).execute_many
        monkeypatch.setattr(type(held), "execute_many",
                            lambda self, commands: sent.append(len(commands)) or real_many(self, commands))

    entries = planner.judge_many([(envelope(k, b'{"id": 1}'), "handler_error")
                                  for k in ("applied", "broken", "other", "new")]
                                 + [(envelope(None), "handler_error")])

    assert sent == [4]  # one round trip: inspect (with the stored fingerprint) for each of the four keys
    assert [(e.key, e.state, e.step) for e in entries] == [
        ("applied", "applied", Step.DROP), ("broken", "unavailable", Step.LEAVE),
        ("other", "conflict", Step.LEAVE), ("new", "free", Step.REPLAY), (None, "no_key", Step.LEAVE)]
    assert "holds a set, not a hash" in entries[1].note  # what inspect.lua found there, for this key alone


def test_redis_down_leaves_every_message_of_the_batch(private_redis: RedisServer) -> None:
    dedupe = Deduplicator(redis.Redis.from_url(private_redis.url, socket_timeout=0.5), namespace="t")
    try:
        assert Planner(dedupe, header_key()).judge(envelope("warm")).step is Step.REPLAY
        private_redis.stop()
        entries = Planner(dedupe, header_key()).judge_many([(envelope(k), "") for k in ("a", "b", "c")])
        assert [(e.key, e.state, e.step) for e in entries] == [(k, "unavailable", Step.LEAVE) for k in "abc"]
    finally:
        dedupe.close()


def test_a_batch_read_after_the_scripts_were_flushed_loads_them(private_redis: RedisServer) -> None:
    client = redis.Redis.from_url(private_redis.url)
    dedupe = Deduplicator(client, namespace="t")
    try:
        apply_before(dedupe, "applied", b'{"id": 1}')
        client.script_flush()  # a restart or failover: every script gone (a private server)
        entries = Planner(dedupe, header_key()).judge_many([(envelope(k), "") for k in ("applied", "new")])
        assert [(e.state, e.step) for e in entries] == [("applied", Step.DROP), ("free", Step.REPLAY)]
    finally:
        dedupe.close()


def test_default_strategies_match_the_consumers(dedupe: Deduplicator) -> None:
    """No idempotency-key header: RabbitMQ falls back to message_id, Kafka to record key + hash."""
    apply_before(dedupe, "message-id:m1", b"x")
    assert Planner(dedupe, RABBITMQ_DEFAULT).judge(Envelope(body=b"x", message_id="m1")).state == "applied"
    kafka_key = KAFKA_DEFAULT(Envelope(body=b"x", partition_key=b"order-1"))
    apply_before(dedupe, kafka_key, b"x")
    assert Planner(dedupe, KAFKA_DEFAULT).judge(Envelope(body=b"x", partition_key=b"order-1")).state == "applied"


class FakeRecord:
    """Just enough of a confluent-kafka Message for :func:`lookup_envelope` (no broker involved)."""

    def __init__(self, headers: list[tuple[str, bytes]]) -> None:
        self._headers = headers

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers

    def value(self) -> bytes:
        return b"v"

    def key(self) -> bytes:
        return b"k"

    def topic(self) -> str:
        return "payments.dlq"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 42


def test_kafka_lookup_uses_the_original_position_for_position_keys() -> None:
    record = FakeRecord([("x-dedupe-original-topic", b"payments"), ("x-dedupe-original-partition", b"3"),
                         ("x-dedupe-original-offset", b"17")])
    assert position_key()(lookup_envelope(record)) == "payments/3/17"
    assert position_key()(lookup_envelope(FakeRecord([]))) == "payments.dlq/0/42"


def test_replay_headers_drop_attempts_and_count_replays() -> None:
    first = replay_headers([("tenant", b"a"), ("x-dedupe-attempts", b"5"), ("dup", b"1"), ("dup", b"2")])
    assert first == [("tenant", b"a"), ("dup", b"1"), ("dup", b"2"), (REPLAYED, "1")]
    assert replay_headers([(REPLAYED, b"2"), ("X-Dedupe-Attempts", "3")]) == [(REPLAYED, "3")]
    assert replay_headers([(REPLAYED, "junk")]) == [(REPLAYED, "1")]


def test_pacer_spaces_calls_with_an_injected_clock() -> None:
    now = [100.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    pacer = Pacer(4.0, clock=lambda: now[0], sleep=sleep)
    for _ in range(3):
        pacer.wait()
    assert slept == [0.25, 0.25]
    now[0] += 10
    pacer.wait()
    assert slept == [0.25, 0.25]
    Pacer(None, sleep=sleep).wait()
    with pytest.raises(ValueError):
        Pacer(0)


def test_summary_counts_each_message_once_and_prints() -> None:
    seen: list[str] = []
    summary = Summary.start(ReplayOptions(keep_entries=True, on_entry=lambda e, tally: seen.append(tally)))
    summary.record(Entry("a", "free", Step.REPLAY))
    summary.record(Entry("b", "free", Step.REPLAY), ok=False)
    summary.record(Entry("c", "applied", Step.DROP, "handler_error"))
    summary.record(Entry(None, "no_key", Step.LEAVE, note="no header"))
    assert seen == ["replayed", "failed", "already_applied", "left_in_place"]
    data = summary.as_dict()
    assert {k: data[k] for k in ("examined", "replayed", "already_applied", "left_in_place", "failed")} == {
        "examined": 4, "replayed": 1, "already_applied": 1, "left_in_place": 1, "failed": 1}
    assert data["plan"][2] == {"key": "c", "state": "applied", "action": "drop", "reason": "handler_error",
                               "note": "", "token": 0}
    json.dumps(data)
    table = format_table(summary.entries).splitlines()
    assert table[0].split() == ["KEY", "STATE", "ACTION", "REASON", "NOTE"]
    assert table[4].split()[:3] == ["-", "no_key", "leave"]
    assert "replayed 1, already applied 1, left in place 1, failed 1 (of 4 examined)" in summary.line()


def test_progress_draws_live_counts() -> None:
    stream = io.StringIO()
    progress = Progress(stream, width=10)
    progress.start(4)
    progress.entry(Entry("a", "free", Step.REPLAY), "replayed")
    progress.entry(Entry("b", "applied", Step.DROP), "already_applied")
    progress.close()
    last = stream.getvalue().rstrip("\n").split("\r")[-1]
    assert last == "[#####.....] 2/4 replayed=1 applied=1 left=0 failed=0"


def test_rabbitmq_destinations_and_reasons() -> None:
    assert Destination.parse("orders-exchange/orders.created") == Destination("orders-exchange", "orders.created")
    assert Destination.parse("/orders") == Destination("", "orders") == Destination.parse("orders")
    ours = {"x-dedupe-original-queue": "orders", "x-dedupe-reason": "conflict"}
    theirs = {"x-death": [{"queue": b"orders.src", "reason": "expired", "count": 1}]}
    assert original_destination(ours) == Destination("", "orders")
    assert original_destination(theirs) == Destination("", "orders.src")
    assert original_destination({}) is None
    assert (dead_letter_reason(ours), dead_letter_reason(theirs), dead_letter_reason({})) == (
        "conflict", "expired", "")


def test_rate_parsing() -> None:
    assert parse_rate("50") == 50.0 and parse_rate("50/s") == 50.0 and parse_rate("120/min") == 2.0
    for bad in ("0", "-1/s", "fast", "5/h"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rate(bad)


def test_exports() -> None:
    assert sorted(exported) == sorted([
        "REPLAYED", "Destination", "Entry", "Found", "Pacer", "Planner", "Progress", "ReplayOptions", "Step",
        "Summary", "format_table", "replay_headers", "replay_kafka", "replay_rabbitmq"])


def test_key_only_trusts_an_outcome_without_a_fingerprint_and_compares_the_others(dedupe: Deduplicator) -> None:
    dedupe.run("plain", lambda: "done")  # no fingerprint stored with it
    apply_before(dedupe, "order-8", b'{"amount": 1}')
    planner = Planner(dedupe, header_key(), key_only=True)

    plain = planner.judge(envelope("plain"), "handler_error")
    other = planner.judge(envelope("order-8", b'{"amount": 2}'), "handler_error")

    assert (plain.state, plain.step) == ("applied", Step.DROP) and "--key-only" in plain.note
    assert (other.state, other.step) == ("conflict", Step.LEAVE)  # a stored fingerprint is still compared

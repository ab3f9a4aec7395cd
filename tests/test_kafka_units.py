"""Pieces of the Kafka integration that need no broker: partition planning, CLI options, exports,
and the batch-handler hook of ``decide_many`` (against real Redis)."""

from __future__ import annotations

import argparse

import pytest
import redis

import dedupe_worker.kafka
from dedupe_worker import Decision, Deduplicator, Reason, decide_many
from dedupe_worker.cli import _kafka as kafka_cli
from dedupe_worker.kafka._deadletter import DeadLetter, producer_config
from dedupe_worker.kafka._positions import DONE, Hold, PartitionState, plan_partition


def test_exports() -> None:
    assert sorted(dedupe_worker.kafka.__all__) == [
        "ConsumerHooks", "DeadLetter", "DeadLetterProducer", "DedupeKafkaConsumer"]


def test_commit_stops_at_the_first_undecided_message() -> None:
    state = PartitionState()
    letter = DeadLetter(None, Decision(Reason.CONFLICT))
    plan = plan_partition(state, [(10, DONE), (11, DONE), (12, Hold(1.0)), (13, DONE),
                                  (14, Hold(2.0, letter)), (15, Hold(0.5))])
    assert plan.commit == 12
    assert plan.rewind == (12, Hold(1.0))
    assert state.decided_behind == {13: None, 14: letter}  # 15 is simply read and decided again
    assert state.holds == 1


def test_redelivered_settled_messages_move_the_commit_and_are_forgotten() -> None:
    state = PartitionState(decided_behind={13: None}, attempts={12: 2, 20: 1}, holds=3)
    plan = plan_partition(state, [(12, DONE), (13, DONE), (14, DONE)])
    assert plan == type(plan)(15, None)
    assert state.decided_behind == {} and state.attempts == {20: 1} and state.holds == 0


def test_nothing_decided_commits_nothing() -> None:
    state = PartitionState()
    plan = plan_partition(state, [(3, Hold(1.0)), (4, Hold(1.0))])
    assert plan.commit is None and plan.rewind == (3, Hold(1.0)) and state.decided_behind == {}


def test_producer_config_keeps_connection_settings_only() -> None:
    config = producer_config({"bootstrap.servers": "b:9092", "group.id": "g", "sasl.username": "u",
                              "session.timeout.ms": 2000}, {"linger.ms": 50}, timeout=7)
    assert config == {"bootstrap.servers": "b:9092", "sasl.username": "u", "acks": "all",
                      "linger.ms": 50, "message.timeout.ms": 7000}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kafka_cli.register(parser.add_subparsers())
    return parser.parse_args(["kafka", *argv])


def test_cli_options() -> None:
    args = parse("--bootstrap", "h:1", "--topic", "payments", "--topic", "refunds", "--group", "billing",
                 "-X", "session.timeout.ms=2000", "--batch-size", "50", "--key-header", "x-id", "mod:fn")
    assert args.topic == ["payments", "refunds"] and args.batch_size == 50 and args.handler == "mod:fn"
    assert kafka_cli.consumer_config(args) == {"bootstrap.servers": "h:1", "group.id": "billing",
                                               "session.timeout.ms": "2000"}
    with pytest.raises(SystemExit):
        kafka_cli.consumer_config(parse("--bootstrap", "h", "--topic", "t", "--group", "g",
                                        "-X", "oops", "m:f"))


# -- decide_many(run_batch=...), the core hook behind the batch handler (real Redis) ---------------


def test_run_batch_gets_only_the_acquired_items(dedupe: Deduplicator) -> None:
    decide_many(dedupe, [("a", "fa", lambda: "old-a")])
    seen: list[list[int]] = []

    def run_batch(indices: list[int]) -> list[str]:
        seen.append(indices)
        return [f"new-{i}" for i in indices]

    items = [("a", "fa", _never), ("b", "fb", _never), ("b", "fb", _never), ("c", "fc", _never)]
    decisions = decide_many(dedupe, items, run_batch=run_batch)
    assert seen == [[1, 3]]
    assert [d.reason for d in decisions] == [Reason.DUPLICATE, Reason.APPLIED, Reason.DUPLICATE, Reason.APPLIED]
    assert [d.value for d in decisions] == ["old-a", "new-1", "new-1", "new-3"]
    assert dedupe.status("c").value == b'"new-3"'


@pytest.mark.parametrize("outcome", ["raises", "wrong length"])
def test_run_batch_failure_fails_every_item_and_releases(dedupe: Deduplicator, outcome: str) -> None:
    def run_batch(indices: list[int]) -> list[str]:
        if outcome == "raises":
            raise ConnectionError("db away")
        return ["only one"]

    decisions = decide_many(dedupe, [("x", None, _never), ("y", None, _never)], run_batch=run_batch)
    assert [d.reason for d in decisions] == [Reason.HANDLER_ERROR] * 2
    assert all(isinstance(d.error, ConnectionError if outcome == "raises" else ValueError) for d in decisions)
    again = decide_many(dedupe, [("x", None, _never), ("y", None, _never)], run_batch=lambda i: [1, 2])
    assert [d.reason for d in again] == [Reason.APPLIED] * 2  # the claims were released


def test_run_batch_permanent_error_is_stored(redis_client: redis.Redis, namespace: str) -> None:
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=5.0, permanent_errors=(KeyError,))
    try:
        def run_batch(indices: list[int]) -> list[str]:
            raise KeyError("no such account")

        first = decide_many(dedupe, [("p", None, _never)], run_batch=run_batch)
        assert first[0].reason is Reason.PERMANENT_FAILURE
        assert decide_many(dedupe, [("p", None, _never)], run_batch=run_batch)[0].reason is Reason.PREVIOUSLY_FAILED
    finally:
        dedupe.close()


def _never() -> None:
    raise AssertionError("per-item handlers are not called when run_batch is given")

"""Pieces of the Kafka integration that need no broker: partition planning, CLI options, exports."""

from __future__ import annotations

import argparse

import pytest

import dedupe_worker.kafka
from dedupe_worker.cli import kafka as kafka_cli
from dedupe_worker.handling import Decision, Reason
from dedupe_worker.kafka.deadletter import DeadLetter, producer_config
from dedupe_worker.kafka.positions import DONE, Hold, PartitionState, plan_partition


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
    assert state.settled == {13: None, 14: letter}  # 15 is simply read and decided again
    assert state.holds == 1


def test_redelivered_settled_messages_move_the_commit_and_are_forgotten() -> None:
    state = PartitionState(settled={13: None}, attempts={12: 2, 20: 1}, holds=3)
    plan = plan_partition(state, [(12, DONE), (13, DONE), (14, DONE)])
    assert plan == type(plan)(15, None)
    assert state.settled == {} and state.attempts == {20: 1} and state.holds == 0


def test_nothing_decided_commits_nothing() -> None:
    state = PartitionState()
    plan = plan_partition(state, [(3, Hold(1.0)), (4, Hold(1.0))])
    assert plan.commit is None and plan.rewind == (3, Hold(1.0)) and state.settled == {}


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

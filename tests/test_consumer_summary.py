"""A running consumer logs what it did at INFO every ``summary_interval`` seconds and once at
shutdown (applied, duplicates, deferred, retried, dead-lettered), and the long-running commands
(``rabbitmq``, ``kafka``, ``replay``) show INFO without ``-v``, as ``celery worker`` does. Real
RabbitMQ, Kafka (tansu)."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kombu import Connection

from dedupe_worker import Deduplicator, Reason
from dedupe_worker._engine.dispatch import Done, Tally
from dedupe_worker.kafka import DedupeKafkaConsumer
from dedupe_worker.keys import header_key
from dedupe_worker.rabbitmq import DedupeConsumer

from .kafka_fixtures import Topics, kafka_topics, produce, running, wait_until
from .rabbitmq_fixtures import amqp, consumer_thread, drained, publish, queue_name, wait_for
from .test_cli_ux import env, script
from .test_replay_rabbitmq import dead_letter

__all__ = ["amqp", "kafka_topics", "queue_name"]

LOGGER = "dedupe_worker._engine.dispatch"


def summaries(caplog: pytest.LogCaptureFixture, name: str, state: str) -> list[dict[str, int]]:
    """The counts of each ``<name> <state>`` summary line logged at INFO so far."""
    out = []
    for record in caplog.records:
        message = record.getMessage()
        if record.levelno == logging.INFO and message.startswith(f"{name} {state} for "):
            out.append({k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", message)})
    return out


def test_the_tally_logs_every_interval_and_at_close(caplog: pytest.LogCaptureFixture) -> None:
    now = [50.0]
    tally = Tally("test consumer", interval=10.0, clock=lambda: now[0])
    now[0] = 100.0  # built early, started later: the clock runs from begin()
    tally.begin()
    caplog.set_level(logging.INFO, LOGGER)
    tally.count(Done.ACKED, Reason.APPLIED)
    tally.acked(2, 3)
    tally.count(Done.DEFERRED, Reason.IN_PROGRESS)
    tally.count(Done.RETRIED, Reason.HANDLER_ERROR)
    tally.count(Done.DEAD_LETTERED, Reason.CONFLICT)
    tally.count(Done.NOT_DONE, Reason.CONFLICT)  # a copy not confirmed: requeued, not counted
    now[0] = 109.9
    tally.tick()
    assert summaries(caplog, "test consumer", "running") == []
    now[0] = 110.0
    tally.tick()
    tally.tick()  # not again before another interval
    assert summaries(caplog, "test consumer", "running") == [
        {"applied": 3, "duplicates": 3, "deferred": 1, "retried": 1, "dead_lettered": 1}]
    assert "for 10s" in caplog.records[-1].getMessage()
    now[0] = 125.0
    tally.close()
    assert summaries(caplog, "test consumer", "stopped") == [
        {"applied": 3, "duplicates": 3, "deferred": 1, "retried": 1, "dead_lettered": 1}]


def test_the_rabbitmq_consumer_logs_a_summary_while_running_and_at_shutdown(
        amqp: Connection, queue_name: str, dedupe: Deduplicator, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    consumer = DedupeConsumer(amqp.clone(), [queue_name], lambda body, message: body, dedupe,
                              key_strategy=header_key("idempotency-key"), summary_interval=0.2)
    with consumer_thread(consumer):
        for key in ("a", "b", "a"):
            publish(amqp, queue_name, json.dumps({"id": key}), headers={"idempotency-key": key})
        publish(amqp, queue_name, "{}")  # no key: dead-lettered
        wait_for(lambda: any(s == {"applied": 2, "duplicates": 1, "deferred": 0, "retried": 0, "dead_lettered": 1}
                             for s in summaries(caplog, "rabbitmq consumer", "running")),
                 timeout=10, what="a summary line with the four messages")
    assert summaries(caplog, "rabbitmq consumer", "stopped") == [
        {"applied": 2, "duplicates": 1, "deferred": 0, "retried": 0, "dead_lettered": 1}]


def test_the_kafka_consumer_logs_a_summary_while_running_and_at_shutdown(
        kafka_bootstrap: str, kafka_topics: Topics, dedupe: Deduplicator, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    topic = kafka_topics.create(1, prefix="summary")
    consumer = DedupeKafkaConsumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic}-g",
                                    "session.timeout.ms": 6000, "heartbeat.interval.ms": 500},
                                   [topic], lambda msg: None, dedupe, key_strategy=header_key("idempotency-key"),
                                   poll_timeout=0.1, summary_interval=0.2)
    records = [(0, None, b"{}", [("idempotency-key", key.encode())]) for key in ("a", "b", "a")]
    produce(kafka_bootstrap, topic, [*records, (0, None, b"{}", [])])  # the last has no key: dead-lettered
    expected = {"applied": 2, "duplicates": 1, "deferred": 0, "retried": 0, "dead_lettered": 1}
    with running(consumer):
        wait_until(lambda: expected in summaries(caplog, "kafka consumer", "running"), timeout=60,
                   what="a summary line with the four messages")
    assert summaries(caplog, "kafka consumer", "stopped") == [expected]


# -- the commands, as a user runs them: INFO by default, like ``celery worker`` ---------------------

HANDLER = "def apply(*args):\n    return None\n"


def run_until(args: list[str], cwd: Path, done: Callable[[str], bool], timeout: float = 60) -> str:
    """Run the console script (no ``-v``) until ``done(stderr so far)``, then SIGTERM it; its stderr."""
    log = cwd / "stderr.log"
    with log.open("w") as err:
        proc = subprocess.Popen([script(), *args], cwd=cwd, env=env(), stdout=subprocess.DEVNULL, stderr=err,
                                text=True)
        try:
            deadline = time.monotonic() + timeout
            while not done(log.read_text()) and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    return log.read_text()


def summary_of(stderr: str, name: str, state: str) -> dict[str, int] | None:
    for line in stderr.splitlines():
        if f" INFO dedupe_worker._engine.dispatch: {name} {state} for " in line:
            return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
    return None


def test_the_rabbitmq_command_shows_its_summary_without_v(amqp: Connection, queue_name: str, tmp_path: Path,
                                                          redis_url: str, namespace: str) -> None:
    (tmp_path / "h.py").write_text(HANDLER)
    for key in ("a", "b", "a"):
        publish(amqp, queue_name, json.dumps({"id": key}), headers={"idempotency-key": key})
    err = run_until(["rabbitmq", "h:apply", "--url", amqp.as_uri(include_password=True), "--queue", queue_name,
                     "--key-header", "idempotency-key", "--redis-url", redis_url, "--namespace", namespace],
                    tmp_path, lambda text: "consuming" in text and drained(amqp, queue_name))
    assert f"INFO dedupe_worker.rabbitmq._consumer: consuming {queue_name}" in err
    assert summary_of(err, "rabbitmq consumer", "stopped") == {
        "applied": 2, "duplicates": 1, "deferred": 0, "retried": 0, "dead_lettered": 0}, err


def test_the_kafka_command_shows_its_summary_without_v(kafka_bootstrap: str, kafka_topics: Topics, tmp_path: Path,
                                                       redis_url: str, namespace: str) -> None:
    (tmp_path / "h.py").write_text(HANDLER)
    topic = kafka_topics.create(1, prefix="summarycli")
    produce(kafka_bootstrap, topic, [(0, None, b"{}", [("idempotency-key", key.encode())]) for key in "aba"])
    expected = {"applied": 2, "duplicates": 1, "deferred": 0, "retried": 0, "dead_lettered": 0}
    committed = [False]

    def consumed(text: str) -> bool:
        # the periodic line comes every 10 s; the three records are done once the group committed them
        if "assigned" in text and not committed[0]:
            committed[0] = group_offset(kafka_bootstrap, topic, f"{topic}-g") >= 3
        return committed[0]

    err = run_until(["kafka", "h:apply", "--bootstrap", kafka_bootstrap, "--topic", topic, "--group", f"{topic}-g",
                     "--key-header", "idempotency-key", "--redis-url", redis_url, "--namespace", namespace],
                    tmp_path, consumed, timeout=90)
    assert "INFO dedupe_worker.kafka._flow: assigned" in err
    assert summary_of(err, "kafka consumer", "stopped") == expected, err


def group_offset(bootstrap: str, topic: str, group: str) -> int:
    """The offset ``group`` committed on partition 0 of ``topic`` (-1 when none)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        [tp] = consumer.committed([TopicPartition(topic, 0)], timeout=10)
        return int(tp.offset)
    finally:
        consumer.close()


def test_the_replay_command_logs_each_message_without_v(amqp: Connection, queue_name: str, redis_url: str,
                                                        namespace: str) -> None:
    amqp.default_channel.queue_declare(queue=f"{queue_name}.dlq", durable=True, auto_delete=False)
    dead_letter(amqp, queue_name, 1)
    done = subprocess.run([script(), "replay", "rabbitmq", "--url", amqp.as_uri(include_password=True), "--from",
                           f"{queue_name}.dlq", "--redis-url", redis_url, "--namespace", namespace],
                          capture_output=True, text=True, env=env(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "INFO dedupe_worker.replay._rabbitmq: replay key=k1 token=0 republished to" in done.stderr

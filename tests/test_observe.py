"""Metrics and traces: every integration moves the same counters; the CLI consumers serve a
/metrics that parses; spans land in an in-memory exporter. Real Redis, RabbitMQ and Kafka."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dedupe_worker import Deduplicator, InProgress, KeyConflict, PreviouslyFailed
from dedupe_worker.observe import current
from dedupe_worker.observe._metrics import MetricsObserver

from . import services
from .kafka_fixtures import Topics, kafka_topics, produce, running, unique, wait_until
from .rabbitmq_fixtures import amqp, consumer_thread, publish, queue_name, wait_for

__all__ = ["amqp", "kafka_topics", "queue_name"]

ROOT = Path(__file__).resolve().parent.parent


class Permanent(Exception):
    pass


@pytest.fixture
def metrics() -> Iterator[tuple[MetricsObserver, CollectorRegistry]]:
    registry = CollectorRegistry()
    observer = MetricsObserver(registry)
    current.enable(observer)
    yield observer, registry
    current.disable(observer)


def count(registry: CollectorRegistry, integration: str, reason: str) -> float:
    return registry.get_sample_value("dedupe_decisions_total", {"integration": integration, "reason": reason}) or 0


def test_run_moves_a_counter_for_each_reason(metrics: Any, redis_client: Any, namespace: str) -> None:
    _, registry = metrics
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=5, permanent_errors=(Permanent,))
    dedupe.run("a", lambda: 1)
    dedupe.run("a", lambda: 1)
    dedupe.begin("held")
    with pytest.raises(InProgress):
        dedupe.run("held", lambda: 1)
    with pytest.raises(ValueError):
        dedupe.run("boom", lambda: (_ for _ in ()).throw(ValueError("x")))
    with pytest.raises(Permanent):
        dedupe.run("perm", lambda: (_ for _ in ()).throw(Permanent("x")))
    with pytest.raises(PreviouslyFailed):
        dedupe.run("perm", lambda: 1)
    dedupe.run("fp", lambda: 1, fingerprint="one")
    with pytest.raises(KeyConflict):
        dedupe.run("fp", lambda: 1, fingerprint="two")
    expected = {"applied": 2, "duplicate": 1, "in_progress": 1, "handler_error": 1, "permanent_failure": 1,
                "previously_failed": 1, "conflict": 1}
    assert {r: count(registry, "run", r) for r in expected} == expected
    assert registry.get_sample_value("dedupe_round_trip_seconds_count", {"op": "claim"}) == 8  # one per run()
    assert registry.get_sample_value("dedupe_handler_seconds_count", {"integration": "run"}) == 4
    dedupe.close()


def test_celery_rabbitmq_and_kafka_feed_the_same_counters(
        metrics: Any, redis_client: Any, namespace: str, amqp: Any, queue_name: str, kafka_bootstrap: str,
        kafka_topics: Topics) -> None:
    from celery import Celery

    from dedupe_worker.celery import IdempotentTask
    from dedupe_worker.kafka import DedupeKafkaConsumer
    from dedupe_worker.keys import field_key
    from dedupe_worker.rabbitmq import DedupeConsumer

    _, registry = metrics
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=5)
    app = Celery("observe", set_as_current=False)
    app.conf.task_always_eager = True

    @app.task(base=IdempotentTask, idempotency_key=lambda n: f"celery:{n}")
    def task(n: int) -> int:
        return n

    task.deduplicator = dedupe
    task.delay(1).get()
    task.delay(1).get()
    assert (count(registry, "celery", "applied"), count(registry, "celery", "duplicate")) == (1, 1)

    consumer = DedupeConsumer(amqp.clone(), [queue_name], lambda body, message: None, dedupe)
    with consumer_thread(consumer):
        for body in (b'{"id": 1}', b'{"id": 1}', b"not json"):
            publish(amqp, queue_name, body, headers={"idempotency-key": "r1"} if body != b"not json" else {})
        wait_for(lambda: sum(count(registry, "rabbitmq", r) for r in ("applied", "duplicate", "undecodable")) == 3,
                 what="the RabbitMQ verdicts counted")
    assert count(registry, "rabbitmq", "applied") == 1
    assert count(registry, "rabbitmq", "duplicate") == 1
    assert count(registry, "rabbitmq", "undecodable") == 1  # refused before the engine, counted all the same

    topic = kafka_topics.create(partitions=1)
    produce(kafka_bootstrap, topic, [(0, None, json.dumps({"id": i}).encode(), []) for i in ("k1", "k1")]
            + [(0, None, b"{}", [])])
    kafka = DedupeKafkaConsumer({"bootstrap.servers": kafka_bootstrap, "group.id": unique("g"),
                                 "session.timeout.ms": 2000, "heartbeat.interval.ms": 500}, [topic],
                                lambda m: None, dedupe, key_strategy=field_key("id"), poll_timeout=0.2)
    with running(kafka):
        wait_until(lambda: count(registry, "kafka", "invalid_key") == 1, 30, "the Kafka verdicts counted")
        wait_until(lambda: count(registry, "kafka", "duplicate") == 1, 10, "the copy counted")
    assert count(registry, "kafka", "applied") == 1
    dedupe.close()


def test_the_lease_gauge_and_lost_leases(metrics: Any, redis_client: Any, namespace: str) -> None:
    _, registry = metrics
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=0.3, renew_interval=0.05)
    stolen = []

    def slow() -> None:
        time.sleep(0.2)
        redis_client.hset(f"{namespace}:{{k}}:started", "owner", 1)  # someone else owns it now
        stolen.append(1)
        time.sleep(0.2)

    with pytest.raises(Exception):  # noqa: B017 - LeaseLost
        dedupe.run("k", slow)
    assert registry.get_sample_value("dedupe_leases_lost_total") >= 1
    assert registry.get_sample_value("dedupe_leases_held") is not None
    dedupe.close()


def test_spans_for_claim_handler_and_complete(redis_client: Any, namespace: str) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from dedupe_worker.observe._tracing import TracingObserver

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = current.enable(TracingObserver(provider))
    tracer = provider.get_tracer("test")
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=5)
    try:
        with tracer.start_as_current_span("consume") as parent:
            token = dedupe.run("x" * 300, lambda: tracer.start_span("inside").end() or "ok")
    finally:
        current.disable(observer)
        dedupe.close()
    assert token == "ok"
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"consume", "dedupe.claim", "dedupe.handler", "dedupe.complete", "inside"} <= set(spans)
    for name in ("dedupe.claim", "dedupe.handler", "dedupe.complete"):
        span = spans[name]
        assert span.parent is not None and span.parent.span_id == parent.get_span_context().span_id
        assert "sha256:" in span.attributes["dedupe.key"] and "xxx" not in span.attributes["dedupe.key"]
        assert span.attributes["dedupe.token"] > 0 and span.attributes["dedupe.outcome"] == "acquired"
    assert all(spans[n].attributes["dedupe.integration"] == "run" for n in ("dedupe.claim", "dedupe.handler",
                                                                           "dedupe.complete"))
    assert spans["inside"].parent.span_id == spans["dedupe.handler"].context.span_id


def test_the_rabbitmq_command_serves_metrics_that_parse(amqp: Any, queue_name: str, redis_url: str,
                                                       namespace: str) -> None:
    port = services.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dedupe_worker", "rabbitmq", "--url", amqp.as_uri(True),
                             "--queue", queue_name, "--redis-url", redis_url, "--namespace", namespace,
                             "--metrics-port", str(port), "tests.crash_handlers:rabbit_effect"],
                            cwd=ROOT, env={**os.environ, "TEST_REDIS_URL": redis_url,
                                           "TEST_EFFECTS": f"{namespace}:effects", "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        services.wait_for_port("127.0.0.1", port, 20)
        for _ in range(2):
            publish(amqp, queue_name, orjson.dumps({"id": "m1"}), headers={"idempotency-key": "m1"})

        def scrape() -> dict[tuple[str, str], float]:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return {(s.labels.get("integration", ""), s.labels.get("reason", "")): s.value
                    for family in text_string_to_metric_families(text) for s in family.samples
                    if s.name == "dedupe_decisions_total"}

        samples = wait_for(lambda: (s := scrape()) and s.get(("rabbitmq", "duplicate")) and s, what="scraped")
        assert samples[("rabbitmq", "applied")] == 1 and samples[("rabbitmq", "duplicate")] == 1
    finally:
        proc.terminate()
        proc.wait(15)


def test_without_the_extras_nothing_is_imported_and_enabling_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None\n"
        "sys.modules['opentelemetry'] = None\n"
        "import dedupe_worker, dedupe_worker.rabbitmq, dedupe_worker.kafka, dedupe_worker.celery\n"
        "from dedupe_worker import observe\n"
        "for enable in (observe.enable_metrics, observe.enable_tracing):\n"
        "    try:\n"
        "        enable()\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
        "print(sorted(m for m in sys.modules if 'prometheus' in m or 'opentelemetry' in m))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "pip install 'dedupe-worker[metrics]'" in out and "pip install 'dedupe-worker[otel]'" in out
    assert out.strip().endswith("['opentelemetry', 'prometheus_client']")  # only the blocked entries


def test_the_kafka_command_serves_metrics_that_parse(kafka_bootstrap: str, kafka_topics: Topics, redis_url: str,
                                                    namespace: str) -> None:
    topic = kafka_topics.create(partitions=1)
    produce(kafka_bootstrap, topic, [(0, None, b"k1", [("idempotency-key", b"k1")])] * 2)
    port = services.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dedupe_worker", "kafka", "tests.crash_handlers:kafka_effect",
                             "--bootstrap", kafka_bootstrap, "--topic", topic, "--group", unique("g"),
                             "--redis-url", redis_url, "--namespace", namespace, "--metrics-port", str(port),
                             "-X", "session.timeout.ms=2000", "-X", "heartbeat.interval.ms=500"],
                            cwd=ROOT, env={**os.environ, "TEST_REDIS_URL": redis_url,
                                           "TEST_EFFECTS": f"{namespace}:effects", "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        services.wait_for_port("127.0.0.1", port, 20)

        def decided() -> dict[str, float]:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return {s.labels["reason"]: s.value for family in text_string_to_metric_families(text)
                    for s in family.samples
                    if s.name == "dedupe_decisions_total" and s.labels["integration"] == "kafka"}

        samples = wait_for(lambda: (d := decided()).get("duplicate") and d, timeout=30, what="scraped")
        assert samples == {"applied": 1.0, "duplicate": 1.0}
    finally:
        proc.terminate()
        proc.wait(15)

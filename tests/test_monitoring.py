"""The Grafana dashboard and the Prometheus alert rules of docs/monitoring/ query only what the
exporter produces: a real run (``run()`` and a RabbitMQ consumer fed by ``publish_once``, real
Redis and RabbitMQ) with :class:`MetricsObserver` on a fresh registry is scraped as Prometheus
would (``generate_latest``), and every metric name and label value the PromQL names is checked
against it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kombu import Connection, Producer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dedupe_worker import Deduplicator, KeyConflict, Reason
from dedupe_worker.keys import header_key
from dedupe_worker.observe import current
from dedupe_worker.observe._metrics import HTTP_ANSWERS, MetricsObserver
from dedupe_worker.producers import publish_once
from dedupe_worker.rabbitmq import DedupeConsumer

from .rabbitmq_fixtures import amqp, consumer_thread, queue_name, wait_for

__all__ = ["amqp", "queue_name"]

DOCS = Path(__file__).resolve().parent.parent / "docs" / "monitoring"
DASHBOARD = DOCS / "grafana-dashboard.json"
ALERTS = DOCS / "alerts.yaml"
METRIC = re.compile(r"\b(dedupe_[a-z_]+)\b")
MATCHER = re.compile(r'\b(reason|answer)\s*=~?\s*"([^"]+)"')


def dashboard_exprs() -> list[str]:
    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for name, value in node.items():
                if name in ("expr", "definition") and isinstance(value, str):
                    yield value
                else:
                    yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    return list(walk(json.loads(DASHBOARD.read_text())))


def alert_exprs() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


@pytest.fixture
def scraped(amqp: Connection, queue_name: str, dedupe: Deduplicator) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it was exposed with, after a real run."""
    registry = CollectorRegistry()
    observer = MetricsObserver(registry)
    current.enable(observer)
    try:
        dedupe.run("applied", lambda: 1)
        dedupe.run("applied", lambda: 1)  # duplicate
        with pytest.raises(RuntimeError):
            dedupe.run("fails", _fail)  # handler_error
        dedupe.run("fp", lambda: 1, fingerprint="one")
        with pytest.raises(KeyConflict):
            dedupe.run("fp", lambda: 1, fingerprint="two")  # conflict
        producer = Producer(amqp.default_channel)
        for key in ("m1", "m2"):
            publish_once(producer, {"id": key}, key=key, deduplicator=dedupe, routing_key=queue_name,
                         header="idempotency-key")
        handled: list[Any] = []
        consumer = DedupeConsumer(amqp.clone(), [queue_name], lambda body, message: handled.append(body), dedupe,
                                  key_strategy=header_key("idempotency-key"))
        with consumer_thread(consumer):
            wait_for(lambda: len(handled) == 2, what="the consumer to apply both messages")
        publish_once(producer, {"id": "m1"}, key="m1", deduplicator=dedupe, routing_key=queue_name,
                     header="idempotency-key")  # done: skipped
        text = generate_latest(registry).decode()
    finally:
        current.disable(observer)
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(dict(sample.labels))
    return samples


def _fail() -> None:
    raise RuntimeError("boom")


def test_every_metric_queried_is_exported(scraped: dict[str, list[dict[str, str]]]) -> None:
    queried = {name for expr in dashboard_exprs() + alert_exprs() for name in METRIC.findall(expr)}
    assert queried, "no metric found in the dashboard or the alert rules"
    missing = sorted(queried - set(scraped))
    assert not missing, f"queried but not exported: {missing}; exported: {sorted(scraped)}"


def test_every_exported_metric_is_on_the_dashboard(scraped: dict[str, list[dict[str, str]]]) -> None:
    shown = {name for expr in dashboard_exprs() for name in METRIC.findall(expr)}
    families = {re.sub(r"_(bucket|sum|count|created)$", "", name) for name in scraped}
    families = {f for f in families if not f.endswith(("_created",))}
    unshown = sorted(f for f in families if not any(s == f or s.startswith(f + "_") for s in shown))
    assert not unshown, f"exported but on no panel: {unshown}"


def test_label_values_are_ones_the_library_uses(scraped: dict[str, list[dict[str, str]]]) -> None:
    reasons = {r.value for r in Reason}
    for expr in dashboard_exprs() + alert_exprs():
        for label, values in MATCHER.findall(expr):
            known = reasons if label == "reason" else set(HTTP_ANSWERS)
            assert set(values.split("|")) <= known, (expr, values)
    # the run produced what the panels show
    decided = {(s["integration"], s["reason"]) for s in scraped["dedupe_decisions_total"]}
    assert {("run", "applied"), ("run", "duplicate"), ("run", "handler_error"), ("run", "conflict"),
            ("rabbitmq", "applied")} <= decided
    assert {s["outcome"] for s in scraped["dedupe_sends_total"]} == {"published", "skipped_done"}
    assert {s["answer"] for s in scraped["dedupe_http_requests_total"]} == set(HTTP_ANSWERS)


def test_the_panels_and_rules_the_operator_needs() -> None:
    board = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in board["panels"] if p["type"] != "row"}
    assert {"Applied", "Duplicates", "Deferred", "Conflicts", "Lease lost", "Dead-lettered", "Store errors",
            "Handler latency", "Round-trip latency", "HTTP decisions"} <= titles
    http = " ".join(e for e in dashboard_exprs() if "dedupe_http_requests_total" in e)
    for answer in ("replayed", "conflict", "mismatch", "missing_key", "too_large"):  # replayed, 409, 422, 400, 413
        assert f'answer="{answer}"' in http
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    assert all({"alert", "expr", "labels", "annotations"} <= set(rule) for rule in rules)
    assert len({rule["alert"] for rule in rules}) == len(rules)


def test_http_answers_are_counted_through_the_fan_out() -> None:
    """``Observer.http_answered`` reaches the counter the HTTP panels read (the HTTP layer calls it)."""
    registry = CollectorRegistry()
    observer = MetricsObserver(registry)
    current.enable(observer)
    try:
        for answer in ("replayed", "replayed", "conflict", "too_large"):
            current.http_answered(answer)
    finally:
        current.disable(observer)
    value = {a: registry.get_sample_value("dedupe_http_requests_total", {"answer": a}) for a in HTTP_ANSWERS}
    assert value == {**dict.fromkeys(HTTP_ANSWERS, 0.0), "replayed": 2.0, "conflict": 1.0, "too_large": 1.0}

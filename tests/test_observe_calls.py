"""Observers change nothing but what they report: a batch (and a single message, sync and asyncio)
makes the same Redis calls with metrics and tracing on as with them off (recorded with MONITOR on
a private redis-server)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from prometheus_client import CollectorRegistry

from dedupe_worker import Deduplicator, Reason, decide, decide_many
from dedupe_worker._engine import Pacing
from dedupe_worker._engine.batch import STREAM_STEP
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.asyncio import decide as adecide
from dedupe_worker.observe import current
from dedupe_worker.observe._metrics import MetricsObserver
from dedupe_worker.observe._tracing import TracingObserver

from . import services


class Permanent(Exception):
    pass


class Monitor:
    """The commands a redis-server receives, read from MONITOR in a thread until :meth:`stop`."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.commands: list[list[str]] = []
        self.mark = f"end-{uuid.uuid4().hex}"
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.read, daemon=True)

    def read(self) -> None:
        with self.client.monitor() as monitor:
            self.ready.set()
            for event in monitor.listen():
                command = event["command"]
                if self.mark in command:
                    return
                self.commands.append(command.split())

    def __enter__(self) -> Monitor:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.echo(self.mark)
        self.thread.join(10)
        assert not self.thread.is_alive()


#: The commands that run one of our scripts: EVALSHA, or FCALL of the function library (Redis 7+).
SCRIPT_CALLS = {"EVALSHA", "EVALSHA_RO", "EVAL", "FCALL", "FCALL_RO"}


def scripts(commands: list[list[str]]) -> list[tuple[str, ...]]:
    """Each command as its name, and for a script call its SHA or function name and number of keys
    (the keys and arguments differ from run to run: namespaces, tokens, times)."""
    out = []
    for command in commands:
        name = command[0].strip('"').upper()
        if name in SCRIPT_CALLS:
            out.append((name, command[1].strip('"'), command[2].strip('"')))
        else:
            out.append((name,))
    return out


class FixedSteps(Pacing):
    """A streamed chunk is claimed in calls of STREAM_STEP, however long its handlers take."""

    def step(self, claims: int) -> int:
        return STREAM_STEP


def batch(dedupe: Deduplicator) -> list[Reason]:
    """One batch of 120: new keys, keys applied before, a key repeated inside, a handler error, a
    permanent failure, a conflict."""
    def fail(exc: Exception) -> Callable[[], Any]:
        def handler() -> Any:
            raise exc
        return handler

    items: list[tuple[str, Any, Callable[[], Any]]] = [(f"k{i}", None, lambda i=i: i) for i in range(100)]
    items += [(f"old{i}", None, lambda: "again") for i in range(10)]
    items += [("k3", None, lambda: "copy"), ("boom", None, fail(ValueError("x"))),
              ("doomed", None, fail(Permanent("y"))), ("taken", "other", lambda: 1)]
    items += [(f"late{i}", None, lambda: None) for i in range(6)]
    # flush_after of a second and calls of STREAM_STEP: chunks and their calls are sized the same
    # whatever the handlers take (the pacing would otherwise size them from timings, which
    # observers change)
    reasons = [d.reason for d in decide_many(dedupe, items, pacing=FixedSteps(1.0))]
    # and the single-message engine: applied, duplicate, handler error
    return reasons + [decide(dedupe, key, handler).reason
                      for key, handler in (("one", lambda: 1), ("one", lambda: 2), ("two", fail(KeyError("z"))))]


async def singles(url: str, namespace: str) -> list[Reason]:
    """The asyncio engine: applied, duplicate, handler error."""
    client = redis.asyncio.Redis.from_url(url)
    dedupe = AsyncDeduplicator(client, namespace=namespace, lease=30, result_ttl=60, renew_interval=60)

    async def value() -> int:
        return 1

    async def fail() -> int:
        raise KeyError("z")

    try:
        return [(await adecide(dedupe, key, handler)).reason
                for key, handler in (("async", value), ("async", value), ("async-fail", fail))]
    finally:
        await dedupe.aclose()
        await client.aclose()


def run_monitored(server: services.RedisServer) -> tuple[list[Reason], list[tuple[str, ...]]]:
    client = redis.Redis.from_url(server.url)
    # renewals every 60 s: none lands inside the recording
    namespace = f"n{uuid.uuid4().hex[:8]}"
    dedupe = Deduplicator(client, namespace=namespace, lease=30, result_ttl=60,
                          renew_interval=60, permanent_errors=(Permanent,))
    try:
        decide_many(dedupe, [(f"old{i}", None, lambda: "first") for i in range(10)] + [("taken", "mine", lambda: 1)])
        with Monitor(server.url) as monitor:
            reasons = batch(dedupe)
            reasons += asyncio.run(singles(server.url, namespace))
        return reasons, scripts(monitor.commands)
    finally:
        dedupe.close()
        client.close()


@pytest.fixture
def observers() -> Iterator[None]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    enabled = [current.enable(MetricsObserver(CollectorRegistry())), current.enable(TracingObserver(provider))]
    yield
    for observer in enabled:
        current.disable(observer)
    assert {"dedupe.flush", "dedupe.handler", "dedupe.claim", "dedupe.complete"} <= {
        span.name for span in exporter.get_finished_spans()}


def test_a_batch_makes_the_same_redis_calls_with_observers_on_and_off(
        private_redis: services.RedisServer, request: pytest.FixtureRequest) -> None:
    assert not current.enabled
    reasons_off, calls_off = run_monitored(private_redis)
    request.getfixturevalue("observers")
    assert current.enabled
    reasons_on, calls_on = run_monitored(private_redis)
    assert reasons_on == reasons_off
    assert reasons_off.count(Reason.APPLIED) == 108 and reasons_off.count(Reason.DUPLICATE) == 13
    assert {Reason.HANDLER_ERROR, Reason.PERMANENT_FAILURE, Reason.CONFLICT} <= set(reasons_off)
    assert calls_on == calls_off
    # the batch was claimed by several script calls in one write (streamed), not one call per round trip
    assert sum(1 for call in calls_off if call[0] in SCRIPT_CALLS) >= 4

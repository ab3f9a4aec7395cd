"""The same scenarios through every integration give the same order of broker step and hooks.

Each integration runs on its real broker (Celery's task body on a RabbitMQ-backed app, Dramatiq's
worker on RabbitMQ, FastStream on RabbitMQ, the RabbitMQ consumer, the Kafka consumer on tansu)
with one Redis namespace. The trace records, per key, the broker step as it returns (what it did:
``acked``, ``deferred``, ``retried``, ``dead_lettered``, ``handed_over``) and each hook as it is
called. A hook must come after the step it reports, in the same order everywhere; the only
difference allowed is where the framework owns handler retries (Dramatiq's ``Retries``,
FastStream's ``ack_policy``): the error is handed over and no hook reports it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import pytest
import redis
from celery import Celery
from kombu import Connection

from dedupe_worker import Decision, Deduplicator, Envelope, current_claim
from dedupe_worker._engine.dispatch import Acted, Done
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.celery import IdempotentTask
from dedupe_worker.celery import _task as celery_task
from dedupe_worker.dramatiq import DedupeMiddleware
from dedupe_worker.dramatiq import _middleware as dramatiq_middleware
from dedupe_worker.faststream import DedupeMiddleware as FastStreamMiddleware
from dedupe_worker.faststream import _middleware as faststream_middleware
from dedupe_worker.kafka import DeadLetterProducer, DedupeKafkaConsumer
from dedupe_worker.keys import header_key
from dedupe_worker.rabbitmq import DedupeConsumer
from dedupe_worker.rabbitmq import _actions as rabbitmq_actions

from .dramatiq_app import pika_url
from .kafka_fixtures import Topics, kafka_topics, produce, running
from .rabbitmq_fixtures import amqp, consumer_thread, publish, queue_name

__all__ = ["amqp", "kafka_topics", "queue_name"]


class Permanent(Exception):
    """Configured as permanent: stored as the key's outcome, dead-lettered."""


#: scenario -> (payload mode, what is set up in Redis first, expected trace)
SCENARIOS: dict[str, tuple[str, str, list[str]]] = {
    "applied": ("ok", "", ["acked", "on_applied"]),
    "duplicate": ("ok", "stored", ["acked", "on_duplicate"]),
    "conflict": ("ok", "stored-other", ["dead_lettered", "on_dead_letter"]),
    "permanent_failure": ("permanent", "", ["dead_lettered", "on_dead_letter"]),
    "handler_error": ("fail", "", ["retried", "on_deferred"]),
    "in_progress": ("ok", "held", ["deferred", "on_deferred"]),
    "lease_lost": ("steal", "", ["deferred", "on_lease_lost", "on_deferred"]),
}
#: Where the framework retries handler errors itself.
HANDED_OVER = ["handed_over"]
HOOKS = ("on_applied", "on_duplicate", "on_deferred", "on_lease_lost", "on_dead_letter")


class Trace:
    """``(key, event)`` in the order they happened, from any thread."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def add(self, key: str, event: str) -> None:
        with self.lock:
            self.events.append((key, event))

    def of(self, key: str) -> list[str]:
        with self.lock:
            return [event for k, event in self.events if k == key]


class World:
    """One integration's run: its keys (fresh per run), the Redis set-up, the trace."""

    def __init__(self, dedupe: Deduplicator, namespace: str) -> None:
        self.dedupe = dedupe
        self.namespace = namespace
        self.run = uuid.uuid4().hex[:8]
        self.trace = Trace()
        self.held: list[Any] = []  # claims taken by "other workers", completed at the end

    def key(self, scenario: str) -> str:
        return f"{scenario}-{self.run}"

    def payload(self, scenario: str) -> dict[str, Any]:
        return {"key": self.key(scenario), "fp": f"fp-{scenario}", "mode": SCENARIOS[scenario][0]}

    def prepare(self, scenario: str) -> None:
        setup, key = SCENARIOS[scenario][1], self.key(scenario)
        if setup == "stored":
            assert self.dedupe.run(key, lambda: 1, fingerprint=f"fp-{scenario}") == 1
        elif setup == "stored-other":
            assert self.dedupe.run(key, lambda: 1, fingerprint="another payload") == 1
        elif setup == "held":
            claim = self.dedupe.begin(key, fingerprint=f"fp-{scenario}")
            assert claim.acquired
            self.held.append(claim)

    def handle(self, payload: dict[str, Any]) -> int:
        """The handler every integration runs."""
        mode = payload["mode"]
        if mode == "fail":
            raise ValueError("boom")
        if mode == "permanent":
            raise Permanent("doomed")
        if mode == "steal":  # another worker takes the key over while this one runs
            mine = current_claim()
            assert mine is not None
            if self.dedupe.release(mine):
                theirs = self.dedupe.begin(mine.key, fingerprint=mine.fingerprint)
                assert theirs.acquired
                self.held.append(theirs)
        return 1

    def hook(self, name: str, decision: Decision) -> None:
        assert decision.claim is not None
        self.trace.add(decision.claim.key, name)

    def step(self, key: str | None, acted: Acted) -> None:
        assert key is not None
        self.trace.add(key, acted.done.value)

    def scenarios(self, send: Callable[[dict[str, Any]], None], owned_retries: bool = True,
                  timeout: float = 20.0) -> dict[str, list[str]]:
        """Send each scenario's message in turn and take its first steps and hooks."""
        traces = {}
        for scenario, (_, _, expected) in SCENARIOS.items():
            if scenario == "handler_error" and not owned_retries:
                expected = HANDED_OVER
            self.prepare(scenario)
            send(self.payload(scenario))
            key = self.key(scenario)
            deadline = time.monotonic() + timeout
            while len(self.trace.of(key)) < len(expected) and time.monotonic() < deadline:
                time.sleep(0.02)
            traces[scenario] = self.trace.of(key)[:len(expected)]
            if scenario in ("in_progress", "lease_lost"):  # let the other worker finish: the copy is a duplicate
                self.finish()
        return traces

    def finish(self) -> None:
        for claim in self.held:
            self.dedupe.complete(claim, "theirs")
        self.held.clear()


def hooks_of(world: World) -> dict[str, Any]:
    """The five hooks, each adding itself to ``world``'s trace (as class attributes)."""
    def make(name: str) -> Callable[..., None]:
        def hook(self: Any, message: Any, decision: Decision, *delay: float) -> None:
            world.hook(name, decision)
        return hook
    return {name: make(name) for name in HOOKS}


def record_steps(monkeypatch: pytest.MonkeyPatch, port: type, world: World, key_of: Callable[[Any], str | None],
                 coroutines: bool = False) -> None:
    """Wrap the port's four steps so that what each did goes into the trace as it returns."""
    for name in ("ack", "defer", "retry", "dead_letter"):
        original = getattr(port, name)
        if coroutines:
            async def astep(self: Any, message: Any, decision: Decision, _original: Any = original) -> Acted:
                acted: Acted = await _original(self, message, decision)
                world.step(key_of(self), acted)
                return acted
            monkeypatch.setattr(port, name, astep)
        else:
            def step(self: Any, message: Any, decision: Decision, _original: Any = original) -> Acted:
                acted: Acted = _original(self, message, decision)
                world.step(key_of(self), acted)
                return acted
            monkeypatch.setattr(port, name, step)


@pytest.fixture
def world(redis_client: redis.Redis, namespace: str) -> Iterator[World]:
    dedupe = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0,
                          permanent_errors=(Permanent,))
    w = World(dedupe, namespace)
    yield w
    w.finish()
    dedupe.close()


OPTIONS = {"defer_base": 0.05, "defer_cap": 0.2, "defer_wait": 0}


def expected(owned_retries: bool = True) -> dict[str, list[str]]:
    out = {scenario: trace for scenario, (_, _, trace) in SCENARIOS.items()}
    if not owned_retries:
        out["handler_error"] = HANDED_OVER
    return out


# -- the integrations -----------------------------------------------------------------------------


def test_celery(world: World, rabbitmq_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The task body as a worker runs it (a request that is neither eager nor a direct call), on
    an app whose broker is RabbitMQ: deferrals and retries publish their copies there."""
    queue = f"dispatch-{world.run}"
    app = Celery(f"dispatch-{world.run}", broker=rabbitmq_url, backend=redis_url, set_as_current=False)
    app.conf.update(task_default_queue=queue, dedupe_namespace=world.namespace)
    record_steps(monkeypatch, celery_task._TaskSteps, world, lambda port: port.key)
    base = type("Recording", (IdempotentTask,), {**hooks_of(world), "abstract": True,
                                                **{f"dedupe_{name}": value for name, value in OPTIONS.items()},
                                                "dedupe_retry_base": 0.05})

    @app.task(base=base, bind=True, shared=False, name="dispatch.handle",
              idempotency_key=lambda payload: payload["key"], idempotency_fingerprint=lambda payload: payload["fp"])
    def handle(self: IdempotentTask, payload: dict[str, Any]) -> int:
        return world.handle(payload)

    handle.__dict__["deduplicator"] = world.dedupe

    def send(payload: dict[str, Any]) -> None:
        handle.push_request(id=uuid.uuid4().hex, args=[payload], kwargs={}, is_eager=False, called_directly=False,
                            delivery_info={"routing_key": queue}, retries=0, headers={})
        try:
            handle.run_once((payload,), {})
        except Exception:  # Retry, or the task failing: what a worker would record
            pass
        finally:
            handle.pop_request()

    try:
        traces = world.scenarios(send)
    finally:
        with Connection(rabbitmq_url) as conn:
            conn.default_channel.queue_delete(queue=queue)
    assert traces == expected()


def test_dramatiq(world: World, rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = f"dispatch-{world.run}"
    broker = dramatiq.brokers.rabbitmq.RabbitmqBroker(url=pika_url(rabbitmq_url))
    middleware_cls = type("Recording", (DedupeMiddleware,), hooks_of(world))
    record_steps(monkeypatch, dramatiq_middleware._MessageSteps, world, lambda port: port.key)
    broker.add_middleware(middleware_cls(world.dedupe, **OPTIONS))

    def handle(payload: dict[str, Any]) -> int:
        return world.handle(payload)

    actor = dramatiq.actor(handle, broker=broker, queue_name=queue, max_retries=0,
                           idempotency_key=lambda payload: payload["key"],
                           idempotency_fingerprint=lambda payload: payload["fp"])
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        traces = world.scenarios(lambda payload: actor.send(payload), owned_retries=False)
    finally:
        world.finish()
        worker.stop()
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
            broker.channel.queue_delete(name)
        broker.close()
    assert traces == expected(owned_retries=False)


def test_faststream(world: World, rabbitmq_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from faststream.rabbit import RabbitBroker, RabbitQueue

    queue = f"dispatch-{world.run}"
    record_steps(monkeypatch, faststream_middleware._MessageSteps, world, lambda port: port.key, coroutines=True)
    middleware_cls = type("Recording", (FastStreamMiddleware,), hooks_of(world))

    async def main() -> dict[str, list[str]]:
        dedupe = AsyncDeduplicator(redis.asyncio.Redis.from_url(redis_url), namespace=world.namespace,
                                   lease=5.0, result_ttl=60.0, permanent_errors=(Permanent,))
        middleware = middleware_cls(dedupe, key_strategy=header_key("idempotency-key"),
                                    fingerprint=lambda envelope: envelope.header("x-fp"), **OPTIONS)
        broker = RabbitBroker(rabbitmq_url, middlewares=[middleware], logger=None)

        @broker.subscriber(RabbitQueue(queue, durable=True))
        async def handle(body: dict[str, Any]) -> int:
            return world.handle(body)

        await broker.start()
        loop = asyncio.get_running_loop()

        def send(payload: dict[str, Any]) -> None:
            headers = {"idempotency-key": payload["key"], "x-fp": payload["fp"]}
            asyncio.run_coroutine_threadsafe(broker.publish(payload, queue=queue, headers=headers), loop).result(10)

        try:
            return await asyncio.to_thread(world.scenarios, send, False)
        finally:
            world.finish()
            await broker.stop()
            await dedupe.aclose()
            await dedupe.store.client.aclose()

    try:
        traces = asyncio.run(main())
    finally:
        with Connection(rabbitmq_url) as conn:
            for name in (queue, f"{queue}.dlq"):
                conn.default_channel.queue_delete(queue=name)
    assert traces == expected(owned_retries=False)


def test_rabbitmq_consumer(world: World, amqp: Connection, queue_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    record_steps(monkeypatch, rabbitmq_actions._ItemSteps, world, lambda port: port.item.key)
    consumer_cls = type("Recording", (DedupeConsumer,), hooks_of(world))
    consumer = consumer_cls(amqp.clone(), [queue_name], lambda body, message: world.handle(body), world.dedupe,
                            key_strategy=header_key("idempotency-key"),
                            fingerprint=lambda envelope: envelope.header("x-fp"), prefetch_count=1,
                            max_attempts=2, retry_base=0.05, **OPTIONS)

    def send(payload: dict[str, Any]) -> None:
        publish(amqp, queue_name, json.dumps(payload), headers={"idempotency-key": payload["key"],
                                                               "x-fp": payload["fp"]})

    with consumer_thread(consumer):
        traces = world.scenarios(send)
    assert traces == expected()


def test_kafka_consumer(world: World, kafka_bootstrap: str, kafka_topics: Topics,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Kafka consumer's steps are per batch: the rewind of a held message, the delivery of
    dead letters, and the commit (the ACK's step, recorded for the messages it covers)."""
    topic = kafka_topics.create(1, prefix="dispatch")
    key_of = header_key("idempotency-key")

    class Recording(DedupeKafkaConsumer):
        batch: list[Any] = []

        def process(self, messages: Any) -> None:
            self.batch = list(messages)
            super().process(messages)

        def _hold(self, tp: Any, state: Any, msg: Any, hold: Any) -> Acted | None:
            acted = super()._hold(tp, state, msg, hold)
            if acted is not None:
                world.step(hold.key, acted)
            return acted

        def _commit(self, offsets: list[Any]) -> None:
            super()._commit(offsets)
            ends = {(tp.topic, tp.partition): tp.offset for tp in offsets}
            for msg in self.batch:
                end = ends.get((msg.topic(), msg.partition()))
                if end is not None and (msg.offset() or 0) < end:
                    world.step(key_of(Envelope(b"", headers=dict(msg.headers() or []))), Acted(Done.ACKED))

    for name, hook in hooks_of(world).items():
        setattr(Recording, name, hook)
    original_send = DeadLetterProducer.send

    def send_letters(self: DeadLetterProducer, letters: list[Any]) -> list[bool]:
        delivered: list[bool] = original_send(self, letters)
        for letter, ok in zip(letters, delivered, strict=True):
            if ok:
                world.step(letter.key, Acted(Done.DEAD_LETTERED))
        return delivered

    monkeypatch.setattr(DeadLetterProducer, "send", send_letters)
    consumer = Recording({"bootstrap.servers": kafka_bootstrap, "group.id": f"g-{world.run}",
                          "session.timeout.ms": 6000, "heartbeat.interval.ms": 500},
                         [topic], lambda msg: world.handle(json.loads(msg.value())), world.dedupe,
                         key_strategy=key_of, fingerprint=lambda envelope: envelope.header("x-fp"),
                         poll_timeout=0.1, max_attempts=2, retry_base=0.05, **OPTIONS)

    def send(payload: dict[str, Any]) -> None:
        produce(kafka_bootstrap, topic, [(0, None, json.dumps(payload).encode(),
                                          [("idempotency-key", payload["key"].encode()),
                                           ("x-fp", payload["fp"].encode())])])

    with running(consumer):
        traces = world.scenarios(send, timeout=60.0)
        world.finish()
    assert traces == expected()


"""The RabbitMQ consumer when Redis or the broker connection fails mid-stream."""

from __future__ import annotations

import collections
import shutil
import socket
import subprocess
import threading
import time
from typing import Any

import orjson
import redis
from kombu import Connection

from dedupe_worker import Deduplicator, Reason
from dedupe_worker.rabbitmq import DedupeConsumer

from . import services
from .rabbitmq_fixtures import amqp, consumer_thread, dead_letters, depth, drained, publish, queue_name, wait_for

__all__ = ["amqp", "queue_name"]  # fixtures used by name


class Calls:
    """A handler recording each call's ``id`` and time (thread-safe)."""

    def __init__(self, block_on: str | None = None) -> None:
        self.calls: list[tuple[str, float]] = []
        self.lock = threading.Lock()
        self.block_on = block_on
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, body: Any, message: Any) -> str:
        if body["id"] == self.block_on:
            self.started.set()
            assert self.release.wait(20)
        with self.lock:
            self.calls.append((body["id"], time.monotonic()))
        return str(body["id"])

    def counts(self) -> collections.Counter[str]:
        with self.lock:
            return collections.Counter(key for key, _ in self.calls)


def test_redis_outage_mid_stream_loses_nothing_and_applies_nothing_twice(
    amqp: Connection, queue_name: str, private_redis: services.RedisServer, namespace: str
) -> None:
    # Restart the private server with an fsync'ed append-only file, so its records survive the
    # kill below (the outage is about availability; a Redis that forgets is another story).
    private_redis.stop()
    private_redis.extra = ("--appendonly", "yes", "--appendfsync", "always")
    private_redis.start()
    client = redis.Redis.from_url(private_redis.url, socket_connect_timeout=1, socket_timeout=2)
    dedupe = Deduplicator(client, namespace=namespace, lease=2.0, result_ttl=60.0)
    handler = Calls()
    outage: dict[str, float] = {}
    deferred: list[str] = []

    class KillsRedis(DedupeConsumer):
        """Stops Redis right after the 10th message was applied and acked (between batches, so
        no handler is in flight: the mid-handler case is the crash story, tested elsewhere)."""

        def on_applied(self, message: Any, decision: Any) -> None:
            if len(handler.calls) >= 10 and "down" not in outage:
                private_redis.stop()
                outage["down"] = time.monotonic()

        def on_deferred(self, message: Any, decision: Any, delay: float) -> None:
            deferred.append(decision.reason.value)

    for n in range(40):
        publish(amqp, queue_name, orjson.dumps({"id": f"k{n}"}), headers={"idempotency-key": f"k{n}"})
    consumer = KillsRedis(amqp.clone(), [queue_name], handler, dedupe, prefetch_count=5, outage_cap=1.0)
    try:
        with consumer_thread(consumer):
            wait_for(lambda: "down" in outage, what="the outage")
            # copies of messages applied before the outage arrive during it
            for n in range(5):
                publish(amqp, queue_name, orjson.dumps({"id": f"k{n}"}), headers={"idempotency-key": f"k{n}"})
            time.sleep(2.0)
            assert depth(amqp, queue_name) > 0  # the rest is still queued (or held, un-acked)
            private_redis.start()  # same port
            outage["up"] = time.monotonic()
            wait_for(lambda: len(handler.counts()) == 40, timeout=30, what="all keys applied")
            wait_for(lambda: drained(amqp, queue_name))
    finally:
        dedupe.close()
        client.close()
    assert handler.counts() == {f"k{n}": 1 for n in range(40)}
    during = [key for key, at in handler.calls if outage["down"] < at < outage["up"]]
    assert during == [], "handlers ran while Redis was down"
    assert Reason.STORE_UNAVAILABLE.value in deferred
    assert dead_letters(amqp, queue_name) == []


def _cut_connection(connection: Any) -> str:
    """Have the broker close ``connection`` (``rabbitmqctl close_connection``, when rabbitmqctl
    reaches the broker), else shut its socket down from our side. Returns which it was."""
    sock = connection.connection.sock
    local_port = sock.getsockname()[1]
    if shutil.which("rabbitmqctl"):
        listing = subprocess.run(["rabbitmqctl", "-q", "list_connections", "pid", "peer_port"],
                                 capture_output=True, text=True, timeout=30)
        pids = [line.split()[0] for line in listing.stdout.splitlines()
                if listing.returncode == 0 and line.split()[-1:] == [str(local_port)]]
        if pids:
            subprocess.run(["rabbitmqctl", "close_connection", pids[0], "closed by the test"],
                           check=True, capture_output=True, timeout=30)
            return "broker"
    sock.shutdown(socket.SHUT_RDWR)
    return "socket"


def test_connection_lost_mid_handler_reconnects_and_the_redelivery_is_a_duplicate(
    amqp: Connection, queue_name: str, dedupe: Deduplicator
) -> None:
    handler = Calls(block_on="held")
    connections: list[Any] = []
    duplicates: list[str] = []

    class Watching(DedupeConsumer):
        def on_consume_ready(self, connection: Any, channel: Any, consumers: Any, **kwargs: Any) -> None:
            connections.append(connection)
            super().on_consume_ready(connection, channel, consumers, **kwargs)

        def on_duplicate(self, message: Any, decision: Any) -> None:
            duplicates.append(message.headers["idempotency-key"])

    consumer = Watching(amqp.clone(), [queue_name], handler, dedupe, prefetch_count=1)
    with consumer_thread(consumer):
        publish(amqp, queue_name, '{"id": "held"}', headers={"idempotency-key": "held"})
        assert handler.started.wait(10)
        _cut_connection(connections[0])
        handler.release.set()  # the handler finishes and its outcome is stored; the ack is lost
        wait_for(lambda: len(connections) == 2, what="a new connection")
        wait_for(lambda: duplicates == ["held"], what="the redelivered copy acked as a duplicate")
        publish(amqp, queue_name, '{"id": "after"}', headers={"idempotency-key": "after"})
        wait_for(lambda: handler.counts()["after"] == 1, what="consumption to go on")
    assert handler.counts() == {"held": 1, "after": 1}
    assert depth(amqp, queue_name) == 0
    assert dead_letters(amqp, queue_name) == []

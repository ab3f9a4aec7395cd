"""The soak's producer: N distinct operations, each sent at least twice, copies interleaved.

Each operation is ``charge <id> <amount>`` for one integration (round robin over the chosen ones).
70% are sent twice (the original and a producer retry), the rest 3 to 5 times; copies go out at
random instants within ``spread`` seconds of the first, so copies of different operations
interleave. Where each copy goes:

- ``celery``: ``send_task("soak.charge", (id, amount))`` on the Celery queue (a new task id each);
- ``rabbitmq``: the RabbitMQ queue, header ``idempotency-key: <id>``;
- ``kafka``: the 3-partition topic, key and header ``<id>``;
- ``replay``: the first copy straight into ``<replay queue>.dlq`` with the headers a consumer
  writes when it dead-letters; for half of the operations the other copies go to the replay
  queue itself (so the dead-lettered copy is "already applied" when the replay sees it), for the
  other half to the dead-letter queue too.

The producer publishes straight to the brokers (not through the proxies); the ledger row of an
operation is written before its first copy is sent.
"""

from __future__ import annotations

import heapq
import json
import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .ledger import Ledger, Operation

__all__ = ["Producer", "Targets"]

log = logging.getLogger(__name__)


@dataclass
class Targets:
    """Where the traffic goes."""

    rabbitmq_url: str
    celery_queue: str
    rabbit_queue: str
    replay_queue: str
    kafka_bootstrap: str
    kafka_topic: str


@dataclass
class Producer:
    ledger: Ledger
    targets: Targets
    integrations: list[str]
    rng: random.Random
    rate: float
    spread: float = 2.0
    sent: Counter[str] = field(default_factory=Counter)
    operations: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pending: list[tuple[float, int, Operation, str]] = []
        self.seq = 0
        self._kafka: Any = None
        self._amqp: Any = None
        self._celery: Any = None
        self.lock = threading.Lock()

    # -- connections ----------------------------------------------------------------------------

    def connect(self) -> None:
        from celery import Celery
        from confluent_kafka import Producer as KafkaProducer
        from kombu import Connection

        if {"rabbitmq", "replay", "celery"} & set(self.integrations):
            self._amqp = Connection(self.targets.rabbitmq_url)
            self._amqp.ensure_connection(max_retries=3)
        if "celery" in self.integrations:
            self._celery = Celery("soak-producer", broker=self.targets.rabbitmq_url, set_as_current=False)
        if "kafka" in self.integrations:
            self._kafka = KafkaProducer({"bootstrap.servers": self.targets.kafka_bootstrap, "linger.ms": 5,
                                         "log.connection.close": False, "message.timeout.ms": 300000})

    def close(self) -> None:
        if self._kafka is not None:
            left = self._kafka.flush(60)
            if left:
                self.errors.append(f"{left} kafka records not delivered")
        if self._amqp is not None:
            self._amqp.release()

    # -- sending --------------------------------------------------------------------------------

    def plan(self, op: Operation) -> None:
        """Write ``op``'s ledger row and schedule its copies."""
        copies = 2 if self.rng.random() < 0.7 else self.rng.randint(3, 5)
        now = time.monotonic()
        offsets = [0.0, *sorted(self.rng.uniform(0.05, self.spread) for _ in range(copies - 1))]
        direct_rest = self.rng.random() < 0.5
        self.ledger.open_account(op)
        self.operations[op.integration] += 1
        for n, offset in enumerate(offsets):
            where = op.integration
            if op.integration == "replay":
                where = "dlq" if n == 0 or not direct_rest else "replay"
            self.seq += 1
            heapq.heappush(self.pending, (now + offset, self.seq, op, where))

    def send_due(self) -> None:
        now = time.monotonic()
        while self.pending and self.pending[0][0] <= now:
            _, _, op, where = heapq.heappop(self.pending)
            self.send(op, where)
        if self._kafka is not None:
            self._kafka.poll(0)

    def send(self, op: Operation, where: str) -> None:
        from .. import rabbitmq_fixtures

        body = json.dumps({"id": op.id, "amount": op.amount}).encode()
        headers = {"idempotency-key": op.id}
        if where == "celery":
            self._celery.send_task("soak.charge", args=(op.id, op.amount), queue=self.targets.celery_queue)
        elif where in ("rabbitmq", "replay"):
            queue = self.targets.rabbit_queue if where == "rabbitmq" else self.targets.replay_queue
            rabbitmq_fixtures.publish(self._amqp, queue, body, headers=headers, delivery_mode=2)
        elif where == "dlq":
            queue = self.targets.replay_queue
            rabbitmq_fixtures.publish(self._amqp, f"{queue}.dlq", body, headers={
                **headers, "x-dedupe-key": op.id, "x-dedupe-reason": "handler_error",
                "x-dedupe-error": "RuntimeError: downstream down (soak)", "x-dedupe-attempts": "5",
                "x-dedupe-original-queue": queue, "x-dedupe-original-exchange": "",
                "x-dedupe-original-routing-key": queue}, delivery_mode=2)
        else:
            self._kafka.produce(self.targets.kafka_topic, value=body, key=op.id.encode(),
                                headers=[("idempotency-key", op.id.encode())], on_delivery=self.delivered)
        self.sent[op.integration] += 1

    def delivered(self, err: Any, msg: Any) -> None:
        if err is not None:
            self.errors.append(f"kafka delivery failed: {err}")

    def run(self, seconds: float, stop: threading.Event) -> None:
        """Start ``rate`` operations a second for ``seconds``, then send the copies still due."""
        deadline = time.monotonic() + seconds
        interval = 1.0 / self.rate
        next_op = time.monotonic()
        i = 0
        while not stop.is_set() and (time.monotonic() < deadline or self.pending):
            now = time.monotonic()
            if now < deadline and now >= next_op:
                integration = self.integrations[i % len(self.integrations)]
                self.plan(Operation(f"{integration}-{i:07d}", integration, self.rng.randint(1, 1000)))
                i += 1
                next_op += interval
            self.send_due()
            time.sleep(0.005)

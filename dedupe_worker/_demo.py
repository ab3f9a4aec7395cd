"""The demonstration behind ``dedupe-worker demo``: at-least-once delivery, applied once.

An in-process broker delivers every order at least once to several concurrent workers: the
producer publishes some orders twice (a retried publish), some acks are lost after the work was
done (the broker redelivers), and some workers die right after claiming, before doing anything
(their lease must run out before anyone else may take the order). The same delivery script runs
twice, without and with deduplication, and the applied effects are compared.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ._deduplicator import Deduplicator
from ._engine import Action, decide

__all__ = ["DemoReport", "run_demo"]


@dataclass(order=True)
class _Delivery:
    due: float
    seq: int
    order_id: str = field(compare=False)
    attempt: int = field(compare=False, default=1)


class _Broker:
    """At-least-once: a message leaves only when acked; redeliveries come back after a delay."""

    def __init__(self) -> None:
        self._heap: list[_Delivery] = []
        self._seq = 0
        self._cond = threading.Condition()
        self.unacked = 0
        self.deliveries = 0

    def publish(self, order_id: str, delay: float = 0.0, attempt: int = 1) -> None:
        with self._cond:
            self._seq += 1
            heapq.heappush(self._heap, _Delivery(time.monotonic() + delay, self._seq, order_id, attempt))
            self.unacked += 1
            self._cond.notify()

    def get(self) -> _Delivery | None:
        with self._cond:
            while True:
                if self.unacked == 0:
                    return None
                now = time.monotonic()
                if self._heap and self._heap[0].due <= now:
                    self.deliveries += 1
                    return heapq.heappop(self._heap)
                wait = (self._heap[0].due - now) if self._heap else 0.05
                self._cond.wait(min(wait, 0.05))

    def ack_or_redeliver(self, delivery: _Delivery, redeliver_after: float | None) -> None:
        """Ack, or put the message back (a lost ack, a crash, a deferral)."""
        with self._cond:
            self.unacked -= 1
            self._cond.notify_all()
        if redeliver_after is not None:
            self.publish(delivery.order_id, redeliver_after, delivery.attempt + 1)


@dataclass
class DemoReport:
    orders: int
    deliveries: int = 0
    applied: Counter[str] = field(default_factory=Counter)
    deferred: int = 0
    duplicates: int = 0
    #: Orders whose work was finally done under a larger fencing token than a dead worker's claim.
    taken_over: int = 0

    @property
    def effects(self) -> int:
        return sum(self.applied.values())

    @property
    def applied_twice(self) -> int:
        return sum(1 for n in self.applied.values() if n > 1)

    @property
    def missing(self) -> int:
        return self.orders - len(self.applied)


def _script(orders: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ids = [f"order-{i:04d}" for i in range(orders)]
    return {
        "publish": ids + [i for i in ids if rng.random() < 0.25],  # producer retries
        "lose_ack": {i for i in ids if rng.random() < 0.2},
        "die_after_claim": {i for i in ids if rng.random() < 0.1},
    }


def run_demo(
    dedupe: Deduplicator | None, *, orders: int = 200, workers: int = 4, seed: int = 7,
    work_seconds: float = 0.002,
) -> DemoReport:
    """Deliver ``orders`` orders at least once to ``workers`` threads; with ``dedupe`` None,
    every delivery runs the handler."""
    plan = _script(orders, seed)
    broker = _Broker()
    report = DemoReport(orders)
    lock = threading.Lock()
    visibility = dedupe.lease / 2 if dedupe else 0.05
    rng_lock = threading.Lock()
    rng = random.Random(seed + 1)
    dead_claims: dict[str, int] = {}  # order -> token of the claim a "dead" worker left behind

    def handler(order_id: str) -> str:
        time.sleep(work_seconds)
        with lock:
            report.applied[order_id] += 1
        return f"charged {order_id}"

    def first_time(order_id: str, attempt: int, chosen: set[str]) -> bool:
        return attempt == 1 and order_id in chosen

    def worker() -> None:
        while (d := broker.get()) is not None:
            with rng_lock:
                jitter = rng.uniform(0, 0.02)
            if first_time(d.order_id, d.attempt, plan["die_after_claim"]):
                if dedupe is not None:
                    dead = dedupe.begin(d.order_id)  # claimed, then the process "dies"
                    if dead.acquired:
                        with lock:
                            dead_claims[d.order_id] = dead.token
                broker.ack_or_redeliver(d, visibility + jitter)
                continue
            if dedupe is None:
                handler(d.order_id)
                redeliver = first_time(d.order_id, d.attempt, plan["lose_ack"])
                broker.ack_or_redeliver(d, visibility + jitter if redeliver else None)
                continue
            decision = decide(dedupe, d.order_id, lambda: handler(d.order_id))
            with lock:
                if decision.reason.value == "applied" and d.order_id in dead_claims:
                    report.taken_over += decision.token > dead_claims[d.order_id]
                report.duplicates += decision.reason.value == "duplicate"
            if decision.action is Action.DEFER:
                with lock:
                    report.deferred += 1
                broker.ack_or_redeliver(d, decision.retry_after + jitter)
            elif decision.action is Action.ACK:
                redeliver = first_time(d.order_id, d.attempt, plan["lose_ack"])
                broker.ack_or_redeliver(d, visibility + jitter if redeliver else None)
            else:  # a handler error: retry later (the demo handler does not fail)
                broker.ack_or_redeliver(d, visibility + jitter)

    for order_id in plan["publish"]:
        broker.publish(order_id)
    threads = [threading.Thread(target=worker, name=f"demo-worker-{n}") for n in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report.deliveries = broker.deliveries
    return report

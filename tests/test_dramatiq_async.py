"""``async def`` Dramatiq actors (with Dramatiq's ``AsyncIO`` middleware) see ``current_claim()``
inside their coroutine, on a real Redis (Dramatiq's in-process stub broker: the point is the
event loop thread, not the transport)."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from dedupe_worker import Deduplicator, current_claim
from dedupe_worker.dramatiq import DedupeMiddleware

AsyncIO = pytest.importorskip("dramatiq.middleware.asyncio").AsyncIO


def test_async_actor_sees_its_claim_and_runs_once_per_key(dedupe: Deduplicator) -> None:
    broker = StubBroker()
    broker.add_middleware(AsyncIO())
    broker.add_middleware(DedupeMiddleware(dedupe))
    seen: list[Any] = []

    @dramatiq.actor(broker=broker, queue_name="async-claims", max_retries=0,
                    idempotency_key=lambda order_id: f"order:{order_id}")  # type: ignore[call-overload]
    async def charge(order_id: int) -> int:
        claim = current_claim()
        seen.append(None if claim is None else (claim.key, claim.token))
        return order_id * 2

    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        for order in (1, 1, 2):
            charge.send(order)
        broker.join("async-claims")
        worker.join()
    finally:
        worker.stop()
        broker.close()
    assert [key for key, _ in seen] == ["order:1", "order:2"]  # set inside the coroutine; the copy ran once
    assert all(token >= 1 for _, token in seen)
    assert dedupe.status("order:1").state == "done"

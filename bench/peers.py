"""The peers ``bench.core`` measures next to our paths, on the same Redis with the same payloads.

* AWS Lambda Powertools' ``idempotent_function`` with its Redis persistence layer
  (``RedisCachePersistenceLayer``): no AWS account is needed, only a region name; every call
  hashes the payload and reads or writes its record in Redis, which :func:`powertools_cases`
  checks by counting the records it left.
* Celery eager mode (``task_always_eager``, what users' unit tests run): a plain task,
  ``IdempotentTask`` and celery-once's ``QueueOnce``, each called with ``apply_async``.

Each case is ``fn(i) -> messages done`` for :func:`bench.core.rates`. The peers are in the
``bench`` extra (``pip install -e .[bench]``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import redis

__all__ = ["Case", "celery_eager_cases", "payload", "powertools_cases", "powertools_records"]

Case = Callable[[int], int]


def payload(i: int) -> dict[str, Any]:
    """The message every path handles: an order with a small body (the same for every peer)."""
    return {"order_id": f"order-{i}", "amount": 1250, "currency": "EUR"}


def powertools_cases(client: redis.Redis, namespace: str) -> dict[str, Case]:
    """Powertools' first-seen and duplicate paths, keyed by the payload's ``order_id``."""
    os.environ.setdefault("AWS_REGION", "eu-west-1")  # read by the package at import; no AWS call is made
    os.environ.pop("POWERTOOLS_IDEMPOTENCY_DISABLED", None)
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.redis import RedisCachePersistenceLayer

    # Outside Lambda there is no context to tell the remaining time: Powertools warns on every call.
    warnings.filterwarnings("ignore", message="Couldn't determine the remaining time left")
    layer = RedisCachePersistenceLayer(client=client)
    config = IdempotencyConfig(event_key_jmespath="order_id", expires_after_seconds=600)

    @idempotent_function(data_keyword_argument="order", persistence_store=layer, config=config,
                         key_prefix=f"{namespace}:powertools")
    def handle(order: dict[str, Any]) -> dict[str, Any]:
        return {"status": "charged", "order": order["order_id"]}

    handle(order=payload(-1))

    def first(i: int) -> int:
        handle(order=payload(i))
        return 1

    def duplicate(_: int) -> int:
        handle(order=payload(-1))
        return 1

    return {"powertools": first, "powertools dup": duplicate}


def powertools_records(client: redis.Redis, namespace: str) -> int:
    """How many records Powertools wrote under ``namespace``: proof that it really used Redis."""
    return sum(1 for _ in client.scan_iter(f"{namespace}:powertools#*", count=5000))


def celery_eager_cases(redis_url: str, namespace: str) -> dict[str, Case]:
    """A plain task, ``IdempotentTask`` and ``QueueOnce`` in eager mode, same store and arguments."""
    from bench.celery_tasks import make_app

    app = make_app("memory://", redis_url, namespace, f"bench-{namespace}")
    app.conf.update(task_always_eager=True, task_eager_propagates=True)
    tasks = {"eager plain": app.tasks["bench.plain"], "eager Idempotent": app.tasks["bench.idempotent"],
             "eager QueueOnce": app.tasks["bench.once"]}

    def case(task: Any) -> Case:
        def call(i: int) -> int:
            task.apply_async((i,))
            return 1
        return call

    return {name: case(task) for name, task in tasks.items()}

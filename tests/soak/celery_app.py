"""The Celery app a soak ``celery worker -P prefork`` runs (``-A tests.soak.celery_app:app``).

Settings from the environment the harness sets: ``SOAK_CELERY_BROKER`` (through the harness's
proxy), ``SOAK_REDIS_URL`` (idem), ``SOAK_NAMESPACE``, ``SOAK_CELERY_QUEUE``, ``SOAK_LEASE``, plus
the handlers' ``SOAK_DSN`` / ``SOAK_RUN`` / ``SOAK_WORK``. One task, ``soak.charge(op_id, amount)``,
keyed by the operation id, applies the operation with :func:`tests.soak.handlers.charge`.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from dedupe_worker.celery import IdempotentTask

from .handlers import LedgerHooks, charge

__all__ = ["app", "charge_task"]

app = Celery("soak", broker=os.environ.get("SOAK_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//"),
             set_as_current=False)
app.conf.update(
    task_default_queue=os.environ.get("SOAK_CELERY_QUEUE", "soak-celery"),
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    worker_prefetch_multiplier=1,
    dedupe_redis_url=os.environ.get("SOAK_REDIS_URL", "redis://127.0.0.1:6379/0"),
    dedupe_namespace=os.environ.get("SOAK_NAMESPACE", "soak"),
    dedupe_lease=float(os.environ.get("SOAK_LEASE", "2")),
)


class SoakTask(LedgerHooks, IdempotentTask):
    """IdempotentTask that records lease-lost and dead-letter verdicts in the ledger."""


@app.task(base=SoakTask, bind=True, shared=False, name="soak.charge", dedupe_defer_wait=0.5, dedupe_defer_cap=2.0,
          dedupe_retry_base=0.2, dedupe_retry_cap=2.0, dedupe_max_attempts=8, idempotency_key=lambda op_id, **_: op_id)
def charge_task(self: IdempotentTask, op_id: str, amount: int) -> dict[str, Any]:
    return charge(op_id, amount)

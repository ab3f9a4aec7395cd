"""Apps for the PostgreSQL-only integration tests (``test_store_sql_integrations.py``): a Celery
app (RabbitMQ broker, ``rpc://`` results) and an ASGI app under the HTTP middleware, both with the
claim store at ``DEDUPE_STORE_URL`` and their side effects counted as rows of ``sql_effects`` in
the same database. No Redis anywhere: ``DEDUPE_REDIS_URL`` points at a closed port.

A worker subprocess imports ``app`` (Celery, from ``SQL_TEST_*``) or ``asgi`` (uvicorn).
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from celery import Celery

from dedupe_worker.celery import IdempotentTask

__all__ = ["effect", "make_celery"]


def effect(kind: str, key: str) -> None:
    """Count one application of ``kind`` for ``key`` (a row of ``sql_effects``)."""
    with psycopg.connect("postgresql://" + os.environ["DEDUPE_STORE_URL"].split("://", 1)[1],
                         autocommit=True) as conn:
        conn.execute("INSERT INTO sql_effects (kind, key) VALUES (%s, %s)", (kind, key))


def make_celery(broker: str, queue: str, namespace: str) -> Celery:
    app = Celery(f"sq-{namespace}", broker=broker, backend="rpc://", set_as_current=False)
    app.conf.update(task_default_queue=queue, dedupe_namespace=namespace, dedupe_lease=5.0,
                    worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True, result_expires=300)

    @app.task(base=IdempotentTask, bind=True, shared=False, name="sq.charge",
              idempotency_key=lambda order_id, **_: f"charge:{order_id}")
    def charge(self: IdempotentTask, order_id: int, amount: int) -> dict[str, Any]:
        effect("charge", str(order_id))
        return {"order_id": order_id, "amount": amount, "token": self.request.fencing_token}

    return app


if "SQL_TEST_QUEUE" in os.environ:  # a celery worker subprocess
    app = make_celery(os.environ["SQL_TEST_BROKER"], os.environ["SQL_TEST_QUEUE"], os.environ["SQL_TEST_NAMESPACE"])

if "SQL_TEST_HTTP" in os.environ:  # uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from dedupe_worker.asyncio import AsyncDeduplicator
    from dedupe_worker.http import IdempotencyMiddleware

    asgi = FastAPI()
    asgi.add_middleware(IdempotencyMiddleware, dedupe=AsyncDeduplicator.from_settings(
        namespace=os.environ["SQL_TEST_NAMESPACE"], lease=10.0), scope=lambda request: "one-client")

    @asgi.get("/health")
    async def health() -> dict[str, str]:
        return {"ok": "yes"}

    @asgi.post("/orders")
    async def orders(request: Request) -> JSONResponse:
        from starlette.concurrency import run_in_threadpool

        key = request.headers.get("idempotency-key", "")
        await run_in_threadpool(effect, "order", key)
        return JSONResponse({"key": key, "pid": os.getpid(), "body": (await request.body()).decode()},
                            status_code=201)

"""The end-to-end example of docs/http.md, as written: a FastAPI endpoint behind the
Idempotency-Key middleware enqueues a Celery task keyed by the claim (real Redis broker, a real
in-process worker), and the task writes through ``atomic()`` on real PostgreSQL. Needs
``dedupe_worker.sql``."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import psycopg
import pytest
from celery.contrib.testing.worker import start_worker

from .test_http_docs import examples, load

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def schema_dsn(postgres_dsn: str) -> Iterator[str]:
    """A schema of the test's own with one ``accounts`` row, and a DSN whose search_path is it."""
    schema = f"http_e2e_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.accounts (id text PRIMARY KEY, balance int NOT NULL)")
        conn.execute(f"INSERT INTO {schema}.accounts VALUES ('acme', 0)")
    yield f"{postgres_dsn}{'&' if '?' in postgres_dsn else '?'}options=-csearch_path%3D{schema}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def shop(redis_url: str, namespace: str, schema_dsn: str, tmp_path: Path,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    for name, value in (("DEDUPE_REDIS_URL", redis_url), ("DEDUPE_SQL_DSN", schema_dsn),
                        ("DEDUPE_NAMESPACE", namespace), ("CELERY_BROKER_URL", redis_url)):
        monkeypatch.setenv(name, value)
    module = load("end-to-end", examples()["end-to-end"], tmp_path)
    module.celery_app.conf.task_default_queue = f"{namespace}-payments"
    from dedupe_worker.sql import SqlOutcomes

    SqlOutcomes(schema_dsn).create_table()
    with start_worker(module.celery_app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        yield module


def balance(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT balance FROM accounts WHERE id = 'acme'").fetchone()
        assert row is not None
        return int(row[0])


def test_request_to_database_applies_once(shop: ModuleType, schema_dsn: str) -> None:
    async def requests() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=shop.api)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
            headers = {"Idempotency-Key": str(uuid.uuid4()), "X-Account": "acme"}
            payment = {"account": "acme", "amount": 10}
            first = await client.post("/payments", json=payment, headers=headers)
            rest = await asyncio.gather(*(client.post("/payments", json=payment, headers=headers) for _ in range(5)))
            return [first, *rest]

    responses = asyncio.run(requests())
    first = responses[0]
    assert first.status_code == 202
    assert all(r.content == first.content and r.headers["idempotent-replayed"] == "true" for r in responses[1:])
    task_id = first.json()["task"]
    result: Any = shop.celery_app.AsyncResult(task_id).get(timeout=30)
    assert result == {"account": "acme", "amount": 10}
    assert balance(schema_dsn) == 10

    # A redelivery of the task, then one after Redis forgot the task's key: the committed row answers.
    assert shop.record_payment.apply_async((task_id, "acme", 10)).get(timeout=30) == result
    shop.record_payment.deduplicator.forget(task_id, force=True)
    assert shop.record_payment.apply_async((task_id, "acme", 10)).get(timeout=30) == result
    assert balance(schema_dsn) == 10

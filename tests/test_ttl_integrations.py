"""Per-message retention through the integrations, on a real Redis (and real brokers for
FastStream, PostgreSQL for the SQL outcomes): FastStream and Dramatiq read the ``x-dedupe-ttl``
header, Celery the ``dedupe_ttl`` task option, ``apply_async(dedupe_ttl=)`` and the header, the
HTTP layer its ``ttl`` option and the app's ``Idempotency-TTL``, and an SQL outcome row expires
after the message's ttl."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
import redis
from celery import Celery
from dramatiq.brokers.stub import StubBroker

from dedupe_worker import Deduplicator
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.celery import IdempotentTask
from dedupe_worker.dramatiq import DedupeMiddleware
from dedupe_worker.http import IdempotencyMiddleware
from dedupe_worker.sql import atomic
from dedupe_worker.sql._statements import stored_key

from .faststream_app import App
from .recording import record
from .sql_fixtures import Tables, pg
from .test_faststream import Target, publish, scenario, target, until
from .test_http_inprocess import call, scope
from .test_ttl import assert_kept, pttl

__all__ = ["pg", "record", "target"]  # fixtures used by name


def result_pttls(redis_client: redis.Redis, namespace: str) -> list[int]:
    """The PTTL of every outcome record in ``namespace``, of either format. The names are found
    first (a large ``COUNT``: the shared Redis holds other tests' keys, and a slow scan would age
    the PTTLs)."""
    names = [name for name in redis_client.scan_iter(match=f"{namespace}:*", count=100_000)
             if KeyLayout.kind(name.decode()) in ("record", "result")]
    return [int(redis_client.pttl(name)) for name in names]


@pytest.mark.parametrize("target", ["rabbit", "kafka"], indirect=True)
def test_faststream_reads_the_ttl_header(target: Target, redis_url: str, redis_client: redis.Redis, namespace: str,
                                         record: str) -> None:
    async def body(app: App) -> None:
        await publish(app, target, {"id": "a", "amount": 1}, headers={"x-dedupe-ttl": "7"})
        await publish(app, target, {"id": "b", "amount": 1})
        await publish(app, target, {"id": "c", "amount": 1}, headers={"x-dedupe-ttl": "later"})
        await until(lambda: app.middleware.count("applied") == 2 and app.middleware.count("dead_letter") == 1,
                    what="two applied, one dead letter")

    scenario(target, redis_url, namespace, record, body)
    dedupe = Deduplicator(redis_client, namespace=namespace)
    assert_kept(pttl(redis_client, dedupe, "a"), 7)
    assert_kept(pttl(redis_client, dedupe, "b"), 60)  # the scenario's result_ttl
    (letter,) = target.dead_letters(1)
    assert letter["x-dedupe-reason"] == "undecodable" and "x-dedupe-ttl header" in letter["x-dedupe-error"]


def test_dramatiq_reads_the_message_option_and_the_actor_option(dedupe: Deduplicator,
                                                                redis_client: redis.Redis) -> None:
    broker = StubBroker()
    broker.add_middleware(DedupeMiddleware(dedupe))

    @dramatiq.actor(broker=broker, queue_name="ttl", max_retries=0, idempotency_ttl=3600,  # type: ignore[call-overload]
                    idempotency_key=lambda order_id: f"order:{order_id}")
    def charge(order_id: int) -> int:
        return order_id

    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        charge.send(1)  # the actor's idempotency_ttl
        charge.send_with_options(args=(2,), **{"x-dedupe-ttl": 7})  # the message's own
        charge.send_with_options(args=(3,), **{"x-dedupe-ttl": "0"})  # bad: dead-lettered
        broker.join("ttl", fail_fast=False)
        worker.join()
    finally:
        worker.stop()
        broker.close()
    assert_kept(pttl(redis_client, dedupe, "order:1"), 3600)
    assert_kept(pttl(redis_client, dedupe, "order:2"), 7)
    assert pttl(redis_client, dedupe, "order:3") == -2
    assert len(broker.dead_letters_by_queue["ttl"]) == 1


@pytest.fixture
def celery_app(redis_url: str, namespace: str) -> Iterator[Celery]:
    app = Celery(f"ttl-{namespace}", broker="memory://", backend=redis_url, set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True, dedupe_redis_url=redis_url,
                    dedupe_namespace=namespace, dedupe_result_ttl=60)

    @app.task(base=IdempotentTask, shared=False, name="ttl.kept", dedupe_ttl=3600,
              idempotency_key=lambda n: f"kept:{n}")
    def kept(n: int) -> int:
        return n

    @app.task(base=IdempotentTask, shared=False, name="ttl.plain", idempotency_key=lambda n: f"plain:{n}")
    def plain(n: int) -> int:
        return n

    yield app
    app.close()


def test_celery_task_option_per_call_and_header(celery_app: Celery, redis_client: redis.Redis,
                                                namespace: str) -> None:
    kept, plain = celery_app.tasks["ttl.kept"], celery_app.tasks["ttl.plain"]
    dedupe = Deduplicator(redis_client, namespace=namespace)
    assert kept.delay(1).get() == 1
    assert kept.apply_async((2,), dedupe_ttl=7).get() == 2  # per call wins over the task option
    assert plain.apply_async((3,), headers={"x-dedupe-ttl": "11"}).get() == 3
    assert plain.delay(4).get() == 4
    assert_kept(pttl(redis_client, dedupe, "kept:1"), 3600)
    assert_kept(pttl(redis_client, dedupe, "kept:2"), 7)
    assert_kept(pttl(redis_client, dedupe, "plain:3"), 11)
    assert_kept(pttl(redis_client, dedupe, "plain:4"), 60)
    celery_app.conf.dedupe_ttl = 13  # the app's default for every task without its own
    assert plain.delay(5).get() == 5
    assert_kept(pttl(redis_client, dedupe, "plain:5"), 13)
    with pytest.raises(ValueError):
        plain.apply_async((6,), dedupe_ttl=-1)


@pytest.mark.asyncio
async def test_http_ttl_option_and_idempotency_ttl_header(redis_url: str, redis_client: redis.Redis,
                                                          namespace: str) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any, ttl: bytes | None = None) -> None:
        await receive()
        headers = [(b"content-type", b"text/plain")] + ([(b"idempotency-ttl", ttl)] if ttl else [])
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    async def with_header(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await app(scope, receive, send, b"17")

    async with AsyncDeduplicator.from_url(redis_url, namespace=namespace, result_ttl=60.0) as dedupe:
        await call(IdempotencyMiddleware(app, dedupe, scope=lambda request: "tenant-1", ttl=13), scope())
        assert len(result_pttls(redis_client, namespace)) == 1
        assert_kept(result_pttls(redis_client, namespace)[0], 13)
    async with AsyncDeduplicator.from_url(redis_url, namespace=namespace + "h", result_ttl=60.0) as dedupe:
        sent = await call(IdempotencyMiddleware(with_header, dedupe, scope=lambda request: "tenant-1", ttl=13), scope())
        assert all(name != b"idempotency-ttl" for name, _ in sent[0]["headers"])  # stripped
        assert_kept(result_pttls(redis_client, namespace + "h")[0], 17)  # the app's header wins
    for name in redis_client.scan_iter(match=f"{namespace}h:*", count=100_000):
        redis_client.delete(name)


def test_an_sql_outcome_row_expires_after_the_message_ttl(redis_client: redis.Redis, namespace: str, pg: Tables,
                                                          postgres_dsn: str) -> None:
    dedupe = Deduplicator(redis_client, namespace=namespace, result_ttl=60, outcomes=pg.outcomes)

    def handler() -> str:
        with psycopg.connect(postgres_dsn) as conn, atomic(conn) as outcome:
            outcome.result = "done"
        return "done"

    began = time.time()
    dedupe.run("short", handler, ttl=5)
    dedupe.run("long", handler, ttl=3600)
    dedupe.run("default", handler)
    with psycopg.connect(postgres_dsn) as conn:
        expiry = {key: int(at) for key, at in conn.execute(f"SELECT dedupe_key, expires_at FROM {pg.outcomes.table}")}
    for key, seconds in (("short", 5), ("long", 3600), ("default", 60)):
        at = expiry[stored_key(dedupe.request(key).stem)]
        assert began * 1000 + seconds * 1000 - 100 <= at <= time.time() * 1000 + seconds * 1000, key
    assert pg.outcomes.purge(now=time.time() + 120) == 2  # short and default; long is kept
    dedupe.close()

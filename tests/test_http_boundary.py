"""The Idempotency-Key layer's bounds and answers called in-process, on real Redis (and real
PostgreSQL for ``atomic()``): construction without ``scope=``, a scope of ``""``, bodies spooled
past memory, ``AlreadyApplied`` answered from the committed result, stored-size decisions, bounded
replays, and the ``dedupe_http_requests_total`` counter."""

from __future__ import annotations

import io
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import prometheus_client
import psycopg
import pytest
import redis
from fastapi import FastAPI, Request
from flask import Flask

from dedupe_worker import AlreadyApplied, Deduplicator
from dedupe_worker._protocol import TooLarge
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.http import IdempotencyMiddleware, IdempotencyRules, Response, WSGIIdempotencyMiddleware
from dedupe_worker.http._body import IN_MEMORY, Body
from dedupe_worker.http._stored import decode, encode
from dedupe_worker.observe import _base
from dedupe_worker.observe._metrics import MetricsObserver
from dedupe_worker.sql import SqlOutcomes, atomic

from .test_http_inprocess import call, environ, replayed, scope, status, wsgi_call

asyncio_test = pytest.mark.asyncio


@pytest.mark.parametrize("build", [
    lambda d: IdempotencyMiddleware(lambda *a: None, d),
    lambda d: WSGIIdempotencyMiddleware(lambda *a: [], d),
    lambda d: IdempotencyRules(),
])
def test_construction_without_scope_names_the_choices(build: Any, dedupe: Deduplicator) -> None:
    with pytest.raises(TypeError) as refused:
        build(dedupe)
    text = str(refused.value)
    for choice in ("scope=", "asgi_user_scope", "dedupe_worker.django.user_scope", "flask_login_scope",
                   "header_scope", "callable"):
        assert choice in text


def test_django_without_scope_is_improperly_configured() -> None:
    pytest.importorskip("django")
    import subprocess
    import sys

    code = ("from django.conf import settings; settings.configure(DEDUPE_HTTP={'required': True}); "
            "from dedupe_worker.django import IdempotencyMiddleware as M\n"
            "try:\n    M(lambda r: None)\nexcept Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("ImproperlyConfigured DEDUPE_HTTP: IdempotencyRules needs scope=")
    assert "dedupe_worker.django.user_scope" in out


@asyncio_test
@pytest.mark.parametrize("nobody", [None, ""])
async def test_empty_scope_is_refused_like_none(redis_url: str, namespace: str, nobody: str | None) -> None:
    runs: list[int] = []

    async def app(s: dict[str, Any], receive: Any, send: Any) -> None:
        runs.append(1)

    async with AsyncDeduplicator.from_url(redis_url, namespace=namespace) as d:
        sent = await call(IdempotencyMiddleware(app, d, scope=lambda request: nobody), scope())
    assert status(sent) == 403 and runs == []
    assert (b"content-type", b"application/problem+json") in sent[0]["headers"]


@asyncio_test
async def test_asgi_body_past_memory_is_spooled_and_reaches_the_app_intact(redis_url: str, namespace: str) -> None:
    received: list[bytes] = []

    async def app(s: dict[str, Any], receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            received.append(message["body"])
            if not message["more_body"]:
                break
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    pieces = tuple(bytes([i]) * (512 * 1024) for i in range(5))  # 2.5 MiB in five messages
    async with AsyncDeduplicator.from_url(redis_url, namespace=namespace) as d:
        middleware = IdempotencyMiddleware(app, d, scope=lambda r: "tenant", max_request_bytes=3 * 1024 * 1024)
        assert status(await call(middleware, scope(), body=pieces)) == 201
        assert b"".join(received) == b"".join(pieces) and max(map(len, received)) <= 64 * 1024
        assert replayed(await call(middleware, scope(), body=pieces))
        too_big = await call(middleware, scope([(b"idempotency-key", b"k-2")]), body=(*pieces, *pieces))
        assert status(too_big) == 413 and len(received) > 1


def test_body_keeps_at_most_its_memory_bound() -> None:
    body = Body(limit=3 * IN_MEMORY)
    for _ in range(5):
        assert body.feed(b"y" * (IN_MEMORY // 2))
    assert body.whole() is None  # spooled: nothing of it held in memory
    assert b"".join(body.chunks()) == b"y" * (5 * IN_MEMORY // 2)
    assert not body.feed(b"y" * IN_MEMORY)  # past the limit: refused
    body.close()


def test_wsgi_too_large_is_413_without_reading_it(dedupe: Deduplicator) -> None:
    class Endless(io.RawIOBase):
        read_bytes = 0

        def read(self, n: int = -1) -> bytes:
            self.read_bytes += n
            return b"z" * n

    stream = Endless()
    env = {**environ(), "CONTENT_LENGTH": str(512 * 1024 * 1024), "wsgi.input": stream}
    middleware = WSGIIdempotencyMiddleware(lambda e, s: [], dedupe, scope=lambda r: "tenant",
                                           max_request_bytes=1024 * 1024)
    assert wsgi_call(middleware, env)[0].startswith("413") and stream.read_bytes == 0
    chunked = {**environ(), "CONTENT_LENGTH": "", "wsgi.input_terminated": True, "wsgi.input": stream}
    assert wsgi_call(middleware, chunked)[0].startswith("413") and stream.read_bytes <= 1024 * 1024 + 64 * 1024


def test_response_whose_stored_form_is_over_the_limit_is_replayed_without_body(redis_url: str,
                                                                               namespace: str) -> None:
    blob = (bytes(range(256)) * 56)[:14_200]
    headers = [("Content-Type", "application/octet-stream"),
               ("Content-Disposition", "attachment; filename=\"r\u00e9sum\u00e9\x01.bin\"")]
    runs: list[int] = []

    def app(env: dict[str, Any], start_response: Any) -> list[bytes]:
        runs.append(1)
        start_response("201 Created", headers)
        return [blob]

    for limit, whole in ((1_000_000, True), (19_000, False)):
        d = Deduplicator.from_url(redis_url, namespace=f"{namespace}-{limit}", compress_above=None,
                                  max_result_bytes=limit)
        middleware = WSGIIdempotencyMiddleware(app, d, scope=lambda r: "tenant", compress_above=None)
        first = wsgi_call(middleware, environ())
        again = wsgi_call(middleware, environ())
        assert first[0] == again[0] == "201 Created" and first[2] == blob
        assert ("idempotent-replayed", "true") in again[1]
        assert again[2] == (blob if whole else b"")
        assert (("idempotent-body-omitted", "true") in again[1]) is not whole
        d.close()
    assert len(runs) == 2


def test_replay_inflates_within_its_bound() -> None:
    bomb = {"v": 1, "s": 200, "h": [], "z": "deflate", "b": ""}
    import base64

    bomb["b"] = base64.b64encode(zlib.compress(b"\0" * 50_000_000)).decode()
    with pytest.raises(TooLarge):  # stops at the bound: never 50 MB in memory
        decode(bomb, 1_000_000)
    fine = encode(Response(200, (), b"a" * 5000), compress_above=100, compression="gzip")
    assert decode(fine, 5000) is not None
    with pytest.raises(TooLarge):
        decode(fine, 4999)
    assert decode({"v": 1, "s": 201, "h": [], "b": "%%%"}, 100) is None  # bad base64 is not an empty 201


def test_a_response_only_this_process_cannot_read_is_kept_and_not_run_again(redis_url: str, namespace: str) -> None:
    """A worker whose ``max_body_bytes`` is smaller than the one that stored a response answers
    its retry with a 503 and keeps the record, never runs the request a second time; a worker
    configured like the first still replays it."""
    body = b"\0" * (2 * 1024 * 1024)
    runs: list[int] = []

    def app(env: dict[str, Any], start_response: Any) -> list[bytes]:
        runs.append(1)
        start_response("201 Created", [("Content-Type", "application/octet-stream")])
        return [body]

    dedupe = Deduplicator.from_url(redis_url, namespace=namespace)
    stored_with = WSGIIdempotencyMiddleware(app, dedupe, scope=lambda r: "tenant", max_body_bytes=4 * 1024 * 1024)
    read_with = WSGIIdempotencyMiddleware(app, dedupe, scope=lambda r: "tenant", max_body_bytes=1024 * 1024)
    first = wsgi_call(stored_with, environ())
    retry = wsgi_call(read_with, environ())
    assert first[0] == "201 Created" and first[2] == body
    assert retry[0].startswith("503") and b"Stored response unavailable" in retry[2]
    assert ("idempotent-replayed", "true") not in retry[1]
    again = wsgi_call(stored_with, environ())  # the record was kept: replayed where it can be read
    assert again[0] == "201 Created" and again[2] == body and ("idempotent-replayed", "true") in again[1]
    assert len(runs) == 1
    dedupe.close()


@pytest.fixture
def accounts(postgres_dsn: str) -> Iterator[tuple[str, SqlOutcomes]]:
    table = f"http_accounts_{uuid.uuid4().hex[:8]}"
    outcomes = SqlOutcomes(postgres_dsn, table=f"http_outcome_{uuid.uuid4().hex[:8]}")
    outcomes.create_table()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id text PRIMARY KEY, balance int NOT NULL)")
        conn.execute(f"INSERT INTO {table} VALUES ('acme', 0)")
    yield table, outcomes
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {table}")
        conn.execute(f"DROP TABLE {outcomes.table}")


def lose_redis(redis_url: str, namespace: str) -> None:
    """What Redis losing its data does to the app: FLUSHALL on a private Redis, else the
    namespace's keys deleted (the shared one is never flushed)."""
    r = redis.Redis.from_url(redis_url)
    if r.connection_pool.connection_kwargs.get("port") != 6379:
        r.flushall()
    else:
        for name in r.scan_iter(f"{namespace}*"):
            r.delete(name)
    r.close()


@asyncio_test
async def test_atomic_endpoint_after_redis_lost_answers_from_the_committed_result(
        redis_url: str, namespace: str, postgres_dsn: str, accounts: tuple[str, SqlOutcomes]) -> None:
    table, outcomes = accounts
    app = FastAPI()
    dedupe = AsyncDeduplicator.from_url(redis_url, namespace=namespace, outcomes=outcomes)
    app.add_middleware(IdempotencyMiddleware, dedupe=dedupe, scope=lambda r: "tenant-1", required=True)

    @app.post("/payments", status_code=201)
    def pay(payment: dict[str, Any]) -> dict[str, Any]:
        with psycopg.connect(postgres_dsn) as conn, atomic(conn) as outcome:
            conn.execute(f"UPDATE {table} SET balance = balance + %s WHERE id = 'acme'", (payment["amount"],))
            outcome.result = {"paid": payment["amount"]}
        return outcome.result  # type: ignore[no-any-return]

    key = {"Idempotency-Key": str(uuid.uuid4())}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        first = await client.post("/payments", json={"amount": 7}, headers=key)
        assert first.status_code == 201 and first.json() == {"paid": 7}
        lose_redis(redis_url, namespace)
        retries = [await client.post("/payments", json={"amount": 7}, headers=key) for _ in range(3)]
    assert [r.status_code for r in retries] == [200, 200, 200]
    assert [(r.json(), r.headers.get("idempotent-replayed")) for r in retries] == [({"paid": 7}, "true")] * 3
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute(f"SELECT balance FROM {table}").fetchone() == (7,)  # one effect
    await dedupe.aclose()


def replayed_http(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


def test_flask_already_applied_is_answered_not_500(dedupe: Deduplicator) -> None:
    app = Flask(__name__)
    calls: list[int] = []

    @app.post("/pay")
    def pay() -> Any:
        calls.append(1)
        raise AlreadyApplied("k", {"paid": 7}, 3)

    app.wsgi_app = WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, dedupe, scope=lambda r: "tenant",
        already_applied=lambda exc: Response(202, (("content-type", "text/plain"),), b"done before"))
    client = app.test_client()
    answers = [client.post("/pay", data=b"{}", headers={"Idempotency-Key": "k-9"}) for _ in range(2)]
    assert [a.status_code for a in answers] == [202, 202] and answers[0].data == b"done before"
    assert all(a.headers["Idempotent-Replayed"] == "true" for a in answers)
    assert calls == [1]  # stored under the key: the retry is a replay, never a second run


def test_http_answers_are_counted(dedupe: Deduplicator) -> None:
    registry = prometheus_client.CollectorRegistry()
    observer = _base.current.enable(MetricsObserver(registry))
    try:
        middleware = WSGIIdempotencyMiddleware(
            lambda e, s: (s("201 Created", []), [b"ok"])[1], dedupe, required=True, max_request_bytes=10,
            scope=lambda r: r.header("authorization"))
        wsgi_call(middleware, {**environ(), "HTTP_AUTHORIZATION": "a"})
        wsgi_call(middleware, {**environ(), "HTTP_AUTHORIZATION": "a"})
        wsgi_call(middleware, {**environ(b'{"x": 1}'), "HTTP_AUTHORIZATION": "a"})
        wsgi_call(middleware, {**environ(b"x" * 11), "HTTP_AUTHORIZATION": "a"})
        wsgi_call(middleware, environ())
        no_key = environ()
        del no_key["HTTP_IDEMPOTENCY_KEY"]
        wsgi_call(middleware, no_key)
    finally:
        _base.current.disable(observer)

    def count(answer: str) -> float:
        return registry.get_sample_value("dedupe_http_requests_total", {"answer": answer}) or 0.0

    assert [count(a) for a in ("ran", "replayed", "mismatch", "too_large", "scope_refused", "missing_key")] == \
        [1, 1, 1, 1, 1, 1]


def test_asgi_user_scope_reads_starlette_user(redis_url: str, namespace: str) -> None:
    from starlette.authentication import SimpleUser, UnauthenticatedUser

    from dedupe_worker.http import RequestInfo, asgi_user_scope, header_scope

    assert asgi_user_scope(RequestInfo("POST", "/", raw={"user": SimpleUser("ann")})) == "user:ann"
    assert asgi_user_scope(RequestInfo("POST", "/", raw={"user": UnauthenticatedUser()})) is None
    assert asgi_user_scope(RequestInfo("POST", "/", raw={})) is None
    by_key = header_scope("X-Api-Key")
    assert by_key(RequestInfo("POST", "/", headers=(("x-api-key", "k1"),))) != \
        by_key(RequestInfo("POST", "/", headers=(("x-api-key", "k2"),)))
    assert by_key(RequestInfo("POST", "/")) is None
    _ = Request  # FastAPI's Request: the docs examples use it through request.raw

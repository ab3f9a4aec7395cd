"""The ASGI and WSGI middleware called directly (no server) on real Redis, for what a server
hides: an app that raises, a response cut off, a client that leaves, a body sent in pieces, a
store that is down."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from dedupe_worker import Deduplicator
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.http import IdempotencyMiddleware, WSGIIdempotencyMiddleware, current_claim, header_scope

KEY = [(b"idempotency-key", b'"k-1"')]
SCOPE = header_scope("idempotency-key")  # every request of these tests has one caller
asyncio_test = pytest.mark.asyncio


def scope(headers: list[tuple[bytes, bytes]] = KEY, method: str = "POST") -> dict[str, Any]:
    return {"type": "http", "method": method, "path": "/pay", "query_string": b"", "headers": headers}


async def call(app: Any, scope: dict[str, Any], body: tuple[bytes, ...] = (b"{}",), fail_send: bool = False,
               disconnect: bool = False) -> list[dict[str, Any]]:
    """Drive an ASGI app once; the messages it sent."""
    incoming = [{"type": "http.request", "body": b, "more_body": i < len(body) - 1} for i, b in enumerate(body)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        if disconnect:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if fail_send and message["type"] == "http.response.body":
            raise OSError("client went away")
        sent.append(message)

    await app(scope, receive, send)
    return sent


def status(sent: list[dict[str, Any]]) -> int:
    return int(sent[0]["status"])


def replayed(sent: list[dict[str, Any]]) -> bool:
    return (b"idempotent-replayed", b"true") in sent[0]["headers"]


@pytest.fixture
def adedupe(redis_url: str, namespace: str) -> Iterator[AsyncDeduplicator]:
    yield AsyncDeduplicator.from_url(redis_url, namespace=namespace, lease=5.0, result_ttl=60.0)


class Counting:
    """An ASGI app that counts its runs and answers 201 with the body it read, or as told."""

    def __init__(self, mode: str = "ok") -> None:
        self.runs = 0
        self.mode = mode
        self.bodies: list[bytes] = []
        self.claims: list[Any] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.runs += 1
        self.claims.append(current_claim())
        message = await receive()
        self.bodies.append(message["body"])
        if self.mode == "raise" and self.runs == 1:
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"part one, ", "more_body": True})
        if self.mode == "cut" and self.runs == 1:
            return  # stopped streaming (as Starlette does when the client disconnects)
        await send({"type": "http.response.body", "body": b"part two", "more_body": False})


@asyncio_test
async def test_asgi_exception_releases_the_key(adedupe: AsyncDeduplicator) -> None:
    app = Counting("raise")
    middleware = IdempotencyMiddleware(app, adedupe, scope=SCOPE)
    with pytest.raises(RuntimeError):
        await call(middleware, scope())
    sent = await call(middleware, scope())
    assert status(sent) == 201 and not replayed(sent) and app.runs == 2
    again = await call(middleware, scope())
    assert replayed(again) and b"".join(m.get("body", b"") for m in again[1:]) == b"part one, part two"
    assert app.runs == 2
    await adedupe.aclose()


@asyncio_test
@pytest.mark.parametrize("how", ["cut", "send fails"])
async def test_asgi_response_cut_off_releases_the_key(adedupe: AsyncDeduplicator, how: str) -> None:
    app = Counting("cut" if how == "cut" else "ok")
    middleware = IdempotencyMiddleware(app, adedupe, scope=SCOPE)
    if how == "cut":
        await call(middleware, scope())
    else:
        with pytest.raises(OSError):
            await call(middleware, scope(), fail_send=True)
    sent = await call(middleware, scope())
    assert not replayed(sent) and app.runs == 2
    assert replayed(await call(middleware, scope()))
    await adedupe.aclose()


@asyncio_test
async def test_asgi_body_in_pieces_reaches_the_app_intact_and_claim_is_current(adedupe: AsyncDeduplicator) -> None:
    app = Counting()
    middleware = IdempotencyMiddleware(app, adedupe, scope=SCOPE)
    await call(middleware, scope(), body=(b'{"a": ', b"1", b"}"))
    assert app.bodies == [b'{"a": 1}']
    assert app.claims[0] is not None and app.claims[0].key.startswith("http:")
    other = await call(middleware, scope(), body=(b'{"a": 2}',))  # same key, other body
    assert status(other) == 422
    await adedupe.aclose()


@asyncio_test
async def test_asgi_client_gone_before_the_body_runs_nothing(adedupe: AsyncDeduplicator) -> None:
    app = Counting()
    sent = await call(IdempotencyMiddleware(app, adedupe, scope=SCOPE), scope(), body=(), disconnect=True)
    assert sent == [] and app.runs == 0
    await adedupe.aclose()


@asyncio_test
async def test_asgi_store_down_is_503_and_app_not_run() -> None:
    app = Counting()
    down = AsyncDeduplicator.from_url("redis://127.0.0.1:1/0", namespace="down")
    sent = await call(IdempotencyMiddleware(app, down, scope=SCOPE), scope())
    assert status(sent) == 503 and app.runs == 0
    assert (b"content-type", b"application/problem+json") in sent[0]["headers"]
    await down.aclose()
    fail_open = AsyncDeduplicator.from_url("redis://127.0.0.1:1/0", namespace="down", fail_open=True)
    sent = await call(IdempotencyMiddleware(app, fail_open, scope=SCOPE), scope())
    assert status(sent) == 201 and app.runs == 1 and app.bodies == [b"{}"]  # run without a claim
    await fail_open.aclose()


@asyncio_test
async def test_asgi_other_scopes_pass_through(adedupe: AsyncDeduplicator) -> None:
    seen = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    await IdempotencyMiddleware(app, adedupe, scope=SCOPE)({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    assert seen == ["lifespan"]
    await adedupe.aclose()


def environ(body: bytes = b"{}") -> dict[str, Any]:
    return {"REQUEST_METHOD": "POST", "PATH_INFO": "/pay", "QUERY_STRING": "", "CONTENT_LENGTH": str(len(body)),
            "CONTENT_TYPE": "application/json", "HTTP_IDEMPOTENCY_KEY": "k-1", "wsgi.input": io.BytesIO(body)}


def wsgi_call(app: Any, env: dict[str, Any], consume: int | None = None) -> tuple[str, list[Any], bytes]:
    started: list[Any] = []
    written: list[bytes] = []

    def start_response(status: str, headers: list[Any], exc_info: Any = None) -> Any:
        started[:] = [status, headers]
        return written.append

    result = app(env, start_response)
    try:
        for i, chunk in enumerate(result):
            if consume is not None and i >= consume:
                break
            written.append(chunk)
    finally:
        getattr(result, "close", lambda: None)()
    return started[0], started[1], b"".join(written)


class WsgiCounting:
    def __init__(self, mode: str = "ok") -> None:
        self.runs = 0
        self.mode = mode
        self.bodies: list[bytes] = []

    def __call__(self, env: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        self.runs += 1
        self.bodies.append(env["wsgi.input"].read(int(env["CONTENT_LENGTH"])))
        if self.mode == "raise" and self.runs == 1:
            raise RuntimeError("boom")
        write = start_response("200 OK", [("Content-Type", "text/plain")])
        write(b"written, ")  # the legacy write() path is recorded too
        return iter([b"one, ", b"two"])


def test_wsgi_exception_and_early_close_release(dedupe: Deduplicator) -> None:
    app = WsgiCounting("raise")
    middleware = WSGIIdempotencyMiddleware(app, dedupe, scope=SCOPE)
    with pytest.raises(RuntimeError):
        wsgi_call(middleware, environ())
    wsgi_call(middleware, environ(), consume=1)  # the server stopped after one chunk (client gone)
    status, headers, body = wsgi_call(middleware, environ())
    assert app.runs == 3 and ("idempotent-replayed", "true") not in headers
    status, headers, again = wsgi_call(middleware, environ())
    assert ("idempotent-replayed", "true") in headers and again == body == b"written, one, two"
    assert status == "200 OK" and app.runs == 3 and app.bodies[-1] == b"{}"


def test_store_down_wsgi_is_503(namespace: str) -> None:
    down = Deduplicator(redis.Redis(port=1), namespace=namespace)
    app = WsgiCounting()
    status, headers, _ = wsgi_call(WSGIIdempotencyMiddleware(app, down, scope=SCOPE), environ())
    assert status.startswith("503") and app.runs == 0 and ("retry-after", "1") in headers
    down.close()


def test_wsgi_response_with_content_length_is_stored_before_its_last_chunk_is_written(dedupe: Deduplicator) -> None:
    def app(env: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("201 Created", [("Content-Type", "text/plain"), ("Content-Length", "6")])
        return [b"abc", b"def"]

    middleware = WSGIIdempotencyMiddleware(app, dedupe, scope=SCOPE)
    body = middleware(environ(), lambda status, headers, exc_info=None: None)
    chunks = iter(body)
    assert next(chunks) == b"abc"
    assert wsgi_call(middleware, environ())[0].startswith("409")  # still running
    assert next(chunks) == b"def"  # handed to the server: already stored
    status, headers, replay = wsgi_call(middleware, environ())
    assert status == "201 Created" and replay == b"abcdef" and ("idempotent-replayed", "true") in headers
    body.close()  # type: ignore[attr-defined]


@asyncio_test
async def test_asgi_response_is_stored_before_its_last_chunk_goes_out(adedupe: AsyncDeduplicator) -> None:
    app = Counting()
    middleware = IdempotencyMiddleware(app, adedupe, scope=SCOPE)
    seen_in_send: list[list[dict[str, Any]]] = []
    inner = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict[str, Any]:
        return inner.pop(0) if inner else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            seen_in_send.append(await call(middleware, scope()))  # a retry at that very moment

    await middleware(scope(), receive, send)
    assert replayed(seen_in_send[0]) and app.runs == 1
    await adedupe.aclose()

"""Conformance: the examples of draft-ietf-httpapi-idempotency-key-header and the HTTP scenarios of
idemkit's spec/conformance.yaml, written here as tests of our own against a FastAPI app behind
``IdempotencyMiddleware`` on real Redis. Where the two lists disagree this follows the draft, and
where this library deliberately differs the test says so (docs/http.md, "Conformance").

Differences kept on purpose: the replay header is ``Idempotent-Replayed`` (Stripe's and the
draft's discussion), not ``Idempotency-Replayed``; an in-flight retry past ``wait`` is the draft's
409, not 423; problem ``type``s are ``<docs_url>#<slug>``, not ``urn:idemkit:*``; a response
body over ``max_body_bytes`` is stored without its body and its retry replays status and headers
(``Idempotent-Body-Omitted: true``) rather than running the request again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.http import IdempotencyMiddleware, RequestInfo
from dedupe_worker.http._body import Body

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

DRAFT_DETAIL = "This operation is idempotent and it requires correct usage of Idempotency Key."


class Api:
    """A FastAPI app whose ``/resources`` counts its runs; the caller is ``X-Caller``."""

    def __init__(self, dedupe: AsyncDeduplicator, **options: Any) -> None:
        self.calls = 0
        self.app = FastAPI()
        self.app.add_middleware(IdempotencyMiddleware, dedupe=dedupe, scope=lambda r: r.header("x-caller"),
                                docs_url="https://developer.example.com/idempotency", **options)
        self.delay = 0.0
        self.status = 201
        self.headers: dict[str, str] = {}

        @self.app.post("/resources")
        async def create(request: Request) -> Any:
            self.calls += 1
            body = await request.json()
            await asyncio.sleep(self.delay)
            return JSONResponse({"name": body["name"], "caller": request.headers.get("x-caller"), "n": self.calls},
                                status_code=self.status, headers=self.headers)

        @self.app.post("/report")
        async def report() -> StreamingResponse:
            self.calls += 1

            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(2):
                    yield b"r" * 1024

            return StreamingResponse(chunks(), status_code=200)  # no Content-Length: bytes are counted

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://api")


@pytest_asyncio.fixture
async def adedupe(redis_url: str, namespace: str) -> AsyncIterator[AsyncDeduplicator]:
    async with AsyncDeduplicator.from_url(redis_url, namespace=namespace, lease=5.0) as d:
        yield d


def headers(key: str | None = None, caller: str = "tenant-A:user-1") -> dict[str, str]:
    out = {"X-Caller": caller, "Content-Type": "application/json"}
    if key is not None:
        out["Idempotency-Key"] = key
    return out


def replayed(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


async def test_draft_key_is_a_structured_field_string(adedupe: AsyncDeduplicator) -> None:
    api = Api(adedupe, required=True)
    async with api.client() as c:
        key = "8e03978e-40d5-43e8-bc93-6894a57f9324"
        first = await c.post("/resources", content=b'{"name": "x"}', headers=headers(f'"{key}"'))
        again = await c.post("/resources", content=b'{"name": "x"}', headers=headers(key))  # bare: the same key
    assert first.status_code == again.status_code == 201 and replayed(again) and api.calls == 1


async def test_basic_replay(adedupe: AsyncDeduplicator) -> None:
    api = Api(adedupe)
    async with api.client() as c:
        first = await c.post("/resources", content=b'{"name": "x"}', headers=headers("K1"))
        again = await c.post("/resources", content=b'{"name": "x"}', headers=headers("K1"))
    assert first.status_code == 201 and not replayed(first)
    assert again.status_code == 201 and replayed(again) and again.content == first.content and api.calls == 1


async def test_payload_mismatch_is_the_drafts_422(adedupe: AsyncDeduplicator) -> None:
    api = Api(adedupe)
    async with api.client() as c:
        await c.post("/resources", content=b'{"name": "x"}', headers=headers("K2"))
        other = await c.post("/resources", content=b'{"name": "y"}', headers=headers("K2"))
    assert other.status_code == 422 and other.headers["content-type"] == "application/problem+json"
    problem = other.json()
    assert problem["title"] == "Idempotency-Key is already used" and problem["detail"].startswith(DRAFT_DETAIL)
    assert problem["type"] == "https://developer.example.com/idempotency#key-reused" and api.calls == 1


async def test_concurrent_same_key_runs_exactly_once(adedupe: AsyncDeduplicator) -> None:
    api = Api(adedupe, wait=5.0)
    api.delay = 0.3
    async with api.client() as c:
        answers = await asyncio.gather(*(c.post("/resources", content=b'{"name": "x"}', headers=headers("K3"))
                                         for _ in range(50)))
    assert api.calls == 1 and len({a.content for a in answers}) == 1
    assert {a.status_code for a in answers} == {201} and sum(map(replayed, answers)) == 49


async def test_in_flight_wait_then_replay(adedupe: AsyncDeduplicator) -> None:
    api = Api(adedupe, wait=2.0)
    api.delay = 0.5
    async with api.client() as c:
        first = asyncio.ensure_future(c.post("/resources", content=b'{"name": "x"}', headers=headers("K4")))
        await asyncio.sleep(0.1)
        second = await c.post("/resources", content=b'{"name": "x"}', headers=headers("K4"))
        assert (await first).status_code == 201
    assert second.status_code == 201 and replayed(second) and api.calls == 1


async def test_in_flight_wait_timeout_is_the_drafts_409_with_retry_after(adedupe: AsyncDeduplicator) -> None:
    api = Api(adedupe, wait=0.2)
    api.delay = 1.5
    async with api.client() as c:
        first = asyncio.ensure_future(c.post("/resources", content=b'{"name": "x"}', headers=headers("K5")))
        await asyncio.sleep(0.05)
        second = await c.post("/resources", content=b'{"name": "x"}', headers=headers("K5"))
        await first
    assert second.status_code == 409 and second.json()["title"] == "A request is outstanding for this Idempotency-Key"
    assert second.json()["type"].endswith("#request-outstanding") and int(second.headers["retry-after"]) == 1
    assert api.calls == 1


async def test_crash_recovery_after_lease_expiry(redis_url: str, namespace: str) -> None:
    async with AsyncDeduplicator.from_url(redis_url, namespace=namespace, lease=0.3) as dedupe:
        api = Api(dedupe)
        middleware = IdempotencyMiddleware(api.app, dedupe, scope=lambda r: r.header("x-caller"))
        request = RequestInfo("POST", "/resources", "", (("content-type", "application/json"),
                                                          ("x-caller", "tenant-A:user-1")))
        body = Body(100)
        body.feed(b'{"name": "x"}')
        attempt = middleware.rules.attempt(request, "K6", "tenant-A:user-1", body.digest())
        crashed = await dedupe.begin(attempt.key, fingerprint=attempt.fingerprint)  # claimed, then the process died
        assert crashed.acquired
        await asyncio.sleep(0.6)
        async with api.client() as c:
            after = await c.post("/resources", content=b'{"name": "x"}', headers=headers("K6"))
    assert after.status_code == 201 and not replayed(after) and api.calls == 1


async def test_5xx_is_not_cached(adedupe: AsyncDeduplicator) -> None:
    api = Api(adedupe)
    api.status = 500
    async with api.client() as c:
        assert (await c.post("/resources", content=b'{"name": "x"}', headers=headers("K7"))).status_code == 500
        api.status = 201
        retry = await c.post("/resources", content=b'{"name": "x"}', headers=headers("K7"))
    assert retry.status_code == 201 and not replayed(retry) and api.calls == 2


async def test_cross_tenant_isolation(adedupe: AsyncDeduplicator) -> None:
    api = Api(adedupe)
    async with api.client() as c:
        a = await c.post("/resources", content=b'{"name": "x"}', headers=headers("K8", "tenant-A:user-1"))
        b = await c.post("/resources", content=b'{"name": "x"}', headers=headers("K8", "tenant-B:user-2"))
    assert "tenant-A" in a.text and "tenant-B" in b.text and not replayed(b) and api.calls == 2


async def test_missing_key_when_required_is_the_drafts_400(adedupe: AsyncDeduplicator) -> None:
    api = Api(adedupe, required=True)
    async with api.client() as c:
        missing = await c.post("/resources", content=b'{"name": "x"}', headers=headers())
    assert missing.status_code == 400 and missing.json()["title"] == "Idempotency-Key is missing"
    assert missing.json()["detail"] == DRAFT_DETAIL and missing.json()["type"].endswith("#missing-key")
    assert api.calls == 0


async def test_response_headers_preserved_cookies_not(adedupe: AsyncDeduplicator) -> None:
    api = Api(adedupe)
    api.headers = {"Location": "/resources/abc123", "ETag": '"v1"', "Set-Cookie": "session=secret-value"}
    async with api.client() as c:
        await c.post("/resources", content=b'{"name": "x"}', headers=headers("K10"))
        again = await c.post("/resources", content=b'{"name": "x"}', headers=headers("K10"))
    assert again.headers["location"] == "/resources/abc123" and again.headers["etag"] == '"v1"'
    assert "set-cookie" not in again.headers and replayed(again) and api.calls == 1


async def test_corrupt_record_is_treated_as_absent(adedupe: AsyncDeduplicator, redis_url: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    api = Api(adedupe)
    async with api.client() as c:
        await c.post("/resources", content=b'{"name": "x"}', headers=headers("K11"))
        r = redis.Redis.from_url(redis_url)
        for name in r.scan_iter(f"{adedupe.layout.namespace}:*"):
            if r.type(name) == b"hash" and r.hexists(name, "v"):
                r.hset(name, "v", b'{"v": 1, "s": 201, "h": [], "b": "tru')  # cut short
            elif r.type(name) == b"string":
                r.set(name, r.get(name)[:-10])  # type: ignore[index]
        r.close()
        after = await c.post("/resources", content=b'{"name": "x"}', headers=headers("K11"))
    assert after.status_code == 201 and not replayed(after) and api.calls == 2
    assert sum("treated as absent" in m for m in caplog.messages) == 1  # logged once


async def test_body_over_the_size_limit_counts_streamed_bytes(adedupe: AsyncDeduplicator) -> None:
    api = Api(adedupe, max_body_bytes=1024)
    async with api.client() as c:
        first = await c.post("/report", content=b"{}", headers=headers("K12"))
        again = await c.post("/report", content=b"{}", headers=headers("K12"))
    assert first.status_code == 200 and len(first.content) == 2048 and "content-length" not in first.headers
    # deliberate difference: kept as status and headers, replayed without its body, not run again
    assert again.status_code == 200 and again.content == b"" and again.headers["idempotent-body-omitted"] == "true"
    assert api.calls == 1

"""What the ASGI Idempotency-Key middleware adds to a request, against the same app without it.

    python -m bench.http_middleware [--redis-url URL] [--seconds S]

The app is a FastAPI endpoint that parses a small JSON body and answers 201 with JSON, driven
in-process with raw ASGI calls (no server, no HTTP client: their noise would hide what is
measured). Cases, each in µs per request, taking turns in short rounds, each the median of its
rounds:

- ``app``: the app alone (the baseline: a trivial endpoint);
- ``first-seen``: through ``IdempotencyMiddleware``, a new key every request (claim, run the app,
  store the response: two scripts);
- ``replay``: through the middleware, the same key every time (one script; the stored response
  is sent without running the app);
- ``claim+complete``: the two scripts first-seen runs, awaited straight on the
  ``AsyncDeduplicator`` (``begin`` a new key, ``complete`` it with a response-sized value);
- ``claim stored``: the one script a replay runs (``begin`` of a key whose response is stored);
- ``2 PINGs``: two round trips on the same ``redis.asyncio`` client, no script.

Printed with what the middleware adds to first-seen and to a replay beyond the scripts it runs
(its own Python), the round trips those are, and whether a replay is faster than running the
endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio
from fastapi import FastAPI

from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.http import IdempotencyMiddleware

BODY = b'{"account": "acme", "amount": 10}'
#: A case: run ``n`` requests, return the seconds they took.
Case = Callable[[int], Awaitable[float]]


def endpoint() -> FastAPI:
    app = FastAPI()

    @app.post("/payments", status_code=201)
    async def create_payment(payment: dict[str, Any]) -> dict[str, Any]:
        return {"id": 1, "amount": payment["amount"]}

    return app


async def call(app: Any, key: bytes | None) -> int:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
    if key is not None:
        headers.append((b"idempotency-key", key))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/payments", "raw_path": b"/payments", "root_path": "", "query_string": b"", "headers": headers,
             "server": ("bench", 80), "client": ("127.0.0.1", 1)}
    status = 0

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


def cases(app: Any, wrapped: Any, client: redis.asyncio.Redis) -> dict[str, Case]:
    replay_key = f'"{uuid.uuid4()}"'.encode()

    async def plain(n: int) -> float:
        began = time.perf_counter()
        for _ in range(n):
            await call(app, None)
        return time.perf_counter() - began

    async def first_seen(n: int) -> float:
        keys = [f'"{uuid.uuid4()}"'.encode() for _ in range(n)]
        began = time.perf_counter()
        for key in keys:
            await call(wrapped, key)
        return time.perf_counter() - began

    async def replay(n: int) -> float:
        began = time.perf_counter()
        for _ in range(n):
            await call(wrapped, replay_key)
        return time.perf_counter() - began

    async def round_trips(n: int) -> float:
        began = time.perf_counter()
        for _ in range(n):
            await client.ping()
            await client.ping()
        return time.perf_counter() - began

    dedupe: AsyncDeduplicator = wrapped.dedupe
    value = {"v": 1, "s": 201, "h": [["content-length", "25"], ["content-type", "application/json"]],
             "b": "eyJpZCI6MSwiYW1vdW50IjoxMH0="}

    async def claim_complete(n: int) -> float:
        keys = [f"http:{uuid.uuid4().hex}" for _ in range(n)]
        began = time.perf_counter()
        for key in keys:
            claim = await dedupe.begin(key, fingerprint="f" * 32)
            await dedupe.complete(claim, value)
        return time.perf_counter() - began

    stored_key = f"http:{uuid.uuid4().hex}"

    async def claim_stored(n: int) -> float:
        began = time.perf_counter()
        for _ in range(n):
            await dedupe.begin(stored_key, fingerprint="f" * 32)
        return time.perf_counter() - began

    async def prepare() -> None:
        await dedupe.complete(await dedupe.begin(stored_key, fingerprint="f" * 32), value)

    prepared.append(prepare)
    return {"app": plain, "first-seen": first_seen, "replay": replay, "claim+complete": claim_complete,
            "claim stored": claim_stored, "2 PINGs": round_trips}


prepared: list[Callable[[], Awaitable[None]]] = []


async def measure(redis_url: str, seconds: float, rounds: int = 7) -> dict[str, float]:
    """µs per request of each case, the median of ``rounds`` rounds taken in turn."""
    client = redis.asyncio.Redis.from_url(redis_url)
    dedupe = AsyncDeduplicator(client, namespace=f"bench-http-{uuid.uuid4().hex[:8]}", result_ttl=120.0)
    app = endpoint()
    wrapped = IdempotencyMiddleware(app, dedupe, scope=lambda request: "bench-tenant", required=True)
    chosen = cases(app, wrapped, client)
    for prepare in prepared:
        await prepare()
    assert await call(wrapped, b'"warm"') == 201 and await call(wrapped, b'"warm"') == 201
    for case in chosen.values():  # warm up, and size a round to about seconds / rounds
        await case(50)
    per: dict[str, list[float]] = {name: [] for name in chosen}
    sizes = {}
    for name, case in chosen.items():
        took = await case(200) / 200
        sizes[name] = max(50, int(seconds / rounds / len(chosen) / took))
    for _ in range(rounds):
        for name, case in chosen.items():
            per[name].append(await case(sizes[name]) / sizes[name] * 1e6)
    await dedupe.aclose()
    await client.aclose()
    return {name: statistics.median(values) for name, values in per.items()}


def report(us: dict[str, float]) -> str:
    added = us["first-seen"] - us["app"]
    lines = [f"  {name:<15} {value:8.1f} µs/request" for name, value in us.items()]
    lines.append(f"  first-seen adds {added:.1f} µs to the app: the two scripts ({us['claim+complete']:.1f} µs;"
                 f" two plain round trips {us['2 PINGs']:.1f} µs) and {added - us['claim+complete']:.1f} µs"
                 " of middleware")
    lines.append(f"  replay: one script ({us['claim stored']:.1f} µs) and {us['replay'] - us['claim stored']:.1f} µs"
                 f" of middleware; replay / app {us['replay'] / us['app']:.2f}x"
                 f" ({'faster' if us['replay'] < us['app'] else 'slower'} than running the endpoint)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--seconds", type=float, default=6.0, help="in total, spread over 7 rounds")
    parser.add_argument("--label", default=f"pid {os.getpid()}, cpus {sorted(os.sched_getaffinity(0))}")
    args = parser.parse_args()
    print(f"[http middleware (ASGI, in-process): {args.label}]", flush=True)
    print(report(asyncio.run(measure(args.redis_url, args.seconds))), flush=True)


if __name__ == "__main__":
    main()

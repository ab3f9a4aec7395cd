"""FastAPI on the ASGI middleware: every path goes to :func:`common.handle`."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.http import IdempotencyMiddleware

from . import common

app = FastAPI()
app.add_middleware(IdempotencyMiddleware, dedupe=AsyncDeduplicator.from_url(common.REDIS_URL,
                   namespace=common.NAMESPACE, lease=10.0), **common.OPTIONS)


@app.api_route("/{path:path}", methods=["GET", "POST", "PATCH"])
async def anything(request: Request) -> Response:
    body = await request.body()
    from starlette.concurrency import run_in_threadpool

    status, headers, content = await run_in_threadpool(
        common.handle, request.method, request.url.path, request.url.query, dict(request.headers), body)
    if isinstance(content, bytes):
        response = Response(content, status_code=status)
    else:
        response = StreamingResponse(content, status_code=status)
    for name, value in headers:
        response.headers.append(name, value)
    return response

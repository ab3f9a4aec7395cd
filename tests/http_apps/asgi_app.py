"""FastAPI on the ASGI middleware, with Starlette's cookie sessions: every path goes to
:func:`common.handle`; the scope is the session's user, a bearer token's subject or the visitor."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.middleware.sessions import SessionMiddleware

from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.http import IdempotencyMiddleware, RequestInfo

from . import common


def scope(request: RequestInfo) -> str | None:
    session = request.raw.get("session") or {}
    return common.principal(session.get("user"), session.get("visitor"), request.header("authorization"))


app = FastAPI()
# added first, so it runs inside SessionMiddleware (add_middleware wraps): the session is read
app.add_middleware(IdempotencyMiddleware, dedupe=AsyncDeduplicator.from_url(common.REDIS_URL,
                   namespace=common.NAMESPACE, lease=10.0), scope=scope, **common.OPTIONS)
app.add_middleware(SessionMiddleware, secret_key="not-secret")


@app.api_route("/{path:path}", methods=["GET", "POST", "PATCH"])
async def anything(request: Request) -> Response:
    session = common.session_reply(request.url.path, request.session)
    if session is not None:
        return Response(session[1], status_code=session[0])
    body = await request.body()
    from starlette.concurrency import run_in_threadpool

    who = scope(RequestInfo("POST", "", "", tuple(request.headers.items()), request.scope))
    status, headers, content = await run_in_threadpool(
        common.handle, request.method, request.url.path, request.url.query, dict(request.headers), body, who)
    if isinstance(content, bytes):
        response = Response(content, status_code=status)
    else:
        response = StreamingResponse(content, status_code=status)
    for name, value in headers:
        response.headers.append(name, value)
    return response

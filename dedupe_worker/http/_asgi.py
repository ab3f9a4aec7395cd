"""``IdempotencyMiddleware``: the Idempotency-Key layer for any ASGI app, on an ``AsyncDeduplicator``.

Pure ASGI (no Starlette import), so it wraps FastAPI, Starlette, Quart or a bare ASGI callable::

    app.add_middleware(IdempotencyMiddleware, dedupe=AsyncDeduplicator.from_url(url), required=True)

The rules are :class:`~dedupe_worker.http.IdempotencyRules`' (shared with the WSGI and
Django middleware); this module only moves ASGI messages. The request body is read once, before
the claim (its hash is part of the fingerprint), at most ``max_request_bytes`` of it (past that,
a 413 and nothing more is read), held in memory up to 1 MiB and spooled beyond, and handed to the
app intact. An :class:`~dedupe_worker.AlreadyApplied` out of the app (``atomic()`` found the
effect committed) is answered from the committed result and stored under the key. The response streams to
the client as the app sends it; it is stored when the app hands over its last chunk, before that
chunk goes out (so a client that received the whole response finds it stored).

On a crash: an exception in the app, a response cut off, or a cancelled task releases the key, so
the client's retry runs the request again; a process killed mid-request leaves the key held until
its lease runs out (a retry gets 409 meanwhile).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Literal

from .._errors import AlreadyApplied, LeaseLost, StoreUnavailable
from .._protocol import Claim, drive_async
from ..asyncio._deduplicator import AsyncDeduplicator
from ._body import Body, declared_length
from ._claiming import Begin, Forget, claim_flow
from ._recorder import Recorder, Settle, stored_size
from ._request import RequestInfo
from ._rules import Attempt, IdempotencyRules
from ._stored import Response

__all__ = ["IdempotencyMiddleware"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def request_info(scope: Scope) -> RequestInfo:
    """The :class:`RequestInfo` of an ASGI HTTP scope (``path`` as the scope has it)."""
    return RequestInfo(
        scope["method"],
        scope["path"],
        scope.get("query_string", b"").decode("latin-1"),
        tuple((name.decode("latin-1").lower(), value.decode("latin-1")) for name, value in scope.get("headers", ())),
        scope,
    )


async def send_response(send: Send, response: Response) -> None:
    """Send a complete :class:`Response` as two ASGI messages."""
    await send({"type": "http.response.start", "status": response.status,
                "headers": [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.headers]})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


async def read_body(receive: Receive, request: RequestInfo, limit: int) -> Body | Literal[False] | None:
    """The request body, read as it arrives into a :class:`Body` of at most ``limit`` bytes;
    ``False`` when it is over ``limit`` (announced by ``Content-Length``, or found so while
    reading: nothing more is read); ``None`` when the client went away before sending it."""
    declared = declared_length(request.header("content-length"))
    if declared is not None and declared > limit:
        return False
    body = Body(limit)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            body.close()
            return None
        if not body.feed(message.get("body", b"")):
            body.close()
            return False
        if not message.get("more_body", False):
            return body


class IdempotencyMiddleware:
    """ASGI middleware applying the Idempotency-Key rules (see :class:`IdempotencyRules`, whose
    options it takes as keywords, or whole as ``rules=``) with ``dedupe`` as the store.

    Inside the request, :func:`~dedupe_worker.current_claim` is the claim (key and fencing token),
    and its lease is renewed while the app runs.
    """

    def __init__(self, app: ASGIApp, dedupe: AsyncDeduplicator, *, rules: IdempotencyRules | None = None,
                 **options: Any) -> None:
        self.app = app
        self.dedupe = dedupe
        self.rules = rules if rules is not None else IdempotencyRules(**options)
        self._measure = stored_size(dedupe)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = request_info(scope)
        screened = self.rules.screen(request)
        if screened is None:
            await self.app(scope, receive, send)
            return
        if isinstance(screened, Response):
            await send_response(send, screened)
            return
        caller = self.rules.caller(request)
        if isinstance(caller, Response):
            await send_response(send, caller)
            return
        body = await read_body(receive, request, self.rules.max_request_bytes)
        if body is None:
            return  # the client left before its request was read: nothing ran, nothing to answer
        if body is False:
            await send_response(send, self.rules.too_large())
            return
        try:
            await self._claimed(scope, request, self.rules.attempt(request, screened, caller, body.digest()), body,
                                receive, send)
        finally:
            body.close()

    async def _claimed(self, scope: Scope, request: RequestInfo, attempt: Attempt, body: Body, receive: Receive,
                       send: Send) -> None:
        ttl = self.rules.request_ttl(request)

        perform: dict[type[Any], Callable[[Any], Awaitable[Any]]] = {
            Begin: lambda _: self.dedupe.begin(attempt.key, fingerprint=attempt.fingerprint, wait=attempt.wait,
                                               ttl=ttl),
            Forget: lambda forget: self.dedupe.forget(attempt.key, token=forget.token, force=True),
        }
        claim, answer = await drive_async(claim_flow(self.rules, attempt, self.dedupe.fail_open), perform)
        if answer is not None:
            await send_response(send, answer)
        elif claim is None:
            await self.app(scope, _replaying(body, receive), send)
        else:
            await self._run(scope, request, body, receive, send, claim)

    async def _run(self, scope: Scope, request: RequestInfo, body: Body, receive: Receive, send: Send,
                   claim: Claim) -> None:
        recorder = self.rules.recorder(request)
        settled = False

        async def recording_send(message: Message) -> None:
            nonlocal settled
            kind = message["type"]
            if kind == "http.response.start":
                headers = recorder.start(message["status"], [(name.decode("latin-1"), value.decode("latin-1"))
                                                             for name, value in message.get("headers", ())])
                message = {**message, "headers": [(name.encode("latin-1"), value.encode("latin-1"))
                                                  for name, value in headers]}
            elif kind == "http.response.body":
                recorder.body(message.get("body", b""))
                if not message.get("more_body", False):
                    # stored before the last chunk goes out: a client that got it all can get it again
                    settled = True
                    await self._settle(claim, recorder, completed=True)
            await send(message)

        try:
            with self.dedupe.hold(claim):
                await self.app(scope, _replaying(body, receive), recording_send)
        except AlreadyApplied as exc:
            if recorder.status:  # the app had started its answer: it cannot be replaced any more
                if not settled:
                    await self._release(claim)
                raise
            stored, answer = self.rules.applied(exc)
            await self._store(claim, recorder.stored(stored, False, self.dedupe.max_result_bytes, self._measure))
            await send_response(send, answer)
            return
        except BaseException:
            if not settled:
                await self._release(claim)
            raise
        if not settled:
            await self._settle(claim, recorder, completed=False)

    async def _settle(self, claim: Claim, recorder: Recorder, *, completed: bool) -> None:
        """Store the recorded response, or release the key, as :meth:`Recorder.settle` says. Never
        raises: a store that fails leaves the lease to run out."""
        settle = recorder.settle(completed, self.dedupe.max_result_bytes, self._measure)
        if not settle.store:
            log.info("released key=%s token=%s: status %s, response %s", claim.key, claim.token,
                     recorder.status, "complete" if completed else "cut off")
            await self._release(claim)
            return
        await self._store(claim, settle)

    async def _store(self, claim: Claim, settle: Settle) -> None:
        try:
            await self.dedupe.complete(claim, settle.value, ttl=settle.ttl)
        except LeaseLost:
            log.warning("response not stored key=%s token=%s: the lease was lost", claim.key, claim.token)
        except StoreUnavailable as exc:
            log.error("response not stored key=%s token=%s: %s", claim.key, claim.token, exc)

    async def _release(self, claim: Claim) -> None:
        try:
            await self.dedupe.release(claim)
        except StoreUnavailable as exc:  # the lease runs out instead
            log.error("release failed key=%s token=%s: %s", claim.key, claim.token, exc)


def _replaying(body: Body, receive: Receive) -> Receive:
    """A ``receive`` that gives the app the body read before the claim (in chunks when it was
    spooled), then the client's own messages (``http.disconnect`` when it goes away)."""
    chunks = body.chunks()
    pending: bytes | None = next(chunks, b"")

    async def replaying_receive() -> Message:
        nonlocal pending
        if pending is not None:
            chunk, pending = pending, next(chunks, None)
            return {"type": "http.request", "body": chunk, "more_body": pending is not None}
        return await receive()

    return replaying_receive

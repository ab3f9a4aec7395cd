"""``IdempotencyMiddleware``: the Idempotency-Key layer for any ASGI app, on an ``AsyncDeduplicator``.

Pure ASGI (no Starlette import), so it wraps FastAPI, Starlette, Quart or a bare ASGI callable::

    app.add_middleware(IdempotencyMiddleware, dedupe=AsyncDeduplicator.from_url(url), required=True)

The rules are :class:`~dedupe_worker.http.IdempotencyRules`' (shared with the WSGI and
Django middleware); this module only moves ASGI messages. The request body is read once, before
the claim (it is part of the fingerprint), and handed to the app intact. The response streams to
the client as the app sends it; it is stored when the app hands over its last chunk, before that
chunk goes out (so a client that received the whole response finds it stored).

On a crash: an exception in the app, a response cut off, or a cancelled task releases the key, so
the client's retry runs the request again; a process killed mid-request leaves the key held until
its lease runs out (a retry gets 409 meanwhile).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .._errors import LeaseLost, StoreUnavailable
from .._protocol.claim import Claim
from ..asyncio._deduplicator import AsyncDeduplicator
from ._request import RequestInfo
from ._rules import IdempotencyRules, Recorder
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


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or ``None`` when the client went away before sending it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


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
        body = await read_body(receive)
        if body is None:
            return  # the client left before its request was read: nothing ran, nothing to answer
        attempt = self.rules.attempt(request, screened, body)
        try:
            claim = await self.dedupe.begin(attempt.key, fingerprint=attempt.fingerprint, wait=attempt.wait,
                                            ttl=self.rules.request_ttl(request))
        except StoreUnavailable as exc:
            down = self.rules.store_down(attempt, exc, self.dedupe.fail_open)
            if down is not None:
                await send_response(send, down)
            else:
                await self.app(scope, _replaying(body, receive), send)
            return
        answer = self.rules.answer(claim)
        if answer is not None:
            await send_response(send, answer)
            return
        await self._run(scope, request, body, receive, send, claim)

    async def _run(self, scope: Scope, request: RequestInfo, body: bytes, receive: Receive, send: Send,
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
        except BaseException:
            if not settled:
                await self._release(claim)
            raise
        if not settled:
            await self._settle(claim, recorder, completed=False)

    async def _settle(self, claim: Claim, recorder: Recorder, *, completed: bool) -> None:
        """Store the recorded response, or release the key, as :meth:`Recorder.settle` says. Never
        raises: a store that fails leaves the lease to run out."""
        settle = recorder.settle(completed, self.dedupe.max_result_bytes)
        if not settle.store:
            log.info("released key=%s token=%s: status %s, response %s", claim.key, claim.token,
                     recorder.status, "complete" if completed else "cut off")
            await self._release(claim)
            return
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


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the app the body read before the claim, then the client's own
    messages (``http.disconnect`` when it goes away)."""
    pending = True

    async def replaying_receive() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replaying_receive

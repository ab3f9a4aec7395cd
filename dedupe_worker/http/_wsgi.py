"""``WSGIIdempotencyMiddleware``: the Idempotency-Key layer for any WSGI app, on a ``Deduplicator``.

Pure WSGI (PEP 3333), so it wraps Flask, Bottle, Falcon or a bare WSGI callable::

    app.wsgi_app = WSGIIdempotencyMiddleware(app.wsgi_app, Deduplicator.from_url(url), required=True)

The rules are :class:`~dedupe_worker.http.IdempotencyRules`' (shared with the ASGI and
Django middleware). The request body is read once, before the claim, and put back as
``wsgi.input`` for the app. The response body streams through as the server iterates it; it is
stored when the server has asked for the end of it (every chunk before was written), and the key
is released when the iteration is closed early or raises.

On a crash: an exception in the app releases the key; a process killed mid-request leaves it
held until its lease runs out (a retry gets 409 meanwhile).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from typing import Any

from .._deduplicator import Deduplicator
from .._errors import LeaseLost, StoreUnavailable
from .._protocol.claim import Claim
from .._protocol.context import Holding
from ._request import RequestInfo
from ._rules import IdempotencyRules, Recorder
from ._stored import Response

__all__ = ["WSGIIdempotencyMiddleware"]

log = logging.getLogger(__name__)

Environ = dict[str, Any]
StartResponse = Callable[..., Callable[[bytes], Any]]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]


def status_line(status: int) -> str:
    """``"201 Created"``: the WSGI status string of a code (``"599 Unknown"`` for a code Python
    does not name)."""
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


def request_info(environ: Environ) -> RequestInfo:
    """The :class:`RequestInfo` of a WSGI environ (header names from ``HTTP_*``, lower-cased)."""
    headers = []
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            headers.append((name[5:].replace("_", "-").lower(), value))
    if environ.get("CONTENT_TYPE"):
        headers.append(("content-type", environ["CONTENT_TYPE"]))
    path = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
    return RequestInfo(environ.get("REQUEST_METHOD", "GET"), path, environ.get("QUERY_STRING", ""), tuple(headers),
                       environ)


def respond(start_response: StartResponse, response: Response) -> list[bytes]:
    """Start a complete :class:`Response` and return its body as the WSGI iterable."""
    start_response(status_line(response.status), list(response.headers))
    return [response.body]


def read_input(environ: Environ) -> bytes:
    """The whole request body (``CONTENT_LENGTH`` bytes, or all of a terminated input)."""
    stream = environ.get("wsgi.input")
    if stream is None:
        return b""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > 0:
        return bytes(stream.read(length))
    if environ.get("wsgi.input_terminated"):
        return bytes(stream.read())
    return b""


class WSGIIdempotencyMiddleware:
    """WSGI middleware applying the Idempotency-Key rules (see :class:`IdempotencyRules`, whose
    options it takes as keywords, or whole as ``rules=``) with ``dedupe`` as the store.

    Inside the request (and while the server iterates the body), :func:`~dedupe_worker.current_claim`
    is the claim, and its lease is renewed.
    """

    def __init__(self, app: WSGIApp, dedupe: Deduplicator, *, rules: IdempotencyRules | None = None,
                 **options: Any) -> None:
        self.app = app
        self.dedupe = dedupe
        self.rules = rules if rules is not None else IdempotencyRules(**options)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        request = request_info(environ)
        screened = self.rules.screen(request)
        if screened is None:
            return self.app(environ, start_response)
        if isinstance(screened, Response):
            return respond(start_response, screened)
        body = read_input(environ)
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        attempt = self.rules.attempt(request, screened, body)
        try:
            claim = self.dedupe.begin(attempt.key, fingerprint=attempt.fingerprint, wait=attempt.wait,
                                      ttl=self.rules.request_ttl(request))
        except StoreUnavailable as exc:
            down = self.rules.store_down(attempt, exc, self.dedupe.fail_open)
            return self.app(environ, start_response) if down is None else respond(start_response, down)
        answer = self.rules.answer(claim)
        if answer is not None:
            return respond(start_response, answer)
        return self._run(environ, start_response, request, claim)

    def _run(self, environ: Environ, start_response: StartResponse, request: RequestInfo,
             claim: Claim) -> Iterable[bytes]:
        recorder = self.rules.recorder(request)

        def recording_start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            write = start_response(status, recorder.start(int(status.split(" ", 1)[0]), headers), exc_info)

            def recording_write(data: bytes) -> Any:
                recorder.body(data)
                return write(data)

            return recording_write

        holding = self.dedupe.hold(claim)
        holding.__enter__()
        try:
            iterable = self.app(environ, recording_start_response)
        except BaseException:
            holding.__exit__(None, None, None)
            settle_claim(self.dedupe, claim, recorder, completed=False)
            raise
        return RecordedBody(iterable, recorder, lambda completed: self._settle(holding, claim, recorder, completed))

    def _settle(self, holding: Holding, claim: Claim, recorder: Recorder, completed: bool) -> None:
        try:
            holding.__exit__(None, None, None)
        except ValueError:  # closed from another context than the one the app ran in
            holding.renewer.untrack(claim.stem, claim.token)
        settle_claim(self.dedupe, claim, recorder, completed=completed)


def settle_claim(dedupe: Deduplicator, claim: Claim, recorder: Recorder, *, completed: bool) -> None:
    """Store the recorded response, or release the key, as :meth:`Recorder.settle` says. Never
    raises: the response has gone out; a store that fails leaves the lease to run out."""
    settle = recorder.settle(completed, dedupe.max_result_bytes)
    try:
        if settle.store:
            dedupe.complete(claim, settle.value, ttl=settle.ttl)
        else:
            log.info("released key=%s token=%s: status %s, response %s", claim.key, claim.token,
                     recorder.status, "complete" if completed else "cut off")
            dedupe.release(claim)
    except LeaseLost:
        log.warning("response not stored key=%s token=%s: the lease was lost", claim.key, claim.token)
    except StoreUnavailable as exc:
        log.error("response not settled key=%s token=%s: %s", claim.key, claim.token, exc)


class RecordedBody:
    """The app's body iterable, recorded chunk by chunk as the server iterates it. The claim is
    settled once: stored when the body reaches its ``Content-Length`` (before that last chunk is
    handed to the server), or else when the server asks past the last chunk; released by
    ``close()`` (which PEP 3333 servers always call) if neither happened."""

    def __init__(self, iterable: Iterable[bytes], recorder: Recorder, settle: Callable[[bool], None]) -> None:
        self.iterable = iterable
        self.recorder = recorder
        self._settle: Callable[[bool], None] | None = settle

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.iterable:
            self.recorder.body(chunk)
            if self.recorder.received_all:
                self.settle(True)  # stored before the server writes it: whoever got it all can get it again
            yield chunk
        self.settle(True)

    def settle(self, completed: bool) -> None:
        settle, self._settle = self._settle, None
        if settle is not None:
            settle(completed)

    def close(self) -> None:
        try:
            close = getattr(self.iterable, "close", None)
            if close is not None:
                close()
        finally:
            self.settle(False)

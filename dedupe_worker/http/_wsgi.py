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

import logging
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from typing import Any

from .._deduplicator import Deduplicator
from .._errors import AlreadyApplied, LeaseLost, StoreUnavailable
from .._protocol import Claim, Holding, drive
from ._applied import RAISED, notice_exceptions
from ._body import CHUNK, Body, declared_length
from ._claiming import Begin, Forget, claim_flow
from ._recorder import Recorder, Settle, stored_size
from ._request import RequestInfo
from ._rules import Attempt, IdempotencyRules
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


def read_input(environ: Environ, limit: int) -> Body | None:
    """The request body (``CONTENT_LENGTH`` bytes, or all of a terminated input) read in chunks
    into a :class:`Body` of at most ``limit`` bytes; ``None`` when it is over ``limit`` (announced
    by ``CONTENT_LENGTH``, or found so while reading: nothing more is read)."""
    body = Body(limit)
    stream = environ.get("wsgi.input")
    length = declared_length(environ.get("CONTENT_LENGTH") or None)
    if length is not None and length > limit:
        return None
    if stream is None or (not length and not environ.get("wsgi.input_terminated")):
        return body
    left = length if length else limit + 1
    while left > 0:
        chunk = stream.read(min(CHUNK, left))
        if not chunk:
            break
        left -= len(chunk)
        if not body.feed(bytes(chunk)):
            body.close()
            return None
    return body


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
        self._measure = stored_size(dedupe)
        notice_exceptions()

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        request = request_info(environ)
        screened = self.rules.screen(request)
        if screened is None:
            return self.app(environ, start_response)
        if isinstance(screened, Response):
            return respond(start_response, screened)
        caller = self.rules.caller(request)
        if isinstance(caller, Response):
            return respond(start_response, caller)
        body = read_input(environ, self.rules.max_request_bytes)
        if body is None:
            return respond(start_response, self.rules.too_large())
        environ["wsgi.input"] = body.stream()  # closed (and a spool deleted) with it, when collected
        environ["CONTENT_LENGTH"] = str(body.size)
        attempt = self.rules.attempt(request, screened, caller, body.digest())
        claim, answer = drive(claim_flow(self.rules, attempt, self.dedupe.fail_open),
                              claim_steps(self.dedupe, attempt, self.rules.request_ttl(request)))
        if answer is not None:
            body.close()
            return respond(start_response, answer)
        if claim is None:
            return self.app(environ, start_response)
        return self._run(environ, start_response, request, claim)

    def _run(self, environ: Environ, start_response: StartResponse, request: RequestInfo,
             claim: Claim) -> Iterable[bytes]:
        recorder = self.rules.recorder(request)
        # The server's start_response is called once the app returned (or at its first write()),
        # so a framework's error page for AlreadyApplied can still be replaced by the answer.
        started: list[Any] = []
        writes: list[Callable[[bytes], Any]] = []

        def flush() -> Callable[[bytes], Any]:
            if not writes:
                writes.append(start_response(*started))
            return writes[0]

        def recording_start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            started[:] = [status, recorder.start(int(status.split(" ", 1)[0]), headers), exc_info]
            if writes:  # called again after a write(): the server decides (PEP 3333)
                start_response(*started)

            def recording_write(data: bytes) -> Any:
                recorder.body(data)
                return flush()(data)

            return recording_write

        holding = self.dedupe.hold(claim)
        holding.__enter__()
        token = RAISED.set(None)
        try:
            iterable = self.app(environ, recording_start_response)
        except AlreadyApplied as exc:
            holding.__exit__(None, None, None)
            return self._applied(start_response, claim, recorder, exc)
        except BaseException:
            holding.__exit__(None, None, None)
            settle_claim(self.dedupe, claim, recorder, completed=False)
            raise
        finally:
            noticed = RAISED.get()
            RAISED.reset(token)
        if isinstance(noticed, AlreadyApplied) and not writes:  # the framework made it its error page
            close = getattr(iterable, "close", None)
            if close is not None:
                close()
            holding.__exit__(None, None, None)
            return self._applied(start_response, claim, recorder, noticed)
        if started:
            flush()
        return RecordedBody(iterable, recorder, lambda completed: self._settle(holding, claim, recorder, completed),
                            flush if not started else None)

    def _applied(self, start_response: StartResponse, claim: Claim, recorder: Recorder,
                 exc: AlreadyApplied) -> list[bytes]:
        """Answer from the committed result, stored under the key."""
        stored, answer = self.rules.applied(exc)
        store_settled(self.dedupe, claim, recorder.stored(stored, False, self.dedupe.max_result_bytes, self._measure))
        start_response(status_line(answer.status), list(answer.headers))
        return [answer.body]

    def _settle(self, holding: Holding, claim: Claim, recorder: Recorder, completed: bool) -> None:
        try:
            holding.__exit__(None, None, None)
        except ValueError:  # closed from another context than the one the app ran in
            holding.renewer.untrack(claim.stem, claim.token)
        settle_claim(self.dedupe, claim, recorder, completed=completed)


def settle_claim(dedupe: Deduplicator, claim: Claim, recorder: Recorder, *, completed: bool) -> None:
    """Store the recorded response, or release the key, as :meth:`Recorder.settle` says. Never
    raises: the response has gone out; a store that fails leaves the lease to run out."""
    settle = recorder.settle(completed, dedupe.max_result_bytes, stored_size(dedupe))
    if not settle.store:
        log.info("released key=%s token=%s: status %s, response %s", claim.key, claim.token,
                 recorder.status, "complete" if completed else "cut off")
    store_settled(dedupe, claim, settle)


def store_settled(dedupe: Deduplicator, claim: Claim, settle: Settle) -> None:
    """Store ``settle``'s value under ``claim`` (or release it). Never raises."""
    try:
        if settle.store:
            dedupe.complete(claim, settle.value, ttl=settle.ttl)
        else:
            dedupe.release(claim)
    except LeaseLost:
        log.warning("response not stored key=%s token=%s: the lease was lost", claim.key, claim.token)
    except StoreUnavailable as exc:
        log.error("response not settled key=%s token=%s: %s", claim.key, claim.token, exc)


def claim_steps(dedupe: Deduplicator, attempt: Attempt, ttl: float | None) -> dict[type[Any], Callable[[Any], Any]]:
    """How the sync middleware (WSGI, Django) performs each effect of :func:`claim_flow`."""
    return {
        Begin: lambda _: dedupe.begin(attempt.key, fingerprint=attempt.fingerprint, wait=attempt.wait, ttl=ttl),
        Forget: lambda forget: dedupe.forget(attempt.key, token=forget.token, force=True),
    }


class RecordedBody:
    """The app's body iterable, recorded chunk by chunk as the server iterates it. The claim is
    settled once: stored when the body reaches its ``Content-Length`` (before that last chunk is
    handed to the server), or else when the server asks past the last chunk; released by
    ``close()`` (which PEP 3333 servers always call) if neither happened."""

    def __init__(self, iterable: Iterable[bytes], recorder: Recorder, settle: Callable[[bool], None],
                 start: Callable[[], Any] | None = None) -> None:
        self.iterable = iterable
        self.recorder = recorder
        self._settle: Callable[[bool], None] | None = settle
        self._start = start

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.iterable:
            start, self._start = self._start, None
            if start is not None:  # an app that starts its response from its iterable
                start()
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

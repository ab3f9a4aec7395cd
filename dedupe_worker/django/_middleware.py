"""``IdempotencyMiddleware`` for Django, configured from settings.

::

    MIDDLEWARE.insert(MIDDLEWARE.index("django.contrib.auth.middleware.AuthenticationMiddleware") + 1,
                      "dedupe_worker.django.IdempotencyMiddleware")
    DEDUPE_REDIS_URL = "redis://localhost:6379/0"
    DEDUPE_NAMESPACE = "shop-api"
    DEDUPE_HTTP = {"scope": "dedupe_worker.django.user_scope", "required": True, "wait": 2.0}

``DEDUPE_HTTP`` holds the options of :class:`~dedupe_worker.http.IdempotencyRules` by their
names (the ASGI and WSGI middleware take the same ones), and the client options ``lease`` and
``result_ttl``; ``scope`` is required, a callable or its dotted path (:func:`user_scope`: the
signed-in user, else the visitor's session). The rules are the same code as the other two
middleware; this module only turns Django's request and response into theirs. Placed after
``AuthenticationMiddleware``, a ``scope=`` callable can read ``request.raw.user``.

The body is read from the request's stream once, at most ``max_request_bytes`` (past it, a 413),
hashed as it arrives and spooled beyond 1 MiB, then given back to Django as the request's stream:
the view reads ``request.body``, ``request.POST`` or ``request.FILES`` as without the middleware,
under Django's own limits (a multipart upload is parsed from the spool, not from memory).

Django turns an exception in a view into a 500 response before it reaches this middleware, so it
releases the key like any 5xx; an :class:`~dedupe_worker.AlreadyApplied` (``atomic()`` found the
effect committed) is caught first (``process_exception``) and answered from the committed result.
A streaming response keeps its lease renewed while it streams; it is stored when the server has
read its last chunk, and the key released when the server closes it before that.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .._deduplicator import Deduplicator
from .._errors import AlreadyApplied
from .._protocol import Claim, drive
from .._settings import ClientOptions, DedupeSettings
from ..http._body import CHUNK, Body, declared_length
from ..http._claiming import claim_flow
from ..http._recorder import Recorder, stored_size
from ..http._request import RequestInfo
from ..http._rules import IdempotencyRules
from ..http._stored import Response
from ..http._wsgi import RecordedBody, claim_steps, settle_claim, store_settled

__all__ = ["IdempotencyMiddleware", "user_scope"]

log = logging.getLogger(__name__)

_CLIENT_OPTIONS = ("lease", "result_ttl")
#: The request attribute holding the claim while the view runs (for ``process_exception``).
_CLAIM = "_dedupe_http_claim"


def user_scope(request: RequestInfo) -> str | None:
    """The principal of a Django request: the signed-in user (``user:<pk>``), else an anonymous
    visitor's session (``session:<key>``, once the session exists), else ``None`` (refused).
    Needs ``AuthenticationMiddleware`` (and ``SessionMiddleware``) before this middleware."""
    user = getattr(request.raw, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    session = getattr(request.raw, "session", None)
    key = getattr(session, "session_key", None)
    return f"session:{key}" if key else None


def request_info(request: Any) -> RequestInfo:
    """The :class:`RequestInfo` of a Django ``HttpRequest``."""
    headers = tuple((name.lower(), value) for name, value in request.headers.items())
    return RequestInfo(request.method or "GET", request.path, request.META.get("QUERY_STRING", ""), headers, request)


def to_django(response: Response) -> Any:
    """A Django ``HttpResponse`` with exactly ``response``'s status, headers and body."""
    from django.http import HttpResponse

    reply = HttpResponse(response.body, status=response.status)
    del reply["Content-Type"]
    for name, value in response.headers:
        if name.lower() == "set-cookie":
            reply.cookies.load(value)
        else:
            reply.headers[name] = value
    return reply


def response_headers(response: Any) -> list[tuple[str, str]]:
    """A Django response's headers as sent, ``Set-Cookie`` lines included."""
    headers = list(response.items())
    headers += [("Set-Cookie", morsel.output(header="").strip()) for morsel in response.cookies.values()]
    return headers


def read_stream(request: Any, limit: int) -> Body | None:
    """The request body read from Django's stream into a :class:`Body` (``None``: over ``limit``),
    then put back as the stream the view reads, as if untouched."""
    length = declared_length(request.META.get("CONTENT_LENGTH") or None)
    if length is not None and length > limit:
        return None
    body = Body(limit)
    while True:
        chunk = request.read(CHUNK)
        if not chunk:
            break
        if not body.feed(chunk):
            body.close()
            return None
    request._stream = body.stream()  # Django reads body, POST and FILES from it
    request._read_started = False
    return body


def scope_option(value: Any) -> Any:
    """``DEDUPE_HTTP["scope"]``: a callable, or the dotted path of one."""
    if isinstance(value, str):
        from django.utils.module_loading import import_string

        return import_string(value)
    return value


class IdempotencyMiddleware:
    """Django middleware applying the Idempotency-Key rules, from ``DEDUPE_REDIS_URL``,
    ``DEDUPE_NAMESPACE`` and ``DEDUPE_HTTP``. One :class:`Deduplicator` per process.

    Inside the view, :func:`~dedupe_worker.current_claim` is the claim, and its lease is renewed.
    """

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: Callable[[Any], Any], *, dedupe: Deduplicator | None = None) -> None:
        from django.conf import settings
        from django.core.exceptions import ImproperlyConfigured

        self.get_response = get_response
        options = dict(getattr(settings, "DEDUPE_HTTP", None) or {})
        client_options = {name: options.pop(name) for name in _CLIENT_OPTIONS if name in options}
        if "scope" in options:
            options["scope"] = scope_option(options["scope"])
        try:
            self.rules = IdempotencyRules(**options)
        except TypeError as exc:
            raise ImproperlyConfigured(f"DEDUPE_HTTP: {exc}") from exc
        self.dedupe = dedupe if dedupe is not None else Deduplicator.from_url(
            getattr(settings, "DEDUPE_REDIS_URL", DedupeSettings.model_fields["redis_url"].default),
            namespace=getattr(settings, "DEDUPE_NAMESPACE", ClientOptions.namespace), **client_options)
        self._measure = stored_size(self.dedupe)

    def __call__(self, request: Any) -> Any:
        info = request_info(request)
        screened = self.rules.screen(info)
        if screened is None:
            return self.get_response(request)
        if isinstance(screened, Response):
            return to_django(screened)
        caller = self.rules.caller(info)
        if isinstance(caller, Response):
            return to_django(caller)
        body = read_stream(request, self.rules.max_request_bytes)
        if body is None:
            return to_django(self.rules.too_large())
        attempt = self.rules.attempt(info, screened, caller, body.digest())
        claim, answer = drive(claim_flow(self.rules, attempt, self.dedupe.fail_open),
                              claim_steps(self.dedupe, attempt, self.rules.request_ttl(info)))
        if answer is not None:
            return to_django(answer)
        if claim is None:
            return self.get_response(request)
        return self._run(request, info, claim)

    def process_exception(self, request: Any, exception: Exception) -> Any:
        """An ``AlreadyApplied`` out of the view: answered from the committed result (the response
        then comes back through :meth:`__call__`, which stores it); other exceptions: Django's."""
        claim = getattr(request, _CLAIM, None)
        if claim is None or not isinstance(exception, AlreadyApplied):
            return None
        stored, answer = self.rules.applied(exception)
        reply = to_django(answer)
        reply._dedupe_applied = stored  # read back by _run
        return reply

    def _run(self, request: Any, info: RequestInfo, claim: Claim) -> Any:
        recorder = self.rules.recorder(info)
        setattr(request, _CLAIM, claim)
        try:
            with self.dedupe.hold(claim):
                response = self.get_response(request)
        except BaseException:
            settle_claim(self.dedupe, claim, recorder, completed=False)
            raise
        applied = getattr(response, "_dedupe_applied", None)
        if applied is not None:  # stored whatever its status: the key is never released for it
            store_settled(self.dedupe, claim,
                          recorder.stored(applied, False, self.dedupe.max_result_bytes, self._measure))
            return response
        recorder.start(response.status_code, response_headers(response))
        if self.rules.ttl_header in response:
            del response[self.rules.ttl_header]
        if response.streaming:
            self.dedupe.renewer.track(claim.stem, claim.token)  # the lease outlives the view while it streams
            response.streaming_content = RecordedBody(response.streaming_content, recorder,
                                                      lambda completed: self._settle(claim, recorder, completed))
            return response
        recorder.body(response.content)
        settle_claim(self.dedupe, claim, recorder, completed=True)
        return response

    def _settle(self, claim: Claim, recorder: Recorder, completed: bool) -> None:
        """The end of a streaming response: stop renewing, then store or release."""
        self.dedupe.renewer.untrack(claim.stem, claim.token)
        settle_claim(self.dedupe, claim, recorder, completed=completed)

"""``IdempotencyMiddleware`` for Django, configured from settings.

::

    MIDDLEWARE = [..., "django.contrib.auth.middleware.AuthenticationMiddleware",
                  "dedupe_worker.django.IdempotencyMiddleware", ...]
    DEDUPE_REDIS_URL = "redis://localhost:6379/0"
    DEDUPE_NAMESPACE = "shop-api"
    DEDUPE_HTTP = {"required": True, "wait": 2.0, "scope": lambda request: str(request.raw.user.pk)}

``DEDUPE_HTTP`` holds the options of :class:`~dedupe_worker.http.IdempotencyRules` by their
names (the ASGI and WSGI middleware take the same ones), and the client options ``lease`` and
``result_ttl``. The rules are the same code as the other two middleware; this module only turns
Django's request and response into theirs. Placed after ``AuthenticationMiddleware``, a
``scope=`` callable can read ``request.raw.user``.

Django turns an exception in a view into a 500 response before it reaches this middleware, so it
releases the key like any 5xx. A streaming response keeps its lease renewed while it streams; it
is stored when the server has read its last chunk, and the key released when the server closes
it before that.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .._deduplicator import Deduplicator
from .._errors import StoreUnavailable
from .._protocol.claim import Claim
from .._settings import Defaults
from ..http._request import RequestInfo
from ..http._rules import IdempotencyRules, Recorder
from ..http._stored import Response
from ..http._wsgi import RecordedBody, settle_claim

__all__ = ["IdempotencyMiddleware"]

log = logging.getLogger(__name__)

_CLIENT_OPTIONS = ("lease", "result_ttl")


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


class IdempotencyMiddleware:
    """Django middleware applying the Idempotency-Key rules, from ``DEDUPE_REDIS_URL``,
    ``DEDUPE_NAMESPACE`` and ``DEDUPE_HTTP``. One :class:`Deduplicator` per process.

    Inside the view, :func:`~dedupe_worker.current_claim` is the claim, and its lease is renewed.
    """

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: Callable[[Any], Any], *, dedupe: Deduplicator | None = None) -> None:
        from django.conf import settings

        self.get_response = get_response
        options = dict(getattr(settings, "DEDUPE_HTTP", None) or {})
        client_options = {name: options.pop(name) for name in _CLIENT_OPTIONS if name in options}
        self.rules = IdempotencyRules(**options)
        self.dedupe = dedupe if dedupe is not None else Deduplicator.from_url(
            getattr(settings, "DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"),
            namespace=getattr(settings, "DEDUPE_NAMESPACE", Defaults.NAMESPACE), **client_options)

    def __call__(self, request: Any) -> Any:
        info = request_info(request)
        screened = self.rules.screen(info)
        if screened is None:
            return self.get_response(request)
        if isinstance(screened, Response):
            return to_django(screened)
        attempt = self.rules.attempt(info, screened, request.body)  # Django keeps the body for the view
        try:
            claim = self.dedupe.begin(attempt.key, fingerprint=attempt.fingerprint, wait=attempt.wait,
                                      ttl=self.rules.request_ttl(info))
        except StoreUnavailable as exc:
            down = self.rules.store_down(attempt, exc, self.dedupe.fail_open)
            return self.get_response(request) if down is None else to_django(down)
        answer = self.rules.answer(claim)
        if answer is not None:
            return to_django(answer)
        return self._run(request, info, claim)

    def _run(self, request: Any, info: RequestInfo, claim: Claim) -> Any:
        recorder = self.rules.recorder(info)
        try:
            with self.dedupe.hold(claim):
                response = self.get_response(request)
        except BaseException:
            settle_claim(self.dedupe, claim, recorder, completed=False)
            raise
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

"""Django on its middleware, configured from settings, with cookie sessions: every path goes to
:func:`common.handle`; the scope is the session's user, a bearer token's subject or the visitor."""

from __future__ import annotations

import hashlib

from django.conf import settings

from dedupe_worker.http import RequestInfo

from . import common

if not settings.configured:
    settings.configure(
        DEBUG=False,
        ALLOWED_HOSTS=["*"],
        SECRET_KEY="not-secret",
        ROOT_URLCONF=__name__,
        SESSION_ENGINE="django.contrib.sessions.backends.signed_cookies",
        MIDDLEWARE=["django.contrib.sessions.middleware.SessionMiddleware",
                    "dedupe_worker.django.IdempotencyMiddleware"],
        DEDUPE_REDIS_URL=common.REDIS_URL,
        DEDUPE_NAMESPACE=common.NAMESPACE,
        # max_request_bytes: the default, so an upload Django takes without the layer is taken with it
        DEDUPE_HTTP={**{k: v for k, v in common.OPTIONS.items() if k != "max_request_bytes"},
                     "scope": f"{__name__}.scope", "lease": 10.0},
    )

from django.core.wsgi import get_wsgi_application
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.urls import re_path
from django.views.decorators.csrf import csrf_exempt


def scope(request: RequestInfo) -> str | None:
    session = request.raw.session
    return common.principal(session.get("user"), session.get("visitor"), request.header("authorization"))


@csrf_exempt
def anything(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    session = common.session_reply(request.path, request.session)
    if session is not None:
        return HttpResponse(session[1], status=session[0])
    who = scope(RequestInfo("POST", "", "", tuple((k.lower(), v) for k, v in request.headers.items()), request))
    if request.content_type == "multipart/form-data":  # parsed from the stream, as Django does
        upload = request.FILES["file"]
        digest = hashlib.sha256(b"".join(upload.chunks())).hexdigest()
        body = f'{{"name": "{upload.name}", "size": {upload.size}, "sha256": "{digest}"}}'.encode()
    else:
        body = request.body
    status, headers, content = common.handle(request.method or "GET", request.path,
                                             request.META.get("QUERY_STRING", ""),
                                             {k.lower(): v for k, v in request.headers.items()}, body, who)
    response: HttpResponse | StreamingHttpResponse
    if isinstance(content, bytes):
        response = HttpResponse(content, status=status)
    else:
        response = StreamingHttpResponse(content, status=status)
    del response["Content-Type"]
    for name, value in headers:
        if name.lower() == "set-cookie":
            response.cookies.load(value)
        else:
            response[name] = value
    return response


urlpatterns = [re_path(r"^.*$", anything)]
application = get_wsgi_application()

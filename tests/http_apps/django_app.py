"""Django on its middleware, configured from settings: every path goes to :func:`common.handle`."""

from __future__ import annotations

from django.conf import settings

from . import common

if not settings.configured:
    settings.configure(
        DEBUG=False,
        ALLOWED_HOSTS=["*"],
        SECRET_KEY="not-secret",
        ROOT_URLCONF=__name__,
        MIDDLEWARE=["dedupe_worker.django.IdempotencyMiddleware"],
        DEDUPE_REDIS_URL=common.REDIS_URL,
        DEDUPE_NAMESPACE=common.NAMESPACE,
        DEDUPE_HTTP={**common.OPTIONS, "lease": 10.0},
    )

from django.core.wsgi import get_wsgi_application
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.urls import re_path
from django.views.decorators.csrf import csrf_exempt


@csrf_exempt
def anything(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    status, headers, content = common.handle(request.method or "GET", request.path,
                                             request.META.get("QUERY_STRING", ""),
                                             {k.lower(): v for k, v in request.headers.items()}, request.body)
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

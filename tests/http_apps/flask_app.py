"""Flask on the WSGI middleware: every path goes to :func:`common.handle`."""

from __future__ import annotations

from flask import Flask, Response, request

from dedupe_worker import Deduplicator
from dedupe_worker.http import WSGIIdempotencyMiddleware

from . import common

app = Flask(__name__)
app.wsgi_app = WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
    app.wsgi_app, Deduplicator.from_url(common.REDIS_URL, namespace=common.NAMESPACE, lease=10.0), **common.OPTIONS)


@app.route("/", defaults={"path": ""}, methods=["GET", "POST", "PATCH"])
@app.route("/<path:path>", methods=["GET", "POST", "PATCH"])
def anything(path: str) -> Response:
    status, headers, content = common.handle(request.method, request.path, request.query_string.decode(),
                                             {k.lower(): v for k, v in request.headers.items()}, request.get_data())
    response = Response(content, status=status)
    response.headers.clear()
    for name, value in headers:
        response.headers.add(name, value)
    return response

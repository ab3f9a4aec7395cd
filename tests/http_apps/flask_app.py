"""Flask on the WSGI middleware, with Flask-Login: every path goes to :func:`common.handle`; the
scope is the logged-in user, a bearer token's subject or the anonymous visitor's session."""

from __future__ import annotations

from typing import Any

from flask import Flask, Response, request, session
from flask_login import LoginManager, UserMixin, current_user, login_user

from dedupe_worker import Deduplicator
from dedupe_worker.http import RequestInfo, WSGIIdempotencyMiddleware

from . import common

app = Flask(__name__)
app.secret_key = "not-secret"
login = LoginManager(app)


class User(UserMixin):
    def __init__(self, name: str) -> None:
        self.id = name


@login.user_loader
def load_user(name: str) -> User:
    return User(name)


def who() -> str | None:
    user = current_user.get_id() if current_user.is_authenticated else None
    return common.principal(user, session.get("visitor"), request.headers.get("authorization"))


def scope(info: RequestInfo) -> str | None:
    with app.request_context(info.raw):  # the middleware runs before Flask's own request context
        return who()


app.wsgi_app = WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
    app.wsgi_app, Deduplicator.from_url(common.REDIS_URL, namespace=common.NAMESPACE, lease=10.0), scope=scope,
    **common.OPTIONS)


@app.route("/", defaults={"path": ""}, methods=["GET", "POST", "PATCH"])
@app.route("/<path:path>", methods=["GET", "POST", "PATCH"])
def anything(path: str) -> Any:
    if request.path.startswith("/login/"):
        login_user(User(request.path.removeprefix("/login/")))
        return current_user.get_id()
    if request.path == "/visit":
        return common.session_reply("/visit", session)[1]  # type: ignore[index]
    status, headers, content = common.handle(request.method, request.path, request.query_string.decode(),
                                             {k.lower(): v for k, v in request.headers.items()}, request.get_data(),
                                             who())
    response = Response(content, status=status)
    response.headers.clear()
    for name, value in headers:
        response.headers.add(name, value)
    return response

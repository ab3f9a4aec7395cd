"""Ready-made ``scope=`` callables: whom an ``Idempotency-Key`` belongs to.

A scope names the *principal* (the user, the tenant: who would be charged twice), never the
credential that proves it: a client that refreshes its bearer token and retries is the same
principal, and two users behind one gateway token are two. Each returns ``None`` when the request
names nobody; the middleware then refuses a request carrying a key (403), so it never runs in a
scope shared with strangers. ``dedupe_worker.django.user_scope`` is Django's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._protocol import content_hash
from ._request import RequestInfo

__all__ = ["asgi_user_scope", "flask_login_scope", "header_scope"]


def asgi_user_scope(request: RequestInfo) -> str | None:
    """The authenticated user Starlette's ``AuthenticationMiddleware`` puts in the ASGI scope
    (``request.user`` in FastAPI and Starlette): its ``identity``, else its ``display_name``;
    ``None`` for an unauthenticated user. Add ``IdempotencyMiddleware`` *before*
    ``AuthenticationMiddleware`` (``add_middleware`` wraps, so the one added last runs first)."""
    user = request.raw.get("user") if isinstance(request.raw, dict) else None
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    try:
        identity = user.identity
    except NotImplementedError:  # Starlette's BaseUser leaves it to subclasses
        identity = user.display_name
    return f"user:{identity}" if identity not in (None, "") else None


def header_scope(name: str) -> Callable[[RequestInfo], str | None]:
    """A scope that is a hash of request header ``name`` (``None`` when absent): for an API key
    that *is* the principal. Not for credentials that rotate: a client that gets a new bearer
    token or cookie and retries lands in a new scope and runs the request again, and every user
    behind one gateway token shares one scope. Map such credentials to the principal instead."""
    lower = name.lower()

    def scope(request: RequestInfo) -> str | None:
        value = request.header(lower)
        return content_hash(value) if value else None

    scope.__qualname__ = f"header_scope({name!r})"
    return scope


def flask_login_scope(app: Any) -> Callable[[RequestInfo], str | None]:
    """Flask-Login's ``current_user`` of ``app``: its ``get_id()`` when authenticated, else
    ``None``. The WSGI middleware runs before Flask's request context, so this opens one for the
    request (the session is read from its cookie; the body is not read)."""
    from flask_login import current_user  # the extra is the application's

    def scope(request: RequestInfo) -> str | None:
        with app.request_context(request.raw):
            if not current_user.is_authenticated:
                return None
            return f"user:{current_user.get_id()}"

    return scope

"""The Idempotency-Key layer for HTTP APIs: ASGI, WSGI (and Django) middleware on the claim protocol.

A ``POST`` or ``PATCH`` carrying ``Idempotency-Key`` runs once per key and caller (``scope=``,
required: :func:`asgi_user_scope`, :func:`flask_login_scope`, :func:`header_scope`,
``dedupe_worker.django.user_scope``, or a callable naming the principal):
a retry while it runs waits up to ``wait`` seconds, then gets a 409 with ``Retry-After``; a
retry after it gets the first response replayed byte for byte with ``Idempotent-Replayed: true``;
the same key with another request is a 422. The behaviour follows
draft-ietf-httpapi-idempotency-key-header and Stripe's API; see docs/http.md.

- :class:`IdempotencyMiddleware`: ASGI (FastAPI, Starlette, any ASGI app), on an
  :class:`~dedupe_worker.asyncio.AsyncDeduplicator`;
- :class:`WSGIIdempotencyMiddleware`: WSGI (Flask, any WSGI app), on a
  :class:`~dedupe_worker.Deduplicator`;
- ``dedupe_worker.django.IdempotencyMiddleware``: Django, configured from settings.

All three apply one set of rules, :class:`IdempotencyRules` (their options, by the same names).
No dependency beyond the library's own.
"""

from __future__ import annotations

from .._protocol import current_claim
from ._asgi import IdempotencyMiddleware
from ._request import KeyProblem, RequestInfo, parse_key
from ._rules import IdempotencyRules, applied_as_json, stored_status
from ._scopes import asgi_user_scope, flask_login_scope, header_scope
from ._stored import Response
from ._wsgi import WSGIIdempotencyMiddleware

__all__ = [
    "IdempotencyMiddleware",
    "IdempotencyRules",
    "KeyProblem",
    "RequestInfo",
    "Response",
    "WSGIIdempotencyMiddleware",
    "applied_as_json",
    "asgi_user_scope",
    "current_claim",
    "flask_login_scope",
    "header_scope",
    "parse_key",
    "stored_status",
]

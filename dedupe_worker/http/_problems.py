"""The error responses of the Idempotency-Key layer, as ``application/problem+json`` (RFC 9457).

Titles are the ones draft-ietf-httpapi-idempotency-key-header uses; ``type`` is
``<docs_url>#<slug>`` when the application set ``docs_url=``, else ``about:blank``.
"""

from __future__ import annotations

import math

import orjson

from ._request import KeyProblem
from ._stored import Response

__all__ = ["conflict", "in_progress", "invalid_key", "no_scope", "problem", "replay_unavailable", "too_large",
           "unavailable"]

_DETAIL = "This operation is idempotent and it requires correct usage of Idempotency Key."
_KEY_DETAILS = {
    KeyProblem.MISSING: ("Idempotency-Key is missing", _DETAIL),
    KeyProblem.REPEATED: ("Idempotency-Key is invalid", _DETAIL + " Send exactly one Idempotency-Key field."),
    KeyProblem.EMPTY: ("Idempotency-Key is invalid", _DETAIL + " The key is empty."),
    KeyProblem.TOO_LONG: ("Idempotency-Key is invalid", _DETAIL + " The key is too long."),
    KeyProblem.SYNTAX: ("Idempotency-Key is invalid",
                        _DETAIL + " The key must be a Structured Field string, such as \"8e03978e-40d5\"."),
}


def problem(status: int, slug: str, title: str, detail: str, docs_url: str | None,
            extra: tuple[tuple[str, str], ...] = ()) -> Response:
    """An ``application/problem+json`` response."""
    body = orjson.dumps({"type": f"{docs_url}#{slug}" if docs_url else "about:blank", "title": title,
                         "status": status, "detail": detail})
    headers = (("content-type", "application/problem+json"), ("content-length", str(len(body))), *extra)
    return Response(status, headers, body)


def invalid_key(why: KeyProblem, header: str, docs_url: str | None) -> Response:
    """400: the key is missing on an operation that requires it, repeated, empty, too long or
    not a Structured Field string."""
    title, detail = _KEY_DETAILS[why]
    if header.lower() != "idempotency-key":
        title = title.replace("Idempotency-Key", header)
    return problem(400, "missing-key" if why is KeyProblem.MISSING else "invalid-key", title, detail, docs_url)


def no_scope(header: str, docs_url: str | None) -> Response:
    """403: the request carries a key, but the application's ``scope`` names no caller for it, so
    there is no one the key could belong to (it never runs under a shared scope)."""
    return problem(403, "scope-refused", f"{header} needs an identified caller",
                   f"This operation takes an {header} only from a caller the server can identify (signed in, or"
                   " with a session); the request was not processed.", docs_url)


def too_large(limit: int, docs_url: str | None) -> Response:
    """413: the request body is over ``max_request_bytes``; the request was not processed."""
    return problem(413, "too-large", "Request body too large",
                   f"The request body is over {limit} bytes; the request was not processed.", docs_url)


def conflict(docs_url: str | None) -> Response:
    """422: the key was used before with a different request."""
    return problem(422, "key-reused", "Idempotency-Key is already used",
                   _DETAIL + " Idempotency Key MUST not be reused across different payloads of this operation.",
                   docs_url)


def in_progress(retry_after: float, docs_url: str | None) -> Response:
    """409 with ``Retry-After`` (``retry_after`` rounded up to whole seconds, at least 1): the first
    request still runs."""
    seconds = max(1, math.ceil(retry_after))
    return problem(409, "request-outstanding", "A request is outstanding for this Idempotency-Key",
                   "A request with the same Idempotency-Key for the same operation is being processed"
                   " or is outstanding.", docs_url, (("retry-after", str(seconds)),))


def unavailable(docs_url: str | None) -> Response:
    """503 with ``Retry-After: 1``: the idempotency store cannot be reached, the request was not run."""
    return problem(503, "store-unavailable", "Idempotency store unavailable",
                   "The request was not processed; retry it with the same Idempotency-Key.", docs_url,
                   (("retry-after", "1"),))


def replay_unavailable(docs_url: str | None) -> Response:
    """503: the request was processed before, and its stored response cannot be read by this server
    (compressed with a codec it lacks, or larger than it decodes); it is not processed again."""
    return problem(503, "replay-unavailable", "Stored response unavailable",
                   "A request with this Idempotency-Key was processed, and its stored response cannot be"
                   " read by this server; the request was not processed again.", docs_url)

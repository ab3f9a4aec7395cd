"""The rules of the Idempotency-Key layer, written once, without I/O.

:class:`IdempotencyRules` holds the options and answers every question a middleware asks, in the
order it asks them; the ASGI, WSGI and Django middleware only move bytes and await or call the
claim protocol, so the three behave alike::

    outcome = rules.screen(request)       # None: pass through; Response: a 400; str: the key
    caller = rules.caller(request)        # str: the principal; Response: a 403 (no one to own the key)
    (the body is read into a Body of rules.max_request_bytes: past it, rules.too_large(), a 413)
    attempt = rules.attempt(request, key, caller, body.digest())  # stored key, fingerprint, wait
    claim = dedupe.begin(attempt.key, fingerprint=attempt.fingerprint, wait=attempt.wait,
                         ttl=rules.request_ttl(request))
    (a claim that raised StoreUnavailable: rules.store_down(...), a 503 or, fail_open, run the app)
    answer = rules.answer(claim)          # None: run the app; UNREADABLE: forget the record
                                          # (dedupe.forget(key, token=claim.token, force=True))
                                          # and claim again; else a replay, a 409 or a 422
    recorder = rules.recorder(request)    # fed the app's response as it is sent
    settle = recorder.settle(completed, limit, measure)   # store (value, ttl) with complete(), or release()
    (the app raised AlreadyApplied: rules.applied(exc) is the answer, stored with complete())

Every answer is counted through :mod:`dedupe_worker.observe` (``http_answered``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import orjson

from .._errors import AlreadyApplied
from .._protocol import OMITTED, Claim, Outcome, TooLarge, content_hash
from .._settings import ClientOptions
from ..observe._base import current as observer
from . import _problems as problems
from ._recorder import REPLAYED, Recorder, Settle
from ._request import KeyProblem, RequestInfo, parse_key
from ._stored import Response, decode

__all__ = ["UNREADABLE", "Attempt", "IdempotencyRules", "Recorder", "Settle", "stored_status"]

log = logging.getLogger(__name__)

_NEVER_STORED = frozenset({408, 409, 425, 429})
#: :meth:`IdempotencyRules.answer` for a record it cannot read (a claim answered UNREADABLE, or a
#: stored response that does not decode): treat it as absent.
UNREADABLE = problems.problem(500, "unreadable", "", "", None)

_NO_SCOPE = (
    "IdempotencyRules needs scope=: whom a key belongs to, so that two callers sending the same key never "
    "see each other's response. Pass one of: dedupe_worker.http.asgi_user_scope (Starlette/FastAPI "
    "request.user), dedupe_worker.django.user_scope (Django request.user; DEDUPE_HTTP['scope'] as a callable "
    "or its dotted path), dedupe_worker.http.flask_login_scope(app) (Flask-Login), "
    "dedupe_worker.http.header_scope('X-Api-Key') (a hash of a header: a credential that rotates starts a "
    "new scope), or a callable (request: RequestInfo) -> str | None naming the principal (None refuses it)."
)


def stored_status(status: int) -> bool:
    """The default of ``store=``: 2xx, 3xx and 4xx responses are kept for replay, except 408,
    409, 425 and 429 (the client is asked to try again); a 5xx releases the key."""
    return 200 <= status < 500 and status not in _NEVER_STORED


def applied_as_json(exc: AlreadyApplied) -> Response:
    """The default of ``already_applied=``: the committed result as JSON, status 200."""
    body = orjson.dumps(exc.result, default=str)
    return Response(200, (("content-type", "application/json"), ("content-length", str(len(body)))), body)


class Attempt(NamedTuple):
    """What to claim for a request: the stored key, the request's fingerprint, seconds to wait."""

    key: str
    fingerprint: str
    wait: float


@dataclass(frozen=True)
class IdempotencyRules:
    """The options of the Idempotency-Key middleware (the same names for all three).

    :param scope: required: whom a key belongs to, a callable ``(request) -> str | None``
        returning the principal (the user id, the tenant: who is charged, not the credential
        that proves it). Keys of two principals never meet; a request with a key whose scope is
        ``None`` or ``""`` is refused (403 problem) and never runs. Ready-made:
        :func:`~dedupe_worker.http.asgi_user_scope`, :func:`~dedupe_worker.http.flask_login_scope`,
        :func:`~dedupe_worker.http.header_scope`, ``dedupe_worker.django.user_scope``.
    :param methods: the methods the layer applies to; others pass through untouched.
    :param required: ``True`` (a request without a key is a 400), ``False`` (without a key it
        passes through), or a callable on the :class:`RequestInfo` returning ``True``,
        ``False`` or ``None`` (the route is excluded: passes through even with a key).
    :param header: the request header holding the key.
    :param wait: seconds a retry waits for the first request's response before its 409; a
        number or a callable on the request.
    :param retry_after: the most seconds a 409's ``Retry-After`` says (never past the first
        request's remaining lease; whole seconds, at least 1).
    :param ttl: seconds a response is kept (a number, or a callable on the request returning
        one or ``None``); default the client's ``result_ttl``. The app's ``Idempotency-TTL``
        response header wins over both when it holds a usable number of seconds.
    :param max_key_length: longer keys are a 400.
    :param max_request_bytes: a request body over this is answered 413 before the app runs,
        without reading the rest of it; at most 1 MiB of a body is held in memory, the rest is
        spooled to a temporary file.
    :param max_body_bytes: a response body over this is passed through but stored without its
        body (a retry gets status and headers, an empty body and ``Idempotent-Body-Omitted``).
    :param compress_above: stored bodies over this many bytes are compressed (``compression``:
        ``"deflate"`` or ``"gzip"``); ``None``: never.
    :param replay_cookies: replay ``Set-Cookie`` headers too (off: a replay sets no cookie).
    :param docs_url: the page problem ``type`` links point into (``<docs_url>#<slug>``).
    :param store: a predicate on the status: keep the response (default :func:`stored_status`);
        otherwise the key is released so a retry runs again.
    :param ttl_header: the response header through which the app sets the TTL; stripped.
    :param already_applied: renders the response for an :class:`~dedupe_worker.AlreadyApplied`
        raised by the app (an earlier run committed): default the result as JSON with 200.
    """

    scope: Callable[[RequestInfo], str | None] | None = None
    methods: Iterable[str] = ("POST", "PATCH")
    required: bool | Callable[[RequestInfo], bool | None] = False
    header: str = "Idempotency-Key"
    wait: float | Callable[[RequestInfo], float] = 0.0
    retry_after: float = 1.0
    ttl: float | Callable[[RequestInfo], float | None] | None = None
    max_key_length: int = 255
    max_request_bytes: int = 10 * 1024 * 1024
    max_body_bytes: int = 1_000_000
    compress_above: int | None = ClientOptions.compress_above
    compression: str = "deflate"
    replay_cookies: bool = False
    docs_url: str | None = None
    store: Callable[[int], bool] = stored_status
    ttl_header: str = "Idempotency-TTL"
    already_applied: Callable[[AlreadyApplied], Response] = applied_as_json

    def __post_init__(self) -> None:
        if self.scope is None or not callable(self.scope):
            raise TypeError(_NO_SCOPE)
        object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))
        if self.compression not in ("deflate", "gzip"):
            raise ValueError(f"compression must be 'deflate' or 'gzip', not {self.compression!r}")
        if self.max_key_length < 1 or self.max_body_bytes < 0 or self.max_request_bytes < 0:
            raise ValueError("max_key_length must be positive, max_body_bytes and max_request_bytes not negative")
        if not self.retry_after > 0:
            raise ValueError(f"retry_after must be positive seconds, not {self.retry_after!r}")

    # -- before the claim -----------------------------------------------------------------------

    def screen(self, request: RequestInfo) -> str | Response | None:
        """The client's key; or a 400 problem (the key is missing where required, repeated,
        empty, too long or malformed); or ``None``: the request passes through untouched."""
        if request.method.upper() not in self.methods:
            return None
        required = self.required(request) if callable(self.required) else self.required
        if required is None:
            return None
        key = parse_key(request.header_values(self.header), self.max_key_length)
        if key is KeyProblem.MISSING and not required:
            return None
        if isinstance(key, KeyProblem):
            observer.http_answered("missing_key")
            return problems.invalid_key(key, self.header, self.docs_url)
        return key

    def caller(self, request: RequestInfo) -> str | Response:
        """Whom the key of a screened request belongs to: ``scope(request)``; a 403 problem when
        that is ``None`` or ``""`` (nobody: the request never runs in a scope shared with others)."""
        assert self.scope is not None
        who = self.scope(request)
        if who is None or who == "":
            observer.http_answered("scope_refused")
            return problems.no_scope(self.header, self.docs_url)
        return str(who)

    def too_large(self) -> Response:
        """The 413 for a request body over ``max_request_bytes`` (the app did not run)."""
        observer.http_answered("too_large")
        return problems.too_large(self.max_request_bytes, self.docs_url)

    def attempt(self, request: RequestInfo, client_key: str, principal: str, body_digest: str) -> Attempt:
        """What to claim: method, path, principal (:meth:`caller`) and client key make the stored
        key; method, path, query, content type and the body's hash (``Body.digest()``) make the
        fingerprint (the same key with another fingerprint is a 422)."""
        method = request.method.upper()
        key = "http:" + content_hash("\n".join((method, request.path, principal, client_key)), 40)
        fingerprint = content_hash("\n".join((method, request.path, request.query,
                                              request.header("content-type") or "", body_digest)))
        wait = self.wait(request) if callable(self.wait) else self.wait
        return Attempt(key, fingerprint, float(wait))

    # -- after the claim ------------------------------------------------------------------------

    def answer(self, claim: Claim) -> Response | None:
        """``None`` when ``claim`` was acquired (run the app); :data:`UNREADABLE` when a record
        under the key is not the protocol's (the claim answered UNREADABLE) or the stored
        response does not decode (forget it, claim again; logged here, once); else what the
        client gets: the stored response replayed, a 409 (still in flight after ``wait``), a
        422 (another request used this key) or a 503 (a stored response whose body is past this
        process's ``max_body_bytes``, kept for a process that can read it)."""
        if claim.outcome is Outcome.ACQUIRED:
            observer.http_answered("ran")
            return None
        if claim.outcome is Outcome.UNREADABLE:
            log.warning("records of key=%s are not the protocol's (%s): treated as absent, replaced",
                        claim.key, getattr(claim.error, "detail", claim.error))
            return UNREADABLE
        if claim.outcome is Outcome.CONFLICT:
            observer.http_answered("mismatch")
            return problems.conflict(self.docs_url)
        if claim.outcome is Outcome.IN_PROGRESS:
            observer.http_answered("conflict")
            return problems.in_progress(min(self.retry_after, claim.retry_after), self.docs_url)
        try:
            stored = None if claim.failed or claim.result is OMITTED else decode(claim.result, self.max_body_bytes)
        except TooLarge:
            return self._unreadable_here(claim)
        if stored is None:
            log.warning("stored response of key=%s token=%s does not decode: treated as absent, replaced",
                        claim.key, claim.token)
            return UNREADABLE
        observer.http_answered("replayed")
        return replay(stored)

    def _unreadable_here(self, claim: Claim) -> Response:
        """A 503 for a response stored by a request that ran, whose body inflates past this
        process's ``max_body_bytes`` (a peer configured with a larger one stored it). Running the request again
        would apply it twice, and forgetting the record would erase the proof that it ran: the
        record is kept for a process that can read it."""
        log.warning("stored response of key=%s token=%s cannot be read by this process: answering 503, "
                    "the record kept", claim.key, claim.token)
        observer.http_answered("error")
        return problems.replay_unavailable(self.docs_url)

    def store_down(self, attempt: Attempt, exc: Exception, fail_open: bool) -> Response | None:
        """When the claim could not be made (Redis unreachable): a 503 problem (the request was not
        run), or with ``fail_open`` ``None``: run the app without a claim. Logged either way."""
        observer.http_answered("error")
        if fail_open:
            log.error("idempotency store unavailable, running without a claim (fail_open) key=%s: %s",
                      attempt.key, exc)
            return None
        log.error("idempotency store unavailable, answering 503 key=%s: %s", attempt.key, exc)
        return problems.unavailable(self.docs_url)

    def applied(self, exc: AlreadyApplied) -> tuple[Response, Response]:
        """For a request whose app raised :class:`~dedupe_worker.AlreadyApplied` (an earlier run
        committed): ``(stored, sent)``, ``already_applied(exc)`` to store under the key like any
        response (the key is never released for it) and the same marked as a replay to send."""
        observer.http_answered("already_applied")
        log.info("key=%s was already applied (token %s): answered from the committed result", exc.key, exc.token)
        rendered = self.already_applied(exc)
        return rendered, replay(rendered)

    def request_ttl(self, request: RequestInfo) -> float | None:
        """Seconds ``request``'s response is kept (``ttl``), before the app's ``ttl_header``
        may change it: given to ``begin(..., ttl=)``, so the claim carries it as every consumer's
        per-message ttl does."""
        return self.ttl(request) if callable(self.ttl) else self.ttl

    def recorder(self, request: RequestInfo) -> Recorder:
        """A :class:`Recorder` for the app's response to ``request``."""
        return Recorder(self.ttl_header, self.max_body_bytes, self.store, self.replay_cookies, self.compress_above,
                        self.compression, self.request_ttl(request))


def replay(stored: Response) -> Response:
    """The response a retry gets: the stored one with ``Idempotent-Replayed: true``."""
    if stored.omitted:
        headers = tuple((n, v) for n, v in stored.headers if n.lower() not in ("content-length", "content-encoding"))
        return Response(stored.status, (*headers, ("content-length", "0"), REPLAYED,
                                        ("idempotent-body-omitted", "true")), b"")
    return Response(stored.status, (*stored.headers, REPLAYED), stored.body)


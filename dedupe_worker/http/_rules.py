"""The rules of the Idempotency-Key layer, written once, without I/O.

:class:`IdempotencyRules` holds the options and answers every question a middleware asks, in the
order it asks them; the ASGI, WSGI and Django middleware only move bytes and await or call the
claim protocol, so the three behave alike::

    outcome = rules.screen(request)       # None: pass through; Response: a 400; str: the key
    attempt = rules.attempt(request, key, body)           # stored key, fingerprint, wait
    claim = dedupe.begin(attempt.key, fingerprint=attempt.fingerprint, wait=attempt.wait,
                         ttl=rules.request_ttl(request))
    (a claim that raised StoreUnavailable: rules.store_down(...), a 503 or, fail_open, run the app)
    answer = rules.answer(claim)          # None: run the app; else a replay, a 409 or a 422
    recorder = rules.recorder(request)    # fed the app's response as it is sent
    settle = recorder.settle(completed)   # store (value, ttl) with complete(), or release()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._protocol.claim import OMITTED, Claim, Outcome
from .._protocol.fingerprint import content_hash
from . import _problems as problems
from ._request import KeyProblem, RequestInfo, parse_key
from ._stored import Response, decode, encode, kept_headers

__all__ = ["Attempt", "IdempotencyRules", "Recorder", "Settle", "stored_status"]

log = logging.getLogger(__name__)

REPLAYED = ("idempotent-replayed", "true")
_NEVER_STORED = frozenset({408, 409, 425, 429})


def stored_status(status: int) -> bool:
    """The default of ``store=``: 2xx, 3xx and 4xx responses are kept for replay, except 408,
    409, 425 and 429 (the client is asked to try again); a 5xx releases the key."""
    return 200 <= status < 500 and status not in _NEVER_STORED


class Attempt(NamedTuple):
    """What to claim for a request: the stored key, the request's fingerprint, seconds to wait."""

    key: str
    fingerprint: str
    wait: float


class Settle(NamedTuple):
    """After the app answered: ``store`` the ``value`` for ``ttl`` seconds (``None``: the
    client's ``result_ttl``), or release the key (``store`` false)."""

    store: bool
    value: Any = None
    ttl: float | None = None


@dataclass(frozen=True)
class IdempotencyRules:
    """The options of the Idempotency-Key middleware (the same names for all three).

    :param methods: the methods the layer applies to; others pass through untouched.
    :param required: ``True`` (a request without a key is a 400), ``False`` (without a key it
        passes through), or a callable on the :class:`RequestInfo` returning ``True``,
        ``False`` or ``None`` (the route is excluded: passes through even with a key).
    :param header: the request header holding the key.
    :param scope: a callable returning the principal the key belongs to (e.g. the user id);
        default a hash of the ``Authorization`` header. Keys of two principals never meet.
    :param wait: seconds a retry waits for the first request's response before its 409; a
        number or a callable on the request.
    :param ttl: seconds a response is kept (a number, or a callable on the request returning
        one or ``None``); default the client's ``result_ttl``. The app's ``Idempotency-TTL``
        response header wins over both.
    :param max_key_length: longer keys are a 400.
    :param max_body_bytes: a response body over this is passed through but stored without its
        body (a retry gets status and headers, an empty body and ``Idempotent-Body-Omitted``).
    :param compress_above: stored bodies over this many bytes are compressed (``compression``:
        ``"deflate"`` or ``"gzip"``).
    :param replay_cookies: replay ``Set-Cookie`` headers too (off: a replay sets no cookie).
    :param docs_url: the page problem ``type`` links point into (``<docs_url>#<slug>``).
    :param store: a predicate on the status: keep the response (default :func:`stored_status`);
        otherwise the key is released so a retry runs again.
    :param ttl_header: the response header through which the app sets the TTL; stripped.
    """

    methods: Iterable[str] = ("POST", "PATCH")
    required: bool | Callable[[RequestInfo], bool | None] = False
    header: str = "Idempotency-Key"
    scope: Callable[[RequestInfo], str] | None = None
    wait: float | Callable[[RequestInfo], float] = 0.0
    ttl: float | Callable[[RequestInfo], float | None] | None = None
    max_key_length: int = 255
    max_body_bytes: int = 1_000_000
    compress_above: int = 1024
    compression: str = "deflate"
    replay_cookies: bool = False
    docs_url: str | None = None
    store: Callable[[int], bool] = stored_status
    ttl_header: str = "Idempotency-TTL"

    def __post_init__(self) -> None:
        object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))
        if self.compression not in ("deflate", "gzip"):
            raise ValueError(f"compression must be 'deflate' or 'gzip', not {self.compression!r}")
        if self.max_key_length < 1 or self.max_body_bytes < 0:
            raise ValueError("max_key_length must be positive and max_body_bytes not negative")

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
            return problems.invalid_key(key, self.header, self.docs_url)
        return key

    def principal(self, request: RequestInfo) -> str:
        """Whom the key belongs to: ``scope(request)``, else a hash of ``Authorization``."""
        if self.scope is not None:
            return str(self.scope(request))
        authorization = request.header("authorization")
        return content_hash(authorization) if authorization else ""

    def attempt(self, request: RequestInfo, client_key: str, body: bytes) -> Attempt:
        """What to claim: method, path, principal and client key make the stored key; method,
        path, query, content type and a hash of the body make the fingerprint (the same key with
        another fingerprint is a 422)."""
        method = request.method.upper()
        key = "http:" + content_hash("\n".join((method, request.path, self.principal(request), client_key)), 40)
        fingerprint = content_hash("\n".join((method, request.path, request.query,
                                              request.header("content-type") or "", content_hash(body))))
        wait = self.wait(request) if callable(self.wait) else self.wait
        return Attempt(key, fingerprint, float(wait))

    # -- after the claim ------------------------------------------------------------------------

    def answer(self, claim: Claim) -> Response | None:
        """``None`` when ``claim`` was acquired (run the app); else what the client gets: the
        stored response replayed, a 409 (still in flight after ``wait``) or a 422 (another
        request used this key)."""
        if claim.outcome is Outcome.ACQUIRED:
            return None
        if claim.outcome is Outcome.CONFLICT:
            return problems.conflict(self.docs_url)
        if claim.outcome is Outcome.IN_PROGRESS:
            return problems.in_progress(claim.retry_after, self.docs_url)
        stored = None if claim.failed or claim.result is OMITTED else decode(claim.result)
        if stored is None:
            log.error("stored response of key=%s token=%s does not decode; answering 409", claim.key, claim.token)
            return problems.in_progress(1.0, self.docs_url)
        return replay(stored)

    def store_down(self, attempt: Attempt, exc: Exception, fail_open: bool) -> Response | None:
        """When the claim could not be made (Redis unreachable): a 503 problem (the request was not
        run), or with ``fail_open`` ``None``: run the app without a claim. Logged either way."""
        if fail_open:
            log.error("idempotency store unavailable, running without a claim (fail_open) key=%s: %s",
                      attempt.key, exc)
            return None
        log.error("idempotency store unavailable, answering 503 key=%s: %s", attempt.key, exc)
        return problems.unavailable(self.docs_url)

    def request_ttl(self, request: RequestInfo) -> float | None:
        """Seconds ``request``'s response is kept (``ttl``), before the app's ``ttl_header``
        may change it: given to ``begin(..., ttl=)``, so the claim carries it as every consumer's
        per-message ttl does."""
        return self.ttl(request) if callable(self.ttl) else self.ttl

    def recorder(self, request: RequestInfo) -> Recorder:
        """A :class:`Recorder` for the app's response to ``request``."""
        return Recorder(self, self.request_ttl(request))


def replay(stored: Response) -> Response:
    """The response a retry gets: the stored one with ``Idempotent-Replayed: true``."""
    if stored.omitted:
        headers = tuple((n, v) for n, v in stored.headers if n.lower() not in ("content-length", "content-encoding"))
        return Response(stored.status, (*headers, ("content-length", "0"), REPLAYED,
                                        ("idempotent-body-omitted", "true")), b"")
    return Response(stored.status, (*stored.headers, REPLAYED), stored.body)


class Recorder:
    """Follows the app's response as it is sent and decides what is kept.

    :meth:`start` takes the status and headers and gives back the headers to send (the TTL
    header stripped); :meth:`body` takes each chunk as it streams (kept until the body passes
    ``max_body_bytes``); :meth:`settle` says whether to store or release.
    """

    __slots__ = ("_chunks", "_size", "headers", "length", "rules", "status", "ttl")

    def __init__(self, rules: IdempotencyRules, ttl: float | None) -> None:
        self.rules = rules
        self.ttl = ttl
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self._chunks: list[bytes] | None = []
        self._size = 0
        #: The body's ``Content-Length``, when the app sent one.
        self.length: int | None = None

    def start(self, status: int, headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Note the status and headers; returns the headers to send (the TTL header taken out
        and, when it holds positive seconds, used as this response's TTL)."""
        self.status = status
        ttl_name = self.rules.ttl_header.lower()
        sent = []
        for name, value in headers:
            lower = name.lower()
            if lower == "content-length" and value.isdigit():
                self.length = int(value)
            if lower == ttl_name:
                try:
                    seconds = float(value)
                except ValueError:
                    seconds = 0.0
                if seconds > 0:
                    self.ttl = seconds
                else:
                    log.warning("ignored %s response header %r: not positive seconds", self.rules.ttl_header, value)
                continue
            sent.append((name, value))
        self.headers = sent
        return sent

    def body(self, chunk: bytes) -> None:
        """Note a body chunk as it passes; past ``max_body_bytes`` only its size is counted."""
        self._size += len(chunk)
        if self._chunks is not None:
            if self._size > self.rules.max_body_bytes:
                self._chunks = None
            elif chunk:
                self._chunks.append(chunk)

    @property
    def received_all(self) -> bool:
        """Whether the body seen so far is all its ``Content-Length`` announced: the response can
        be stored before its last chunk goes out."""
        return self.length is not None and self._size >= self.length

    def settle(self, completed: bool, limit: int) -> Settle:
        """``completed``: the whole response went out. Store it when its status is one
        ``store`` keeps; release the key when it is not, or when the response was cut off
        (the app raised or stopped, or the client went away before the end). ``limit``: the
        client's ``max_result_bytes``; a response whose stored form would be larger is kept
        without its body, as one over ``max_body_bytes``."""
        if not completed or not self.status or not self.rules.store(self.status):
            return Settle(False)
        rules = self.rules
        headers = kept_headers(self.headers, drop=frozenset(), replay_cookies=rules.replay_cookies)
        if self._chunks is not None:
            value = encode(Response(self.status, headers, b"".join(self._chunks)),
                           compress_above=rules.compress_above, compression=rules.compression)
            if len(value["b"]) + sum(len(n) + len(v) + 8 for n, v in headers) + 64 <= limit:
                return Settle(True, value, self.ttl)
        log.info("response of %d bytes stored without its body", self._size)
        return Settle(True, encode(Response(self.status, headers, b"", omitted=True),
                                   compress_above=rules.compress_above, compression=rules.compression), self.ttl)

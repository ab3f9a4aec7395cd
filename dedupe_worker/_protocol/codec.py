"""The I/O-free half of the protocol client: keys into requests, replies into claims, values
into stored records. Shared by :class:`~dedupe_worker.ClaimClient` and the asyncio client
(:mod:`dedupe_worker.asyncio`), so both check keys, decode outcomes and encode results alike.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._errors import InvalidKey, ResultNotSerializable, UnreadableRecord
from .._settings import ClientOptions
from .calls import ClaimReply, _claim_reply
from .claim import OMITTED, Claim, Outcome, Stored
from .fingerprint import request_fingerprint
from .layout import HASHED_PREFIX, KeyLayout, plain_ascii
from .serialization import JsonSerializer, Packer, Serializer, TooLarge, decoded_limit, unpack

__all__ = ["KEY_HARD_LIMIT", "ClaimCodec", "Prepared", "Request", "ttl_ms"]

log = logging.getLogger(__name__)

#: Keys longer than this many UTF-8 bytes are refused outright instead of hashed: almost surely a bug.
KEY_HARD_LIMIT = 8192

#: The longest per-message ttl taken, in seconds (ten years): beyond it a value is a mistake.
_MAX_TTL = 10 * 365 * 86400.0

_ACQUIRED, _DUPLICATE = Outcome.ACQUIRED, Outcome.DUPLICATE


def ttl_ms(ttl: float) -> int:
    """A per-message ttl in seconds, checked, in milliseconds; ``ValueError`` unless it is a
    positive number (at most ten years)."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= _MAX_TTL:
        raise ValueError(f"ttl must be a positive number of seconds, not {ttl!r}")
    return max(1, int(ttl * 1000))


def _byte_length(key: str | bytes) -> int:
    """How many bytes ``key`` has in UTF-8 (a lone surrogate counted as its three bytes)."""
    if isinstance(key, bytes) or key.isascii():
        return len(key)
    return len(key.encode("utf-8", "surrogatepass"))


#: ``(key, token)`` of the oversized values logged (bounded: cleared when full), so a duplicate
#: delivered again and again logs its value once.
_LOGGED: set[tuple[str, int]] = set()


def _log_once(key: str, token: int, message: str, *args: Any) -> None:
    if (key, token) in _LOGGED:
        return
    if len(_LOGGED) >= 1024:
        _LOGGED.clear()
    _LOGGED.add((key, token))
    log.warning(message, key, token, *args)


class Request(NamedTuple):
    """A key made ready for ``claim.lua``: the key as text, its Redis stem, the fingerprint as
    sent, and the original key when the stem holds its hash (else ``""``)."""

    key: str
    stem: str
    fingerprint: str
    original: str


#: :class:`Request`'s fields as a plain tuple, as :meth:`ClaimCodec.prepare` returns them.
Prepared = tuple[str, str, str, str]


class ClaimCodec:
    """Key checking, claim replies and outcome encoding for one namespace and set of options.

    Nothing here talks to Redis; the clients hold a codec's fields (they subclass it) and add the
    round trips. ``lease`` and ``result_ttl`` are kept in seconds, and with ``token_retention``
    also in milliseconds as the scripts take them (``_lease_ms``, ``_result_ttl_ms``,
    ``_retention_ms``).
    """

    def __init__(self, options: ClientOptions) -> None:
        #: The client's options, whole; the attributes below are the ones its paths read.
        self.options = options
        namespace, max_key_length = options.namespace, options.max_key_length
        self.layout = KeyLayout(namespace, max_key_length)
        self.lease = lease = options.lease
        self.result_ttl = result_ttl = options.result_ttl
        self.max_result_bytes = max_result_bytes = options.max_result_bytes
        #: The most bytes a stored value is decompressed to (:func:`decoded_limit`): past it a
        #: duplicate's value is :data:`OMITTED`, and a result serialised larger is stored omitted.
        self.decode_limit = decoded_limit(max_result_bytes)
        self.serializer: Serializer = options.serializer or JsonSerializer()
        #: Compresses stored values over ``compress_above`` bytes (:class:`Packer`).
        self.packer = Packer(options.compress_above, options.compression)
        self._lease_ms = max(1, int(lease * 1000))
        self._result_ttl_ms = max(1, int(result_ttl * 1000))
        self._retention_ms = max(self._lease_ms, int((options.token_retention or result_ttl) * 1000))
        #: What :meth:`request` builds a stem from without the general checks: an ASCII ``str``
        #: key this long at most, free of what :class:`KeyLayout` hashes (unsafe characters, the
        #: ``sha256:`` prefix), is stored as it is.
        self._plain_limit = min(max_key_length, KEY_HARD_LIMIT)
        self._stem_open = f"{namespace}:{{"

    def result_ttl_ms(self, ttl: float | None = None) -> int:
        """How long an outcome is kept, in milliseconds as ``complete.lua`` takes it: ``ttl``
        seconds when given (a per-call choice), else ``result_ttl``."""
        if ttl is None:
            return self._result_ttl_ms
        return ttl_ms(ttl)

    def retention_ms(self, ttl: float | None = None) -> int:
        """How long a started key (and with it the token counter) is kept once released, in
        milliseconds: ``token_retention``, or longer for a message kept ``ttl`` seconds, so the counter
        outlives every outcome and a key's tokens stay monotonic."""
        if ttl is None:
            return self._retention_ms
        return max(self._retention_ms, self.result_ttl_ms(ttl))

    @staticmethod
    def with_ttl(claims: list[Claim], ttl: float | None) -> list[Claim]:
        """``claims`` carrying ``ttl`` (the ttl their outcomes are stored with)."""
        if ttl is None:
            return claims
        return [dataclasses.replace(c, ttl=ttl) for c in claims]

    @staticmethod
    def owns(claim: Claim, stored: Any) -> bool:
        """Whether ``claim``'s outcome counts as ours once ``complete.lua`` answered ``stored``:
        exactly when the script stored it. The one place a verdict on a finished claim is decided,
        for the sync and asyncio clients alike.

        The script checked the fencing token in the same atomic step that wrote the outcome, so
        its reply is the truth. What the lease renewer saw meanwhile is not: a renewal that lands
        after our own ``complete.lua`` deleted the started record is refused, and reporting that
        as LEASE_LOST would defer (and count as lost) an outcome that is stored."""
        del claim
        return bool(stored)

    def check_key(self, key: str | bytes) -> tuple[str, str]:
        """Return ``(stored, original)`` as :meth:`KeyLayout.stored_key`; raise :class:`InvalidKey`
        for an empty key, one that is not str/bytes, or one longer than ``KEY_HARD_LIMIT`` UTF-8
        bytes."""
        if isinstance(key, (str, bytes)) and (size := _byte_length(key)) > KEY_HARD_LIMIT:
            raise InvalidKey(f"idempotency key is {size} bytes long; the limit is {KEY_HARD_LIMIT} bytes")
        return self.layout.stored_key(key)

    def request(self, key: str | bytes, fingerprint: Any = None) -> Request:
        """Check ``key`` and prepare its claim; raises :class:`InvalidKey`."""
        return Request(*self.prepare(key, fingerprint))

    def prepare(self, key: str | bytes, fingerprint: Any = None) -> Prepared:
        """:meth:`request`'s fields as a plain tuple ``(key, stem, fingerprint, original)``: what a
        batch keeps in its columns, without a :class:`Request` per key."""
        if (type(key) is str and key.isascii() and 0 < len(key) <= self._plain_limit and plain_ascii(key)
                and not key.startswith(HASHED_PREFIX)):
            # the common key (what check_key and KeyLayout.stem would give, a batch's worth cheaper)
            stem, original = self._stem_open + key + "}", ""
        else:
            stored, original = self.check_key(key)
            stem = self.layout.stem(stored)
            if not isinstance(key, str):
                key = key.decode("utf-8", "backslashreplace")
        if fingerprint is None:
            return key, stem, "", original
        if type(fingerprint) is str and len(fingerprint) <= 64:
            return key, stem, fingerprint, original
        return key, stem, request_fingerprint(fingerprint), original

    def _claims(self, requests: Sequence[Request], flat: Sequence[Any]) -> list[Claim]:
        """The claims of ``requests`` from ``claim.lua``'s flat reply (four values per key): what
        :meth:`_claim` makes of each, with the common answers (ACQUIRED; DUPLICATE of a stored
        JSON ``null``) built without the general decoding: that decoding is a large part of the
        client's time a message, so this path stays for a batch's messages per second
        (``python -m bench.accelerators claims``; the figures in docs/performance.md)."""
        if len(flat) != 4 * len(requests):
            raise ValueError(f"{len(flat)} reply values for {len(requests)} claims")
        json = type(self.serializer) is JsonSerializer
        claims: list[Claim] = []
        append = claims.append
        for r, code, token, status, value in zip(requests, flat[0::4], flat[1::4], flat[2::4], flat[3::4], strict=True):
            if code == 1:
                append(Claim(r[0], _ACQUIRED, token, None, 0.0, False, None, r[1], r[2], status == 1))
            elif code == 2 and json and value == b"null" and status == b"c":
                append(Claim(r[0], _DUPLICATE, token, None, 0.0, False, None, r[1], r[2]))
            else:
                append(self.claim_of(r, code, token, status, value))
        return claims

    def claim_of(self, request: Request, code: Any, token: Any, a: Any, b: Any) -> Claim:
        """The claim of ``request`` from its four values of ``claim.lua``'s reply (UNREADABLE for
        a record the script could not read, as for a status letter we never write)."""
        try:
            return self._claim(request, _claim_reply(code, token, a, b))
        except UnreadableRecord as exc:
            return self._claim(request, ClaimReply(Outcome.UNREADABLE, 0, value=exc.detail))

    def _claim(self, request: Request, reply: ClaimReply) -> Claim:
        key, stem, fp = request.key, request.stem, request.fingerprint
        outcome = reply.outcome
        if outcome is Outcome.UNREADABLE:
            error = UnreadableRecord(key, str(reply.value))
            log.error("record of key=%s cannot be read, nothing run for it: %s", key, error.detail)
            return Claim(key, outcome, 0, error=error, stem=stem, fingerprint=fp)
        if outcome is Outcome.DUPLICATE:
            if reply.status is Stored.FAILED:
                error = self._stored(key, reply)
                return Claim(key, outcome, reply.token, failed=True, error=error, stem=stem, fingerprint=fp)
            result = OMITTED if reply.status is Stored.OMITTED else self._stored(key, reply)
            return Claim(key, outcome, reply.token, result=result, stem=stem, fingerprint=fp)
        if outcome is Outcome.IN_PROGRESS:
            return Claim(key, outcome, reply.token, retry_after=reply.remaining_ms / 1000,
                         stem=stem, fingerprint=fp)
        return Claim(key, outcome, reply.token, stem=stem, fingerprint=fp, reclaimed=reply.reclaimed)

    def _stored(self, key: str, reply: ClaimReply) -> Any:
        return self.stored_result(key, reply.token, reply.value)

    def stored_result(self, key: str, token: int, data: bytes | str | None) -> Any:
        """Decode a stored value. One that does not parse (written by something else, or
        corrupted), or that decompresses past :attr:`decode_limit` (stopped there: memory stays
        bounded), still proves the work was done: it is answered as :data:`OMITTED`, never
        executed or unpickled."""
        if data == b"null" and type(self.serializer) is JsonSerializer:
            return None  # the common no-op result, without a loads call
        try:
            return self.decode(data or b"null")
        except TooLarge as exc:
            _log_once(key, token, "stored value of key=%s token=%s is %d bytes that decompress past %d, "
                      "answering OMITTED", len(data or b""), exc.limit)
            return OMITTED
        except Exception as exc:
            log.error("stored value of key=%s token=%s does not decode, answering OMITTED: %s", key, token, exc)
            return OMITTED

    def decode(self, data: bytes | str) -> Any:
        """A stored value back as the handler returned it (JSON types): decompressed when it was
        stored compressed (at most :attr:`decode_limit` bytes: :class:`TooLarge` past them), then
        parsed. Raises what the serializer or the decompressor raise."""
        return self.serializer.loads(unpack(data, self.decode_limit))

    @property
    def null_is_json(self) -> bool:
        """Whether a ``None`` result is stored as JSON ``null`` (``b"null"``, completed): with the
        default serializer, unless ``max_result_bytes`` is below 4."""
        return type(self.serializer) is JsonSerializer and self.max_result_bytes >= 4

    def encode(self, claim: Claim, value: Any) -> tuple[Stored, bytes, ResultNotSerializable | None]:
        """How ``value`` is stored as ``claim``'s outcome: ``(status, data, problem)``. ``data`` is
        compressed when over ``compress_above`` bytes; a value JSON cannot hold, one whose
        stored (compressed) form is over ``max_result_bytes``, or one serialised past
        :attr:`decode_limit` (a duplicate could not read it back), is stored as omitted."""
        if value is None and self.null_is_json:
            return Stored.COMPLETED, b"null", None  # the common no-op result, without a dumps call
        try:
            data = self.serializer.dumps(value)
        except ResultNotSerializable as exc:
            log.error("result of key=%s token=%s not serialisable, stored as omitted: %s",
                      claim.key, claim.token, exc)
            return Stored.OMITTED, b"", exc
        if len(data) > self.decode_limit:  # a duplicate could not decode it: see decoded_limit
            log.info("result of key=%s token=%s is %d bytes serialised, over %d, stored as omitted",
                     claim.key, claim.token, len(data), self.decode_limit)
            return Stored.OMITTED, b"", None
        data = self.packer.pack(data)
        if len(data) > self.max_result_bytes:
            log.info("result of key=%s token=%s is %d bytes, stored as omitted",
                     claim.key, claim.token, len(data))
            return Stored.OMITTED, b"", None
        return Stored.COMPLETED, data, None

    def encode_failure(self, error: BaseException | str) -> bytes:
        """How a permanent failure is stored: its type and message as JSON."""
        detail = (
            {"type": f"{type(error).__module__}.{type(error).__qualname__}", "message": str(error)}
            if isinstance(error, BaseException)
            else {"type": "error", "message": str(error)}
        )
        return self.packer.pack(self.serializer.dumps(detail))

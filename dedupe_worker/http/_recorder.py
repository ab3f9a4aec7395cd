"""Following the app's response as it is sent, and deciding what of it is kept for replay.

Two things the app sends are untrusted input here. The ``Idempotency-TTL`` header may hold any
text: it is read with the library's own bounds for a ttl (a positive number of seconds, at most
ten years, :func:`~dedupe_worker._protocol.codec.ttl_ms`), and any other value is ignored with
one warning, the response untouched. The body may be any size: what decides whether it is stored
is the size of the value as the store would keep it (``measure``), never a guess, so a response
is always stored, whole or as status and headers with its body omitted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import orjson

from .._protocol import ttl_ms
from ._stored import Response, encode, kept_headers

__all__ = ["REPLAYED", "Recorder", "Settle", "parse_ttl", "stored_size"]

log = logging.getLogger(__name__)

REPLAYED = ("idempotent-replayed", "true")
#: Bytes a header pair can take in the stored JSON beyond its own characters' worst case.
_PAIR_OVERHEAD = 8
#: Bytes of the stored JSON besides the body and the headers (status, version, packing).
_VALUE_OVERHEAD = 64


class Settle(NamedTuple):
    """After the app answered: ``store`` the ``value`` for ``ttl`` seconds (``None``: the
    client's ``result_ttl``), or release the key (``store`` false)."""

    store: bool
    value: Any = None
    ttl: float | None = None


def parse_ttl(value: str) -> float | None:
    """Seconds from an ``Idempotency-TTL`` value, ``None`` when it is not a usable ttl (not a
    number, not positive, not finite, or more than the library takes)."""
    try:
        seconds = float(value.strip())
        ttl_ms(seconds)
    except (ValueError, OverflowError):
        return None
    return seconds


def stored_size(client: Any) -> Callable[[Any], int]:
    """How many bytes ``client`` (a Deduplicator) stores for a value: its serializer's output,
    packed as it packs it. The measure :meth:`Recorder.settle` takes."""
    return lambda value: len(client.packer.pack(client.serializer.dumps(value)))


def _json_size(value: Any) -> int:
    return len(orjson.dumps(value))


class Recorder:
    """Follows the app's response as it is sent and decides what is kept.

    :meth:`start` takes the status and headers and gives back the headers to send (the TTL
    header stripped); :meth:`body` takes each chunk as it streams (kept until the body passes
    ``max_body_bytes``); :meth:`settle` says whether to store or release.
    """

    __slots__ = ("_chunks", "_size", "compress_above", "compression", "headers", "keep", "length", "max_body_bytes",
                 "replay_cookies", "status", "ttl", "ttl_header")

    def __init__(self, ttl_header: str, max_body_bytes: int, keep: Callable[[int], bool], replay_cookies: bool,
                 compress_above: int | None, compression: str, ttl: float | None) -> None:
        self.ttl_header = ttl_header
        self.max_body_bytes = max_body_bytes
        self.keep = keep
        self.replay_cookies = replay_cookies
        self.compress_above = compress_above
        self.compression = compression
        self.ttl = ttl
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self._chunks: list[bytes] | None = []
        self._size = 0
        #: The body's ``Content-Length``, when the app sent one.
        self.length: int | None = None

    def start(self, status: int, headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Note the status and headers; returns the headers to send (the TTL header taken out
        and, when it holds a usable ttl, used as this response's TTL)."""
        self.status = status
        ttl_name = self.ttl_header.lower()
        sent = []
        for name, value in headers:
            lower = name.lower()
            if lower == "content-length" and value.isdigit():
                self.length = int(value)
            if lower == ttl_name:
                seconds = parse_ttl(value)
                if seconds is None:
                    log.warning("ignored %s response header %r: not a positive number of seconds up to ten years",
                                self.ttl_header, value[:64])
                else:
                    self.ttl = seconds
                continue
            sent.append((name, value))
        self.headers = sent
        return sent

    def body(self, chunk: bytes) -> None:
        """Note a body chunk as it passes; past ``max_body_bytes`` only its size is counted."""
        self._size += len(chunk)
        if self._chunks is not None:
            if self._size > self.max_body_bytes:
                self._chunks = None
            elif chunk:
                self._chunks.append(chunk)

    @property
    def received_all(self) -> bool:
        """Whether the body seen so far is all its ``Content-Length`` announced: the response can
        be stored before its last chunk goes out."""
        return self.length is not None and self._size >= self.length

    def settle(self, completed: bool, limit: int, measure: Callable[[Any], int] = _json_size) -> Settle:
        """``completed``: the whole response went out. Store it when its status is one ``keep``
        takes; release the key when it is not, or when the response was cut off (the app raised
        or stopped, or the client went away before the end)."""
        if not completed or not self.status or not self.keep(self.status):
            return Settle(False)
        body = None if self._chunks is None else b"".join(self._chunks)
        return self.stored(Response(self.status, tuple(self.headers), body or b""), body is None, limit, measure)

    def stored(self, response: Response, omit: bool, limit: int, measure: Callable[[Any], int]) -> Settle:
        """``response`` as stored: whole when the value the store keeps (``measure``) fits in
        ``limit`` (the client's ``max_result_bytes``), else without its body (also when
        ``omit``: the body was over ``max_body_bytes``)."""
        headers = kept_headers(response.headers, drop=frozenset(), replay_cookies=self.replay_cookies)
        if not omit:
            value = encode(Response(response.status, headers, response.body), compress_above=self.compress_above,
                           compression=self.compression)
            if _fits_surely(value, headers, limit) or measure(value) <= limit:
                return Settle(True, value, self.ttl)
        log.info("response of %d bytes stored without its body", len(response.body) if not omit else self._size)
        return Settle(True, encode(Response(response.status, headers, b"", omitted=True),
                                   compress_above=self.compress_above, compression=self.compression), self.ttl)


def _fits_surely(value: dict[str, Any], headers: tuple[tuple[str, str], ...], limit: int) -> bool:
    """Whether the stored value cannot exceed ``limit`` whatever the serializer's escaping: each
    header character counted as the six bytes of its worst JSON escape (``\\u00XX``). Only a
    value that might not fit is measured exactly."""
    return len(value["b"]) + sum(6 * (len(n) + len(v)) + _PAIR_OVERHEAD for n, v in headers) + _VALUE_OVERHEAD <= limit

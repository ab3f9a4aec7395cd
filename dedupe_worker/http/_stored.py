"""Responses as they are kept in Redis and replayed: status, header list and body bytes.

A stored response is a JSON object (the claim protocol's serializer stores JSON), so the body is
base64 text, deflated or gzipped first when it is larger than the threshold and compression
saves something. Headers are kept as ``[name, value]`` pairs decoded as latin-1, which gives the
exact bytes back. What :func:`encode` and :func:`decode` do round-trips byte for byte.

A response whose body was over ``max_body_bytes`` is stored without its body (``"omitted"``):
the work is known done, and a retry gets the status and headers with an empty body (see
docs/http.md).
"""

from __future__ import annotations

import base64
import gzip
import zlib
from dataclasses import dataclass
from typing import Any

from .._protocol import TooLarge, inflate

__all__ = ["HOP_BY_HOP", "Response", "decode", "encode", "kept_headers"]

#: Headers never stored nor replayed: they describe one connection, not the response (RFC 9110
#: 7.6.1), or one moment (``date``).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "transfer-encoding", "upgrade", "date"})
_VERSION = 1
#: The ``wbits`` of :func:`~dedupe_worker._protocol.serialization.inflate` for each ``z`` a body
#: is stored with.
_WBITS = {"deflate": zlib.MAX_WBITS, "gzip": zlib.MAX_WBITS | 16}


@dataclass(frozen=True)
class Response:
    """A complete response: status, ``(name, value)`` header pairs (latin-1 text) and body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    #: The body was over ``max_body_bytes`` when stored, so only status and headers were kept.
    omitted: bool = False


def kept_headers(headers: list[tuple[str, str]] | tuple[tuple[str, str], ...], *, drop: frozenset[str],
                 replay_cookies: bool) -> tuple[tuple[str, str], ...]:
    """The headers stored for replay: all but hop-by-hop ones, ``Date``, the names in ``drop``
    and, unless ``replay_cookies``, ``Set-Cookie``."""
    out = []
    for name, value in headers:
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in drop or (lower == "set-cookie" and not replay_cookies):
            continue
        out.append((name, value))
    return tuple(out)


def encode(response: Response, *, compress_above: int | None, compression: str) -> dict[str, Any]:
    """The JSON-able value stored for ``response``: ``v`` (format version), ``s``, ``h``, ``b``
    (base64 body), ``z`` (``"deflate"``/``"gzip"`` when compressed) and ``o`` when omitted."""
    value: dict[str, Any] = {"v": _VERSION, "s": response.status, "h": [list(pair) for pair in response.headers]}
    if response.omitted:
        value["o"] = True
        value["b"] = ""
        return value
    body = response.body
    if compress_above is not None and len(body) > compress_above:
        packed = gzip.compress(body, mtime=0) if compression == "gzip" else zlib.compress(body)
        if len(packed) < len(body):
            value["z"] = compression
            body = packed
    value["b"] = base64.b64encode(body).decode("ascii")
    return value


def decode(value: Any, max_body_bytes: int) -> Response | None:
    """The response stored as ``value`` by :func:`encode`; ``None`` when it is not one (a value
    written by something else or by a later format, truncated, invalid base64, or a compressed
    body that inflates past ``max_body_bytes``: decompression stops there, so a stored blob
    never costs more memory than the largest body the layer stores).

    A body that inflates past ``max_body_bytes`` raises :class:`~dedupe_worker._protocol.TooLarge`
    instead: it is a response this process could not have stored, not a record that is not ours,
    so it is kept for a process configured to read it."""
    if not isinstance(value, dict) or value.get("v") != _VERSION:
        return None
    try:
        body = base64.b64decode(value["b"], validate=True)
        packing = value.get("z")
        if packing is not None:
            if packing not in _WBITS:
                return None
            body = inflate(body, max_body_bytes, _WBITS[packing])
        headers = tuple((str(name), str(text)) for name, text in value["h"])
        return Response(int(value["s"]), headers, body, bool(value.get("o", False)))
    except TooLarge:
        raise
    except (KeyError, TypeError, ValueError, zlib.error, OSError):
        return None


"""Reading a stored outcome (a ``:result`` record) from Python, in either of its formats.

The protocol scripts read results themselves; this is for the tools that look at records
directly (``stats``, ``inspect``'s original key, the replay's fingerprint check). The formats,
as ``lua/complete.lua`` writes them:

* format 1, a hash: ``s`` (status), ``v`` (value), ``t`` (token), and ``f`` (fingerprint) and
  ``orig`` (original key) only when the claim had them;
* format 2, a string: the status letter, the token as 8 bytes big-endian, the value; when the
  claim had a fingerprint or an original key the letter is upper case and the value is preceded
  by the fingerprint and the original key, each after its length in 2 bytes big-endian.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from redis.exceptions import ResponseError

__all__ = ["StoredResult", "parse_result", "queue_size_read", "read_result", "size_from_replies"]


class StoredResult(NamedTuple):
    """One result record, whatever its format; ``fingerprint`` and ``original`` are ``b""`` when
    the claim had none."""

    status: bytes
    token: int
    value: bytes
    fingerprint: bytes = b""
    original: bytes = b""


def parse_result(raw: bytes) -> StoredResult:
    """A format-2 result (the string value of a ``:result`` key)."""
    status, token = raw[:1], int.from_bytes(raw[1:9], "big")
    if status.islower():
        return StoredResult(status, token, raw[9:])
    fp_end = 11 + int.from_bytes(raw[9:11], "big")
    orig_end = fp_end + 2 + int.from_bytes(raw[fp_end : fp_end + 2], "big")
    return StoredResult(status.lower(), token, raw[orig_end:], raw[11:fp_end], raw[fp_end + 2 : orig_end])


def _from_hash(fields: dict[Any, Any]) -> StoredResult | None:
    fields = {(k.decode() if isinstance(k, bytes) else k): (v.encode() if isinstance(v, str) else v)
              for k, v in fields.items()}
    if not fields.get("s"):
        return None
    return StoredResult(fields["s"], int(fields.get("t") or 0), fields.get("v") or b"",
                        fields.get("f") or b"", fields.get("orig") or b"")


def read_result(client: Any, name: str) -> StoredResult | None:
    """The result stored at ``name`` (``None`` when there is none): one ``GET``, and one
    ``HGETALL`` more for a format-1 hash. Redis errors other than ``WRONGTYPE`` propagate."""
    try:
        raw = client.get(name)
    except ResponseError as exc:
        if "WRONGTYPE" not in str(exc):
            raise
        return _from_hash(client.hgetall(name))
    if raw is None:
        return None
    return parse_result(raw.encode("latin-1") if isinstance(raw, str) else raw)


def queue_size_read(pipe: Any, name: str) -> None:
    """Queue on ``pipe`` (a non-transactional pipeline) what :func:`size_from_replies` needs for
    the status and value size of the result at ``name``, in either format, without reading a
    format-1 value: three replies, one of which is a ``WRONGTYPE`` error."""
    pipe.hget(name, "s")
    pipe.hstrlen(name, "v")
    pipe.get(name)


def size_from_replies(status: Any, size: Any, raw: Any) -> tuple[bytes, int]:
    """``(status, value size)`` from the three replies of :func:`queue_size_read` (read with
    ``raise_on_error=False``); ``(b"", 0)`` when no result is stored. Raises the error when the
    key is neither format (``WRONGTYPE`` on both reads)."""
    if isinstance(raw, bytes):
        stored = parse_result(raw)
        return stored.status, len(stored.value)
    if isinstance(status, Exception):
        if isinstance(raw, Exception):
            raise status
        return b"", 0
    status = status.encode() if isinstance(status, str) else status
    return status or b"", int(size or 0)

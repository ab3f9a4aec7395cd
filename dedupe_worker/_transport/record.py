"""Reading a stored outcome from Python, in either of its formats.

The protocol scripts read results themselves; this is for the tools that look at records
directly (``stats``, ``inspect``'s original key, the replay's fingerprint check). The formats,
as ``lua/complete.lua`` writes them (at most one of the two exists for a key):

* format 1, a hash at ``<stem>:result``: ``s`` (status), ``v`` (value), ``t`` (token), and ``f``
  (fingerprint) and ``orig`` (original key) only when the claim had them;
* format 2, a string at the stem itself (``<namespace>:{<key>}``): the status letter, the token
  as 8 bytes big-endian, the value; when the claim had a fingerprint or an original key the
  letter is upper case and the value is preceded by the fingerprint and the original key, each
  after its length in 2 bytes big-endian.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._protocol import KeyLayout

__all__ = ["StoredResult", "parse_result", "queue_size_read", "read_result", "size_from_replies"]


class StoredResult(NamedTuple):
    """One result record, whatever its format; ``fingerprint`` and ``original`` are ``b""`` when
    the claim had none."""

    status: bytes
    token: int
    value: bytes
    fingerprint: bytes = b""
    original: bytes = b""


#: The status letters a record may carry (``lua/complete.lua``).
_STATUSES = (b"c", b"o", b"f")


def _bytes(raw: bytes | str) -> bytes:
    return raw.encode("latin-1") if isinstance(raw, str) else raw


def parse_result(raw: bytes) -> StoredResult:
    """A format-2 result (the string value at a key's stem). ``ValueError`` for a string that is
    not one, checked as ``claim.lua`` checks it (too short, a status letter we never write, its
    lengths running past its end): the scripts answer UNREADABLE for it."""
    status, token = raw[:1], int.from_bytes(raw[1:9], "big")
    if len(raw) < 9 or status.lower() not in _STATUSES:
        raise ValueError(f"a {len(raw)}-byte string that is not a format-2 record")
    if status.islower():
        return StoredResult(status, token, raw[9:])
    fp_end = 11 + int.from_bytes(raw[9:11], "big")
    orig_end = fp_end + 2 + int.from_bytes(raw[fp_end : fp_end + 2], "big")
    if len(raw) < 11 or len(raw) < fp_end + 2 or len(raw) < orig_end:
        raise ValueError(f"a format-2 record truncated to {len(raw)} bytes")
    return StoredResult(status.lower(), token, raw[orig_end:], raw[11:fp_end], raw[fp_end + 2 : orig_end])


def _from_hash(fields: dict[Any, Any]) -> StoredResult | None:
    fields = {(k.decode() if isinstance(k, bytes) else k): (v.encode() if isinstance(v, str) else v)
              for k, v in fields.items()}
    if not fields.get("s"):
        return None
    return StoredResult(fields["s"], int(fields.get("t") or 0), fields.get("v") or b"",
                        fields.get("f") or b"", fields.get("orig") or b"")


def read_result(client: Any, stem: str) -> StoredResult | None:
    """The outcome stored for the key whose stem is ``stem`` (``None`` when there is none), in
    either format: one round trip (``GET`` of the stem, ``HGETALL`` of ``<stem>:result``, both in
    the key's hash slot). Redis errors propagate (``WRONGTYPE`` when another program's key of
    another type holds one of the names)."""
    pipe = client.pipeline(transaction=False)
    pipe.get(KeyLayout.record(stem))
    pipe.hgetall(KeyLayout.result(stem))
    raw, fields = pipe.execute()
    if raw is not None:
        return parse_result(_bytes(raw))
    return _from_hash(fields or {})


def queue_size_read(pipe: Any, name: str) -> None:
    """Queue on ``pipe`` what :func:`size_from_replies` needs for the status and value size of
    the outcome record ``name`` found by a ``SCAN`` (``KeyLayout.kind(name)`` is ``"record"`` or
    ``"result"``), without reading a format-1 value: one reply for a format-2 string (the
    record itself), two for a format-1 hash (its status, its value's length)."""
    if KeyLayout.kind(name) == "record":
        pipe.get(name)
    else:
        pipe.hget(name, "s")
        pipe.hstrlen(name, "v")


def size_from_replies(*replies: Any) -> tuple[bytes, int]:
    """``(status, value size)`` from the replies of :func:`queue_size_read`; ``(b"", 0)`` when the
    record is gone (it expired between the ``SCAN`` and the read). An error reply is raised
    (``WRONGTYPE``: another program's key of another type under the name), and ``ValueError`` for
    a record the scripts cannot read (a malformed string, a status letter we never write)."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    if len(replies) == 1:
        raw = replies[0]
        if raw is None:
            return b"", 0
        stored = parse_result(_bytes(raw))
        return stored.status, len(stored.value)
    status, size = replies
    status = status.encode() if isinstance(status, str) else status
    if status and status not in _STATUSES:
        raise ValueError(f"status {status!r} is not one dedupe-worker writes")
    return status or b"", int(size or 0)

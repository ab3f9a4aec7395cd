"""Payload fingerprints: a short content hash stored with a claim.

The claim script compares the fingerprint of a new delivery with the one stored for its key; a
key reused for a different payload is answered CONFLICT instead of a wrong cached result.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

__all__ = ["canonical_json", "content_hash", "fingerprint_of", "request_fingerprint"]


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys and no whitespace, so equal data gives equal bytes.

    pydantic models are dumped first; values JSON cannot hold fall back to ``repr``.
    """

    def default(obj: Any) -> Any:
        dump = getattr(obj, "model_dump", None)
        if callable(dump):
            return dump(mode="json")
        if isinstance(obj, (set, frozenset)):
            return sorted(obj, key=repr)
        return repr(obj)

    return orjson.dumps(value, default=default, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)


def content_hash(data: bytes | str, length: int = 32) -> str:
    """Hex sha256 of ``data``, cut to ``length`` hex digits (128 bits by default)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return hashlib.sha256(raw).hexdigest()[:length]


def fingerprint_of(value: Any) -> str:
    """Fingerprint of any JSON-like value (a pydantic model, dict, list ...): its canonical JSON hash."""
    return content_hash(canonical_json(value))


def request_fingerprint(fingerprint: Any) -> str:
    """The fingerprint as sent to ``claim.lua``: ``""`` (no check) for ``None`` or empty, a short
    string as it is, longer text or bytes hashed, anything else by its canonical JSON."""
    if fingerprint is None or fingerprint == "":
        return ""
    if isinstance(fingerprint, str) and len(fingerprint) <= 64:
        return fingerprint
    if isinstance(fingerprint, (str, bytes)):
        return content_hash(fingerprint)
    return fingerprint_of(fingerprint)

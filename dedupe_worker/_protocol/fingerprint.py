"""Payload fingerprints: a short content hash stored with a claim.

The claim script compares the fingerprint of a new delivery with the one stored for its key; a
key reused for a different payload is answered CONFLICT instead of a wrong cached result. So a
fingerprint must be the same for the same payload in every process, and different for different
payloads: :func:`canonical_json` writes a value as canonical JSON (RFC 8785: sorted keys, no
whitespace, numbers in ECMAScript form) and refuses what has no stable JSON form.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import decimal
import enum
import hashlib
import math
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = ["canonical_json", "canonical_number", "content_hash", "fingerprint_of", "request_fingerprint"]

#: Integers this small are written with ``str`` (they have fewer than 21 digits).
_SMALL_INT = 2**53


def canonical_json(value: Any) -> bytes:
    """``value`` as RFC 8785 canonical JSON (UTF-8): equal data gives equal bytes in any process.

    What is accepted, and as what:

    - ``None``, ``bool``, ``str``; numbers (``int``, finite ``float``, finite ``Decimal``) as
      :func:`canonical_number` writes them, so ``1``, ``1.0`` and ``Decimal("1.00")`` are one value;
    - mappings with ``str`` keys (``int`` keys are written as their number's text) as objects,
      members sorted by their keys' UTF-16 code units; lists and tuples as arrays; sets and
      frozensets as arrays sorted by each element's canonical JSON;
    - pydantic models as their ``model_dump(mode="json")``; dataclass instances as an object of
      their fields; enum members as their value; ``datetime``/``date``/``time`` as ISO 8601 text
      (``isoformat()``); ``UUID`` as its text; ``bytes`` as base64 text.

    Anything else (a plain object, a function, NaN or infinity ...) raises :class:`TypeError`
    naming the type: its only text would be a ``repr``, which may hold a memory address and
    differ between processes. Pass a fingerprint of your own (a string) for such payloads.
    """
    return orjson.dumps(_plain(value))


def canonical_number(number: int | float | decimal.Decimal) -> str:
    """A number as RFC 8785 writes it (ECMAScript's ``Number.prototype.toString``): ``1.0`` as
    ``1``, ``-0.0`` as ``0``, ``1e21`` as ``1e+21``, ``1e-7`` as ``1e-7``, ``0.000001`` as
    ``0.000001``. A float is written with the shortest digits that read back as it; an ``int`` or
    a ``Decimal`` with all of its digits (RFC 8785 would first round an integer beyond 2**53 to a
    double, giving two different large ids one fingerprint; here they stay apart).
    Raises :class:`TypeError` for NaN and infinity, which JSON cannot hold."""
    if type(number) is int and -_SMALL_INT < number < _SMALL_INT:
        return str(number)
    if isinstance(number, float):
        if not math.isfinite(number):
            raise TypeError(f"cannot fingerprint float {number!r}: NaN and infinity have no JSON form")
        if number == 0:
            return "0"
        text = repr(number)
        if "e" not in text:  # 1e-4 <= |x| < 1e16: repr's fixed form has ECMAScript's digits and layout
            return text[:-2] if text.endswith(".0") else text
        negative, text = number < 0, repr(abs(number))
        mantissa, _, exponent = text.partition("e")
        whole, _, fraction = mantissa.partition(".")
        digits, shift = whole + fraction, int(exponent or 0) - len(fraction)
    elif isinstance(number, decimal.Decimal):
        if not number.is_finite():
            raise TypeError(f"cannot fingerprint Decimal {number!r}: NaN and infinity have no JSON form")
        sign, digit_tuple, exp = number.as_tuple()
        negative, digits, shift = bool(sign), "".join(map(str, digit_tuple)), int(exp)
    else:
        negative, digits, shift = number < 0, str(abs(int(number))), 0
    stripped = digits.lstrip("0").rstrip("0")
    if not stripped:
        return "0"
    shift += len(digits.lstrip("0")) - len(stripped)  # trailing zeros move into the exponent
    return ("-" if negative else "") + _layout(stripped, shift + len(stripped))


def _layout(digits: str, n: int) -> str:
    """ECMAScript's layout of the number ``0.<digits> * 10**n`` (``digits`` without leading or
    trailing zeros; ``k`` digits)."""
    k = len(digits)
    if k <= n <= 21:
        return digits + "0" * (n - k)
    if 0 < n <= 21:
        return digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return "0." + "0" * -n + digits
    exponent = n - 1
    mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
    return f"{mantissa}e{'+' if exponent >= 0 else '-'}{abs(exponent)}"


def _utf16(item: tuple[str, Any]) -> bytes:
    return item[0].encode("utf-16-be", "surrogatepass")


def _member_name(key: Any) -> str:
    if isinstance(key, str):
        return str(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return canonical_number(key)
    raise TypeError(f"cannot fingerprint a mapping key of type {type(key).__qualname__}: keys must be str or int")


def _plain(value: Any) -> Any:
    """``value`` made of what orjson writes canonically as it is: ``str``, ``bool``, ``None``,
    integers below 2**53, lists and dicts whose members are in canonical order; every other number
    as an :class:`orjson.Fragment` of its canonical text. Raises :class:`TypeError`."""
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return value
    if kind is int:
        return value if -_SMALL_INT < value < _SMALL_INT else orjson.Fragment(canonical_number(value))
    if kind is float:
        if value.is_integer() and -_SMALL_INT < value < _SMALL_INT:
            return int(value)
        return orjson.Fragment(canonical_number(value))
    if kind is list or kind is tuple:  # before the Mapping check, an ABC's isinstance
        return [_plain(item) for item in value]
    if kind is dict or isinstance(value, Mapping):
        if not value:  # no keyword arguments, the common case of a task's fingerprint
            return {}
        if all(type(key) is str for key in value):
            items = list(value.items())
        else:
            items = [(_member_name(key), item) for key, item in value.items()]
            if len({name for name, _ in items}) < len(items):
                raise TypeError(f"cannot fingerprint a mapping with two keys written as the same text: {value!r:.200}")
        # Code point order is UTF-16 order unless a key holds a character from U+E000 up.
        items.sort(key=_utf16 if items and max(name for name, _ in items) >= "\ue000" else _first)
        return {name: _plain(item) for name, item in items}
    return _plain_other(value)


def _first(item: tuple[str, Any]) -> str:
    return item[0]


def _plain_other(value: Any) -> Any:
    """The types that have a stable JSON form but are not JSON's own (see :func:`canonical_json`)."""
    dump = getattr(value, "model_dump", None)  # pydantic v2 models
    if callable(dump) and not isinstance(value, type):
        return _plain(dump(mode="json"))
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, str):  # subclasses of the plain types, as the plain type
        return str(value)
    if isinstance(value, int):
        return bool(value) if isinstance(value, bool) else _plain(int(value))
    if isinstance(value, float):
        return _plain(float(value))
    if isinstance(value, decimal.Decimal):
        return orjson.Fragment(canonical_number(value))
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (set, frozenset)):  # no order of their own: sorted by canonical form
        return orjson.Fragment(b"[" + b",".join(sorted(canonical_json(item) for item in value)) + b"]")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain({field.name: getattr(value, field.name) for field in dataclasses.fields(value)})
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    raise TypeError(
        f"cannot fingerprint a value of type {type(value).__module__}.{type(value).__qualname__}: it has "
        "no stable JSON form (give it one as a pydantic model or dataclass, or pass a fingerprint string)"
    )


def content_hash(data: bytes | str, length: int = 32) -> str:
    """Hex sha256 of ``data``, cut to ``length`` hex digits (128 bits by default)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return hashlib.sha256(raw).hexdigest()[:length]


def fingerprint_of(value: Any) -> str:
    """Fingerprint of any JSON-like value (a pydantic model, dict, list ...): the hash of its
    :func:`canonical_json`; raises :class:`TypeError` as that does."""
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

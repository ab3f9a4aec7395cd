"""What the rules see of an HTTP request, and how the ``Idempotency-Key`` field is parsed.

The field is a Structured Field String (RFC 8941, ``"..."`` with ``\\"`` and ``\\\\`` escapes),
as draft-ietf-httpapi-idempotency-key-header asks; a bare value of token characters (a UUID as
most clients send it) is accepted too. Parsing never raises: it answers a :class:`KeyProblem`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KeyProblem", "RequestInfo", "parse_key"]

#: tchar (RFC 9110) plus ":" and "/" as an sf-token allows them; no leading digit rule, so UUIDs pass.
_BARE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z:/]+")
#: An sf-string without escapes, the common case, matched whole.
_PLAIN_SF = re.compile(r'"([\x20\x21\x23-\x5b\x5d-\x7e]*)"')


class KeyProblem(enum.Enum):
    """Why a request's key is refused (each a 400)."""

    MISSING = "missing"
    REPEATED = "repeated"
    EMPTY = "empty"
    TOO_LONG = "too_long"
    SYNTAX = "syntax"


@dataclass(frozen=True)
class RequestInfo:
    """An HTTP request as the rules see it, the same for ASGI, WSGI and Django.

    ``headers`` are ``(lower-case name, value)`` pairs decoded as latin-1, in the order received;
    ``raw`` is the framework's own object (the ASGI scope, the WSGI environ, Django's
    ``HttpRequest``) for ``scope=`` and ``required=`` callables that need more (a user id).
    """

    method: str
    path: str
    query: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    raw: Any = field(default=None, compare=False, repr=False)

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), else ``None``."""
        name = name.lower()
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def header_values(self, name: str) -> list[str]:
        """Every value of header ``name`` (case-insensitive), in order."""
        name = name.lower()
        return [value for key, value in self.headers if key == name]


def parse_sf_string(text: str) -> str | None:
    """The value of an RFC 8941 sf-string (``"..."``) with surrounding spaces, else ``None``."""
    text = text.strip(" \t")
    plain = _PLAIN_SF.fullmatch(text)
    if plain is not None:
        return plain.group(1)
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        return None
    out: list[str] = []
    i, end = 1, len(text) - 1
    while i < end:
        char = text[i]
        if char == "\\":
            if i + 1 >= end or text[i + 1] not in '"\\':
                return None
            out.append(text[i + 1])
            i += 2
            continue
        if char == '"' or not (0x20 <= ord(char) <= 0x7E):
            return None
        out.append(char)
        i += 1
    return "".join(out)


def parse_key(values: list[str], max_length: int) -> str | KeyProblem:
    """The client's key from every value of the key header, or why it is refused: none
    (MISSING), more than one field or a list (REPEATED), ``""`` (EMPTY), over ``max_length``
    characters (TOO_LONG), neither an sf-string nor a bare token (SYNTAX)."""
    if not values:
        return KeyProblem.MISSING
    if len(values) > 1:
        return KeyProblem.REPEATED
    text = values[0].strip(" \t")
    if not text:
        return KeyProblem.EMPTY
    if text.startswith('"'):
        key = parse_sf_string(text)
        if key is None:
            return KeyProblem.REPEATED if _is_list(text) else KeyProblem.SYNTAX
    elif _BARE.fullmatch(text):
        key = text
    else:
        return KeyProblem.REPEATED if _is_list(text) else KeyProblem.SYNTAX
    if not key:
        return KeyProblem.EMPTY
    if len(key) > max_length:
        return KeyProblem.TOO_LONG
    return key


def _is_list(text: str) -> bool:
    """Whether ``text`` reads as several keys joined by a comma (two fields a proxy folded)."""
    parts = [part.strip(" \t") for part in text.split(",")]
    return len(parts) > 1 and all(parse_sf_string(p) is not None or _BARE.fullmatch(p) for p in parts)

"""A message's ttl read from a message header: how many seconds its outcome is kept (``ttl=`` of
the engine) instead of the deduplicator's ``result_ttl``.

One parser for every consumer (RabbitMQ, Kafka, FastStream, Dramatiq, Celery): the header
``x-dedupe-ttl`` (the name is configurable per consumer) holds a positive number of seconds as
text or bytes (``"3600"``, ``b"0.5"``: Kafka headers are bytes) or as any number a header
carries (an AMQP integer of any width, a float, or a ``Decimal``: kombu decodes AMQP decimals so,
and ``Decimal("5")`` is five seconds). A missing or empty header means ``result_ttl``. Any
other value is bad input: :func:`header_ttl` raises :class:`~dedupe_worker.UndecodableMessage`,
which :class:`~dedupe_worker._engine.identify.Identify` turns into a refusal (a dead letter whose
reason names the header and the value). Refused rather than run with ``result_ttl``: the sender
asked for a ttl, and keeping
the outcome for another length could drop it too early (a duplicate applied again) or keep it
longer than the sender allows; a dead letter loses nothing and can be replayed once fixed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from numbers import Number
from typing import Any

from .._errors import UndecodableMessage
from .._protocol import ttl_ms

__all__ = ["TTL_HEADER", "TtlHeader", "header_ttl", "parse_ttl"]

#: The default name of the header that carries a message's ttl in seconds.
TTL_HEADER = "x-dedupe-ttl"

#: At most this many characters of a bad value are shown in the error.
_SHOWN = 80


def parse_ttl(value: Any, source: str = f"{TTL_HEADER} header") -> float | None:
    """``value`` (a header's text, bytes or number) as seconds; ``None`` when absent or empty.
    Raises :class:`~dedupe_worker.UndecodableMessage` (naming ``source``) unless it is a positive
    number of seconds."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("utf-8", "backslashreplace")
    seconds: Any = value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            seconds = float(value)
        except ValueError:
            pass
    elif isinstance(value, Number) and not isinstance(value, bool):  # Decimal, int of any width, float
        try:
            seconds = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):  # complex, Decimal('sNaN'), an int past float's range
            pass
    try:
        ttl_ms(seconds)
    except ValueError:
        shown = repr(value)  # bounded: the reason travels in a dead letter's header
        if len(shown) > _SHOWN:
            shown = shown[:_SHOWN - 3] + "..."
        raise UndecodableMessage(f"{source}: {shown} is not a positive number of seconds") from None
    return float(seconds)


def header_ttl(headers: Mapping[str, Any] | None, name: str = TTL_HEADER) -> float | None:
    """The ttl in ``headers`` under ``name`` (case-insensitive): see :func:`parse_ttl`."""
    if not headers:
        return None
    value = headers.get(name)
    if value is None:
        lowered = name.lower()
        for k, v in headers.items():  # a loop, not next(genexpr): once per consumed message
            if isinstance(k, str) and k.lower() == lowered:
                value = v
                break
        else:
            return None
    return parse_ttl(value, f"{name} header")


class TtlHeader:
    """:func:`header_ttl` of one header name, for the headers of many messages (a consumer's).

    The names of other headers are remembered once seen (up to :attr:`REMEMBERED`), so a message
    whose other headers are known costs a set look-up each instead of a lower-cased compare:
    the answers are those of :func:`header_ttl`."""

    #: How many other header names are remembered at most (header names are few in practice).
    REMEMBERED = 1024

    __slots__ = ("lowered", "name", "others", "source")

    def __init__(self, name: str = TTL_HEADER) -> None:
        self.name = name
        self.lowered = name.lower()
        self.source = f"{name} header"
        #: Header names that are not this one in any case.
        self.others: set[Any] = set()

    def __call__(self, headers: Mapping[str, Any] | None) -> float | None:
        if not headers:
            return None
        value = headers.get(self.name)
        if value is None:
            others, lowered = self.others, self.lowered
            if others.issuperset(headers):  # every name known, none ours: no loop in Python
                return None
            for k in headers:  # the first name equal to ours but for case, in the headers' order
                if k in others:
                    continue
                if isinstance(k, str) and k.lower() == lowered:
                    value = headers[k]
                    break
                if len(others) < self.REMEMBERED:
                    others.add(k)
            else:
                return None
        return parse_ttl(value, self.source)

    def many(self, headers: Sequence[Mapping[str, Any] | None]) -> list[float | None] | None:
        """``[self(h) for h in headers]``, or ``None`` when no message holds the header: one set
        test for a batch whose header names are all known (not ours), each message's own reading
        otherwise (it raises what :meth:`__call__` raises)."""
        if self.others.issuperset(chain.from_iterable(filter(None, headers))):
            return None
        return [self(one) for one in headers]

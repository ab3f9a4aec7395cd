"""A broker-neutral view of one message, so keys are derived the same way everywhere.

The RabbitMQ and Kafka consumers and the dead-letter replay all turn their broker's message into
an :class:`Envelope` and hand it to the same key strategy (:mod:`dedupe_worker.keys`), which is
what lets the replay find exactly the records the consumer wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Envelope", "from_kafka", "from_kombu"]


@dataclass(frozen=True)
class Envelope:
    """One message as key strategies see it.

    ``headers`` maps header names to values (bytes or str); ``message_id`` is the AMQP
    ``message_id`` property; ``partition_key`` is the Kafka record key; ``source`` names the
    queue or topic and ``position`` the ``(partition, offset)`` for Kafka, else ``None``.
    """

    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    message_id: str | None = None
    partition_key: bytes | None = None
    source: str = ""
    position: tuple[int, int] | None = None

    def header(self, name: str) -> str | None:
        """The header ``name`` (case-insensitive) as text, or ``None`` when absent or empty."""
        value = self.headers.get(name)
        if value is None:
            lowered = name.lower()
            value = next((v for k, v in self.headers.items() if k.lower() == lowered), None)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "backslashreplace")
        if value is None or value == "":
            return None
        return str(value)


def from_kombu(message: Any, queue: str = "") -> Envelope:
    """The envelope of a kombu ``Message`` (duck-typed: ``body``, ``headers``, ``properties``)."""
    body = message.body
    if isinstance(body, str):
        body = body.encode("utf-8")
    properties = getattr(message, "properties", None) or {}
    return Envelope(
        body=bytes(body),
        headers=dict(getattr(message, "headers", None) or {}),
        message_id=properties.get("message_id"),
        source=queue,
    )


def from_kafka(message: Any) -> Envelope:
    """The envelope of a confluent-kafka ``Message``; repeated headers keep their last value.

    A record that the replay republished (header ``x-dedupe-replayed``) keeps the position it had
    before it was dead-lettered (the ``x-dedupe-original-*`` headers), so a position-based key
    names the same record before and after the replay.
    """
    headers: dict[str, Any] = {}
    for name, value in message.headers() or ():
        headers[name] = value
    source, position = message.topic() or "", (message.partition(), message.offset())
    original = _original_position(headers) if "x-dedupe-replayed" in headers else None
    if original is not None:
        source, position = original
    return Envelope(
        body=message.value() or b"",
        headers=headers,
        partition_key=message.key(),
        source=source,
        position=position,
    )


def _original_position(headers: dict[str, Any]) -> tuple[str, tuple[int, int]] | None:
    def text(name: str) -> str | None:
        value = headers.get(name)
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else value

    topic = text("x-dedupe-original-topic")
    partition, offset = text("x-dedupe-original-partition"), text("x-dedupe-original-offset")
    if not topic or partition is None or offset is None:
        return None
    try:
        return topic, (int(partition), int(offset))
    except ValueError:
        return None

"""A broker-neutral view of one message, so keys are derived the same way everywhere.

The RabbitMQ and Kafka consumers and the dead-letter replay all turn their broker's message into
an :class:`Envelope` and hand it to the same key strategy (:mod:`dedupe_worker.keys`), which is
what lets the replay find exactly the records the consumer wrote.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .deadletter import ORIGINAL_OFFSET, ORIGINAL_PARTITION, ORIGINAL_TOPIC, REPLAYED

__all__ = ["Envelope", "from_kafka", "from_kombu", "original_position"]


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
    # Built as the frozen dataclass's __init__ would (every field, nothing else runs there), with
    # its fields set at once: one per consumed message, and half the cost of the six
    # object.__setattr__ calls of that __init__.
    envelope = object.__new__(Envelope)
    envelope.__dict__.update(body=bytes(body), headers=dict(getattr(message, "headers", None) or {}),
                             message_id=properties.get("message_id"), partition_key=None, source=queue,
                             position=None)
    return envelope


def from_kafka(message: Any) -> Envelope:
    """The envelope of a confluent-kafka ``Message``; repeated headers keep their last value.

    A record that the replay republished (header ``x-dedupe-replayed``) keeps the position it had
    before it was dead-lettered (see :func:`original_position`), so a position-based key names
    the same record before and after the replay.
    """
    headers: dict[str, Any] = dict(message.headers() or ())
    # Built as from_kombu() builds it (every field set at once, as the frozen dataclass's __init__
    # would, without its one object.__setattr__ a field): one per consumed record
    # (docs/performance.md, bench.kafka_cpu).
    envelope = object.__new__(Envelope)
    envelope.__dict__.update(body=message.value() or b"", headers=headers, message_id=None,
                             partition_key=message.key(), source=message.topic() or "",
                             position=(message.partition(), message.offset()))
    original = original_position(envelope) if REPLAYED in headers else None
    if original is None:
        return envelope
    return dataclasses.replace(envelope, source=original[0], position=original[1])


def original_position(envelope: Envelope) -> tuple[str, tuple[int, int]] | None:
    """``(topic, (partition, offset))`` a dead-lettered record came from, from its
    ``x-dedupe-original-*`` headers; ``None`` when they are missing or not numbers."""
    topic = envelope.header(ORIGINAL_TOPIC)
    partition, offset = envelope.header(ORIGINAL_PARTITION), envelope.header(ORIGINAL_OFFSET)
    if topic is None or partition is None or offset is None:
        return None
    if not (partition.isdigit() and offset.isdigit()):
        return None
    return topic, (int(partition), int(offset))

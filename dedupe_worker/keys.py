"""Idempotency keys and payload fingerprints.

A *key strategy* is a callable ``Envelope -> str`` that raises :class:`MissingKey` when the
message does not carry what it looks for; :func:`first_of` chains strategies. The consumers'
defaults are :data:`RABBITMQ_DEFAULT` and :data:`KAFKA_DEFAULT`. A *fingerprint* is a short
content hash of the payload, stored with the claim so that a key reused for different work is
answered with CONFLICT instead of a wrong cached result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from ._engine import body_fingerprint
from ._engine import bytes_fingerprint as bytes_fingerprint  # the Kafka bench fingerprints bodies without envelopes
from ._errors import MissingKey, UndecodableMessage
from ._messages.envelope import Envelope
from ._protocol import canonical_json, content_hash, fingerprint_of

__all__ = [
    "KAFKA_DEFAULT",
    "RABBITMQ_DEFAULT",
    "KeyStrategy",
    "body_fingerprint",
    "canonical_json",
    "content_hash",
    "content_key",
    "field_key",
    "fingerprint_of",
    "first_of",
    "header_key",
    "message_id_key",
    "partition_key_with_hash",
    "position_key",
]

KeyStrategy = Callable[[Envelope], str]

#: Header name read by default, the same in AMQP and Kafka.
DEFAULT_HEADER = "idempotency-key"


def default_header_key(headers: Mapping[str, Any]) -> str | None:
    """What :data:`KAFKA_DEFAULT` answers when ``headers`` hold a non-empty ``idempotency-key``
    (as sent, no case folding: that header wins before the rest of the chain); else ``None``."""
    value = headers.get(DEFAULT_HEADER)
    if value:
        return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
    return None


def header_key(name: str = DEFAULT_HEADER) -> KeyStrategy:
    """The key is the value of header ``name``."""

    def strategy(envelope: Envelope) -> str:
        value = envelope.header(name)
        if value is None:
            raise MissingKey(f"message has no {name!r} header")
        return value

    return strategy


def message_id_key() -> KeyStrategy:
    """The key is the AMQP ``message_id`` property."""

    def strategy(envelope: Envelope) -> str:
        if not envelope.message_id:
            raise MissingKey("message has no message_id")
        return f"message-id:{envelope.message_id}"

    return strategy


def content_key() -> KeyStrategy:
    """The key is a hash of the body: identical bodies are the same message. Like every key that
    begins with ``sha256:``, it is stored under its own hash (the original in ``orig``), so it can
    never name the records of a long key that was hashed."""
    return lambda envelope: f"sha256:{content_hash(envelope.body, 64)}"


def partition_key_with_hash() -> KeyStrategy:
    """The key is the Kafka record key together with a hash of the body."""

    def strategy(envelope: Envelope) -> str:
        if not envelope.partition_key:
            raise MissingKey("record has no key")
        return f"{envelope.partition_key.hex()}:{content_hash(envelope.body)}"

    return strategy


def position_key() -> KeyStrategy:
    """The key is ``topic/partition/offset``.

    This protects only against redelivery of the same record, not against a producer that sent
    the same message twice (the copies have different offsets).
    """

    def strategy(envelope: Envelope) -> str:
        if envelope.position is None:
            raise MissingKey("message has no (partition, offset) position")
        partition, offset = envelope.position
        return f"{envelope.source}/{partition}/{offset}"

    return strategy


def field_key(path: str, model: Any = None) -> KeyStrategy:
    """The key is a field of the JSON body, e.g. ``"order.id"``.

    With a pydantic ``model`` the body is validated first (failure: :class:`UndecodableMessage`)
    and ``path`` names attributes of the model.
    """
    parts = path.split(".")

    def strategy(envelope: Envelope) -> str:
        try:
            value: Any = model.model_validate_json(envelope.body) if model else orjson.loads(envelope.body)
        except Exception as exc:  # orjson.JSONDecodeError, pydantic.ValidationError
            expected = f"input for {model.__name__}" if model else "JSON"
            raise UndecodableMessage(f"body is not valid {expected}: {exc}") from exc
        for part in parts:
            if isinstance(value, dict):
                value = value.get(part)
            else:
                value = getattr(value, part, None)
            if value is None:
                raise MissingKey(f"body has no field {path!r}")
        if isinstance(value, (dict, list)):
            return content_hash(canonical_json(value), 64)
        return str(value)

    return strategy


def first_of(*strategies: KeyStrategy) -> KeyStrategy:
    """The first strategy that finds a key wins; :class:`MissingKey` if none does."""

    def strategy(envelope: Envelope) -> str:
        missing: list[str] = []
        for candidate in strategies:
            try:
                return candidate(envelope)
            except MissingKey as exc:
                missing.append(str(exc))
        raise MissingKey("; ".join(missing) or "no key strategy given")

    return strategy


#: The ``idempotency-key`` header, else the AMQP ``message_id``, else a hash of the body.
RABBITMQ_DEFAULT: KeyStrategy = first_of(header_key(), message_id_key(), content_key())
_KAFKA_CHAIN: KeyStrategy = first_of(header_key(), partition_key_with_hash(), content_key())


def _kafka_default(envelope: Envelope) -> str:
    # the header as sent, not empty: what header_key() returns, without the chain around it
    key = default_header_key(envelope.headers)
    return _KAFKA_CHAIN(envelope) if key is None else key


#: The ``idempotency-key`` header, else the record key with a body hash, else a hash of the body.
KAFKA_DEFAULT: KeyStrategy = _kafka_default

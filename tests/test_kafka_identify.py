"""The Kafka consumer's key, fingerprint and ttl read straight from a record give what the
envelope path (``from_kafka`` + the strategy + the fingerprint + the ttl header) gives."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from dedupe_worker import UndecodableMessage
from dedupe_worker._messages.envelope import from_kafka
from dedupe_worker._messages.retention import TTL_HEADER, header_ttl
from dedupe_worker.kafka._consumer import DedupeKafkaConsumer
from dedupe_worker.keys import KAFKA_DEFAULT, body_fingerprint, header_key


class Record:
    """The parts of a confluent-kafka ``Message`` the consumer reads."""

    def __init__(self, headers: list[tuple[str, Any]] | None, value: bytes | None = b'{"a": 1}',
                 key: bytes | None = b"k1") -> None:
        self._headers, self._value, self._key = headers, value, key

    def headers(self) -> list[tuple[str, Any]] | None:
        return self._headers

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> bytes | None:
        return self._key

    def topic(self) -> str:
        return "orders"

    def partition(self) -> int:
        return 2

    def offset(self) -> int:
        return 41


RECORDS = [
    Record([("idempotency-key", b"order-1")]),
    Record([("idempotency-key", b"order-1"), ("idempotency-key", b"order-2")]),  # the last one wins
    Record([("idempotency-key", b"")]),  # empty: the rest of the chain
    Record([("Idempotency-Key", b"order-3")]),  # not the header as sent: the rest of the chain
    Record(None),
    Record([("idempotency-key", b"order-4"), ("X-Dedupe-TTL", b"30")], value=None),
    Record([("idempotency-key", b"order-5"), ("x-dedupe-ttl", b"2.5")], key=None),
]


def envelope_path(msg: Record, strategy: Any, fingerprint: Any) -> tuple[str, Any, float | None]:
    envelope = from_kafka(msg)
    return (strategy(envelope), None if fingerprint is None else fingerprint(envelope),
            header_ttl(envelope.headers, TTL_HEADER))


@pytest.mark.parametrize("strategy", [KAFKA_DEFAULT, header_key()])
@pytest.mark.parametrize("fingerprint", [body_fingerprint, None, lambda envelope: "fp"])
@pytest.mark.parametrize("msg", RECORDS)
def test_identify_gives_what_the_envelope_gives(msg: Record, strategy: Any, fingerprint: Any) -> None:
    consumer = SimpleNamespace(key_strategy=strategy, fingerprint=fingerprint, ttl_header=TTL_HEADER)
    try:
        expected = envelope_path(msg, strategy, fingerprint)
    except Exception as exc:
        with pytest.raises(type(exc)):
            DedupeKafkaConsumer._identify(consumer, msg)  # type: ignore[arg-type]
        return
    assert DedupeKafkaConsumer._identify(consumer, msg) == expected  # type: ignore[arg-type]


def test_a_bad_ttl_is_reported_after_a_good_key() -> None:
    consumer = SimpleNamespace(key_strategy=KAFKA_DEFAULT, fingerprint=body_fingerprint, ttl_header=TTL_HEADER)
    with pytest.raises(UndecodableMessage):
        DedupeKafkaConsumer._identify(consumer, Record([("idempotency-key", b"k"), (TTL_HEADER, b"-1")]))  # type: ignore[arg-type]

"""The Kafka consumer's key, fingerprint and ttl read straight from a record give what the
envelope path (``from_kafka`` + the strategy + the fingerprint + the ttl header) gives."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from dedupe_worker import UndecodableMessage
from dedupe_worker._messages.envelope import from_kafka
from dedupe_worker._messages.retention import TTL_HEADER, TtlHeader, header_ttl
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


@pytest.mark.parametrize("strategy", [KAFKA_DEFAULT, header_key()])
@pytest.mark.parametrize("fingerprint", [body_fingerprint, None, lambda envelope: "fp"])
def test_a_batch_is_identified_as_each_record_is(strategy: Any, fingerprint: Any) -> None:
    """``_identities`` (a batch, the defaults read inline) answers what ``_identify`` answers for
    each record: its key, fingerprint and ttl, or the same error at the same position."""
    records = [*RECORDS, Record([("idempotency-key", b"k"), (TTL_HEADER, b"-1")]), *RECORDS,
               Record([("idempotency-key", b"k2"), ("X-DEDUPE-ttl", b"7"), ("other", b"")])]
    consumer = SimpleNamespace(key_strategy=strategy, fingerprint=fingerprint, ttl_header=TTL_HEADER, _ttl_of=None)
    consumer._identify = lambda msg: DedupeKafkaConsumer._identify(consumer, msg)  # type: ignore[arg-type]
    consumer._ttl_reader = lambda: DedupeKafkaConsumer._ttl_reader(consumer)  # type: ignore[arg-type]
    keys, fingerprints, ttls, failures = DedupeKafkaConsumer._identities(consumer, records)  # type: ignore[arg-type]
    failed = dict(failures)
    for n, msg in enumerate(records):
        try:
            expected = DedupeKafkaConsumer._identify(consumer, msg)  # type: ignore[arg-type]
        except Exception as exc:
            assert type(failed[n]) is type(exc) and str(failed[n]) == str(exc)
            assert (keys[n], fingerprints[n], ttls[n]) == (None, None, None)
            continue
        assert n not in failed
        assert (keys[n], fingerprints[n], ttls[n]) == expected


@pytest.mark.parametrize("headers", [
    None, {}, {"idempotency-key": b"k"}, {TTL_HEADER: b"30"}, {"X-Dedupe-TTL": b"2.5"},
    {"a": b"1", "X-DEDUPE-TTL": b"3", "x-Dedupe-Ttl": b"4"}, {TTL_HEADER: None, "X-Dedupe-TTL": b"5"},
    {"x-dedupe-tt": b"1", "x-dedupe-ttl-": b"2"}, {TTL_HEADER: b""}, {TTL_HEADER: b"-1"}, {TTL_HEADER: b"soon"},
    {"\u0130": b"x", "x-dedupe-ttl\u0307": b"9"}, {1: b"x", TTL_HEADER.upper(): 12},
])
def test_the_ttl_header_reader_answers_as_header_ttl(headers: Any) -> None:
    """A ``TtlHeader`` (one per consumer, remembering the other header names it saw) answers what
    ``header_ttl`` answers, the first time and once it remembers the names, errors included."""
    reader = TtlHeader(TTL_HEADER)
    for _ in range(3):
        try:
            expected = header_ttl(headers, TTL_HEADER)
        except UndecodableMessage as exc:
            with pytest.raises(UndecodableMessage, match=str(exc)):
                reader(headers)
            continue
        assert reader(headers) == expected
    assert reader({"x-dedupe-ttl".upper(): b"8"}) == 8.0  # a name seen before in another case is still read

"""The Kafka consumer's key, fingerprint and ttl of a record (the engine's ``Identify``, reading the
record as its envelope, or under the defaults as its headers and body) give what the envelope path
(``from_kafka`` + the strategy + the fingerprint + the ttl header) gives, a batch what each of its
records gives, and a batch's admission what the consumer's acceptance of each record gives."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, Message

from dedupe_worker import UndecodableMessage
from dedupe_worker._engine import TTL_HEADER, ConsumerOptions, Decision, TtlHeader, header_ttl
from dedupe_worker._messages.envelope import from_kafka
from dedupe_worker.kafka._consumer import DedupeKafkaConsumer, identify_records
from dedupe_worker.kafka._positions import PartitionState
from dedupe_worker.keys import KAFKA_DEFAULT, body_fingerprint, header_key


class Record:
    """The parts of a confluent-kafka ``Message`` the consumer reads."""

    def __init__(self, headers: Any, value: Any = b'{"a": 1}',
                 key: bytes | None = b"k1") -> None:
        self._headers, self._value, self._key = headers, value, key

    def headers(self) -> Any:
        return self._headers

    def value(self) -> Any:
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
    consumer = consumer_of(strategy, fingerprint)
    try:
        expected = envelope_path(msg, strategy, fingerprint)
    except Exception as exc:
        with pytest.raises(type(exc)):
            consumer._identify(msg)
        return
    assert consumer._identify(msg) == expected


def test_a_bad_ttl_is_reported_after_a_good_key() -> None:
    consumer = consumer_of(KAFKA_DEFAULT, body_fingerprint)
    with pytest.raises(UndecodableMessage):
        consumer._identify(Record([("idempotency-key", b"k"), (TTL_HEADER, b"-1")]))


def consumer_of(strategy: Any, fingerprint: Any, ttl_header: str | None = TTL_HEADER) -> Any:
    """The parts of a DedupeKafkaConsumer that ``_identities`` uses, its own methods bound, and
    ``_identify(msg)``: one record's ``(key, fingerprint, ttl)`` as the consumer's ``Identify``
    reads it, raising what it refuses."""
    identify, read = identify_records(ConsumerOptions(key_strategy=strategy, fingerprint=fingerprint,
                                                      ttl_header=ttl_header))
    consumer = SimpleNamespace(identify=identify, read=read, _identify=lambda msg: identity(identify, msg, read))
    consumer._identities = DedupeKafkaConsumer._identities.__get__(consumer)
    return consumer


def identity(identify: Any, msg: Any, read: Any) -> tuple[Any, ...]:
    """``identify``'s answer for ``msg`` as ``(key, fingerprint, ttl)``; raises what it refused."""
    found = identify(msg, read)
    if isinstance(found, Decision):
        assert found.error is not None
        raise found.error
    return tuple(found)


def assert_identified_as_each(consumer: Any, records: list[Any]) -> None:
    """``_identities`` of ``records`` answers what ``_identify`` answers for each record: its key,
    fingerprint and ttl, or the same error at the same position."""
    keys, fingerprints, ttls, failures = consumer._identities(records)
    failed = dict(failures)
    assert len(failed) == len(failures) and list(failed) == sorted(failed)
    for n, msg in enumerate(records):
        try:
            expected = consumer._identify(msg)
        except Exception as exc:
            assert type(failed[n].error) is type(exc) and str(failed[n].error) == str(exc)
            assert (keys[n], fingerprints[n], ttls[n]) == (None, None, None)
            continue
        assert n not in failed
        assert (keys[n], fingerprints[n], ttls[n]) == expected


@pytest.mark.parametrize("strategy", [KAFKA_DEFAULT, header_key()])
@pytest.mark.parametrize("fingerprint", [body_fingerprint, None, lambda envelope: "fp"])
def test_a_batch_is_identified_as_each_record_is(strategy: Any, fingerprint: Any) -> None:
    records = [*RECORDS, Record([("idempotency-key", b"k"), (TTL_HEADER, b"-1")]), *RECORDS,
               Record([("idempotency-key", b"k2"), ("X-DEDUPE-ttl", b"7"), ("other", b"")])]
    assert_identified_as_each(consumer_of(strategy, fingerprint), records)


class Raising(Record):
    """A record whose ``headers()`` or ``value()`` raises."""

    def __init__(self, raises: str, **kwargs: Any) -> None:
        super().__init__([("idempotency-key", b"k-raising")], **kwargs)
        self.raises = raises

    def headers(self) -> Any:
        if self.raises == "headers":
            raise RuntimeError("headers() broke")
        return super().headers()

    def value(self) -> Any:
        if self.raises == "value":
            raise RuntimeError("value() broke")
        return super().value()


#: Records with odd headers, keys and bodies, side by side with plain ones.
ODD_RECORDS: list[Any] = [
    Record([("idempotency-key", b"caf\xc3\xa9"), ("idempotency-key", b"\xff\xfeno-utf8")]),  # backslashreplace
    Record([("idempotency-key", b"k"), ("h\u00e9ader", b"1")]),  # a name that is not ASCII
    Record([("idempotency-key", b"k"), ("x-dedupe-ttl\u0307", b"9")]),  # not ASCII, nearly the ttl's
    Record([("idempotency-key", b"k"), ("\u212a", b"1")]),  # KELVIN SIGN: lower() is ASCII "k"
    Record([("idempotency-key", None)]),
    Record([("idempotency-key", b"k"), ("idempotency-key", None)]),  # the last one is None
    Record([("idempotency-key", None), ("idempotency-key", b"k")]),
    Record([("idempotency-key", "a str")]),
    Record([("idempotency-key", b"k"), (1, b"x")]),  # a name that is not a str
    Record([("idempotency-key", b"k", b"three")]),  # not a pair
    Record((("idempotency-key", b"tuple-headers"),)),
    Record({"idempotency-key": b"dict-headers"}),
    Record([["idempotency-key", b"list-pair"]]),
    Record([]),
    Record([("idempotency-key", b"k")], value=b""),
    Record([("idempotency-key", b"k")], value="a str body"),
    Record([("idempotency-key", b"k")], value=bytearray(b"ba")),
    Record([("idempotency-key", b"k" * 10_000)], value=b"v" * 100_000),
    Record([("x-dedupe-ttl", b"3"), ("idempotency-key", b"ttl-first")]),
    Record([("idempotency-key", b"k"), ("X-Dedupe-Ttl", b"bad")]),
    Record([("idempotency-key", b"k"), ("x-dedupe-tt", b"1"), ("x-dedupe-ttl-", b"2")]),
    Raising("headers"),
    Raising("value"),
    Message(topic="t", partition=0, offset=5, value=b"{}", headers=[("idempotency-key", b"real-message")]),
    Message(topic="t", partition=0, offset=6, value=None, headers=None),
    Message(topic="t", partition=0, offset=7, value=b"x",
            headers=[("idempotency-key", b"m"), ("X-DEDUPE-TTL", b"60")]),
]


@pytest.mark.parametrize("ttl_header", [TTL_HEADER, "X-\u00c9t\u00e9", None])
@pytest.mark.parametrize("fingerprint", [body_fingerprint, None])
def test_odd_records_are_identified_as_each_record_is(ttl_header: str | None, fingerprint: Any) -> None:
    """Whatever a record holds, a batch is identified as each record is on its own: keys
    undecodable as UTF-8, header names that are not ASCII (one whose lower() is ASCII), not str or
    not in pairs, headers in a tuple or a dict, bodies that are not bytes, calls that raise, a ttl
    header in any case, a ttl header name that is not ASCII."""
    records = [*ODD_RECORDS, *RECORDS, *ODD_RECORDS]
    assert_identified_as_each(consumer_of(KAFKA_DEFAULT, fingerprint, ttl_header), records)


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


def states() -> dict[tuple[str, int], PartitionState]:
    """Partitions in every state admission tells apart."""
    return {
        ("t", 0): PartitionState(),  # flowing
        ("t", 1): PartitionState(paused_until=1e12),  # paused: its records are dropped
        ("t", 2): PartitionState(rewound_to=5),  # older fetches dropped, 5 accepted, then it flows
        ("t", 3): PartitionState(decided_behind={7: None}),  # 7 decided behind a hold earlier
        ("t", 4): PartitionState(rewound_to=2),  # delivers 4: the seek did not take, rewound again
        ("t", 5): PartitionState(),
    }


def record(partition: int, offset: int, topic: str = "t", error: Any = None) -> Message:
    return Message(topic=topic, partition=partition, offset=offset, value=b"{}", error=error,
                   headers=[("idempotency-key", f"{topic}-{partition}-{offset}".encode())])


ADMISSION_BATCH = [
    record(0, 1), record(1, 1), record(2, 3), record(0, 2), record(2, 4), record(2, 5), record(2, 6),
    record(3, 6), record(3, 7), record(3, 8), record(4, 4), record(4, 5), record(0, 3, topic="u"),
    record(5, 1, error=KafkaError(KafkaError._PARTITION_EOF)), record(5, 2), record(2, 7), record(0, 4),
]


def test_a_batch_is_admitted_as_each_record_is_accepted() -> None:
    """``_admit`` (a set look-up for a flowing partition's record, the others one by one) takes
    what ``_accept`` takes record by record, in order, with the same positions of records decided
    earlier, and leaves each partition in the same state: paused records dropped, a rewound partition's older fetches
    dropped and the rest taken from its rewind point, a record past it rewinding it again, an error
    or an unknown partition dropped."""
    from dedupe_worker.testing import in_memory

    config = {"bootstrap.servers": "127.0.0.1:1", "group.id": "admission"}
    consumer = DedupeKafkaConsumer(config, ["t"], lambda m: None, in_memory())
    twin = DedupeKafkaConsumer(config, ["t"], lambda m: None, in_memory())
    try:
        consumer._partitions, twin._partitions = states(), states()
        live: list[Any] = []
        tps: list[Any] = []
        before = consumer._admit(ADMISSION_BATCH, live, tps)
        expected_live: list[Any] = []
        expected_tps: list[Any] = []
        expected_before: list[int] = []
        for msg in ADMISSION_BATCH:  # what the consumer did record by record before admission ran
            tp = twin._accept(msg)
            if tp is None:
                continue
            state = twin._partitions[tp]
            if state.decided_behind and (msg.offset() or 0) in state.decided_behind:
                expected_before.append(len(expected_live))
            expected_live.append(msg)
            expected_tps.append(tp)
        assert [(m.partition(), m.offset()) for m in live] == [(m.partition(), m.offset()) for m in expected_live]
        assert tps == expected_tps and before == expected_before
        assert [(m.partition(), m.offset()) for m in live] == [
            (0, 1), (0, 2), (2, 5), (2, 6), (3, 6), (3, 7), (3, 8), (5, 2), (2, 7), (0, 4)]
        assert before == [5]
        for tp, state in consumer._partitions.items():
            other = twin._partitions[tp]
            assert (state.paused_until is None, state.rewound_to, state.decided_behind) == (
                other.paused_until is None, other.rewound_to, other.decided_behind), tp
        assert consumer._partitions[("t", 4)].paused_until is not None  # rewound again
    finally:
        consumer.close()
        twin.close()

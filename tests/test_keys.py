"""Key layout (hash tags, hashing of long or unsafe keys) and key/fingerprint strategies."""

from __future__ import annotations

import hashlib

import pydantic
import pytest
import redis

from dedupe_worker import Deduplicator, Envelope, InvalidKey, MissingKey, Outcome, UndecodableMessage
from dedupe_worker import keys as k
from dedupe_worker._deduplicator import KEY_HARD_LIMIT
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker._transport.record import read_result


def test_layout_shares_one_hash_slot() -> None:
    layout = KeyLayout("ns")
    stem = layout.stem(layout.stored_key("order-1")[0])
    assert KeyLayout.started(stem) == "ns:{order-1}:started"
    assert KeyLayout.result(stem) == "ns:{order-1}:result"
    assert KeyLayout.record(stem) == stem == "ns:{order-1}"
    assert KeyLayout.records(stem) == ("ns:{order-1}:started", "ns:{order-1}", "ns:{order-1}:result")


@pytest.mark.parametrize(("name", "kind"), [
    ("ns:{order-1}", "record"), ("ns:{order-1}:result", "result"), ("ns:{order-1}:started", "started"),
    ("ns:{order-1}:notice", "notice"), ("ns:{order-1}:sent", "sent"), ("ns:{sha256:ab12}", "record"),
    ("ns:{order-1}:other", ""), ("ns:stray", ""), ("ns:{x}:y:result", "")])
def test_a_scanned_name_tells_what_it_holds(name: str, kind: str) -> None:
    """Record format 2's outcome is the only key without a suffix: SCAN tells the kinds apart."""
    assert KeyLayout.kind(name) == kind


@pytest.mark.parametrize("key", ["a{b}c", "with space", "tab\there", "new\nline", "x" * 201, b"\xff\xfe"])
def test_unsafe_or_long_keys_are_hashed_and_the_original_kept(
    key: str | bytes, redis_client: redis.Redis, namespace: str
) -> None:
    d = Deduplicator(redis_client, namespace=namespace)
    stored, original = d.layout.stored_key(key)
    raw = key if isinstance(key, bytes) else key.encode()
    assert stored == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert original
    claim = d.begin(key)
    assert claim.outcome is Outcome.ACQUIRED
    started = KeyLayout.started(claim.stem)
    assert redis_client.hget(started, "orig") == original.encode()
    d.complete(claim, "v")
    stored = read_result(redis_client, claim.stem)  # in whichever format this run writes
    assert stored is not None and stored.original == original.encode()
    assert d.begin(key).result == "v"


@pytest.mark.parametrize("key", ["zażółć-gęślą-jaźń", "注文-42", "emoji-🧾", "quote'\"and\\slash"])
def test_unicode_keys_round_trip_unhashed(key: str, dedupe: Deduplicator) -> None:
    assert dedupe.layout.stored_key(key) == (key, "")
    assert dedupe.run(key, lambda: key) == key
    assert dedupe.run(key, lambda: "other") == key


@pytest.mark.parametrize("key", ["", b"", None, 42, "x" * (KEY_HARD_LIMIT + 1), "\ud800"])
def test_invalid_keys_are_refused(key: object, dedupe: Deduplicator) -> None:
    with pytest.raises(InvalidKey):
        dedupe.begin(key)  # type: ignore[arg-type]


def test_a_literal_key_never_reaches_a_hashed_keys_records(dedupe: Deduplicator) -> None:
    """``sha256:<hex>`` is what a long key is stored as; given as a key it must not read that
    key's outcome (with keys from request headers, that would read someone else's response)."""
    long_key = "account-7:" + "x" * 300
    dedupe.run(long_key, lambda: "secret of account 7")
    stored, _ = dedupe.layout.stored_key(long_key)
    assert stored.startswith("sha256:")

    literal = dedupe.begin(stored)

    assert literal.outcome is Outcome.ACQUIRED and literal.result is None
    assert dedupe.layout.stored_key(stored) == ("sha256:" + hashlib.sha256(stored.encode()).hexdigest(), stored)
    assert literal.stem != dedupe.begin(long_key).stem
    dedupe.complete(literal, "literal's own")
    assert dedupe.begin(long_key).result == "secret of account 7"
    assert dedupe.begin(stored).result == "literal's own"
    assert dedupe.layout.stored_key(b"sha256:abc")[1] == "sha256:abc"  # bytes keys alike


def test_key_limits_count_utf8_bytes(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, max_key_length=200)
    try:
        assert d.layout.stored_key("é" * 100) == ("é" * 100, "")  # 100 characters, 200 bytes
        stored, original = d.layout.stored_key("é" * 101)  # 101 characters, 202 bytes: hashed
        assert stored.startswith("sha256:") and original == "é" * 101
        assert d.begin("€" * 2730).acquired  # 8,190 bytes, hashed
        for key in ("€" * 2731, "€".encode() * 2731):  # 2,731 characters, 8,193 bytes
            with pytest.raises(InvalidKey, match="8193 bytes long; the limit is 8192 bytes"):
                d.begin(key)
    finally:
        d.close()


def test_canonical_json_and_fingerprints() -> None:
    assert k.canonical_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == b'{"a":[1,{"c":3,"d":2}],"b":1}'
    assert k.fingerprint_of({"x": 1, "y": 2}) == k.fingerprint_of({"y": 2, "x": 1})
    assert k.fingerprint_of({"x": 1}) != k.fingerprint_of({"x": 2})

    class Order(pydantic.BaseModel):
        id: int
        amount: float

    assert k.fingerprint_of(Order(id=1, amount=2.5)) == k.fingerprint_of({"amount": 2.5, "id": 1})


def test_header_then_message_id_then_content() -> None:
    strategy = k.RABBITMQ_DEFAULT
    assert strategy(Envelope(b"{}", {"Idempotency-Key": b"abc"}, "m1")) == "abc"
    assert strategy(Envelope(b"{}", {}, "m1")) == "message-id:m1"
    assert strategy(Envelope(b"{}")) == "sha256:" + hashlib.sha256(b"{}").hexdigest()


def test_kafka_default_uses_record_key_with_content_hash() -> None:
    a = k.KAFKA_DEFAULT(Envelope(b"v1", partition_key=b"user-1"))
    b = k.KAFKA_DEFAULT(Envelope(b"v2", partition_key=b"user-1"))
    assert a != b and a.startswith(b"user-1".hex())
    assert k.position_key()(Envelope(b"", source="t", position=(2, 40))) == "t/2/40"


def test_field_key_from_json_and_pydantic() -> None:
    assert k.field_key("order.id")(Envelope(b'{"order": {"id": 17}}')) == "17"
    with pytest.raises(MissingKey):
        k.field_key("order.id")(Envelope(b'{"order": {}}'))
    with pytest.raises(UndecodableMessage):
        k.field_key("id")(Envelope(b"\x00not json"))

    class Payment(pydantic.BaseModel):
        payment_id: str

    assert k.field_key("payment_id", Payment)(Envelope(b'{"payment_id": "p-1"}')) == "p-1"
    with pytest.raises(UndecodableMessage):
        k.field_key("payment_id", Payment)(Envelope(b'{"other": 1}'))


def test_first_of_reports_every_missing_strategy() -> None:
    strategy = k.first_of(k.header_key("x-id"), k.message_id_key())
    with pytest.raises(MissingKey, match=r"x-id.*message_id"):
        strategy(Envelope(b"body"))


class _Record:
    """The accessors of a confluent-kafka Message that from_kafka reads."""

    def __init__(self, headers: list[tuple[str, bytes]], offset: int) -> None:
        self._headers, self._offset = headers, offset

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers

    def value(self) -> bytes:
        return b"body"

    def key(self) -> bytes:
        return b"k"

    def topic(self) -> str:
        return "payments"

    def partition(self) -> int:
        return 1

    def offset(self) -> int:
        return self._offset


class _KombuMessage:
    """The attributes of a kombu Message that from_kombu reads."""

    def __init__(self, body: bytes | str) -> None:
        self.body = body
        self.headers = {"idempotency-key": "order-1"}
        self.properties = {"message_id": "m-1", "application_headers": self.headers}


@pytest.mark.parametrize("body", [b'{"order": 1}', '{"order": 1}'])
def test_from_kombu_builds_the_envelope_its_init_would(body: bytes | str) -> None:
    import dataclasses

    from dedupe_worker._messages.envelope import from_kombu

    message = _KombuMessage(body)
    envelope = from_kombu(message, "orders")
    assert envelope == Envelope(b'{"order": 1}', {"idempotency-key": "order-1"}, "m-1", source="orders")
    assert set(vars(envelope)) == {f.name for f in dataclasses.fields(Envelope)}
    assert envelope.headers is not message.headers  # a copy: the handler may change the message's
    with pytest.raises(dataclasses.FrozenInstanceError):
        envelope.source = "other"  # type: ignore[misc]


def test_a_replayed_record_keeps_its_original_position() -> None:
    from dedupe_worker._messages.envelope import from_kafka

    assert k.position_key()(from_kafka(_Record([], 9))) == "payments/1/9"
    origin = [("x-dedupe-original-topic", b"payments"), ("x-dedupe-original-partition", b"0"),
              ("x-dedupe-original-offset", b"4")]
    assert k.position_key()(from_kafka(_Record(origin, 9))) == "payments/1/9"  # a DLQ record as such
    replayed = [*origin, ("x-dedupe-replayed", b"1")]
    assert k.position_key()(from_kafka(_Record(replayed, 57))) == "payments/0/4"


@pytest.mark.parametrize("headers", [
    {"idempotency-key": b"order-1"}, {"idempotency-key": "order-1"}, {"Idempotency-Key": b"order-1"},
    {"idempotency-key": b""}, {"idempotency-key": ""}, {"idempotency-key": 7}, {"idempotency-key": b"\xff\xfe"},
    {},
])
@pytest.mark.parametrize("record_key", [b"k-1", None])
def test_kafka_default_answers_as_the_chain_it_stands_for(headers: dict[str, object], record_key: bytes | None) -> None:
    chain = k.first_of(k.header_key(), k.partition_key_with_hash(), k.content_key())
    envelope = Envelope(body=b'{"amount": 1}', headers=headers, partition_key=record_key, source="t")
    assert k.KAFKA_DEFAULT(envelope) == chain(envelope)
    assert k.body_fingerprint(envelope) == k.content_hash(envelope.body)


@pytest.mark.parametrize("key", [
    "order-1", "a" * 200, "a" * 201, "has space", "has{brace}", "tab\tkey", "caf\u00e9", b"bytes-key", b"\xff\xfe",
    "x" * (KEY_HARD_LIMIT + 1), "", 42, "sha256:" + "0" * 64, "sha256:", "€" * 2731, "é" * 101,
])
@pytest.mark.parametrize("fingerprint", [None, "", "fp", "f" * 65, {"a": 1}, b"raw"])
def test_a_request_is_what_the_checked_key_and_its_layout_make(key: object, fingerprint: object,
                                                               dedupe: Deduplicator) -> None:
    """The common key takes a shorter path to its request: the same request as the general one."""
    from dedupe_worker._protocol.fingerprint import request_fingerprint

    try:
        stored, original = dedupe.check_key(key)  # type: ignore[arg-type]
    except InvalidKey:
        with pytest.raises(InvalidKey):
            dedupe.request(key, fingerprint)  # type: ignore[arg-type]
        return
    text = key if isinstance(key, str) else key.decode("utf-8", "backslashreplace")  # type: ignore[union-attr]
    assert dedupe.request(key, fingerprint) == (  # type: ignore[arg-type]
        text, dedupe.layout.stem(stored), request_fingerprint(fingerprint), original)


def test_a_plain_key_is_told_apart_as_the_layout_tells_it() -> None:
    """``plain_ascii`` (``prepare``'s check of a plain key) says of every ASCII character,
    alone and inside a key, what the layout's own check says: plain, or hashed."""
    from dedupe_worker._protocol.layout import _UNSAFE, plain_ascii

    for char in map(chr, range(128)):
        for text in (char, f"order-{char}-1"):
            assert plain_ascii(text) is (_UNSAFE.search(text) is None), repr(text)
            assert (KeyLayout("ns").stored_key(text)[0] == text) is plain_ascii(text), repr(text)

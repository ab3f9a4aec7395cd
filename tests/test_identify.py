"""The engine's one identification step (``Identify``): a message as its key, fingerprint and ttl,
or its refusal with the reason, as every integration and the replay call it; and the options
object every message integration shares (``ConsumerOptions``): keywords or ``options=``, unknown
names, renamed names."""

from __future__ import annotations

import warnings
from decimal import Decimal
from typing import Any

import pytest
from kombu import Connection

from dedupe_worker import ConsumerOptions, Deduplicator, Envelope, MissingKey, Reason, UndecodableMessage, decide
from dedupe_worker._engine import TTL_HEADER, Decision, Identify, Identity
from dedupe_worker.keys import RABBITMQ_DEFAULT, body_fingerprint, field_key, header_key


def identify(**options: Any) -> Identify[Envelope]:
    return Identify("test", options.pop("key", header_key()), options.pop("fingerprint", body_fingerprint), **options)


def test_a_message_is_identified_as_key_fingerprint_and_ttl() -> None:
    envelope = Envelope(b'{"id": 7}', headers={"idempotency-key": "order-7", TTL_HEADER: b"30"})
    found = identify()(envelope)
    assert found == Identity("order-7", body_fingerprint(envelope), 30.0)
    assert identify(fingerprint=None, ttl_header=None)(envelope) == Identity("order-7", None, None)


@pytest.mark.parametrize(("envelope", "key", "reason", "error", "says"), [
    (Envelope(b"{}"), header_key(), Reason.INVALID_KEY, MissingKey, "no 'idempotency-key' header"),
    (Envelope(b"not json"), field_key("id"), Reason.UNDECODABLE, UndecodableMessage, "body is not valid JSON"),
    (Envelope(b'{"other": 1}'), field_key("id"), Reason.INVALID_KEY, MissingKey, "body has no field 'id'"),
    (Envelope(b"{}"), lambda envelope: {}["broken"], Reason.INVALID_KEY, KeyError, "broken"),
    (Envelope(b"{}", headers={"idempotency-key": "k", TTL_HEADER: "soon"}), header_key(), Reason.UNDECODABLE,
     UndecodableMessage, "x-dedupe-ttl header: 'soon' is not a positive number of seconds"),
], ids=["missing key", "undecodable body", "missing field", "broken strategy", "bad ttl"])
def test_each_refusal_has_its_reason(envelope: Envelope, key: Any, reason: Reason, error: type, says: str) -> None:
    found = identify(key=key)(envelope)
    assert type(found) is Decision
    assert found.reason is reason and isinstance(found.error, error) and says in found.detail


def test_a_broken_fingerprint_or_reading_is_refused_too() -> None:
    def broken(envelope: Envelope) -> Any:
        raise RuntimeError("fingerprint broke")

    def unreadable(message: Any) -> Envelope:
        raise RuntimeError("headers() broke")

    envelope = Envelope(b"{}", headers={"idempotency-key": "k"})
    found = identify(fingerprint=broken)(envelope)
    assert type(found) is Decision and found.reason is Reason.INVALID_KEY and "fingerprint broke" in found.detail
    found = identify()(object(), unreadable)
    assert type(found) is Decision and "headers() broke" in found.detail


@pytest.mark.parametrize(("headers", "ttl"), [
    ({TTL_HEADER: "60"}, 60.0), ({TTL_HEADER: b"0.5"}, 0.5), ({"X-Dedupe-TTL": 12}, 12.0),
    ({TTL_HEADER: Decimal("5")}, 5.0), ({TTL_HEADER: 2.5}, 2.5), ({TTL_HEADER: ""}, None), ({}, None),
    ({"x-other": b"1", "X-DEDUPE-TTL": b"7"}, 7.0),
])
def test_the_ttl_header_in_every_form(headers: dict[str, Any], ttl: float | None) -> None:
    reader = identify()
    for _ in range(2):  # and once the reader remembers the header names it saw
        assert reader(Envelope(b"", headers={"idempotency-key": "k", **headers})) == Identity(
            "k", body_fingerprint(Envelope(b"")), ttl)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", b"1e400", True, [1]])
def test_a_bad_ttl_header_is_undecodable(value: Any) -> None:
    found = identify()(Envelope(b"", headers={"idempotency-key": "k", TTL_HEADER: value}))
    assert type(found) is Decision and found.reason is Reason.UNDECODABLE and TTL_HEADER in found.detail


def test_a_named_ttl_header_and_a_default_ttl() -> None:
    reader = identify(ttl_header="x-keep", default_ttl=lambda envelope: 99.0)
    assert reader(Envelope(b"", headers={"idempotency-key": "k", "x-keep": "3"})).ttl == 3.0  # type: ignore[union-attr]
    assert reader(Envelope(b"", headers={"idempotency-key": "k", TTL_HEADER: "3"})).ttl == 99.0  # type: ignore[union-attr]


def test_an_oversized_key_is_refused_by_the_claim(dedupe: Deduplicator) -> None:
    """A key found but too long for the protocol passes identification and is refused one step
    later, by the claim, with the same reason."""
    found = identify()(Envelope(b"", headers={"idempotency-key": "k" * 20_000}))
    assert type(found) is Identity
    decision = decide(dedupe, found.key, lambda: None)
    assert decision.reason is Reason.INVALID_KEY


# -- the options object ---------------------------------------------------------------------------


def test_options_are_written_once_with_their_defaults() -> None:
    from dedupe_worker._engine import RetryPolicy

    options = ConsumerOptions()
    assert (options.max_attempts, options.defer_wait, options.ttl_header) == (5, 5.0, TTL_HEADER)
    assert options.fingerprint is body_fingerprint and options.key_strategy is None
    for name in ("max_attempts", "retry_base", "retry_cap", "defer_base", "defer_cap", "defer_wait"):
        assert getattr(RetryPolicy, name) == getattr(options, name)
    with pytest.raises(AttributeError):
        options.max_attempts = 3  # type: ignore[misc]  # frozen


def test_keywords_and_options_are_the_same(dedupe: Deduplicator) -> None:
    from dedupe_worker.kafka import DedupeKafkaConsumer
    from dedupe_worker.rabbitmq import DedupeConsumer

    chosen = {"key_strategy": RABBITMQ_DEFAULT, "fingerprint": None, "ttl_header": "x-keep", "max_attempts": 2,
              "retry_base": 0.1, "defer_wait": 0.0, "flush_after": 0.01, "summary_interval": 1.0}
    whole = ConsumerOptions(**chosen)
    assert ConsumerOptions.of(**chosen) == whole
    by_keywords = DedupeConsumer(Connection("amqp://"), ["q"], print, dedupe, **chosen)
    by_object = DedupeConsumer(Connection("amqp://"), ["q"], print, dedupe, options=whole)
    assert by_keywords.options == by_object.options == whole
    assert (by_object.max_attempts, by_object.retry_base, by_object.defer_wait) == (2, 0.1, 0.0)
    assert by_object.pacing.flush_after == 0.01 and by_object.identify.ttl_of.name == "x-keep"  # type: ignore[union-attr]
    on_top = DedupeConsumer(Connection("amqp://"), ["q"], print, dedupe, options=whole, max_attempts=4)
    assert on_top.options == ConsumerOptions(**{**chosen, "max_attempts": 4})
    config = {"bootstrap.servers": "127.0.0.1:1", "group.id": "options"}
    kafka = [DedupeKafkaConsumer(config, ["t"], print, dedupe, **chosen),
             DedupeKafkaConsumer(config, ["t"], print, dedupe, options=whole)]
    try:
        assert kafka[0].options == kafka[1].options == whole
        assert kafka[1].max_attempts == 2 and kafka[1].pacing.flush_after == 0.01
    finally:
        for consumer in kafka:
            consumer.close()


def test_none_keeps_a_retry_option_and_turns_the_others_off() -> None:
    options = ConsumerOptions.of(max_attempts=None, defer_wait=None, ttl_header=None, fingerprint=None)
    assert (options.max_attempts, options.defer_wait) == (5, 5.0)
    assert options.ttl_header is None and options.fingerprint is None


def test_an_unknown_option_names_the_choices(dedupe: Deduplicator) -> None:
    from dedupe_worker.rabbitmq import DedupeConsumer

    with pytest.raises(TypeError, match=r"unknown option 'handle'; the options are prefetch_count, .*ttl_header"):
        DedupeConsumer(Connection("amqp://"), ["q"], print, dedupe, handle=print)
    with pytest.raises(TypeError, match="unknown option 'retries'; the options are key_strategy, fingerprint, "):
        ConsumerOptions.of(retries=3)
    with pytest.raises(TypeError, match="unknown option 'max_attempts'; the options are ttl_header, defer_base"):
        ConsumerOptions.of(names=("ttl_header", "defer_base"), max_attempts=3)


def test_a_renamed_option_still_works_with_a_warning() -> None:
    strategy = header_key("x-id")
    with pytest.warns(DeprecationWarning, match="'key' is now called 'key_strategy'"):
        options = ConsumerOptions.of(renamed={"key": "key_strategy"}, key=strategy)
    assert options.key_strategy is strategy
    with pytest.raises(TypeError, match="unknown option 'key'"):
        ConsumerOptions.of(key=strategy)  # only FastStream ever took it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ConsumerOptions.of(key_strategy=strategy).key_strategy is strategy


def test_celery_task_attributes_map_to_the_same_names(redis_url: str) -> None:
    """``dedupe_<name>`` task attributes, ``dedupe_options`` whole and ``app.conf.dedupe_<name>``
    give the same options; the old names of the retry options still work, with a warning."""
    from celery import Celery

    from dedupe_worker.celery import IdempotentTask

    app = Celery("options", set_as_current=False)
    app.conf.update(dedupe_redis_url=redis_url, task_always_eager=True, dedupe_defer_cap=7.0)
    whole = ConsumerOptions(max_attempts=2, retry_base=0.1, ttl_header="x-keep", defer_cap=7.0)

    @app.task(base=IdempotentTask, shared=False, name="options.by_name", dedupe_max_attempts=2,
              dedupe_retry_base=0.1, dedupe_ttl_header="x-keep")
    def by_name() -> None: ...

    @app.task(base=IdempotentTask, shared=False, name="options.whole", dedupe_options=whole)
    def by_object() -> None: ...

    @app.task(base=IdempotentTask, shared=False, name="options.old", max_attempts=2, dedupe_retry_base=0.1,
              dedupe_ttl_header="x-keep")
    def by_old_name() -> None: ...

    with pytest.warns(DeprecationWarning, match="'max_attempts' is now called 'dedupe_max_attempts'"):
        app.finalize()  # the task classes are made here
    for task in (by_name, by_object, by_old_name):
        assert task.options == whole, task.name
        assert (task.max_attempts, task.retry_base, task.defer_cap) == (2, 0.1, 7.0)


def test_the_middlewares_take_the_same_options(dedupe: Deduplicator) -> None:
    import dramatiq  # noqa: F401  (the middleware needs it)

    from dedupe_worker.dramatiq import DedupeMiddleware

    whole = ConsumerOptions(ttl_header="x-keep", defer_wait=0.0, defer_cap=1.0)
    by_keywords = DedupeMiddleware(dedupe, ttl_header="x-keep", defer_wait=0.0, defer_cap=1.0)
    assert by_keywords.options == DedupeMiddleware(dedupe, options=whole).options == whole
    assert (by_keywords.defer_wait, by_keywords.defer_cap) == (0.0, 1.0)
    with pytest.raises(TypeError, match="unknown option 'max_attempts'; the options are ttl_header, defer_base"):
        DedupeMiddleware(dedupe, max_attempts=3)  # Dramatiq's own Retries count the attempts


def test_faststream_takes_the_same_options(redis_url: str) -> None:
    import redis.asyncio

    from dedupe_worker.asyncio import AsyncDeduplicator
    from dedupe_worker.faststream import dedupe_middleware

    client = AsyncDeduplicator(redis.asyncio.Redis.from_url(redis_url))
    strategy = header_key("x-id")
    whole = ConsumerOptions(key_strategy=strategy, fingerprint=None, defer_wait=0.5)
    assert dedupe_middleware(client, key_strategy=strategy, fingerprint=None, defer_wait=0.5).options == whole
    assert dedupe_middleware(client, options=whole).options == whole
    with pytest.warns(DeprecationWarning, match="'key' is now called 'key_strategy'"):
        assert dedupe_middleware(client, key=strategy, fingerprint=None, defer_wait=0.5).options == whole

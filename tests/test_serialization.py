"""Results are JSON: pydantic models, dataclasses and datetimes in; never pickle out."""

from __future__ import annotations

import dataclasses
import datetime
import pickle
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
import pytest
import redis
from kombu import Connection

from dedupe_worker import (
    OMITTED,
    Action,
    Deduplicator,
    Outcome,
    Reason,
    ResultNotSerializable,
    decide,
    decide_many,
)
from dedupe_worker._protocol.layout import KeyLayout
from dedupe_worker._protocol.serialization import JsonSerializer
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.asyncio import decide as adecide
from dedupe_worker.rabbitmq import DedupeConsumer, dlq

from .async_fixtures import adedupe, aredis
from .rabbitmq_fixtures import amqp, consumer_thread, dead_letters, depth, drained, publish, queue_name, wait_for

__all__ = ["adedupe", "amqp", "aredis", "queue_name"]  # fixtures used by name


class Receipt(pydantic.BaseModel):
    order_id: int
    total: float


@dataclasses.dataclass
class Point:
    x: int
    y: int


def test_supported_values_round_trip_as_json(dedupe: Deduplicator) -> None:
    when = datetime.datetime(2026, 11, 22, 12, 0, tzinfo=datetime.timezone.utc)
    ident = uuid.UUID(int=5)
    cases = {
        "model": (Receipt(order_id=1, total=9.5), {"order_id": 1, "total": 9.5}),
        "dataclass": (Point(1, 2), {"x": 1, "y": 2}),
        "datetime": (when, "2026-11-22T12:00:00+00:00"),
        "uuid": (ident, str(ident)),
        "unicode": ("żółw 🐢", "żółw 🐢"),
        "none": (None, None),
        "nested": ({"a": [1, 2.5, True, None]}, {"a": [1, 2.5, True, None]}),
    }
    for key, (value, stored) in cases.items():
        dedupe.run(key, lambda v=value: v)
        assert dedupe.begin(key).result == stored, key


@pytest.mark.parametrize("value", [object(), b"raw bytes", {1j: 1}])
def test_unserialisable_values_raise_a_clear_error(value: object) -> None:
    with pytest.raises(ResultNotSerializable):
        JsonSerializer().dumps(value)


def test_a_pickle_planted_in_redis_is_never_unpickled(
    dedupe: Deduplicator, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("pwned",))

    stem = dedupe.layout.stem("planted")
    redis_client.hset(KeyLayout.result(stem), mapping={"s": "c", "v": pickle.dumps(Boom()), "t": 1})
    claim = dedupe.begin("planted")
    # a record exists, so the work counts as done; its undecodable body is never executed
    assert claim.outcome is Outcome.DUPLICATE and claim.result is OMITTED
    assert dedupe.run("planted", lambda: "not run") is OMITTED
    assert "pwned" not in capsys.readouterr().out


NON_FINITE = [float("nan"), float("inf"), -float("inf"), {"ratio": [1.0, float("nan")]}, (float("inf"),)]


class Ratio(pydantic.BaseModel):
    value: float


@pytest.mark.parametrize("value", [*NON_FINITE, Ratio(value=float("nan")), {"point": Point(1, float("inf"))}])
def test_nan_and_infinity_are_refused_not_stored_as_null(value: object) -> None:
    with pytest.raises(ResultNotSerializable, match="NaN or infinity"):
        JsonSerializer().dumps(value)
    assert JsonSerializer().dumps({"none": None, "text": "null"}) == b'{"none":null,"text":"null"}'


def test_a_non_finite_result_is_dead_lettered_single_and_batch(dedupe: Deduplicator) -> None:
    single = decide(dedupe, "nan-single", lambda: float("nan"))
    assert (single.reason, single.action) == (Reason.UNSERIALIZABLE_RESULT, Action.DEAD_LETTER)
    assert "NaN or infinity" in single.detail
    with pytest.raises(ResultNotSerializable):
        dedupe.run("nan-run", lambda: {"score": float("inf")})

    batch = decide_many(dedupe, [(f"nan-batch-{i}", None, (lambda v=v: v)) for i, v in enumerate(NON_FINITE)]
                        + [("finite", None, lambda: 1.5)])

    assert [d.reason for d in batch] == [Reason.UNSERIALIZABLE_RESULT] * len(NON_FINITE) + [Reason.APPLIED]
    for key in ["nan-single", "nan-run", *(f"nan-batch-{i}" for i in range(len(NON_FINITE)))]:
        claim = dedupe.begin(key)  # the handler ran: done, its body omitted, never a stored null
        assert claim.outcome is Outcome.DUPLICATE and claim.omitted, key


@pytest.mark.asyncio
async def test_a_non_finite_result_is_refused_by_the_asyncio_client(adedupe: AsyncDeduplicator) -> None:
    async def nan() -> float:
        return float("nan")

    with pytest.raises(ResultNotSerializable):
        await adedupe.run("a-nan", nan)
    decision = await adecide(adedupe, "a-inf", _async_value(float("-inf")))
    assert (decision.reason, decision.action) == (Reason.UNSERIALIZABLE_RESULT, Action.DEAD_LETTER)

    claims = await adedupe.begin_many(["a-batch-1", "a-batch-2"])
    assert await adedupe.complete_many([(claims[0], [float("nan")]), (claims[1], 2.5)]) == [True, True]

    assert (await adedupe.begin("a-batch-1")).omitted and (await adedupe.begin("a-batch-2")).result == 2.5
    for key in ("a-nan", "a-inf"):
        assert (await adedupe.begin(key)).omitted, key


def _async_value(value: object) -> Callable[[], Awaitable[object]]:
    async def handler() -> object:
        return value

    return handler


def test_the_rabbitmq_consumer_dead_letters_a_nan_result_with_its_reason(
    amqp: Connection, queue_name: str, dedupe: Deduplicator
) -> None:
    def handler(body: Any, _message: Any) -> Any:
        return float("nan") if body["id"] == "nan" else body["id"]

    consumer = DedupeConsumer(amqp.clone(), [queue_name], handler, dedupe)
    with consumer_thread(consumer):
        publish(amqp, queue_name, '{"id": "nan"}', headers={"idempotency-key": "nan"})
        publish(amqp, queue_name, '{"id": "ok"}', headers={"idempotency-key": "ok"})
        wait_for(lambda: depth(amqp, dlq(queue_name)) == 1 and drained(amqp, queue_name), what="one dead letter")
    (letter,) = dead_letters(amqp, queue_name)
    assert letter.headers["x-dedupe-reason"] == "unserializable_result"
    assert "NaN or infinity" in letter.headers["x-dedupe-error"]
    assert dedupe.begin("nan").omitted and dedupe.begin("ok").result == "ok"

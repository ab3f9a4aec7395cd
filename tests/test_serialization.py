"""Results are JSON: pydantic models, dataclasses and datetimes in; never pickle out."""

from __future__ import annotations

import dataclasses
import datetime
import pickle
import uuid

import pydantic
import pytest
import redis

from dedupe_worker import OMITTED, Deduplicator, Outcome, ResultNotSerializable
from dedupe_worker.protocol.layout import KeyLayout
from dedupe_worker.protocol.serialization import JsonSerializer


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

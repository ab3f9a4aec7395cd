"""``Deduplicator.run``, ``apply``, the lease heartbeat and ``@idempotent``."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from dedupe_worker import (
    Deduplicator,
    InProgress,
    KeyConflict,
    LeaseLost,
    Outcome,
    PreviouslyFailed,
    ResultNotSerializable,
    current_claim,
    idempotent,
)

from .doubles import redis_or_double  # noqa: F401 - each test runs on Redis and on the double


def test_run_calls_once_and_returns_the_stored_value(dedupe: Deduplicator) -> None:
    calls = []
    assert dedupe.run("k", lambda x: calls.append(x) or x * 2, 21) == 42
    assert dedupe.run("k", lambda x: calls.append(x) or -1, 21) == 42
    assert calls == [21]


def test_run_raises_in_progress_with_retry_after(dedupe: Deduplicator) -> None:
    dedupe.begin("k")
    with pytest.raises(InProgress) as info:
        dedupe.run("k", lambda: 1)
    assert 0 < info.value.retry_after <= 5


def test_run_raises_conflict(dedupe: Deduplicator) -> None:
    dedupe.run("k", lambda: 1, fingerprint={"amount": 10})
    with pytest.raises(KeyConflict):
        dedupe.run("k", lambda: 1, fingerprint={"amount": 11})


def test_exception_releases_the_claim_and_propagates(dedupe: Deduplicator) -> None:
    with pytest.raises(ZeroDivisionError):
        dedupe.run("k", lambda: 1 / 0)
    assert dedupe.run("k", lambda: "second try") == "second try"


def test_permanent_errors_are_stored(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, permanent_errors=(ValueError,))
    with pytest.raises(ValueError):
        d.run("k", lambda: int("not a number"))
    with pytest.raises(PreviouslyFailed) as info:
        d.run("k", lambda: 1)
    assert "invalid literal" in info.value.error["message"]


def test_unserialisable_result_is_recorded_done_and_reported(dedupe: Deduplicator) -> None:
    calls = []
    with pytest.raises(ResultNotSerializable):
        dedupe.run("k", lambda: calls.append(1) or object())
    claim = dedupe.begin("k")
    assert claim.outcome is Outcome.DUPLICATE and claim.omitted
    assert calls == [1]


def test_current_claim_is_set_while_the_handler_runs(dedupe: Deduplicator) -> None:
    seen = dedupe.run("k", lambda: (current_claim().key, current_claim().token))  # type: ignore[union-attr]
    assert seen == ("k", dedupe.begin("k").token)  # the token that stored the outcome
    assert current_claim() is None
    assert dedupe.run("k", lambda: None) == list(seen)  # stored as JSON: a tuple comes back a list


def test_heartbeat_keeps_a_long_handler_owning_its_claim(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.3, result_ttl=30)
    other: list[Outcome] = []

    def slow() -> str:
        for _ in range(4):  # 0.8 s, well past the 0.3 s lease
            time.sleep(0.2)
            other.append(d.begin("k").outcome)
        return "done"

    assert d.run("k", slow) == "done"
    assert other == [Outcome.IN_PROGRESS] * 4
    d.close()


def test_handler_that_lost_its_lease_gets_lease_lost(redis_client: redis.Redis, namespace: str) -> None:
    # renewals every 10 s: the 0.2 s lease is not kept alive, a successor takes over
    d = Deduplicator(redis_client, namespace=namespace, lease=0.2, result_ttl=30, renew_interval=10)
    successor = Deduplicator(redis_client, namespace=namespace, lease=5, result_ttl=30)

    def paused() -> str:
        time.sleep(0.3)
        claim = successor.begin("k")
        assert claim.outcome is Outcome.ACQUIRED
        successor.complete(claim, "successor")
        return "zombie"

    with pytest.raises(LeaseLost):
        d.run("k", paused)
    assert d.begin("k").result == "successor"


def test_renewer_marks_a_stolen_claim_lost(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.2, result_ttl=30, renew_interval=10)
    claim = d.begin("k")
    time.sleep(0.25)
    d.begin("k")  # a successor takes it
    with d.hold(claim):
        d.renewer.renew_now()
        assert d.renewer.is_lost(claim.stem, claim.token)
    with pytest.raises(LeaseLost):
        d.complete(claim, 1)


def test_one_renewer_thread_serves_every_claim(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=0.3, result_ttl=30)
    before = set(threading.enumerate())  # other tests' threads may end meanwhile (and their idents be reused)
    barrier = threading.Barrier(20)
    inside: list[int] = []

    def handler() -> int:
        barrier.wait()
        inside.append(1)
        time.sleep(0.5)
        return 1

    threads = [threading.Thread(target=d.run, args=(f"k{i}", handler)) for i in range(20)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(inside) < 20 and time.monotonic() < deadline:  # every handler holds its claim now
        time.sleep(0.01)
    started = [t for t in threading.enumerate() if t not in before]
    assert len(started) == 20 + 1  # the workers, plus one renewer
    assert [t.name for t in started if t not in threads] == ["dedupe-lease-renewer"]
    for t in threads:
        t.join()
    assert all(d.begin(f"k{i}").outcome is Outcome.DUPLICATE for i in range(20))
    d.close()


def test_idempotent_decorator_with_format_key(dedupe: Deduplicator) -> None:
    calls = []

    @idempotent(dedupe, key="charge:{order_id}")
    def charge(order_id: int, amount: int) -> dict[str, int]:
        calls.append(order_id)
        return {"order": order_id, "amount": amount}

    assert charge(7, 100) == {"order": 7, "amount": 100}
    assert charge(7, amount=100) == {"order": 7, "amount": 100}
    assert calls == [7]
    with pytest.raises(KeyConflict):
        charge(7, 999)


def test_idempotent_decorator_with_callable_key(dedupe: Deduplicator) -> None:
    @idempotent(dedupe, key=lambda event: f"evt:{event['id']}", fingerprint=False)
    def handle(event: dict[str, object]) -> object:
        return event["n"]

    assert handle({"id": 1, "n": "a"}) == "a"
    assert handle({"id": 1, "n": "b"}) == "a"

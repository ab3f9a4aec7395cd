"""``AsyncDeduplicator.run``, ``apply``, ``decide``, the renewer task and ``@idempotent`` on
``async def``: the cases of ``test_run.py``, awaited, on a real Redis; plus 500 concurrent runs
of one key, cancellation, ``fail_open`` and Redis down."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio

import dedupe_worker
from dedupe_worker import (
    Action,
    Deduplicator,
    InProgress,
    KeyConflict,
    LeaseLost,
    Outcome,
    PreviouslyFailed,
    Reason,
    ResultNotSerializable,
    StoreUnavailable,
    current_claim,
)
from dedupe_worker.asyncio import AsyncDeduplicator, decide, idempotent

from . import services
from .async_fixtures import adedupe, aredis
from .services import ProcessGroup, python

__all__ = ["adedupe", "aredis"]

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parent.parent


def unreachable(namespace: str, **options: object) -> AsyncDeduplicator:
    """A client whose Redis does not answer (nothing listens on the port), built as users build it."""
    return AsyncDeduplicator.from_url(f"redis://127.0.0.1:{services.free_port()}/0", namespace=namespace,
                                      **options)


async def test_run_calls_once_and_returns_the_stored_value(adedupe: AsyncDeduplicator) -> None:
    calls = []

    async def double(x: int) -> int:
        calls.append(x)
        return x * 2

    assert await adedupe.run("k", double, 21) == 42
    assert await adedupe.run("k", double, 21) == 42
    assert calls == [21]


async def test_run_raises_in_progress_with_retry_after(adedupe: AsyncDeduplicator) -> None:
    await adedupe.begin("k")
    with pytest.raises(InProgress) as info:
        await adedupe.run("k", asyncio.sleep, 0)
    assert 0 < info.value.retry_after <= 5


async def test_run_raises_conflict(adedupe: AsyncDeduplicator) -> None:
    await adedupe.run("k", asyncio.sleep, 0, fingerprint={"amount": 10})
    with pytest.raises(KeyConflict):
        await adedupe.run("k", asyncio.sleep, 0, fingerprint={"amount": 11})


async def test_exception_releases_the_claim_and_propagates(adedupe: AsyncDeduplicator) -> None:
    async def broken() -> float:
        return 1 / 0

    async def fine() -> str:
        return "second try"

    with pytest.raises(ZeroDivisionError):
        await adedupe.run("k", broken)
    assert await adedupe.run("k", fine) == "second try"


async def test_permanent_errors_are_stored(aredis: redis.asyncio.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, permanent_errors=(ValueError,))

    async def parse() -> int:
        return int("not a number")

    with pytest.raises(ValueError):
        await d.run("k", parse)
    with pytest.raises(PreviouslyFailed) as info:
        await d.run("k", parse)
    assert "invalid literal" in info.value.error["message"]
    await d.aclose()


async def test_unserialisable_result_is_recorded_done_and_reported(adedupe: AsyncDeduplicator) -> None:
    calls = []

    async def handler() -> object:
        calls.append(1)
        return object()

    with pytest.raises(ResultNotSerializable):
        await adedupe.run("k", handler)
    claim = await adedupe.begin("k")
    assert claim.outcome is Outcome.DUPLICATE and claim.omitted
    assert calls == [1]


async def test_current_claim_is_set_inside_the_coroutine(adedupe: AsyncDeduplicator) -> None:
    async def handler() -> tuple[str, int]:
        await asyncio.sleep(0)  # still set after a suspension
        claim = current_claim()
        assert claim is not None
        return claim.key, claim.token

    seen = await adedupe.run("k", handler)
    assert seen == ("k", (await adedupe.begin("k")).token)  # the token that stored the outcome
    assert current_claim() is None and dedupe_worker.current_claim() is None


async def test_renewal_keeps_a_long_handler_owning_its_claim(aredis: redis.asyncio.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=0.3, result_ttl=30)
    other: list[Outcome] = []

    async def slow() -> str:
        for _ in range(4):  # 0.8 s, well past the 0.3 s lease
            await asyncio.sleep(0.2)
            other.append((await d.begin("k")).outcome)
        return "done"

    assert await d.run("k", slow) == "done"
    assert other == [Outcome.IN_PROGRESS] * 4
    await d.aclose()


async def test_handler_that_lost_its_lease_gets_lease_lost(aredis: redis.asyncio.Redis, namespace: str) -> None:
    # renewals every 10 s: the 0.2 s lease is not kept alive, a successor takes over
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=0.2, result_ttl=30, renew_interval=10)
    successor = AsyncDeduplicator(aredis, namespace=namespace, lease=5, result_ttl=30)

    async def paused() -> str:
        await asyncio.sleep(0.3)
        claim = await successor.begin("k")
        assert claim.outcome is Outcome.ACQUIRED
        await successor.complete(claim, "successor")
        return "zombie"

    with pytest.raises(LeaseLost):
        await d.run("k", paused)
    assert (await d.begin("k")).result == "successor"
    await d.aclose()


async def test_renewer_marks_a_stolen_claim_lost(aredis: redis.asyncio.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=0.2, result_ttl=30, renew_interval=10)
    claim = await d.begin("k")
    await asyncio.sleep(0.25)
    await d.begin("k")  # a successor takes it
    with d.hold(claim):
        await d.renewer.renew_now()
        assert d.renewer.is_lost(claim.stem, claim.token)
        with pytest.raises(LeaseLost):
            await d.complete(claim, 1)
    await d.aclose()


async def test_one_renewer_task_serves_every_claim(
    aredis: redis.asyncio.Redis, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=0.3, result_ttl=30)
    inside = asyncio.Event()
    holding: list[int] = []

    async def handler() -> int:
        holding.append(1)
        if len(holding) == 20:
            inside.set()
        await asyncio.sleep(0.5)  # past the lease: only renewal keeps the claims
        return 1

    before = asyncio.all_tasks()
    runs = [asyncio.create_task(d.run(f"k{i}", handler)) for i in range(20)]
    await asyncio.wait_for(inside.wait(), 10)
    started = asyncio.all_tasks() - before - set(runs)
    assert [t.get_name() for t in started] == ["dedupe-lease-renewer"]
    assert d.renewer.tasks() == list(started)
    assert await asyncio.gather(*runs) == [1] * 20
    assert [c.outcome for c in await d.begin_many([f"k{i}" for i in range(20)])] == [Outcome.DUPLICATE] * 20
    # a renewal that crossed a completion in flight is not reported as a lost lease
    assert "lease lost" not in caplog.text
    await d.aclose()
    assert d.renewer.tasks() == []


async def test_the_renewer_task_ends_by_itself_once_its_loop_holds_no_lease(
    aredis: redis.asyncio.Redis, namespace: str
) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=0.3)  # renewals every 0.1 s
    claim = await d.begin("k")
    with d.hold(claim):
        [task] = d.renewer.tasks()
        await asyncio.sleep(0.35)  # past the lease: renewed meanwhile
        assert not task.done()
    assert (await d.begin("k")).outcome is Outcome.IN_PROGRESS  # the lease was kept
    await asyncio.wait({task}, timeout=10)
    assert task.done() and not task.cancelled() and d.renewer.tasks() == []


async def test_aclose_cancels_the_renewer_task(aredis: redis.asyncio.Redis, namespace: str) -> None:
    d = AsyncDeduplicator(aredis, namespace=namespace, lease=5)
    claim = await d.begin("k")
    with d.hold(claim):
        [task] = d.renewer.tasks()
        await d.aclose()
        assert task.cancelled()


async def test_500_concurrent_runs_of_one_key_run_the_function_once(redis_url: str, namespace: str) -> None:
    async with AsyncDeduplicator.from_url(redis_url, namespace=namespace, lease=5) as d:
        await five_hundred_runs(d)
    assert d.renewer.tasks() == []  # "async with" closed it


async def five_hundred_runs(d: AsyncDeduplicator) -> None:
    calls = []

    async def charge() -> str:
        calls.append(1)
        await asyncio.sleep(0.05)
        return "charged"

    answers = await asyncio.gather(*(d.run("order-500", charge) for _ in range(500)), return_exceptions=True)
    assert calls == [1]
    assert all(a == "charged" or isinstance(a, InProgress) for a in answers), \
        {type(a).__name__ for a in answers}
    assert answers.count("charged") >= 1
    # once stored, every later run answers the stored value without running it
    assert await asyncio.gather(*(d.run("order-500", charge) for _ in range(500))) == ["charged"] * 500
    assert calls == [1]


async def test_concurrent_runs_with_wait_all_get_the_one_value(adedupe: AsyncDeduplicator) -> None:
    calls = []

    async def charge() -> str:
        calls.append(1)
        await asyncio.sleep(0.2)
        return "charged"

    answers = await asyncio.gather(*(adedupe.run("order-w", charge, wait=5) for _ in range(20)))
    assert answers == ["charged"] * 20 and calls == [1]


async def test_a_cancelled_handler_releases_its_claim(adedupe: AsyncDeduplicator) -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(adedupe.run("k", forever))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    retry = await adedupe.begin("k")  # released: claimable at once, not after the lease
    assert retry.outcome is Outcome.ACQUIRED


async def test_decide_returns_the_engines_decision(adedupe: AsyncDeduplicator) -> None:
    async def handler() -> dict[str, int]:
        return {"n": 1}

    applied = await decide(adedupe, "k", handler, integration="faststream")
    assert applied.reason is Reason.APPLIED and applied.action is Action.ACK and applied.value == {"n": 1}
    duplicate = await decide(adedupe, "k", handler)
    assert duplicate.reason is Reason.DUPLICATE and duplicate.value == {"n": 1}
    held = await adedupe.begin("held")
    deferred = await decide(adedupe, "held", handler)
    assert deferred.reason is Reason.IN_PROGRESS and deferred.action is Action.DEFER
    assert deferred.token == held.token and 0 < deferred.retry_after <= 5
    poisoned = await decide(adedupe, "", handler)
    assert poisoned.reason is Reason.INVALID_KEY and poisoned.action is Action.DEAD_LETTER

    async def broken() -> None:
        raise RuntimeError("boom")

    failed = await decide(adedupe, "b", broken)
    assert failed.reason is Reason.HANDLER_ERROR and failed.action is Action.RETRY
    assert isinstance(failed.error, RuntimeError)


async def test_redis_down_defers_without_running_the_handler(namespace: str) -> None:
    d = unreachable(namespace)
    calls = []

    async def handler() -> None:
        calls.append(1)

    decision = await decide(d, "k", handler)
    assert decision.reason is Reason.STORE_UNAVAILABLE and decision.action is Action.DEFER
    with pytest.raises(StoreUnavailable):
        await d.run("k", handler)
    assert calls == []
    await d.aclose()


async def test_fail_open_runs_the_handler_when_redis_is_down(namespace: str) -> None:
    d = unreachable(namespace, fail_open=True)

    async def handler() -> str:
        return "ran anyway"

    assert await d.run("k", handler) == "ran anyway"
    await d.aclose()


async def test_idempotent_decorator_with_format_key(adedupe: AsyncDeduplicator) -> None:
    calls = []

    @idempotent(adedupe, key="charge:{order_id}")
    async def charge(order_id: int, amount: int) -> dict[str, int]:
        calls.append(order_id)
        return {"order": order_id, "amount": amount}

    assert await charge(7, 100) == {"order": 7, "amount": 100}
    assert await charge(7, amount=100) == {"order": 7, "amount": 100}
    assert calls == [7]
    with pytest.raises(KeyConflict):
        await charge(7, 999)


async def test_idempotent_decorator_with_callable_key(adedupe: AsyncDeduplicator) -> None:
    @dedupe_worker.idempotent(adedupe, key=lambda event: f"evt:{event['id']}", fingerprint=False)
    async def handle(event: dict[str, object]) -> object:
        return event["n"]

    assert await handle({"id": 1, "n": "a"}) == "a"
    assert await handle({"id": 1, "n": "b"}) == "a"


async def test_idempotent_refuses_a_mismatched_deduplicator(
    adedupe: AsyncDeduplicator, redis_client: redis.Redis, namespace: str
) -> None:
    with pytest.raises(TypeError, match="needs a Deduplicator"):
        @idempotent(adedupe, key="k")
        def plain() -> None: ...

    with pytest.raises(TypeError, match="needs an AsyncDeduplicator"):
        @idempotent(Deduplicator(redis_client, namespace=namespace), key="k")
        async def coroutine() -> None: ...


#: A worker process: claims ``order`` with a 1 s lease and records ``started`` and ``applied``
#: (with its fencing token) around 30 s of awaited work, which the test cuts short with SIGKILL.
CRASHING_WORKER = """
import asyncio, os, sys
import redis
from dedupe_worker import current_claim
from dedupe_worker.asyncio import AsyncDeduplicator

url, namespace, effects = sys.argv[1:4]
log = redis.Redis.from_url(url)

async def charge():
    log.rpush(effects, f"started:{current_claim().token}")
    await asyncio.sleep(30)
    log.rpush(effects, f"applied:{current_claim().token}")
    return "charged by the worker"

async def main():
    dedupe = AsyncDeduplicator.from_url(url, namespace=namespace, lease=1.0)
    await dedupe.run("order", charge)

asyncio.run(main())
"""


async def test_a_process_killed_mid_handler_loses_nothing_and_applies_once(
    redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    effects = f"{namespace}:effects"
    group = ProcessGroup([python(), "-c", CRASHING_WORKER, redis_url, namespace, effects], dict(os.environ), ROOT)
    try:
        victim = group.start()
        deadline = time.monotonic() + 30
        while not redis_client.lrange(effects, 0, -1) and time.monotonic() < deadline and victim.poll() is None:
            await asyncio.sleep(0.05)
        assert redis_client.llen(effects) == 1, group.output()
        [started] = redis_client.lrange(effects, 0, -1)
        victim.send_signal(signal.SIGKILL)  # mid-handler: the claim is held, nothing stored
        victim.wait(10)
    finally:
        group.cleanup()
    killed_token = int(started.decode().split(":")[1])

    d = AsyncDeduplicator.from_url(redis_url, namespace=namespace, lease=1.0)

    async def charge() -> str:
        claim = current_claim()
        assert claim is not None
        redis_client.rpush(effects, f"applied:{claim.token}")
        return "charged after the crash"

    with pytest.raises(InProgress):  # the dead worker's lease still runs: deferred, not dropped
        await d.run("order", charge)
    assert await d.run("order", charge, wait=5) == "charged after the crash"  # its lease waited out
    assert await d.run("order", charge) == "charged after the crash"  # from now on, a duplicate
    entries = [e.decode() for e in redis_client.lrange(effects, 0, -1)]
    applied = [e for e in entries if e.startswith("applied:")]
    assert len(applied) == 1 and int(applied[0].split(":")[1]) > killed_token
    await d.aclose()

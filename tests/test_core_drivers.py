"""One core, two drivers: the sync and asyncio clients have the same public surface, run the same
flows, and the asyncio batch engine (``dedupe_worker.asyncio.decide_many``) gives the verdicts
of the sync one, on a real Redis."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
import redis
import redis.asyncio

import dedupe_worker.asyncio as dw_asyncio
from dedupe_worker import Deduplicator, Reason, current_claim, decide_many
from dedupe_worker.asyncio import AsyncDeduplicator

from .async_fixtures import adedupe, aredis

__all__ = ["adedupe", "aredis"]

#: Names that differ by design: the asyncio spelling of the same thing.
ASYNC_NAMES = {"__enter__": "__aenter__", "__exit__": "__aexit__"}
#: Only on asyncio: the name asyncio libraries use for ``close``.
ASYNC_ONLY = {"aclose"}


def public(cls: type) -> dict[str, Any]:
    names = {name for name in dir(cls) if not name.startswith("_")} | {"__enter__", "__exit__", "__aenter__",
                                                                      "__aexit__"}
    return {name: inspect.getattr_static(cls, name) for name in names if hasattr(cls, name)}


def parameters(member: Any) -> list[tuple[str, Any, Any]] | None:
    function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    if isinstance(function, property) or not callable(function):
        return None
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def asynchronous(member: Any) -> bool:
    function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    return inspect.iscoroutinefunction(function)


def test_the_asyncio_deduplicator_has_every_public_method_of_the_sync_one_with_the_same_parameters() -> None:
    sync, asyn = public(Deduplicator), public(AsyncDeduplicator)
    assert "__enter__" in sync and "__exit__" in sync
    expected = {ASYNC_NAMES.get(name, name) for name in sync}
    assert set(asyn) - ASYNC_ONLY == expected
    for name, member in sync.items():
        twin = asyn[ASYNC_NAMES.get(name, name)]
        assert parameters(member) == parameters(twin), name
        assert isinstance(member, property) == isinstance(twin, property), name
        # async-ness is the only difference allowed: nothing on the sync side is a coroutine
        assert not asynchronous(member), name
    # and what blocks on sync is awaited on asyncio
    for name in ("begin", "begin_many", "complete", "complete_each", "complete_many", "settle_and_claim",
                 "settle_and_stream", "fail", "release", "release_many", "renew", "forget", "status", "run",
                 "apply", "settle_failure", "close", "check_store", "wait_for", "claim_requests"):
        assert asynchronous(asyn[name]), name


def test_sync_deduplicator_is_a_context_manager_and_closes_the_client_from_url_built(redis_url: str,
                                                                                     namespace: str) -> None:
    with Deduplicator.from_url(redis_url, namespace=namespace) as dedupe:
        assert dedupe.run("k", lambda: 7) == 7
        pool = dedupe.store.client.connection_pool
        connections = [*pool._available_connections, *pool._in_use_connections]  # type: ignore[attr-defined]
        assert any(c._sock is not None for c in connections)
    assert dedupe.owns_redis
    assert all(c._sock is None for c in connections)  # closed: every socket of its pool disconnected

    client = redis.Redis.from_url(redis_url)
    with Deduplicator(client, namespace=namespace) as mine:
        assert mine.run("k", lambda: 8) == 7
    assert client.ping()  # a client passed in is the caller's: still usable
    client.close()


@pytest.mark.asyncio
async def test_asyncio_decide_many_gives_the_verdicts_of_the_sync_engine(adedupe: AsyncDeduplicator,
                                                                        redis_client: redis.Redis,
                                                                        namespace: str) -> None:
    seen: list[tuple[str, int]] = []

    def handler(n: int) -> Any:
        async def handle() -> int:
            claim = current_claim()
            assert claim is not None
            seen.append((claim.key, claim.token))
            await asyncio.sleep(0)
            if n == 3:
                raise RuntimeError("boom")
            return n * 10
        return handle

    items = [(f"m{n}", None, handler(n)) for n in range(6)] + [("m1", None, handler(1)), ("", None, handler(9))]
    decisions = await dw_asyncio.decide_many(adedupe, items)
    assert [d.reason for d in decisions] == [Reason.APPLIED, Reason.APPLIED, Reason.APPLIED, Reason.HANDLER_ERROR,
                                             Reason.APPLIED, Reason.APPLIED, Reason.DUPLICATE, Reason.INVALID_KEY]
    assert [d.value for d in decisions[:3]] == [0, 10, 20] and decisions[6].value == 10
    assert sorted(key for key, _ in seen) == ["m0", "m1", "m2", "m3", "m4", "m5"]  # m1 once; m3 released

    # the sync engine, on the same namespace, sees the same records
    sync = Deduplicator(redis_client, namespace=namespace, lease=5.0, result_ttl=60.0)
    try:
        again = decide_many(sync, [(f"m{n}", None, lambda n=n: n) for n in range(6)])
        assert [d.reason for d in again] == [Reason.DUPLICATE] * 3 + [Reason.APPLIED] + [Reason.DUPLICATE] * 2
        assert [d.value for d in again] == [0, 10, 20, 3, 40, 50]
    finally:
        sync.close()


@pytest.mark.asyncio
async def test_asyncio_decide_many_with_a_batch_handler_and_a_permanent_error(aredis: redis.asyncio.Redis,
                                                                             namespace: str) -> None:
    dedupe = AsyncDeduplicator(aredis, namespace=namespace, lease=5.0, permanent_errors=(ValueError,))
    try:
        async def nothing() -> None:
            raise AssertionError("per-item handlers are not called with run_batch")

        async def run_batch(indices: list[int]) -> list[int]:
            return [i + 100 for i in indices]

        decisions = await dw_asyncio.decide_many(dedupe, [("a", None, nothing), ("b", None, nothing)],
                                                 run_batch=run_batch)
        assert [(d.reason, d.value) for d in decisions] == [(Reason.APPLIED, 100), (Reason.APPLIED, 101)]

        async def bad() -> None:
            raise ValueError("never")

        (failed,) = await dw_asyncio.decide_many(dedupe, [("c", None, bad)])
        assert failed.reason is Reason.PERMANENT_FAILURE
        (stored,) = await dw_asyncio.decide_many(dedupe, [("c", None, bad)])
        assert stored.reason is Reason.PREVIOUSLY_FAILED
    finally:
        await dedupe.aclose()


@pytest.mark.asyncio
async def test_asyncio_decide_many_cancelled_releases_what_did_not_finish(adedupe: AsyncDeduplicator) -> None:
    started = asyncio.Event()

    async def quick() -> str:
        return "done"

    async def forever() -> None:
        started.set()
        await asyncio.sleep(60)

    task = asyncio.create_task(dw_asyncio.decide_many(adedupe, [("q", None, quick), ("f", None, forever)],
                                                      flush_after=10.0))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await adedupe.status("q")).state == "done"  # what finished is stored
    assert (await adedupe.status("f")).state == "free"  # the cancelled one released at once

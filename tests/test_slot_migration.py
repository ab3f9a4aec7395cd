"""A Redis Cluster slot migration while handlers run: nothing runs twice, done keys stay done.

While a slot moves, Redis answers ``TRYAGAIN`` to a script naming several keys of the slot when
some are missing (the result key of a claim being completed always is), and redis-py gives up
after ~0.4 s. The migration here is paced (``CLUSTER SETSLOT ... IMPORTING/MIGRATING``, then
``MIGRATE`` a few keys at a time, as ``redis-cli --cluster reshard`` does) so that it spans every
completion, on a private 3-primary cluster of its own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster, key_slot

from dedupe_worker import Deduplicator, Reason, decide, decide_many
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.asyncio import decide as async_decide

from .services import redis_cluster

pytestmark = pytest.mark.cluster

#: How long the paced migration keeps the slot moving: well past redis-py's own ~0.4 s of
#: TRYAGAIN retries, well inside the 6 s lease (the retry budget is the lease less a renewal
#: interval and a reserve, about 3.4 s: room for a migration slowed by a busy machine).
MIGRATION_SECONDS = 1.5


@pytest.fixture
def cluster_ports() -> Iterator[list[int]]:
    with redis_cluster(3) as ports:  # its own: the test moves a slot
        yield ports


def keys_in_one_slot(count: int) -> tuple[int, list[str]]:
    """``count`` message keys whose records (``ns:{key}...``) all live in one hash slot."""
    slot = key_slot(b"slot-anchor")
    keys, i = [], 0
    while len(keys) < count:
        key = f"m-{i}"
        if key_slot(key.encode()) == slot:
            keys.append(key)
        i += 1
    return slot, keys


def node_id(client: redis.Redis) -> str:
    reply = client.execute_command("CLUSTER", "MYID")
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def migrate_slot(ports: list[int], slot: int, owner: int, started: threading.Event) -> None:
    """Move ``slot`` from the node on port ``owner`` to another primary, paced over
    :data:`MIGRATION_SECONDS`: IMPORTING/MIGRATING, keys moved a few at a time, then the slot
    assigned to its new node everywhere."""
    target = next(p for p in ports if p != owner)
    src, dst = redis.Redis(port=owner), redis.Redis(port=target)
    src_id, dst_id = node_id(src), node_id(dst)
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    started.set()
    ends = time.monotonic() + MIGRATION_SECONDS
    while True:
        keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 2)
        if keys:
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
        if time.monotonic() >= ends and not keys:
            break
        time.sleep(0.05)
    for port in ports:
        redis.Redis(port=port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    src.close()
    dst.close()


def test_a_slot_moving_under_completions_reruns_no_handler(cluster_ports: list[int], namespace: str) -> None:
    d = Deduplicator.from_url(f"redis://127.0.0.1:{cluster_ports[0]}/0?cluster=1", namespace=namespace,
                              lease=6.0, result_ttl=60)
    assert isinstance(d.store.client, RedisCluster)
    slot, keys = keys_in_one_slot(50)
    done, singles, batch = keys[:30], keys[30:40], keys[40:]
    runs: Counter[str] = Counter()
    lock = threading.Lock()
    moving = threading.Event()

    def handler(key: str, wait: bool) -> Callable[[], Any]:
        def run() -> str:
            with lock:
                runs[key] += 1
            if wait:
                moving.wait(10)
            return key
        return run

    for key in done:
        assert decide(d, key, handler(key, False)).reason is Reason.APPLIED
    owner = d.store.client.nodes_manager.get_node_from_slot(slot).port
    first: dict[str, Reason] = {}

    def single(key: str) -> None:
        first[key] = decide(d, key, handler(key, True)).reason

    def batched() -> None:
        for key, decision in zip(batch, decide_many(d, [(k, None, handler(k, True)) for k in batch]), strict=True):
            first[key] = decision.reason

    workers = [threading.Thread(target=single, args=(k,)) for k in singles] + [threading.Thread(target=batched)]
    for w in workers:
        w.start()
    time.sleep(0.2)  # every handler is running (or, in the batch, queued behind the first)
    migrate_slot(cluster_ports, slot, owner, moving)
    for w in workers:
        w.join(30)

    # Every in-flight message is delivered again after the move: an outcome that was refused
    # would leave its claim held, and its handler would run again once the lease ran out.
    for key in singles + batch:
        again = decide(d, key, handler(key, False), wait=d.lease + 1)
        assert again.reason in (Reason.DUPLICATE, Reason.APPLIED), (key, again)
    twice = sorted(k for k, n in runs.items() if n > 1)
    stored_first = [k for k, r in first.items() if r is Reason.APPLIED]
    print(f"handlers run twice: {len(twice)}; in flight stored in the first delivery: {len(stored_first)}"
          f" of {len(singles) + len(batch)}; first verdicts: {Counter(r.name for r in first.values())}")
    assert twice == []
    assert all(first[k] is Reason.APPLIED for k in singles), first
    for key in done:
        assert decide(d, key, handler(key, False)).reason is Reason.DUPLICATE
    assert all(runs[k] == 1 for k in done)
    d.close()


def test_a_slot_moving_under_asyncio_completions_reruns_no_handler(cluster_ports: list[int], namespace: str) -> None:
    slot, keys = keys_in_one_slot(30)
    done, flying = keys[:10], keys[10:]
    runs: Counter[str] = Counter()
    moving = threading.Event()

    async def main() -> tuple[dict[str, Reason], dict[str, Reason], dict[str, Reason]]:
        d = AsyncDeduplicator.from_url(f"redis://127.0.0.1:{cluster_ports[0]}/0?cluster=1", namespace=namespace,
                                       lease=6.0, result_ttl=60)

        def handler(key: str, wait: bool) -> Callable[[], Awaitable[str]]:
            async def run() -> str:
                runs[key] += 1
                while wait and not moving.is_set():  # set by the migration's thread
                    await asyncio.sleep(0.01)
                return key
            return run

        for key in done:
            assert (await async_decide(d, key, handler(key, False))).reason is Reason.APPLIED
        owner = d.store.client.nodes_manager.get_node_from_slot(slot).port
        flights = asyncio.gather(*(async_decide(d, k, handler(k, True)) for k in flying))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(migrate_slot, cluster_ports, slot, owner, moving)
        first = {k: decision.reason for k, decision in zip(flying, await flights, strict=True)}
        again = {k: (await async_decide(d, k, handler(k, False), wait=d.lease + 1)).reason for k in flying}
        after = {k: (await async_decide(d, k, handler(k, False))).reason for k in done}
        await d.aclose()
        return first, again, after

    first, again, after = asyncio.run(main())
    twice = sorted(k for k, n in runs.items() if n > 1)
    print(f"asyncio: handlers run twice: {len(twice)}; first verdicts: {Counter(r.name for r in first.values())}")
    assert twice == []
    assert set(first.values()) == {Reason.APPLIED}
    assert set(again.values()) == {Reason.DUPLICATE}
    assert set(after.values()) == {Reason.DUPLICATE}

"""A verdict is true: an outcome ``complete.lua`` stored is never reported as LEASE_LOST.

A renewal that lands after our own ``complete.lua`` deleted the started record is refused; the
renewer used to mark that lease lost before the engine stopped tracking it, and the stored outcome
came back LEASE_LOST (the message deferred, ``on_lease_lost`` fired). A renewal interval of 0.2 ms
makes that race happen hundreds of times in a second.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import redis

from dedupe_worker import Deduplicator, Reason, decide_many
from dedupe_worker.asyncio import AsyncDeduplicator
from dedupe_worker.asyncio import decide as async_decide

MESSAGES = 12000


def test_stored_outcomes_are_never_lease_lost_in_batches(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=3.0, result_ttl=60, renew_interval=0.0002)
    lost_by_renewer: list[tuple[str, int]] = []
    d.renewer.on_lost = lambda stem, token: lost_by_renewer.append((stem, token))
    verdicts: Counter[str] = Counter()
    for start in range(0, MESSAGES, 500):
        items = [(f"k-{i}", None, (lambda i=i: i)) for i in range(start, start + 500)]
        verdicts.update(decision.reason.name for decision in decide_many(d, items))
    stored = sum(1 for i in range(MESSAGES) if d.status(f"k-{i}").state.value == "done")
    print(f"\n{MESSAGES} messages, renewal every 0.2 ms: {dict(verdicts)}; outcomes stored: {stored}; "
          f"leases the renewer called lost: {len(lost_by_renewer)}")
    d.close()
    assert stored == MESSAGES
    assert verdicts == Counter({Reason.APPLIED.name: MESSAGES})
    assert lost_by_renewer == []


def test_stored_outcomes_are_never_lease_lost_on_asyncio(redis_url: str, namespace: str) -> None:
    async def main() -> Counter[str]:
        d = AsyncDeduplicator.from_url(redis_url, namespace=namespace, lease=3.0, result_ttl=60,
                                       renew_interval=0.0002)
        verdicts: Counter[str] = Counter()

        async def one(i: int) -> None:
            async def handler() -> int:
                await asyncio.sleep(0)
                return i
            verdicts[(await async_decide(d, f"a-{i}", handler)).reason.name] += 1

        for start in range(0, 1500, 100):
            await asyncio.gather(*(one(i) for i in range(start, start + 100)))
        await d.aclose()
        return verdicts

    assert asyncio.run(main()) == Counter({Reason.APPLIED.name: 1500})

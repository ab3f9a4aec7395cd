"""At ``maxmemory`` with ``noeviction``: finishing a claim is never refused, new claims are.

Redis refuses a script at the limit unless it carries the ``allow-oom`` flag (Redis 7): a claim
accepted just under the limit can push memory over it, and without the flag its own completion
would be refused and its handler run again after the lease. On a private Redis whose limit is set
just above what it holds, 320 messages (results of 2 KB each) fill it up.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from dedupe_worker import Deduplicator, Reason, decide, decide_many

from .services import RedisServer

MESSAGES = 320
HEADROOM = 400_000  # bytes between what the server holds and its limit: some 40 outcomes of 2 KB


@pytest.fixture
def full_redis(private_redis: RedisServer) -> Iterator[redis.Redis]:
    """The private server with ``noeviction`` (its limit is set by the test)."""
    client = redis.Redis.from_url(private_redis.url)
    client.config_set("maxmemory-policy", "noeviction")
    filler = client.pipeline(transaction=False)
    for i in range(500):
        filler.set(f"filler:{i}", b"x" * 2000)
    filler.execute()
    yield client
    client.close()


def limit_just_above_use(client: redis.Redis) -> None:
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + HEADROOM)


def test_completions_pass_the_limit_and_claims_are_deferred(full_redis: redis.Redis) -> None:
    # Uncompressed results, so each outcome takes the memory its size says (4 KB of one letter
    # would otherwise compress to a few bytes and the limit never be reached).
    d = Deduplicator(full_redis, namespace="oom", lease=1.0, result_ttl=600, compress_above=1 << 30)
    d.status("warm-up")  # the scripts are loaded (and the Lua engine's memory counted) before the limit
    limit_just_above_use(full_redis)
    runs: Counter[str] = Counter()
    lock = threading.Lock()

    def handler(key: str) -> Callable[[], Any]:
        def run() -> str:
            with lock:
                runs[key] += 1
            time.sleep(0.005)  # several workers' claims are in flight when memory crosses the limit
            return "r" * 4000
        return run

    keys = [f"m-{i}" for i in range(MESSAGES)]
    verdicts: dict[str, Reason] = {}

    def worker(n: int) -> None:  # eight workers: half decide one by one, half decide_many batches of 10
        mine = keys[n::8]
        if n % 2:
            for key in mine:
                verdicts[key] = decide(d, key, handler(key)).reason
            return
        for start in range(0, len(mine), 10):
            part = mine[start:start + 10]
            for key, decision in zip(part, decide_many(d, [(k, None, handler(k)) for k in part]), strict=True):
                verdicts[key] = decision.reason

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    ran = [k for k in keys if runs[k]]
    refused = [k for k in ran if verdicts[k] is not Reason.APPLIED]
    deferred = [k for k in keys if not runs[k]]
    full = int(full_redis.info("memory")["used_memory"]) >= int(full_redis.config_get("maxmemory")["maxmemory"])

    # The limit is lifted; the lease of a refused completion runs out; every message comes again.
    full_redis.config_set("maxmemory", 0)
    for key in keys:
        again = decide(d, key, handler(key), wait=d.lease + 1)
        assert again.reason in (Reason.DUPLICATE, Reason.APPLIED), (key, again)
    twice = [k for k in keys if runs[k] > 1]
    print(f"\nRESULT {MESSAGES} messages at the limit: {len(ran)} handlers ran, {len(refused)} completions refused,"
          f" {len(deferred)} claims deferred, {len(twice)} handlers ran twice (full: {full})")
    assert full and deferred, "the limit was never reached: the test proves nothing"
    assert all(verdicts[k] is Reason.STORE_UNAVAILABLE for k in deferred)
    assert refused == []
    assert twice == []
    d.close()

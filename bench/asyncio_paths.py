"""The asyncio path against the synchronous one, and concurrency against sequence, in one run.

    python -m bench.asyncio_paths [--redis-url URL] [--seconds S] [--concurrency 50]

Pinned, as the figures in docs/asyncio.md were taken (a private Redis on vCPU 0, the bench on 1):

    taskset -c 0 redis-server --port 6437 --save "" --appendonly no
    taskset -c 1 python -m bench.asyncio_paths --redis-url redis://127.0.0.1:6437/0

Cases, each in messages/s (unique keys, so every message is claim + handler + complete, two
scripts), taking turns in short rounds so a noisy neighbour hits every case alike, each the
median of its rounds:

- ``sync run``: ``Deduplicator.run`` one message after another (the baseline);
- ``async run``: ``await AsyncDeduplicator.run`` one message after another, in one event loop;
- ``async x50``: 50 coroutines at once, each ``await run`` one message after another;
- ``raw async``: the same two scripts awaited straight from ``redis.asyncio``, one message after
  another, with no library around them (what the asyncio client itself costs);

once with a handler that returns at once, once with one that waits 1 ms on I/O
(``time.sleep``/``asyncio.sleep``). Printed as ratios: async single against sync single (the
price of asyncio on one message), 50 concurrent coroutines against the sequential async path and
against the sync baseline (what concurrency buys one process).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import redis

from dedupe_worker import Deduplicator
from dedupe_worker._protocol.claim import Stored
from dedupe_worker.asyncio import AsyncDeduplicator

#: A case: run for about ``seconds``, return how many messages were done and the time it took.
Case = Callable[[float], tuple[int, float]]


def rates(cases: dict[str, Case], seconds: float, rounds: int = 7) -> dict[str, float]:
    """Median msg/s of each case over ``rounds`` short rounds, the cases taking turns."""
    for case in cases.values():  # warm-up: connections, script cache
        case(0.05)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            done, elapsed = case(seconds / rounds)
            samples[name].append(done / elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}


def measure(url: str, seconds: float, concurrency: int, io_wait: float) -> dict[str, float]:
    ns = f"bench-async-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(url)
    sync = Deduplicator(client, namespace=ns, lease=30, result_ttl=600)
    loop = asyncio.new_event_loop()
    adedupe = AsyncDeduplicator.from_url(url, namespace=ns, lease=30, result_ttl=600)
    counter = iter(range(10**12))

    def sync_handler() -> int:
        if io_wait:
            time.sleep(io_wait)
        return 1

    async def async_handler() -> int:
        if io_wait:
            await asyncio.sleep(io_wait)
        return 1

    def sync_case(seconds: float) -> tuple[int, float]:
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            sync.run(f"s-{next(counter)}", sync_handler)
            done += 1
        return done, time.perf_counter() - start

    runner = adedupe.store.scripts
    loop.run_until_complete(runner.shas())  # the server's texts and call kind (FCALL or EVALSHA)
    raw_client = adedupe.store.client
    raw_command = runner.flows.command  # the command the runner sends: FCALL on Redis 7+, else EVALSHA
    store = adedupe.store

    async def raw_worker(until: float) -> int:
        done = 0
        while time.perf_counter() < until:
            stem = f"{ns}:{{r-{next(counter)}}}"
            claim = store.claim_calls([(stem, "", "")], 30000, 600000)[0]
            reply = await raw_client.execute_command(*raw_command(*claim))
            await async_handler()
            complete = store.complete_calls([(stem, int(reply[1]), Stored.COMPLETED, b"1")], 600000)[0]
            await raw_client.execute_command(*raw_command(*complete))
            done += 1
        return done

    async def worker(until: float) -> int:
        done = 0
        while time.perf_counter() < until:
            await adedupe.run(f"a-{next(counter)}", async_handler)
            done += 1
        return done

    def async_case(workers: int, body: Callable[[float], Awaitable[int]] = worker) -> Case:
        async def timed(seconds: float) -> tuple[int, float]:
            start = time.perf_counter()
            counts = await asyncio.gather(*(body(start + seconds) for _ in range(workers)))
            return sum(counts), time.perf_counter() - start

        def case(seconds: float) -> tuple[int, float]:
            return loop.run_until_complete(timed(seconds))

        return case

    cases: dict[str, Case] = {"sync": sync_case, "async": async_case(1), "async_n": async_case(concurrency),
                              "raw": async_case(1, raw_worker)}
    try:
        return rates(cases, seconds)
    finally:
        loop.run_until_complete(adedupe.aclose())
        loop.close()
        sync.close()
        cursor = 0
        while True:  # the bench keys expire anyway, but do not leave them behind
            cursor, found = client.scan(cursor, match=f"{ns}:*", count=5000)
            if found:
                client.unlink(*found)
            if cursor == 0:
                break


def report(m: dict[str, float], handler: str, concurrency: int) -> str:
    return "\n".join([
        f"  handler {handler}",
        f"    sync run(), sequential        {m['sync']:>9,.0f} msg/s  (baseline)",
        f"    async run(), sequential       {m['async']:>9,.0f} msg/s  = {m['async'] / m['sync']:.2f}x sync run(), "
        f"{m['async'] / m['raw']:.2f}x the raw scripts on redis.asyncio ({m['raw']:,.0f} msg/s)",
        f"    async run(), {concurrency} coroutines     {m['async_n']:>9,.0f} msg/s  = "
        f"{m['async_n'] / m['async']:.2f}x sequential async, {m['async_n'] / m['sync']:.2f}x sync run()",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--seconds", type=float, default=2.0, help="per case, spread over 7 rounds")
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--label", default=f"pid {os.getpid()}, cpus {sorted(os.sched_getaffinity(0))}")
    args = parser.parse_args()
    print(f"[asyncio paths: {args.label}]", flush=True)
    for handler, wait in (("returns at once", 0.0), ("waits 1 ms on I/O", 0.001)):
        print(report(measure(args.redis_url, args.seconds, args.concurrency, wait), handler, args.concurrency),
              flush=True)


if __name__ == "__main__":
    main()

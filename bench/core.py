"""Core protocol speed against a real Redis, with baselines measured in the same run.

    python -m bench.core [--redis-url URL] [--seconds S]

Prints, one line each: raw EVALSHA round trips/s (a trivial two-key script); the ``run()`` path
(claim + complete, two scripts per message) in messages/s and as a ratio to two raw round trips;
the batch path (``begin_many`` + ``complete_many``, 100 per batch) in messages/s and as a ratio
to raw pipelined EVALSHA (two trivial scripts per message); a duplicate hit (one round trip); and
Redis memory per completed key (``MEMORY USAGE`` of its records).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable

import redis

from dedupe_worker import Deduplicator

TRIVIAL = "return 1"


def rates(cases: dict[str, Callable[[int], int]], seconds: float, rounds: int = 7) -> dict[str, float]:
    """Messages per second of each ``fn(i) -> messages done``: the cases take turns in short
    rounds and each reports its median round, so a noisy neighbour hits every case alike."""
    for fn in cases.values():  # warm-up: connections, script cache
        for i in range(20):
            fn(-1 - i)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    counter = 0
    for _ in range(rounds):
        for name, fn in cases.items():
            done = 0
            start = time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds / rounds:
                done += fn(counter)
                counter += 1
            samples[name].append(done / elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}


def measure(url: str, seconds: float) -> dict[str, float]:
    client = redis.Redis.from_url(url)
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    d = Deduplicator(client, namespace=ns, lease=30, result_ttl=600)
    sha = client.script_load(TRIVIAL)
    keys = (f"{ns}:{{raw}}:started", f"{ns}:{{raw}}:result")

    def raw(_: int) -> int:
        client.evalsha(sha, 2, *keys, "a", "b")
        return 1

    claim_sha, complete_sha = d.store.scripts.sha["claim"], d.store.scripts.sha["complete"]

    def raw_scripts(i: int) -> int:
        """The same two scripts, called straight from redis-py: what run() costs without us."""
        stem = f"{ns}:{{raw-{i}}}"
        started, result = stem + ":started", stem + ":result"
        token = client.evalsha(claim_sha, 2, started, result, 30000, 600000, "", "")[1]
        client.evalsha(complete_sha, 2, started, result, 600000, token, "c", b"1")
        return 1

    def run_path(i: int) -> int:
        d.run(f"run-{i}", lambda: i)
        return 1

    def raw_pipeline(_: int) -> int:
        pipe = client.pipeline(transaction=False)
        for j in range(200):  # two trivial scripts per message, 100 messages
            pipe.execute_command("EVALSHA", sha, 2, *keys, j, "b")
        pipe.execute()
        return 100

    def batch_path(i: int) -> int:
        claims = d.begin_many([f"batch-{i}-{j}" for j in range(100)])
        d.complete_many([(c, j) for j, c in enumerate(claims)])
        return 100

    d.run("dup", lambda: {"status": "charged"})

    def duplicate(_: int) -> int:
        d.begin("dup")
        return 1

    m = rates({"raw": raw, "scripts": raw_scripts, "run": run_path, "pipe": raw_pipeline,
               "batch": batch_path, "dup": duplicate}, seconds)

    d.run("memory-probe-order-00012345", lambda: {"status": "charged", "amount": 1250})
    stem = d.layout.stem("memory-probe-order-00012345")
    memory = sum(client.memory_usage(k) or 0 for k in (stem + ":started", stem + ":result"))
    cursor = 0
    while True:  # tidy up: the bench keys expire anyway, but do not leave 10^5 keys behind
        cursor, found = client.scan(cursor, match=f"{ns}:*", count=5000)
        if found:
            client.unlink(*found)
        if cursor == 0:
            break
    d.close()
    return {**m, "memory": float(memory)}


def report(m: dict[str, float], label: str) -> str:
    two_raw = m["raw"] / 2
    return "\n".join([
        f"[{label}]",
        f"  raw EVALSHA round trips          {m['raw']:>10,.0f} /s   ({1e6 / m['raw']:.0f} µs each)",
        f"  raw claim.lua+complete.lua       {m['scripts']:>10,.0f} msg/s  (the same scripts from redis-py, "
        f"no library: {two_raw / m['scripts']:.2f}x two trivial round trips)",
        f"  run() claim+handler+complete     {m['run']:>10,.0f} msg/s  = {m['scripts'] / m['run']:.2f}x the raw "
        f"scripts (target <= 1.25x), {two_raw / m['run']:.2f}x two trivial round trips",
        f"  raw pipelined EVALSHA (2/msg)    {m['pipe']:>10,.0f} msg/s",
        f"  begin_many+complete_many (100)   {m['batch']:>10,.0f} msg/s  = {m['batch'] / m['pipe']:.2f}x raw "
        f"pipeline (target >= 50,000 msg/s)",
        f"  duplicate hit (one round trip)   {m['dup']:>10,.0f} /s   = {m['dup'] / m['raw']:.2f}x raw",
        f"  Redis memory per completed key   {m['memory']:>10,.0f} bytes (MEMORY USAGE, both records)",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--seconds", type=float, default=3.0, help="per case, spread over 7 rounds")
    parser.add_argument("--label", default=f"pid {os.getpid()}, cpus {sorted(os.sched_getaffinity(0))}")
    args = parser.parse_args()
    print(report(measure(args.redis_url, args.seconds), args.label), flush=True)


if __name__ == "__main__":
    main()

"""Core protocol speed against a real Redis, with every baseline and peer measured in the same run.

    python -m bench.core [--redis-url URL] [--seconds S] [--label TEXT]

The cases take turns in short rounds (:func:`rates`), so a noisy neighbour hits them alike. Each
ratio is printed next to its baseline: ``run()`` (claim + complete, two scripts per message)
against two raw EVALSHA round trips of a trivial script and against the same two scripts called
straight from redis-py; a duplicate (one round trip) against one raw round trip and against
Powertools' duplicate; the batch path (``begin_many`` + ``complete_many`` of 100) against raw
pipelined EVALSHA (two trivial scripts per message); AWS Lambda Powertools' ``idempotent_function``
with its Redis persistence layer; Celery eager mode (plain, ``IdempotentTask``, celery-once's
``QueueOnce``); and Redis memory per completed key (``MEMORY USAGE`` of its records). Client CPU
time per message is printed too: on a shared machine wall time also measures the neighbours.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable

import redis

from bench.peers import celery_eager_cases, payload, powertools_cases, powertools_records
from dedupe_worker import Deduplicator

TRIVIAL = "return 1"


def rates(cases: dict[str, Callable[[int], int]], seconds: float, rounds: int = 15,
          cpu: dict[str, float] | None = None) -> dict[str, float]:
    """Messages per second of each ``fn(i) -> messages done``: the cases take turns in short
    rounds and each reports its median round, so a noisy neighbour hits every case alike.
    With ``cpu``, also fills in each case's median client CPU seconds per message."""
    for fn in cases.values():  # warm-up: connections, script cache
        for i in range(20):
            fn(-1 - i)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    cpu_samples: dict[str, list[float]] = {name: [] for name in cases}
    counter = 0
    for _ in range(rounds):
        for name, fn in cases.items():
            done = 0
            start, cpu_start = time.perf_counter(), time.process_time()
            while (elapsed := time.perf_counter() - start) < seconds / rounds:
                done += fn(counter)
                counter += 1
            samples[name].append(done / elapsed)
            cpu_samples[name].append((time.process_time() - cpu_start) / done)
    if cpu is not None:
        cpu.update({name: statistics.median(values) for name, values in cpu_samples.items()})
    return {name: statistics.median(values) for name, values in samples.items()}


def completed_key_memory(d: Deduplicator, client: redis.Redis) -> float:
    """``MEMORY USAGE`` (bytes) of every record one completed key leaves, in the format ``d``
    writes: the probe ``tests/test_record_format.py`` holds to its target too."""
    d.run("memory-probe-order-00012345", lambda: {"status": "charged", "amount": 1250})
    stem = d.layout.stem("memory-probe-order-00012345")
    return float(sum(client.memory_usage(k) or 0 for k in (stem + ":started", stem, stem + ":result")))


def raw_script_shas(client: redis.Redis) -> tuple[str, str] | None:
    """The SHAs of claim.lua and complete.lua as our path sends them, loaded here: on Redis 7+ our
    own path calls the Functions library (FCALL), so the EVALSHA scripts need not be on the server.
    None for code from before the ``_protocol`` package (``make bench BASELINE=70ba3a8``); the
    scripts' loader is in ``_transport`` now and was in ``_protocol`` before (b977d1e)."""
    try:
        from dedupe_worker._transport.script_flow import script_text, takes_flags
        from dedupe_worker._transport.scripts import load_script
    except ImportError:  # the modules' home before the _transport package
        try:
            from dedupe_worker._protocol.script_flow import script_text, takes_flags  # type: ignore[no-redef]
            from dedupe_worker._protocol.scripts import load_script  # type: ignore[no-redef]
        except ImportError:
            return None
    flags = takes_flags(client.info("server"))
    claim, complete = (client.script_load(script_text(load_script(name), flags)) for name in ("claim", "complete"))
    return claim, complete


def measure(url: str, seconds: float) -> tuple[dict[str, float], dict[str, float]]:
    """``(messages per second, client CPU seconds per message)`` of every case, and ``memory``."""
    client = redis.Redis.from_url(url)
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    d = Deduplicator(client, namespace=ns, lease=30, result_ttl=600)
    sha = client.script_load(TRIVIAL)
    keys = (f"{ns}:{{raw}}:started", f"{ns}:{{raw}}:result")

    def raw(_: int) -> int:
        client.evalsha(sha, 2, *keys, "a", "b")
        return 1

    held = client.connection_pool.get_connection()
    trivial = held.pack_command("EVALSHA", sha, 2, *keys, "a", "b")

    def raw_held(_: int) -> int:
        """The floor: the trivial script on a connection kept out of the pool (as our path does)."""
        held.send_packed_command(trivial)
        held.read_response()
        return 1

    shas = raw_script_shas(client)

    def raw_scripts(i: int) -> int:
        """The same two scripts, called straight from redis-py: what run() costs without us."""
        assert shas is not None
        claim_sha, complete_sha = shas
        stem = f"{ns}:{{raw-{i}}}"
        started, result = stem + ":started", stem + ":result"
        token = client.evalsha(claim_sha, 3, started, stem, result, 30000, 600000, "", "")[1]
        client.evalsha(complete_sha, 4, started, stem, result, stem + ":notice", 600000, token, "c", b"1")
        return 1

    def run_path(i: int) -> int:
        d.run(f"order-{i}", lambda: {"status": "charged"})
        return 1

    def run_fingerprint(i: int) -> int:
        body = payload(i)
        d.run(f"fp-order-{i}", lambda: {"status": "charged"}, fingerprint=body)
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

    d.run("order--1", lambda: {"status": "charged"})

    def duplicate(_: int) -> int:
        d.run("order--1", lambda: {"status": "charged"})
        return 1

    cpu: dict[str, float] = {}
    m = rates({"raw": raw, "raw held": raw_held, **({"scripts": raw_scripts} if shas else {}), "run": run_path,
               "run fp": run_fingerprint,
               "dup": duplicate, "pipe": raw_pipeline, "batch": batch_path,
               **powertools_cases(client, ns), **celery_eager_cases(url, ns)}, seconds, cpu=cpu)
    m["powertools records"] = float(powertools_records(client, ns))

    m["memory"] = completed_key_memory(d, client)
    for pattern in (f"{ns}:*", "qo_bench.once*"):  # the bench keys expire anyway: do not leave 10^5 behind
        batch = []
        for key in client.scan_iter(pattern, count=5000):
            batch.append(key)
            if len(batch) >= 5000:
                client.unlink(*batch)
                batch = []
        if batch:
            client.unlink(*batch)
    d.close()
    client.connection_pool.release(held)
    return m, cpu


def report(m: dict[str, float], cpu: dict[str, float], label: str) -> str:
    def us(name: str) -> str:
        return f"{1e6 / m[name]:6.0f} µs ({1e6 * cpu[name]:4.0f} µs CPU)"

    def overhead(name: str) -> float:
        return 1e6 * (1 / m[name] - 1 / m["eager plain"])

    two_raw = m["raw"] / 2
    ours, once = overhead("eager Idempotent"), overhead("eager QueueOnce")
    return "\n".join([
        f"[{label}]  per message: wall (client CPU); ratios are times, lower is faster unless noted",
        f"  raw EVALSHA round trip (trivial)  {us('raw')}  (client.evalsha: the baseline below)",
        f"  the same on a held connection     {us('raw held')}  (no pool get/release: the floor)",
        *([f"  raw claim.lua+complete.lua        {us('scripts')}  = {two_raw / m['scripts']:.2f}x two raw round trips"]
          if "scripts" in m else []),
        f"  run(), first seen                 {us('run')}  = {two_raw / m['run']:.2f}x two raw round trips "
        f"(target <= 1.3x); {m['raw held'] / 2 / m['run']:.2f}x two on a held connection"
        + (f"; {m['scripts'] / m['run']:.2f}x the raw scripts" if "scripts" in m else ""),
        f"  run() with a fingerprint          {us('run fp')}  = {two_raw / m['run fp']:.2f}x two raw round trips",
        f"  Powertools idempotent_function    {us('powertools')}  -> run() is "
        f"{m['run'] / m['powertools']:.2f}x as fast, with a fingerprint {m['run fp'] / m['powertools']:.2f}x "
        f"({m['powertools records']:.0f} Powertools records in Redis)",
        f"  run() duplicate (one round trip)  {us('dup')}  = {m['raw'] / m['dup']:.2f}x one raw round trip",
        f"  Powertools duplicate              {us('powertools dup')}  -> our duplicate is "
        f"{m['dup'] / m['powertools dup']:.2f}x as fast",
        f"  raw pipelined EVALSHA (2/msg)     {us('pipe')}  = {m['pipe']:,.0f} msg/s",
        f"  begin_many+complete_many (100)    {us('batch')}  = {m['batch']:,.0f} msg/s, "
        f"{m['batch'] / m['pipe']:.2f}x the raw pipeline's throughput (target >= 0.8x)",
        f"  Celery eager plain task           {us('eager plain')}",
        f"  Celery eager IdempotentTask       {us('eager Idempotent')}  overhead {ours:5.0f} µs",
        f"  Celery eager QueueOnce            {us('eager QueueOnce')}  overhead {once:5.0f} µs"
        f"  -> ours / QueueOnce's = {ours / once if once > 0 else float('nan'):.2f} (target <= 1)",
        f"  Redis memory per completed key    {m['memory']:6.0f} bytes (MEMORY USAGE, every record; target <= 144)",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--seconds", type=float, default=2.0, help="per case, spread over 15 rounds")
    parser.add_argument("--label", default=f"pid {os.getpid()}, cpus {sorted(os.sched_getaffinity(0))}")
    args = parser.parse_args()
    print(report(*measure(args.redis_url, args.seconds), args.label), flush=True)


if __name__ == "__main__":
    main()

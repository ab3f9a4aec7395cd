"""Compressed results: Redis memory per completed key holding a ~10 KB JSON result, stored plain
and compressed (zlib, and zstd where installed), and the CPU each costs to encode and decode.

    python -m bench.compression [--redis-url URL] [--keys N] [--size BYTES]

Memory is ``MEMORY USAGE`` (``SAMPLES 0``: exact) summed over every record of each key, averaged
over ``N`` keys completed through a real :class:`~dedupe_worker.Deduplicator` (one namespace per
codec, deleted afterwards). CPU is what the client spends per result, median of several rounds:
``encode`` (JSON dump, then compress) and ``decode`` (decompress, then JSON parse), the way a
completion and a duplicate's answer pay them. Read-only on the server apart from its own keys.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

import redis

from dedupe_worker import Deduplicator
from dedupe_worker._protocol.claim import Claim, Outcome
from dedupe_worker._protocol.serialization import CODECS


def result(size: int) -> dict[str, Any]:
    """An order with as many lines as make about ``size`` bytes of JSON: what a handler returns."""
    lines = max(1, size // 85)
    return {"order": "o-1", "lines": [{"sku": f"SKU-{i:05d}", "name": f"widget number {i}", "qty": i % 7,
                                       "price": round(i * 1.25, 2), "tags": ["blue", "large"]}
                                      for i in range(lines)]}


def memory_per_key(client: redis.Redis, dedupe: Deduplicator, value: Any, keys: int) -> tuple[float, int]:
    """Mean ``MEMORY USAGE`` of one completed key's records, and the stored value's length."""
    names = [f"order-{i}" for i in range(keys)]
    for name in names:
        dedupe.run(name, lambda: value)
    total = 0
    for record in client.scan_iter(match=f"{dedupe.layout.namespace}:*", count=1000):
        total += int(client.memory_usage(record, samples=0) or 0)
    stored = dedupe.store.inspect(dedupe.request(names[0]).stem).value
    for record in client.scan_iter(match=f"{dedupe.layout.namespace}:*", count=1000):
        client.unlink(record)
    return total / keys, len(stored or b"")


def cpu_per_result(dedupe: Deduplicator, value: Any, rounds: int = 7, calls: int = 200) -> tuple[float, float]:
    """Median microseconds per encode and per decode of ``value``."""
    claim = Claim("k", Outcome.ACQUIRED, 1)
    data = dedupe.encode(claim, value)[1]
    encodes, decodes = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            dedupe.encode(claim, value)
        encodes.append((time.perf_counter() - start) / calls * 1e6)
        start = time.perf_counter()
        for _ in range(calls):
            dedupe.decode(data)
        decodes.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(encodes), statistics.median(decodes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--size", type=int, default=10_000, help="bytes of JSON per result (about)")
    args = parser.parse_args(argv)
    client = redis.Redis.from_url(args.redis_url)
    value = result(args.size)
    print(f"bench.compression: {args.keys} keys, result of {len(Deduplicator(client).serializer.dumps(value))} "
          f"bytes of JSON, Redis {client.info('server')['redis_version']}")
    print(f"{'stored as':<28}{'stored bytes':>14}{'MEMORY USAGE/key':>18}{'encode µs':>12}{'decode µs':>12}")
    cases: list[tuple[str, dict[str, Any]]] = [("plain JSON (before)", {"compress_above": None})]
    cases += [(f"{codec} (compress_above=1024)", {"compression": codec}) for codec in ("zlib", "zstd")
              if codec in CODECS]
    for label, options in cases:
        dedupe = Deduplicator(client, namespace=f"bench-zip-{uuid.uuid4().hex[:8]}", result_ttl=600,
                              allow_eviction=True, **options)
        memory, stored = memory_per_key(client, dedupe, value, args.keys)
        encode, decode = cpu_per_result(dedupe, value)
        print(f"{label:<28}{stored:>14}{memory:>18.0f}{encode:>12.1f}{decode:>12.1f}")
        dedupe.close()
    if "zstd" not in CODECS:
        print("zstd: not installed (pip install 'dedupe-worker[zstd]')")
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the held connection is worth: the per-message and batch paths with it and without it.

    python -m bench.held_connection [--redis-url URL] [--seconds S]

Two :class:`~dedupe_worker.Deduplicator` objects on the same Redis take turns in short rounds
(:func:`bench.core.rates`, medians of 15 rounds, so a noisy neighbour hits both alike): one on a
client whose pool lets the runner hold a connection, one on a client whose pool is too small for
it (the plain redis-py pool path). Cases: ``run()`` first seen (two scripts, two round trips), a
duplicate (one round trip), ``begin_many`` + ``complete_many`` of 100 (pipelined) and
``decide_many`` of 100 (the streamed claim round trip, handlers run while replies arrive). Printed:
wall and client CPU per message for each, and the held path's time as a share of the pool path's.
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Callable

import redis

from bench.core import rates
from dedupe_worker import Deduplicator, decide_many


def cases(client: redis.Redis, label: str) -> dict[str, Callable[[int], int]]:
    """The four cases on a Deduplicator of ``client``, each name prefixed with ``label``."""
    ns = f"bench-held-{uuid.uuid4().hex[:8]}"
    d = Deduplicator(client, namespace=ns, lease=30, result_ttl=60)
    d.run("dup", lambda: 1)

    def run_path(i: int) -> int:
        d.run(f"run-{i}", lambda: 1)
        return 1

    def duplicate(_: int) -> int:
        d.run("dup", lambda: 1)
        return 1

    def batch(i: int) -> int:
        claims = d.begin_many([f"batch-{i}-{j}" for j in range(100)])
        d.complete_many([(c, j) for j, c in enumerate(claims)])
        return 100

    def many(i: int) -> int:
        decide_many(d, [(f"many-{i}-{j}", None, lambda: 1) for j in range(100)])
        return 100

    return {f"{label} run": run_path, f"{label} dup": duplicate, f"{label} batch": batch,
            f"{label} decide_many": many}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--seconds", type=float, default=2.0, help="per case, spread over 15 rounds")
    parser.add_argument("--label", default=f"pid {os.getpid()}, cpus {sorted(os.sched_getaffinity(0))}")
    args = parser.parse_args()
    held = redis.Redis.from_url(args.redis_url)  # redis-py's default pool: the runner holds one
    plain = redis.Redis.from_url(args.redis_url, max_connections=8)  # too small to hold one of
    cpu: dict[str, float] = {}
    m = rates({**cases(held, "held"), **cases(plain, "pool")}, args.seconds, cpu=cpu)
    print(f"[{args.label}]  per message: wall (client CPU); held/pool = held path's wall time as a share")
    for case in ("run", "dup", "batch", "decide_many"):
        h, p = m[f"held {case}"], m[f"pool {case}"]
        print(f"  {case:<12} held {1e6 / h:7.1f} µs ({1e6 * cpu[f'held {case}']:5.1f} µs CPU)   "
              f"pool {1e6 / p:7.1f} µs ({1e6 * cpu[f'pool {case}']:5.1f} µs CPU)   held/pool {p / h:.2f}", flush=True)


if __name__ == "__main__":
    main()

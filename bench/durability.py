"""The cost of ``wait_replicas=1``: ``run()`` with ``WAIT 1`` in the same round trip as each claim and
completion, as a ratio to the same path without it, on a private primary and replica started here.

    python -m bench.durability [--messages N] [--rounds R]

Both variants run against the same primary in the same run; the replica is local, so the ratio
prices the replication acknowledgement on loopback (a remote replica adds its network round trip).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
import uuid

import redis

from bench.ratios import print_ratios
from dedupe_worker import Deduplicator


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(port: int, *extra: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tempfile.mkdtemp(), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    raise TimeoutError(f"redis-server on {port} did not start")


def measure(dedupe: Deduplicator, count: int) -> float:
    prefix = uuid.uuid4().hex[:8]
    began = time.perf_counter()
    for i in range(count):
        dedupe.run(f"{prefix}-{i}", lambda: None)
    return count / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    primary_port, replica_port = free_port(), free_port()
    procs = [start(primary_port), start(replica_port, "--replicaof", "127.0.0.1", str(primary_port))]
    try:
        client = redis.Redis(port=primary_port)
        while client.info("replication").get("slave0", {}).get("state") != "online":
            time.sleep(0.05)
        variants = {"no WAIT": Deduplicator(client, namespace="bench-wait"),
                    "WAIT 1": Deduplicator(client, namespace="bench-wait", wait_replicas=1, wait_timeout=1.0)}
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, dedupe in variants.items():
                rates[name].append(measure(dedupe, args.messages))
        print(f"run() with wait_replicas=1 (local primary and replica) {args.label}", flush=True)
        print_ratios("run()", rates, "no WAIT", args.messages)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


if __name__ == "__main__":
    main()

"""``make bench``: every benchmark, each against a baseline measured in the same run.

The core bench runs twice when the Redis server is local and ``taskset`` exists: with Redis and
the client pinned to the same vCPU, and to different vCPUs (round trips differ 3-10x between the
two on this kind of machine, so only numbers from one placement are compared with each other).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import redis

BENCHES = ("bench.core", "bench.asyncio_paths", "bench.celery_tasks", "bench.rabbitmq_consumer",
           "bench.kafka_consumer", "bench.frameworks", "bench.replay", "bench.settle", "bench.durability")


def redis_pid(url: str) -> int | None:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        info = client.info("server")
    except redis.RedisError:
        return None
    pid = int(info.get("process_id", 0))
    return pid if pid and os.path.exists(f"/proc/{pid}") else None


def run(module: str, cpu: int | None = None, label: str = "") -> int:
    cmd = [sys.executable, "-m", module, *(["--label", label] if label else [])]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    print(f"\n$ {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd).returncode


def main() -> int:
    url = os.environ.get("DEDUPE_REDIS_URL", "redis://127.0.0.1:6379/0")
    pid = redis_pid(url)
    cpus = sorted(os.sched_getaffinity(0))
    failures = 0
    if pid and shutil.which("taskset") and len(cpus) >= 2:
        original = subprocess.run(["taskset", "-p", str(pid)], capture_output=True, text=True).stdout.split()[-1]
        try:
            subprocess.run(["taskset", "-p", "-c", str(cpus[0]), str(pid)], check=True, capture_output=True)
            failures += run("bench.core", cpus[0], f"Redis and client on vCPU {cpus[0]}") != 0
            failures += run("bench.core", cpus[1], f"Redis on vCPU {cpus[0]}, client on vCPU {cpus[1]}") != 0
        finally:
            subprocess.run(["taskset", "-p", original, str(pid)], capture_output=True)
    else:
        failures += run("bench.core", label="unpinned (Redis not local, or no taskset)") != 0
    for module in BENCHES[1:]:
        failures += run(module) != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

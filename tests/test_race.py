"""Many threads and several processes hit one key at once: the work runs once."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid

import redis

from dedupe_worker import Deduplicator, InProgress, Outcome


def test_fifty_threads_one_key_one_acquisition(redis_client: redis.Redis, namespace: str) -> None:
    d = Deduplicator(redis_client, namespace=namespace, lease=10)
    barrier = threading.Barrier(60)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def contend() -> None:
        barrier.wait()
        claim = d.begin("hot-key", fingerprint="same")
        with lock:
            outcomes.append(claim.outcome)

    threads = [threading.Thread(target=contend) for _ in range(60)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count(Outcome.ACQUIRED) == 1
    assert outcomes.count(Outcome.IN_PROGRESS) == 59


def _process_worker(url: str, namespace: str, counter: str, start: multiprocessing.synchronize.Event) -> None:
    client = redis.Redis.from_url(url)
    d = Deduplicator(client, namespace=namespace, lease=10)
    start.wait()
    deadline = time.monotonic() + 30  # keep delivering until the outcome is stored
    while time.monotonic() < deadline:
        try:
            d.run("hot-key", lambda: client.incr(counter))
            break
        except InProgress:
            time.sleep(0.001)
    d.close()


def test_threads_in_several_processes_apply_once(redis_url: str, namespace: str) -> None:
    client = redis.Redis.from_url(redis_url)
    counter = f"{namespace}:effects:{uuid.uuid4().hex}"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_process_worker, args=(redis_url, namespace, counter, start)) for _ in range(4)]
    for p in procs:
        p.start()
    d = Deduplicator(client, namespace=namespace, lease=10)
    barrier = threading.Barrier(50)
    results: list[object] = []

    def thread_worker() -> None:
        barrier.wait()
        deadline = time.monotonic() + 30  # a busy machine may hold the first run a while
        while time.monotonic() < deadline:
            try:
                results.append(d.run("hot-key", lambda: client.incr(counter)))
                return
            except InProgress:
                time.sleep(0.001)

    threads = [threading.Thread(target=thread_worker) for _ in range(50)]
    start.set()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert int(client.get(counter) or 0) == 1
    assert results == [1] * 50
    client.delete(counter)

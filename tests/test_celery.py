"""IdempotentTask on a real ``celery worker`` (prefork, concurrency 2), RabbitMQ broker, Redis store."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery, chain
from celery.result import AsyncResult

from dedupe_worker import Deduplicator, KeyConflict, PreviouslyFailed

from . import celery_fixtures
from .celery_fixtures import PermanentError, WorkerProcess, delete_queue, effects, make_app

# The fixtures this module uses, from a conftest-free fixtures module.
celery_config = celery_fixtures.celery_config
celery_app = celery_fixtures.celery_app
worker_process = celery_fixtures.worker_process

TIMEOUT = 30


def wait_until(check: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def count(app: Celery, *parts: Any) -> int:
    with effects(app) as r:
        return int(r.get(":".join(["fx", app.conf.dedupe_namespace, *map(str, parts)])) or 0)


def holder(app: Celery, redis_url: str, lease: float) -> Deduplicator:
    """Another "worker" claiming keys in the same namespace, without renewing its leases."""
    return Deduplicator(redis.Redis.from_url(redis_url), namespace=app.conf.dedupe_namespace, lease=lease,
                        result_ttl=60)


def test_same_task_sent_three_times_runs_once(celery_app: Celery, worker_process: WorkerProcess) -> None:
    charge = celery_app.tasks["dt.charge"]
    results = [charge.delay(1, 100).get(timeout=TIMEOUT) for _ in range(3)]

    assert results[0] == results[1] == results[2]
    assert results[0]["fencing_token"] == results[0]["claim_token"] >= 1
    assert count(celery_app, "charge", 1) == 1
    assert count(celery_app, "charge-started", 1) == 1
    assert count(celery_app, "duplicates") == 2


def test_concurrent_copies_on_prefork_worker_run_once(celery_app: Celery,
                                                      worker_process: WorkerProcess) -> None:
    charge = celery_app.tasks["dt.charge"]
    # The body runs 3 s, longer than the 2 s lease: only the heartbeat keeps the claim, so
    # a deferred copy coming back after 2 s must find it still held.
    pending = [charge.delay(2, 200, delay=3.0) for _ in range(3)]
    results = [p.get(timeout=TIMEOUT) for p in pending]

    assert results[0] == results[1] == results[2]
    assert results[0]["fencing_token"] > 0
    assert count(celery_app, "charge", 2) == 1
    assert count(celery_app, "charge-started", 2) == 1
    # The copy that reached the second pool process while the first ran was deferred, which
    # charge's max_retries=0 would have refused had deferrals counted as retries.
    assert count(celery_app, "deferrals") >= 1
    assert all(p.state == "SUCCESS" for p in pending)


def test_pool_process_killed_mid_task_is_redelivered_and_applied_once(
        celery_app: Celery, worker_process: WorkerProcess, redis_url: str) -> None:
    charge = celery_app.tasks["dt.charge"]
    pending = charge.delay(3, 300, delay=4.0)
    with effects(celery_app) as r:
        pid = int(wait_until(lambda: r.get(f"fx:{celery_app.conf.dedupe_namespace}:charge-pid:3"),
                             what="the task to start"))
    assert pid != worker_process.proc.pid  # a pool child, not the worker's main process
    killed = holder(celery_app, redis_url, lease=30).status("charge:3").token
    os.kill(pid, signal.SIGKILL)

    result = pending.get(timeout=TIMEOUT)

    assert count(celery_app, "charge-started", 3) == 2  # the killed run and the redelivery
    assert count(celery_app, "charge", 3) == 1  # the effect once
    assert result["fencing_token"] > killed  # the redelivery claimed after the dead lease ran out
    assert "SIGKILL" in worker_process.output() or "WorkerLostError" in worker_process.output()


def test_in_progress_elsewhere_is_deferred_without_spending_max_retries(
        celery_app: Celery, worker_process: WorkerProcess, redis_url: str) -> None:
    other = holder(celery_app, redis_url, lease=1.5)
    held = other.begin("charge:4")
    assert held.acquired

    result = celery_app.tasks["dt.charge"].delay(4, 400).get(timeout=TIMEOUT)  # max_retries=0

    assert result["fencing_token"] > held.token
    assert count(celery_app, "deferrals") >= 1  # waited 0.5 s (defer_wait), then re-sent
    with effects(celery_app) as r:
        countdowns = [float(c) for c in r.lrange(f"fx:{celery_app.conf.dedupe_namespace}:countdowns", 0, -1)]
    assert countdowns[0] <= 0.06  # a short backoff, tens of milliseconds at first
    assert all(c <= 1.51 for c in countdowns)  # never past the other worker's lease
    assert count(celery_app, "charge", 4) == 1


def test_deferred_task_returns_what_the_holder_stored(celery_app: Celery, worker_process: WorkerProcess,
                                                     redis_url: str) -> None:
    other = holder(celery_app, redis_url, lease=3)
    held = other.begin("charge:5")
    pending = celery_app.tasks["dt.charge"].delay(5, 500)
    wait_until(lambda: count(celery_app, "deferrals") >= 1, what="a deferral")
    other.complete(held, {"stored": "by the holder"})

    assert pending.get(timeout=TIMEOUT) == {"stored": "by the holder"}
    assert count(celery_app, "charge-started", 5) == 0


def test_a_copy_sent_while_the_holder_works_returns_its_result_as_soon_as_it_is_stored(
        celery_app: Celery, worker_process: WorkerProcess) -> None:
    slow = celery_app.tasks["dt.slow"]
    first = slow.delay("s1", 1.5)
    wait_until(lambda: count(celery_app, "slow", "s1") == 1, what="the holder started")
    copy = slow.delay("s1", 1.5)  # the other pool process takes it while the first one works
    ready: dict[str, float] = {}
    deadline = time.monotonic() + TIMEOUT
    while len(ready) < 2 and time.monotonic() < deadline:
        for name, result in (("first", first), ("copy", copy)):
            if name not in ready and result.ready():
                ready[name] = time.monotonic()
        time.sleep(0.01)
    assert copy.get(timeout=1) == first.get(timeout=1)
    assert ready["copy"] - ready["first"] < 0.5
    assert count(celery_app, "slow", "s1") == 1
    assert count(celery_app, "deferrals") == 0  # it waited on the key instead of being re-sent


def test_failing_body_releases_claim_so_autoretry_claims_again(celery_app: Celery,
                                                               worker_process: WorkerProcess) -> None:
    result = celery_app.tasks["dt.flaky"].delay("j1", fail_times=2).get(timeout=TIMEOUT)

    assert result == {"attempt": 3, "retries": 2}
    assert count(celery_app, "flaky", "j1") == 3
    # A later copy is a duplicate of the successful attempt.
    assert celery_app.tasks["dt.flaky"].delay("j1", fail_times=2).get(timeout=TIMEOUT) == result
    assert count(celery_app, "flaky", "j1") == 3


def test_exhausted_retries_fail_with_the_body_error_and_leave_the_key_free(
        celery_app: Celery, worker_process: WorkerProcess) -> None:
    pending = celery_app.tasks["dt.flaky"].delay("j2", fail_times=100)
    with pytest.raises(ValueError, match="attempt 4 fails"):
        pending.get(timeout=TIMEOUT)
    assert count(celery_app, "flaky", "j2") == 4  # first run + max_retries=3
    again = celery_app.tasks["dt.flaky"].delay("j2", fail_times=100)
    with pytest.raises(ValueError, match="attempt 8 fails"):
        again.get(timeout=TIMEOUT)


def test_a_plain_exception_is_retried_until_max_attempts(celery_app: Celery, worker_process: WorkerProcess) -> None:
    plain = celery_app.tasks["dt.plain"]
    assert plain.delay("p1", fail_times=2).get(timeout=TIMEOUT) == {"attempt": 3, "retries": 2}
    with pytest.raises(ConnectionError, match="attempt 3 fails"):
        plain.delay("p2", fail_times=100).get(timeout=TIMEOUT)
    assert count(celery_app, "plain", "p2") == 3  # max_attempts=3, then it fails for good
    assert plain.delay("p1", fail_times=2).get(timeout=TIMEOUT) == {"attempt": 3, "retries": 2}  # duplicate


def test_self_retry_in_body_runs_again(celery_app: Celery, worker_process: WorkerProcess) -> None:
    assert celery_app.tasks["dt.by_hand"].delay("j3").get(timeout=TIMEOUT) == 2
    assert count(celery_app, "by_hand", "j3") == 2


def test_permanent_failure_is_stored_and_not_retried(celery_app: Celery,
                                                     worker_process: WorkerProcess) -> None:
    doomed = celery_app.tasks["dt.doomed"]
    with pytest.raises(PermanentError):
        doomed.delay("j4").get(timeout=TIMEOUT)
    second = doomed.delay("j4")
    # the JSON result backend rebuilds it from its args: the real class, key and stored error
    with pytest.raises(PreviouslyFailed, match=r"failed permanently before.*j4 can never work") as info:
        second.get(timeout=TIMEOUT)
    assert info.value.key and "j4 can never work" in info.value.error["message"]

    assert second.state == "FAILURE"
    assert count(celery_app, "doomed", "j4") == 1


def test_conflicting_payload_fails_without_retry(celery_app: Celery, worker_process: WorkerProcess) -> None:
    charge = celery_app.tasks["dt.charge"]
    charge.delay(6, 600).get(timeout=TIMEOUT)
    conflicting = charge.delay(6, 999)
    with pytest.raises(KeyConflict):
        conflicting.get(timeout=TIMEOUT)

    assert conflicting.state == "FAILURE"
    assert count(celery_app, "charge-started", 6) == 1
    assert count(celery_app, "deferrals") == 0


def test_key_from_message_header(celery_app: Celery, worker_process: WorkerProcess) -> None:
    tagged = celery_app.tasks["dt.tagged"]
    first = tagged.apply_async(("a",), headers={"idempotency_key": "hk-1"}).get(timeout=TIMEOUT)
    again = tagged.apply_async(("a",), headers={"idempotency_key": "hk-1"}).get(timeout=TIMEOUT)
    other = tagged.apply_async(("a",), headers={"idempotency_key": "hk-2"}).get(timeout=TIMEOUT)
    default = tagged.delay("a").get(timeout=TIMEOUT)

    assert first == again == "a:hk-1"
    assert other == "a:hk-2"
    assert default.startswith("a:dt.tagged:")
    assert count(celery_app, "tagged", "a") == 3


def test_header_key_survives_a_deferral(celery_app: Celery, worker_process: WorkerProcess,
                                        redis_url: str) -> None:
    held = holder(celery_app, redis_url, lease=1.0).begin("hk-3")
    assert held.acquired
    result = celery_app.tasks["dt.tagged"].apply_async(("b",), headers={"idempotency_key": "hk-3"})

    assert result.get(timeout=TIMEOUT) == "b:hk-3"
    assert count(celery_app, "deferrals") >= 1


def test_chain_with_a_duplicate_link_passes_the_stored_result_on(
        celery_app: Celery, worker_process: WorkerProcess) -> None:
    charge, total = celery_app.tasks["dt.charge"], celery_app.tasks["dt.total"]
    first = chain(charge.s(7, 21), total.s()).apply_async().get(timeout=TIMEOUT)
    second = chain(charge.s(7, 21), total.s()).apply_async().get(timeout=TIMEOUT)

    assert first == second == 42
    assert count(celery_app, "charge", 7) == 1
    assert count(celery_app, "total", 7) == 2  # the plain link after it ran both times


def test_redis_unreachable_defers_until_it_is_back(celery_config: dict[str, Any], private_redis: Any,
                                                   tmp_path: Any) -> None:
    config = {**celery_config, "store_url": private_redis.url}
    app = make_app(**config)
    worker = WorkerProcess(config, tmp=tmp_path).wait_ready()
    try:
        private_redis.stop()
        pending: AsyncResult = app.tasks["dt.charge"].delay(8, 800)
        wait_until(lambda: count(app, "deferrals") >= 2, what="deferrals while Redis is down")
        assert count(app, "charge-started", 8) == 0  # not run without the store
        private_redis.start()

        assert pending.get(timeout=TIMEOUT)["order_id"] == 8
        assert count(app, "charge", 8) == 1
    finally:
        worker.stop()
        delete_queue(app, config["queue"])
        app.close()


"""Celery apps, tasks and workers for ``tests/test_celery*.py`` (RabbitMQ broker, Redis backend).

Every test gets its own namespace (dedupe keys and side-effect counters) and its own queue, so
test modules running at the same time never see each other's tasks. Side effects are counted with
``INCR`` on ``fx:<namespace>:...`` keys, outside the task's own dedupe records.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from dedupe_worker import Action, Decision, current_claim
from dedupe_worker.celery import IdempotentTask

from . import services

__all__ = ["CONFIG_ENV", "WorkerProcess", "effects", "make_app"]

#: Environment variable through which a worker subprocess receives its app's settings.
CONFIG_ENV = "DEDUPE_TEST_CELERY"
ROOT = Path(__file__).resolve().parent.parent


class PermanentError(Exception):
    """Raised by ``dt.doomed``; configured as permanent."""


def effects(app: Celery) -> redis.Redis:
    """A client for the side-effect counters of ``app``'s test."""
    return redis.Redis.from_url(app.conf.dedupe_test_redis_url, decode_responses=True)


def fx(app: Celery, *parts: Any) -> str:
    return ":".join(["fx", app.conf.dedupe_namespace, *map(str, parts)])


class RecordingTask(IdempotentTask):
    """Counts deferrals and duplicates where the test can see them."""

    def on_deferred(self, message: Any, decision: Decision, delay: float) -> None:
        if decision.action is not Action.DEFER:
            return  # a retry after a failing body, not a deferral
        with effects(self.app) as r:
            r.incr(fx(self.app, "deferrals"))
            r.rpush(fx(self.app, "countdowns"), delay)

    def on_duplicate(self, message: Any, decision: Decision) -> None:
        with effects(self.app) as r:
            r.incr(fx(self.app, "duplicates"))


def make_app(*, broker: str, backend: str, namespace: str, queue: str, lease: float = 2.0,
             eager: bool = False, store_url: str | None = None) -> Celery:
    """A Celery app with the test tasks (names ``dt.*``) routed to ``queue``.

    ``shared=False``: a shared task would be registered on every app created later in the same
    process, and those apps would run the first app's closures (its namespace, its counters).
    """
    app = Celery(f"dt-{namespace}", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_always_eager=eager,
        task_eager_propagates=True,
        result_expires=300,
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        dedupe_redis_url=store_url or backend,
        dedupe_namespace=namespace,
        dedupe_lease=lease,
        dedupe_result_ttl=120,
        dedupe_test_redis_url=backend,
        dedupe_permanent_errors=(PermanentError,),
    )

    @app.task(base=RecordingTask, bind=True, shared=False, name="dt.charge", max_retries=0, dedupe_defer_wait=0.5,
              idempotency_key=lambda order_id, **_: f"charge:{order_id}")
    def charge(self: IdempotentTask, order_id: int, amount: int, delay: float = 0.0) -> dict[str, Any]:
        with effects(app) as r:
            r.incr(fx(app, "charge-started", order_id))
            r.set(fx(app, "charge-pid", order_id), os.getpid())
            time.sleep(delay)
            r.incr(fx(app, "charge", order_id))
        claim = current_claim()
        return {"order_id": order_id, "amount": amount, "fencing_token": self.request.fencing_token,
                "claim_token": claim.token if claim else None}

    @app.task(base=RecordingTask, bind=True, shared=False, name="dt.flaky", autoretry_for=(ValueError,),
              max_retries=3, default_retry_delay=0.1, retry_backoff=False)
    def flaky(self: IdempotentTask, job: str, fail_times: int) -> dict[str, Any]:
        with effects(app) as r:
            attempt = r.incr(fx(app, "flaky", job))
        if attempt <= fail_times:
            raise ValueError(f"attempt {attempt} fails")
        return {"attempt": attempt, "retries": self.request.retries}

    @app.task(base=RecordingTask, bind=True, shared=False, name="dt.plain", dedupe_max_attempts=3,
              dedupe_retry_base=0.05, dedupe_retry_cap=0.1)
    def plain(self: IdempotentTask, job: str, fail_times: int) -> dict[str, Any]:
        """Fails with no Celery retry option: IdempotentTask's max_attempts retries it."""
        with effects(app) as r:
            attempt = r.incr(fx(app, "plain", job))
        if attempt <= fail_times:
            raise ConnectionError(f"attempt {attempt} fails")
        return {"attempt": attempt, "retries": self.request.retries}

    @app.task(base=RecordingTask, bind=True, shared=False, name="dt.slow",
              idempotency_key=lambda job, **_: f"slow:{job}")
    def slow(self: IdempotentTask, job: str, seconds: float) -> dict[str, Any]:
        """Default options (defer_wait 5 s): a copy sent meanwhile waits on the key."""
        with effects(app) as r:
            r.incr(fx(app, "slow", job))
        time.sleep(seconds)
        return {"job": job, "pid": os.getpid()}

    @app.task(base=RecordingTask, bind=True, shared=False, name="dt.by_hand", max_retries=2)
    def by_hand(self: IdempotentTask, job: str) -> int:
        with effects(app) as r:
            attempt = r.incr(fx(app, "by_hand", job))
        if attempt == 1:
            raise self.retry(countdown=0.1, exc=RuntimeError("first attempt"))
        return attempt

    @app.task(base=RecordingTask, bind=True, shared=False, name="dt.doomed")
    def doomed(self: IdempotentTask, job: str) -> None:
        with effects(app) as r:
            r.incr(fx(app, "doomed", job))
        raise PermanentError(f"{job} can never work")

    @app.task(base=RecordingTask, bind=True, shared=False, name="dt.tagged", dedupe_defer_wait=0.2)
    def tagged(self: IdempotentTask, tag: str) -> str:
        with effects(app) as r:
            r.incr(fx(app, "tagged", tag))
        return f"{tag}:{self.request.dedupe_key}"

    @app.task(name="dt.total", shared=False)
    def total(charged: dict[str, Any]) -> int:
        with effects(app) as r:
            r.incr(fx(app, "total", charged["order_id"]))
        return int(charged["amount"]) * 2

    return app


def delete_queue(app: Celery, queue: str) -> None:
    with app.connection_for_write() as conn:
        try:
            conn.default_channel.queue_delete(queue)
        except Exception:  # never declared: nothing to clean
            pass


def delete_namespace(url: str, namespace: str) -> None:
    with redis.Redis.from_url(url) as r:
        for pattern in (f"{namespace}:*", f"fx:{namespace}:*"):
            keys = list(r.scan_iter(pattern, count=1000))
            if keys:
                r.delete(*keys)


@pytest.fixture
def celery_config(namespace: str, rabbitmq_url: str, redis_url: str) -> Iterator[dict[str, Any]]:
    config = {"broker": rabbitmq_url, "backend": redis_url, "namespace": namespace,
              "queue": f"dedupe-test-{namespace}", "lease": 2.0}
    yield config
    delete_namespace(redis_url, namespace)


@pytest.fixture
def celery_app(celery_config: dict[str, Any]) -> Iterator[Celery]:
    app = make_app(**celery_config)
    yield app
    delete_queue(app, celery_config["queue"])
    app.close()


class WorkerProcess:
    """``celery worker`` (prefork) in a subprocess of its own session, killed on ``stop()``."""

    def __init__(self, config: dict[str, Any], concurrency: int = 2, tmp: Path | None = None,
                 app: str = "tests.celery_worker_app:app") -> None:
        self.config = config
        self.log = (tmp or Path("/tmp")) / f"worker-{uuid.uuid4().hex[:8]}.log"
        env = {**os.environ, CONFIG_ENV: json.dumps(config), "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [services.python(), "-m", "celery", "-A", app, "worker",
             "-P", "prefork", "-c", str(concurrency), "-Q", config["queue"],
             "-n", f"{config['namespace']}@%h", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "-l", "INFO", "-f", str(self.log)],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60.0) -> WorkerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.output()}")
            if " ready." in self.output():
                return self
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready within {timeout}s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        try:  # pool children left behind by a killed parent
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def worker_process(celery_config: dict[str, Any], tmp_path: Path) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(celery_config, concurrency=2, tmp=tmp_path)
    try:
        yield worker.wait_ready()
    finally:
        worker.stop()

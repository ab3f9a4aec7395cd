"""A Celery duplicate does not pass for an ordinary success: the worker logs one INFO line saying
the body did not run, with the key, the fencing token that stored the outcome and its age. A real
``celery worker -l INFO`` (RabbitMQ broker, Redis store), as a user runs it."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from dedupe_worker.celery._duplicates import stored_age

from . import celery_fixtures
from .celery_fixtures import WorkerProcess, make_app

celery_config = celery_fixtures.celery_config
celery_app = celery_fixtures.celery_app
worker_process = celery_fixtures.worker_process

LINE = re.compile(r"INFO/\S+\] duplicate task=dt\.charge id=(\S+) key=(\S+) token=(\d+): answered from the "
                  r"outcome stored (\d+\.\d)s ago, body not run")


def test_a_worker_logs_each_duplicate_once_at_info(celery_app: Celery, worker_process: WorkerProcess) -> None:
    charge = celery_app.tasks["dt.charge"]
    first = charge.delay(1, 100)
    applied = first.get(timeout=30)
    time.sleep(0.3)  # an age the line must show
    second = charge.delay(1, 100)
    assert second.get(timeout=30) == applied
    deadline = time.monotonic() + 10
    while not LINE.search(worker_process.output()) and time.monotonic() < deadline:
        time.sleep(0.05)
    found = LINE.findall(worker_process.output())
    assert len(found) == 1, worker_process.output()
    task_id, key, token, age = found[0]
    assert task_id == second.id and key == "charge:1" and int(token) == applied["fencing_token"]
    assert 0.3 <= float(age) < 30
    assert f"id={first.id}" not in "".join(line for line in worker_process.output().splitlines()
                                           if " duplicate task=" in line)  # the applied run: no such line


@pytest.fixture
def eager_app(celery_config: dict[str, Any]) -> Iterator[Celery]:
    app = make_app(**celery_config, eager=True)
    yield app
    app.close()


def test_no_round_trip_and_no_line_below_info(eager_app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    charge = eager_app.tasks["dt.charge"]
    charge.delay(2, 10).get()
    caplog.set_level(logging.WARNING, "dedupe_worker.celery._task")
    charge.delay(2, 10).get()
    assert not [r for r in caplog.records if "duplicate task=" in r.getMessage()]
    caplog.set_level(logging.INFO, "dedupe_worker.celery._task")
    charge.delay(2, 10).get()
    lines = [r for r in caplog.records if "duplicate task=dt.charge" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "key=charge:2 token=" in lines[0].getMessage()


def test_the_age_is_the_ttl_minus_what_is_left(eager_app: Celery) -> None:
    charge = eager_app.tasks["dt.charge"]
    charge.delay(3, 10).get()
    dedupe = charge.deduplicator
    stem = dedupe.request("charge:3").stem
    age, remaining = stored_age(dedupe, stem, None)
    assert remaining is not None and age is not None
    assert abs(age + remaining - dedupe.result_ttl) < 0.01 and 0 <= age < 5
    # an outcome stored with a longer per-message ttl than ours: no age, what is left instead
    longer, left = stored_age(dedupe, stem, 1.0)
    assert longer is None and left is not None and left > 1
    assert stored_age(dedupe, dedupe.request("charge:never").stem, None) == (None, None)

"""A Celery worker refuses to start on a Redis that may evict our records.

Every ``celery worker`` (and ``app.Worker()``) whose app has :class:`IdempotentTask` tasks gets the
bootstep :class:`StoreCheck` (added on ``worker_init``, before the worker builds its blueprint).
As the worker starts, before it consumes anything, the step runs the start-up check
(:func:`~dedupe_worker._operate.doctor.check_at_start`) on the :class:`Deduplicator` of every such
task: an evicting ``maxmemory-policy`` raises :class:`~dedupe_worker.EvictionPolicyError`
(unless ``dedupe_allow_eviction``), and Celery stops the worker with exit code 1 ("Unrecoverable
error") without having taken a message. Redis unreachable at start is only logged (the first
claim checks again).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from celery.signals import worker_init

from .._errors import EvictionPolicyError
from .._operate.doctor import check_at_start
from ._task import IdempotentTask

__all__ = ["StoreCheck", "check_tasks"]

log = logging.getLogger(__name__)


def check_tasks(app: Any) -> int:
    """Run the start-up check on the Deduplicator of each :class:`IdempotentTask` of ``app``
    (once per Deduplicator); returns how many were checked. Raises
    :class:`~dedupe_worker.EvictionPolicyError` for an evicting Redis."""
    checked: set[int] = set()
    for name, task in sorted(app.tasks.items()):
        if not isinstance(task, IdempotentTask):
            continue
        try:
            dedupe = task.deduplicator
        except Exception as exc:  # settings the task cannot use: its first message says so, as before
            log.warning("could not check the store of task=%s at start: %s", name, exc)
            continue
        if id(dedupe) not in checked:
            checked.add(id(dedupe))
            check_at_start(dedupe)
    return len(checked)


class StoreCheck(bootsteps.StartStopStep):  # type: ignore[misc]
    """The worker bootstep whose ``start`` refuses an evicting Redis (see the module doc)."""

    label = "dedupe store check"

    def start(self, worker: Any) -> None:
        try:
            count = check_tasks(worker.app)
        except EvictionPolicyError as exc:
            log.critical("refusing to start the worker: %s", exc)
            raise
        log.debug("store checked at start for %d deduplicator(s)", count)


def _add_store_check(sender: Any = None, **_: Any) -> None:
    """On ``worker_init`` (the blueprint is built right after): add :class:`StoreCheck`."""
    app = getattr(sender, "app", None)
    if app is not None:
        app.steps["worker"].add(StoreCheck)


worker_init.connect(_add_store_check, weak=False)

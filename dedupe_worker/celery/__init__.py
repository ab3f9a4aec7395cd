"""Celery integration: ``@app.task(base=IdempotentTask, ...)`` applies a task's body once per key.

Needs the ``celery`` extra (``pip install 'dedupe-worker[celery]'``). See ``docs/celery.md``.
"""

from __future__ import annotations

from .._extras import require

require("celery", "celery")

from .._protocol import current_claim  # noqa: E402
from . import _startup  # noqa: E402,F401  (the worker's start-up check of the store)
from ._task import DEFERRALS_HEADER, IdempotentTask  # noqa: E402

__all__ = ["DEFERRALS_HEADER", "IdempotentTask", "current_claim"]

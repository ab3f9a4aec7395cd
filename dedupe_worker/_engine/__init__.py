"""The engine: the one place that runs work for every path (claim, run, store, verdict).

``Deduplicator.run()``, ``@idempotent``, Celery's ``IdempotentTask``, the RabbitMQ and Kafka
consumers all call :func:`decide` or :func:`decide_many` and act on the :class:`Decision`; none
of them turns a claim into a verdict itself. No broker is imported here.
"""

from __future__ import annotations

from .._protocol import Holding, bind_claim, current_claim
from .batch import FLUSH_AFTER, Pacing, decide_many
from .decision import Action, Decision, Reason, outcome, poison, settle
from .hooks import Hooks
from .policy import RetryPolicy
from .single import decide, execute, refused, run

__all__ = [
    "FLUSH_AFTER",
    "Action",
    "Decision",
    "Holding",
    "Hooks",
    "Pacing",
    "Reason",
    "RetryPolicy",
    "bind_claim",
    "current_claim",
    "decide",
    "decide_many",
    "execute",
    "outcome",
    "poison",
    "refused",
    "run",
    "settle",
]

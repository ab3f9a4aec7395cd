"""The engine: the one place that runs work for every path (identify, claim, run, store, verdict).

``Deduplicator.run()``, ``@idempotent``, Celery's ``IdempotentTask``, the RabbitMQ and Kafka
consumers all call :func:`decide` or :func:`decide_many` and act on the :class:`Decision`; none
of them turns a claim into a verdict itself. Every integration and the replay identify a message
by :class:`Identify` (key, fingerprint, ttl, or the refusal) and take their shared options as one
:class:`ConsumerOptions`. No broker is imported here. This ``__init__`` is the engine's door: the
integrations import from here, never from a submodule.
"""

from __future__ import annotations

from .._protocol import Holding, bind_claim, current_claim
from .batch import FLUSH_AFTER, Pacing, Verdicts, batch_flow, decide_many, verdicts_flow
from .decision import HANDLER_RAN, Action, Decision, Reason, outcome, poison, verdict_of
from .dispatch import ACKED, Acted, Done, Tally, dispatch, dispatch_async, is_noop, report
from .hooks import Hooks, call_hook
from .identify import Identify, Identity, body_fingerprint, bytes_fingerprint
from .options import FASTSTREAM_RENAMED, RETRY_OPTIONS, ConsumerOptions
from .policy import RetryPolicy, backoff
from .recorded import Outcomes
from .single import (
    decide,
    decide_flow,
    execute,
    execute_flow,
    handler_of,
    refused,
    run,
    settle_failure,
    settle_failure_flow,
)
from .ttl import TTL_HEADER, TtlHeader, header_ttl, parse_ttl

__all__ = [
    "ACKED",
    "FASTSTREAM_RENAMED",
    "FLUSH_AFTER",
    "HANDLER_RAN",
    "RETRY_OPTIONS",
    "TTL_HEADER",
    "Acted",
    "Action",
    "ConsumerOptions",
    "Decision",
    "Done",
    "Holding",
    "Hooks",
    "Identify",
    "Identity",
    "Outcomes",
    "Pacing",
    "Reason",
    "RetryPolicy",
    "Tally",
    "TtlHeader",
    "Verdicts",
    "backoff",
    "batch_flow",
    "bind_claim",
    "body_fingerprint",
    "bytes_fingerprint",
    "call_hook",
    "current_claim",
    "decide",
    "decide_flow",
    "decide_many",
    "dispatch",
    "dispatch_async",
    "execute",
    "execute_flow",
    "handler_of",
    "header_ttl",
    "is_noop",
    "outcome",
    "parse_ttl",
    "poison",
    "refused",
    "report",
    "run",
    "settle_failure",
    "settle_failure_flow",
    "verdict_of",
    "verdicts_flow",
]

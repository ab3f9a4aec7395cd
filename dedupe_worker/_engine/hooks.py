"""The hooks every integration calls, with the same names and arguments everywhere.

Override them in a subclass of ``IdempotentTask``, ``DedupeConsumer``, ``DedupeKafkaConsumer`` or
the Dramatiq and FastStream ``DedupeMiddleware``. ``message`` is what the integration consumed: the
kombu ``Message``, the ``confluent_kafka.Message``, Dramatiq's message, FastStream's
``StreamMessage``, or, for Celery, the task's ``request``.

The contract, the same in every integration (one dispatch calls them,
:mod:`dedupe_worker._engine.dispatch`):

- **A hook runs after the broker action it reports**, once that action is carried out and can
  no longer change: the copy confirmed in the delay or dead-letter queue (RabbitMQ consumer,
  Dramatiq's ``.XQ``, FastStream's ``.dlq``), the dead letter delivered and the partition rewound
  (Kafka), the re-sent task published (Celery's ``retry(throw=False)``), the message handed back
  (FastStream). Where the framework finishes the action itself when the call returns or raises,
  the hook runs once everything is decided, just before that return or raise: Celery, Dramatiq
  and FastStream ack an applied message when the call returns; Dramatiq's ``Retries`` enqueues a
  deferral when the ``Retry`` the middleware raises reaches it. Kafka's ACK hooks run after the
  batch's commit (a message decided behind one held in its partition is committed later with it).
- **The order:** ``on_lease_lost`` then ``on_deferred`` for a lease lost; one hook otherwise.
- **No hook** when the action could not be done (a copy not confirmed: the message is requeued as
  it came and comes again), when there is no broker (Celery eager or direct calls: the error goes
  to the caller), and for a handler error whose retries the framework owns (Dramatiq's
  ``Retries``, FastStream's ``ack_policy``, Celery's ``autoretry_for`` and ``self.retry()``).
- A hook runs in the thread (or event loop) that handled the message; an exception raised by a
  hook is logged and ignored, so a hook can never stall the loop or change what is acked or
  committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .decision import Decision

__all__ = ["Hooks", "call_hook"]

log = logging.getLogger(__name__)


class Hooks:
    """No-op hooks."""

    def on_applied(self, message: Any, decision: Decision) -> None:
        """Called after the handler ran, its outcome was stored and the message acked."""

    def on_duplicate(self, message: Any, decision: Decision) -> None:
        """Called after a message whose key has a stored outcome (applied, or failed for good)
        was acked without running the handler."""

    def on_deferred(self, message: Any, decision: Decision, delay: float) -> None:
        """Called after a message was put back to come again in about ``delay`` seconds: in
        progress elsewhere, lease lost, Redis unavailable, or a handler error with attempts left
        (``decision.action`` tells a deferral from a retry)."""

    def on_lease_lost(self, message: Any, decision: Decision) -> None:
        """Called after a message whose handler finished while another worker took the key over
        was deferred; ``on_deferred`` follows."""

    def on_dead_letter(self, message: Any, decision: Decision) -> None:
        """Called after a message that cannot be applied, or whose attempts are spent, was set
        aside with its reason: written to the dead-letter queue or topic (Celery: the task fails
        without retry)."""


def call_hook(hook: Callable[..., None], *args: Any) -> None:
    """Call ``hook``; log and swallow what it raises."""
    try:
        hook(*args)
    except Exception:
        log.exception("hook %s failed", getattr(hook, "__name__", hook))

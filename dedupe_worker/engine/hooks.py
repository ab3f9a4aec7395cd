"""The hooks every integration calls, with the same names and arguments everywhere.

Override them in a subclass of ``IdempotentTask``, ``DedupeConsumer`` or ``DedupeKafkaConsumer``.
``message`` is what the integration consumed: the kombu ``Message``, the ``confluent_kafka.Message``,
or, for Celery, the task's ``request``. A hook runs in the thread that handled the message, after
the broker action it reports; an exception raised by a hook is logged and ignored, so a hook can
never stall the loop or change what is acked or committed.
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
        """Called after the handler ran and its outcome was stored (and the message acked)."""

    def on_duplicate(self, message: Any, decision: Decision) -> None:
        """Called after a message whose key has a stored outcome (applied, or failed for good)
        was settled without running the handler."""

    def on_deferred(self, message: Any, decision: Decision, delay: float) -> None:
        """Called after a message was put back to come again in about ``delay`` seconds: in
        progress elsewhere, lease lost, Redis unavailable, or a handler error with attempts left."""

    def on_lease_lost(self, message: Any, decision: Decision) -> None:
        """Called when the handler finished but another worker owns the key now (it is deferred)."""

    def on_dead_letter(self, message: Any, decision: Decision) -> None:
        """Called after a message that cannot be applied was set aside with its reason: written
        to the dead-letter queue or topic (Celery: the task failed without retry)."""


def call_hook(hook: Callable[..., None], *args: Any) -> None:
    """Call ``hook``; log and swallow what it raises."""
    try:
        hook(*args)
    except Exception:
        log.exception("hook %s failed", getattr(hook, "__name__", hook))

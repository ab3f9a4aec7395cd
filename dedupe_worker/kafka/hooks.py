"""Hooks of :class:`~dedupe_worker.kafka.DedupeKafkaConsumer`: override them in a subclass.

Every hook runs in the consumer thread; an exception raised by a hook is logged and ignored, so a
hook can never stall or crash the loop (nor change what is committed).
"""

from __future__ import annotations

from typing import Any

from ..engine import Decision

__all__ = ["ConsumerHooks"]


class ConsumerHooks:
    """No-op hooks; ``message`` is a ``confluent_kafka.Message``."""

    def on_applied(self, message: Any, decision: Decision) -> None:
        """Called after the handler ran for ``message`` and its outcome was stored."""

    def on_duplicate(self, message: Any, decision: Decision) -> None:
        """Called when ``message``'s key was applied (or failed permanently) before; it is
        committed without running."""

    def on_deferred(self, message: Any, decision: Decision, delay: float) -> None:
        """Called when ``message``'s partition is paused and rewound to it for ``delay`` seconds."""

    def on_lease_lost(self, message: Any, decision: Decision) -> None:
        """Called when the handler ran but another worker owns the key now (it is deferred)."""

    def on_dead_letter(self, message: Any, decision: Decision) -> None:
        """Called after ``message`` was confirmed written to the dead-letter topic."""

    def on_commit(self, offsets: list[Any]) -> None:
        """Called after ``offsets`` (``TopicPartition`` list) were committed."""

    def on_assign(self, partitions: list[Any]) -> None:
        """Called after ``partitions`` were assigned to this consumer."""

    def on_revoke(self, partitions: list[Any]) -> None:
        """Called after ``partitions`` were revoked (or lost) from this consumer."""

"""Hooks of :class:`~dedupe_worker.kafka.DedupeKafkaConsumer`: override them in a subclass.

The message hooks are the ones every integration shares (:class:`~dedupe_worker.Hooks`);
Kafka adds ``on_commit``, ``on_assign`` and ``on_revoke``. Every hook runs in the consumer thread;
an exception raised by a hook is logged and ignored, so a hook can never stall or crash the loop
(nor change what is committed).
"""

from __future__ import annotations

from typing import Any

from .._engine import Hooks

__all__ = ["ConsumerHooks"]


class ConsumerHooks(Hooks):
    """No-op hooks; ``message`` is a ``confluent_kafka.Message``."""

    def on_commit(self, offsets: list[Any]) -> None:
        """Called after ``offsets`` (``TopicPartition`` list) were committed."""

    def on_assign(self, partitions: list[Any]) -> None:
        """Called after ``partitions`` were assigned to this consumer."""

    def on_revoke(self, partitions: list[Any]) -> None:
        """Called after ``partitions`` were revoked (or lost) from this consumer."""

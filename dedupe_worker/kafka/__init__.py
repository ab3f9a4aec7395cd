"""Kafka integration: :class:`DedupeKafkaConsumer`, a confluent-kafka consumer loop that applies
each idempotency key once, commits only what is decided and dead-letters what cannot be applied.

Needs the ``kafka`` extra (``pip install 'dedupe-worker[kafka]'``). See ``docs/kafka.md``.
"""

from __future__ import annotations

from .._extras import require

require("confluent_kafka", "kafka")

from ._consumer import DedupeKafkaConsumer  # noqa: E402
from ._deadletter import DeadLetter, DeadLetterProducer  # noqa: E402
from ._hooks import ConsumerHooks  # noqa: E402

__all__ = ["ConsumerHooks", "DeadLetter", "DeadLetterProducer", "DedupeKafkaConsumer"]

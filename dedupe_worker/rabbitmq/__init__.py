"""RabbitMQ (kombu) integration: a consumer that applies each message's idempotency key once.

::

    from kombu import Connection, Queue
    from dedupe_worker import Deduplicator
    from dedupe_worker.rabbitmq import DedupeConsumer

    with Connection("amqp://guest:guest@localhost//") as connection:
        DedupeConsumer(connection, queues=[Queue("orders")], handler=apply_order,
                       deduplicator=Deduplicator.from_url("redis://localhost")).run()

See ``docs/rabbitmq.md`` for the behaviour table, the delay and dead-letter queues and the
crash story. Needs the ``[rabbitmq]`` extra (kombu).
"""

from __future__ import annotations

from .._extras import require

require("kombu", "rabbitmq")
require("amqp", "rabbitmq")

from .._republish import (  # noqa: E402
    DEFERRALS,
    DELAY_SUFFIX,
    DLQ_SUFFIX,
    ORIGINAL_USER_ID,
    PublishFailed,
    Republisher,
    delay_queue,
    dlq,
)
from ._consumer import DedupeConsumer, Handler  # noqa: E402

__all__ = [
    "DEFERRALS",
    "DELAY_SUFFIX",
    "DLQ_SUFFIX",
    "ORIGINAL_USER_ID",
    "DedupeConsumer",
    "Handler",
    "PublishFailed",
    "Republisher",
    "delay_queue",
    "dlq",
]

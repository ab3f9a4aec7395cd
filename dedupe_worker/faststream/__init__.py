"""FastStream integration: ``RabbitBroker(url, middlewares=[dedupe_middleware(dedupe)])`` applies
each message once per idempotency key, on RabbitMQ, Kafka and NATS JetStream alike.

Needs the ``faststream`` extra (``pip install 'dedupe-worker[faststream]'``). See ``docs/faststream.md``.
"""

from __future__ import annotations

from .._extras import require

require("faststream", "faststream")

from .._protocol import current_claim  # noqa: E402
from ._brokers import DLQ_SUFFIX  # noqa: E402
from ._middleware import DedupeMiddleware, dedupe_middleware  # noqa: E402

__all__ = ["DLQ_SUFFIX", "DedupeMiddleware", "current_claim", "dedupe_middleware"]

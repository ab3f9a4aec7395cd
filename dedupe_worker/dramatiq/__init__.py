"""Dramatiq integration: ``broker.add_middleware(DedupeMiddleware(dedupe))`` applies every actor's
work once per idempotency key (actor option ``idempotency_key=callable(*args, **kwargs)``).

Needs the ``dramatiq`` extra (``pip install 'dedupe-worker[dramatiq]'``). See ``docs/dramatiq.md``.
"""

from __future__ import annotations

from .._extras import require

require("dramatiq", "dramatiq")

from .._protocol import current_claim  # noqa: E402
from ._middleware import DEFERRALS_OPTION, DeadLettered, DedupeMiddleware  # noqa: E402

__all__ = ["DEFERRALS_OPTION", "DeadLettered", "DedupeMiddleware", "current_claim"]

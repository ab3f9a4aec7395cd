"""OpenTelemetry spans of the engine (the ``otel`` extra, ``opentelemetry-api``).

``dedupe.claim``, ``dedupe.handler`` and ``dedupe.complete`` (``dedupe.flush`` for a batch's round
trip; the handlers run while its claims stream in are its children), children of the span
current when the engine is called, with ``dedupe.key`` (the Redis key, so a hashed key shows its
hash, never the original), ``dedupe.token``, ``dedupe.outcome`` and ``dedupe.integration``. Spans
the handler opens are children of ``dedupe.handler``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ._base import Observer

__all__ = ["TracingObserver"]

# observe imports nothing else of the package (it sits on the bottom floor beside the errors), so
# the hint of the extra to install is spelt here rather than through ``_extras.require``.
try:
    from opentelemetry import trace
except ImportError as exc:
    raise ImportError("opentelemetry.trace is needed for this feature: pip install 'dedupe-worker[otel]'") from exc


class TracingObserver(Observer):
    def __init__(self, tracer_provider: Any = None) -> None:
        self.tracer = trace.get_tracer("dedupe_worker", tracer_provider=tracer_provider)

    @contextlib.contextmanager
    def span(self, name: str, attributes: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self.tracer.start_as_current_span(name) as span:
            try:
                yield attributes
            finally:
                span.set_attributes({k: v for k, v in attributes.items() if v is not None})

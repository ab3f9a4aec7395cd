"""Metrics and traces of what the engine does, for every integration alike.

The engine, the store and the lease renewer report events to :data:`current`, which does
nothing until something is enabled, so without the extras nothing is imported and the cost is
one attribute look-up and an empty call per event. Observers only report: with them on, the
engine makes the same Redis calls as with them off::

    from dedupe_worker.observe import enable_metrics, enable_tracing
    enable_metrics(port=9108)     # Prometheus: dedupe_* metrics, /metrics served on the port
    enable_tracing()              # OpenTelemetry: dedupe.claim / dedupe.handler / dedupe.complete spans

``dedupe-worker rabbitmq|kafka --metrics-port PORT`` does the first. Celery: call it in a
``worker_process_init`` handler (see docs/operating.md).
"""

from __future__ import annotations

from ._base import Observer, current

__all__ = ["Observer", "current", "enable_metrics", "enable_tracing"]


def enable_metrics(port: int | None = None, registry: object = None) -> Observer:
    """Count and time into Prometheus metrics (``pip install 'dedupe-worker[metrics]'``); with
    ``port``, serve ``/metrics`` there. Returns the observer (once per process)."""
    from ._metrics import MetricsObserver

    return current.enable(MetricsObserver.get(registry, port))


def enable_tracing(tracer_provider: object = None) -> Observer:
    """Record OpenTelemetry spans (``pip install 'dedupe-worker[otel]'``) under the current span."""
    from ._tracing import TracingObserver

    return current.enable(TracingObserver(tracer_provider))


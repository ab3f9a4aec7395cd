"""Prometheus metrics of the engine (the ``metrics`` extra, ``prometheus_client``)."""

from __future__ import annotations

from typing import Any, ClassVar

from ._base import Observer

__all__ = ["HTTP_ANSWERS", "MetricsObserver"]

# observe imports nothing else of the package (it sits on the bottom floor beside the errors), so
# the hint of the extra to install is spelt here rather than through ``_extras.require``.
try:
    import prometheus_client as prometheus
except ImportError as exc:
    raise ImportError("prometheus_client is needed for this feature: pip install 'dedupe-worker[metrics]'") from exc


#: What the HTTP layer answers a request with: it ``ran`` the view; ``replayed`` the stored
#: response; refused a retry while the first runs (409, ``conflict``), a key reused with another
#: request (422, ``mismatch``), a missing key (400, ``missing_key``), a body over the bound (413,
#: ``too_large``) or a scope it does not cover (``scope_refused``); answered from an outcome an
#: SQL ``atomic()`` had committed (``already_applied``); or failed (``error``).
HTTP_ANSWERS = ("ran", "replayed", "conflict", "mismatch", "missing_key", "too_large", "scope_refused",
                "already_applied", "error")


class MetricsObserver(Observer):
    """``dedupe_decisions_total{integration,reason}``, ``dedupe_sends_total{integration,outcome}``,
    ``dedupe_round_trip_seconds{op}``,
    ``dedupe_handler_seconds{integration}``, ``dedupe_leases_held``,
    ``dedupe_lease_renewals_failed_total``, ``dedupe_leases_lost_total``,
    ``dedupe_http_requests_total{answer}``. The dashboard and alert rules of docs/monitoring/ query
    these names (tests/test_monitoring.py checks them against a real run)."""

    _made: ClassVar[dict[int, MetricsObserver]] = {}

    def __init__(self, registry: Any = None) -> None:
        r = registry or prometheus.REGISTRY
        self.decisions = prometheus.Counter("dedupe_decisions", "Messages decided, by integration and reason",
                                            ["integration", "reason"], registry=r)
        self.sends = prometheus.Counter("dedupe_sends", "Sends checked before publishing, by integration and "
                                        "outcome", ["integration", "outcome"], registry=r)
        self.round_trips = prometheus.Histogram("dedupe_round_trip_seconds", "Engine round trips to Redis",
                                                ["op"], registry=r,
                                                buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                         0.05, 0.1, 0.25, 1.0))
        self.handlers = prometheus.Histogram("dedupe_handler_seconds", "Handler run time", ["integration"],
                                             registry=r)
        self.held = prometheus.Gauge("dedupe_leases_held", "Claims held and renewed now", registry=r)
        self.renewals_failed = prometheus.Counter("dedupe_lease_renewals_failed",
                                                  "Leases whose renewal round trip failed", registry=r)
        self.lost = prometheus.Counter("dedupe_leases_lost", "Leases found taken over by a larger token",
                                       registry=r)
        self.http = prometheus.Counter("dedupe_http_requests", "HTTP requests answered by the Idempotency-Key "
                                       "layer, by answer", ["answer"], registry=r)
        for answer in HTTP_ANSWERS:  # every series from the start: rate() and alerts see the first one
            self.http.labels(answer)

    @classmethod
    def get(cls, registry: Any = None, port: int | None = None) -> MetricsObserver:
        """One observer per registry (metrics can be registered once); serve ``/metrics`` on ``port``."""
        key = id(registry)
        if key not in cls._made:
            cls._made[key] = cls(registry)
            if port is not None:
                prometheus.start_http_server(port, registry=registry or prometheus.REGISTRY)
        return cls._made[key]

    def decided(self, integration: str, reason: str) -> None:
        self.decisions.labels(integration, reason).inc()

    def sent(self, integration: str, outcome: str) -> None:
        self.sends.labels(integration, outcome).inc()

    def round_trip(self, op: str, seconds: float) -> None:
        self.round_trips.labels(op).observe(seconds)

    def handled(self, integration: str, seconds: float) -> None:
        self.handlers.labels(integration).observe(seconds)

    def leases(self, held: int) -> None:
        self.held.set(held)

    def renewal_failed(self, count: int) -> None:
        self.renewals_failed.inc(count)

    def lease_lost(self) -> None:
        self.lost.inc()

    def http_answered(self, answer: str) -> None:
        self.http.labels(answer).inc()

"""The events the engine reports, as no-op methods; :data:`current` fans them out to what is enabled."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["Observer", "Observers", "current"]


class Observer:
    """No-op receiver of engine events; metrics and tracing override what they need."""

    def decided(self, integration: str, reason: str) -> None:
        """One message got its verdict (``reason`` is a :class:`~dedupe_worker.Reason` value)."""

    def sent(self, integration: str, outcome: str) -> None:
        """A producer checked a key before sending: ``published``, ``skipped_done``,
        ``skipped_queued`` (queued or running) or ``conflict``."""

    def round_trip(self, op: str, seconds: float) -> None:
        """One Redis round trip of the engine: ``claim``, ``complete`` or ``complete_and_claim``."""

    def handled(self, integration: str, seconds: float) -> None:
        """One handler ran for ``seconds``."""

    def leases(self, held: int) -> None:
        """The renewer holds and renews ``held`` leases now."""

    def renewal_failed(self, count: int) -> None:
        """A renewal round trip for ``count`` leases failed (Redis unreachable)."""

    def lease_lost(self) -> None:
        """A lease was found taken over by a larger token."""

    def http_answered(self, answer: str) -> None:
        """The HTTP layer answered one request: ``ran``, ``replayed``, ``conflict`` (409),
        ``mismatch`` (422), ``missing_key`` (400), ``too_large`` (413), ``scope_refused``,
        ``already_applied`` or ``error``."""

    @contextlib.contextmanager
    def span(self, name: str, attributes: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Around a claim, a handler or a completion; the yielded dict takes attributes learned inside."""
        yield attributes


class Observers(Observer):
    """The enabled observers, called in turn; empty (free) by default."""

    def __init__(self) -> None:
        self.enabled: list[Observer] = []

    def enable(self, observer: Observer) -> Observer:
        if observer not in self.enabled:
            self.enabled.append(observer)
        return observer

    def disable(self, observer: Observer) -> None:
        """Stop reporting to ``observer`` (tests; a process normally keeps what it enabled)."""
        if observer in self.enabled:
            self.enabled.remove(observer)

    def decided(self, integration: str, reason: str) -> None:
        for o in self.enabled:
            o.decided(integration, reason)

    def sent(self, integration: str, outcome: str) -> None:
        for o in self.enabled:
            o.sent(integration, outcome)

    def round_trip(self, op: str, seconds: float) -> None:
        for o in self.enabled:
            o.round_trip(op, seconds)

    def handled(self, integration: str, seconds: float) -> None:
        for o in self.enabled:
            o.handled(integration, seconds)

    def leases(self, held: int) -> None:
        for o in self.enabled:
            o.leases(held)

    def renewal_failed(self, count: int) -> None:
        for o in self.enabled:
            o.renewal_failed(count)

    def lease_lost(self) -> None:
        for o in self.enabled:
            o.lease_lost()

    def http_answered(self, answer: str) -> None:
        for o in self.enabled:
            o.http_answered(answer)

    @contextlib.contextmanager
    def span(self, name: str, attributes: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with contextlib.ExitStack() as stack:
            for o in self.enabled:
                stack.enter_context(o.span(name, attributes))
            yield attributes


#: What the engine reports to; enable observers with :func:`dedupe_worker.observe.enable_metrics`
#: and :func:`~dedupe_worker.observe.enable_tracing`.
current = Observers()

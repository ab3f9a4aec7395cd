"""Django integration: ``IdempotencyMiddleware``, the Idempotency-Key layer configured from settings
(see :mod:`dedupe_worker.django.middleware` and docs/http.md)."""

from __future__ import annotations

from .middleware import IdempotencyMiddleware

__all__ = ["IdempotencyMiddleware"]

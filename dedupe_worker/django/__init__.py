"""Django integration: ``IdempotencyMiddleware``, the Idempotency-Key layer configured from settings
(see :mod:`dedupe_worker.django._middleware` and docs/http.md) with :func:`user_scope`, its
ready-made scope, and :func:`atomic`, the ORM's transaction with the key's outcome committed in
it (extra ``django``; see :mod:`dedupe_worker.django._atomic` and docs/sql.md)."""

from __future__ import annotations

from ._atomic import atomic
from ._middleware import IdempotencyMiddleware, user_scope

__all__ = ["IdempotencyMiddleware", "atomic", "user_scope"]

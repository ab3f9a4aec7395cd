"""``dedupe_worker.django.atomic()``: :func:`dedupe_worker.sql._atomic` on Django's own transactions.

::

    from dedupe_worker.django import atomic

    @app.task(base=IdempotentTask, bind=True)
    def ship(self, order_id):
        with atomic() as outcome:                      # django.db.transaction.atomic(using="default")
            Order.objects.filter(id=order_id).update(state="shipped")
            outcome.result = {"order": order_id}
        return outcome.result

The block runs in ``django.db.transaction.atomic(using=using)`` (a savepoint when one is already
open) and records the current claim's key and outcome in the same transaction: the ORM's writes
and the outcome commit together, once. Semantics, guarantees and limits are those of
:func:`dedupe_worker.sql._atomic`; the outcome table lives in the ``using`` database.
"""

from __future__ import annotations

from ..sql._atomic import Atomic
from ..sql._drivers import DjangoDriver
from ..sql._outcomes import SqlOutcomes

__all__ = ["atomic"]


def atomic(using: str = "default", *, outcomes: SqlOutcomes | None = None) -> Atomic:
    """A transaction on the Django database ``using`` that also records the current claim's
    outcome; raises :class:`~dedupe_worker.AlreadyApplied` at entry when an earlier run of the key
    committed. Use it as ``with atomic() as outcome: ...; outcome.result = value``."""
    return Atomic(None, outcomes, driver=DjangoDriver(using))

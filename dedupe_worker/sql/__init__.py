"""Outcomes committed in the handler's own database transaction (extra ``sql``).

Redis keeps copies of a message from running at the same time and answers duplicates in one
round trip; a row written by :func:`atomic` in the same transaction as the handler's effects makes
those effects commit once even when Redis forgets the key (a restart without persistence, a
failover, an eviction) or the worker dies between its commit and ``complete()``::

    from dedupe_worker import Deduplicator
    from dedupe_worker.sql import SqlOutcomes, atomic

    outcomes = SqlOutcomes("postgresql://app@db/app")   # or a SQLAlchemy Engine / AsyncEngine
    outcomes.create_table()                            # or: dedupe-worker sql init
    dedupe = Deduplicator(redis_client, outcomes=outcomes)

    def handle(order):
        with psycopg.connect(DSN) as conn, atomic(conn) as outcome:
            conn.execute("UPDATE stock SET left = left - %s WHERE sku = %s", (order["n"], order["sku"]))
            outcome.result = {"sku": order["sku"]}
        return outcome.result

    dedupe.run(order["id"], handle, order)

See :mod:`dedupe_worker.sql._atomic` for what is and is not guaranteed, and docs/sql.md.
"""

from __future__ import annotations

from .._errors import AlreadyApplied, NotCommitted
from ._atomic import Atomic, AtomicOutcome, atomic
from ._outcomes import SqlOutcomes, ddl

__all__ = ["AlreadyApplied", "Atomic", "AtomicOutcome", "NotCommitted", "SqlOutcomes", "atomic", "ddl"]

"""The soak's handlers and hooks, loaded by the worker processes (``tests.soak.workers`` and the
Celery app). Their configuration comes from the environment the harness sets:

``SOAK_DSN`` (PostgreSQL), ``SOAK_RUN`` (the run id naming the ledger tables), ``SOAK_WORK``
(the longest simulated work of one handler, in seconds; each takes a random share of it),
``SOAK_WRITE`` (``idempotent``, the default, ``fenced`` or ``plain``: see :mod:`tests.soak.ledger`;
with ``plain`` the workers also get ``DEDUPE_SQL_DSN``/``DEDUPE_SQL_TABLE``).

Every handler takes the token from :func:`~dedupe_worker.current_claim` and applies one
operation to the ledger with :func:`~tests.soak.ledger.apply_operation`. The hooks record the
verdicts that happen out of the handler's sight: a completion refused as lease lost, a dead letter.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from dedupe_worker import Decision, current_claim

from .ledger import Ledger, apply_operation

__all__ = ["LedgerHooks", "charge", "kafka_charge", "ledger", "rabbit_charge"]

_ledger: Ledger | None = None


def ledger() -> Ledger:
    """This process's ledger connection (made after a fork, on first use)."""
    global _ledger
    if _ledger is None or _ledger.conn.closed:
        _ledger = Ledger(os.environ["SOAK_DSN"], os.environ["SOAK_RUN"])
    return _ledger


def charge(op_id: str, amount: int) -> dict[str, Any]:
    """Apply ``charge op_id amount`` once, fenced by the current claim's token."""
    claim = current_claim()
    if claim is None:
        raise RuntimeError("soak handler called outside a claim")
    work = random.uniform(0.2, 1.0) * float(os.environ.get("SOAK_WORK", "0.1"))
    if os.environ.get("SOAK_WRITE") == "plain":
        ledger().started(op_id, claim.token)
        time.sleep(work)
        return ledger().write_plain(op_id, amount, claim.token)
    idempotent = os.environ.get("SOAK_WRITE", "idempotent") != "fenced"
    phase = apply_operation(ledger(), op_id, amount, claim.token, work, idempotent)
    return {"id": op_id, "phase": phase, "token": claim.token}


def rabbit_charge(body: Any, message: Any) -> dict[str, Any]:
    return charge(str(body["id"]), int(body["amount"]))


def kafka_charge(message: Any) -> dict[str, Any]:
    body = json.loads(message.value())
    return charge(str(body["id"]), int(body["amount"]))


class LedgerHooks:
    """Engine hooks that write the out-of-handler verdicts to the ledger's events table."""

    def on_lease_lost(self, message: Any, decision: Decision) -> None:
        ledger().event("lease_lost", decision.claim.key if decision.claim else None, describe(decision))

    def on_dead_letter(self, message: Any, decision: Decision) -> None:
        ledger().event("dead_letter", decision.claim.key if decision.claim else None, describe(decision))


def describe(decision: Decision) -> str:
    return f"{decision.reason.value} token={decision.token} {decision.detail}".strip()

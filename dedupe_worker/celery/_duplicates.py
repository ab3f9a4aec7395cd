"""The INFO line a Celery worker logs for a duplicate, so it does not pass for a plain success.

Celery logs a duplicate as ``Task ... succeeded`` with the first run's value, like any other run;
this line, logged just before, says the body did not run and which outcome answered: the key,
the fencing token that stored it and how long ago.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from .._deduplicator import Deduplicator
from .._engine import Decision
from .._protocol import KeyLayout

__all__ = ["log_duplicate", "stored_age"]

log = logging.getLogger("dedupe_worker.celery._task")


def stored_age(dedupe: Deduplicator, stem: str, ttl: float | None) -> tuple[float | None, float | None]:
    """``(age, remaining)`` in seconds of the outcome stored under ``stem``: its remaining TTL (one
    round trip, either record format) and the ttl it was stored with minus that. ``ttl`` is the
    one this call would store with (else ``result_ttl``): an outcome stored with a longer
    per-message ttl gives no age (``None``), nor does a record gone or unreadable, nor one on
    the SQL store (a row's expiry is no Redis TTL: the line says "stored earlier")."""
    if dedupe.store.outcomes_on_row:
        return None, None
    try:
        pipe = dedupe.store.client.pipeline(transaction=False)
        pipe.pttl(KeyLayout.record(stem))
        pipe.pttl(KeyLayout.result(stem))
        replies = pipe.execute()
    except redis.RedisError:
        return None, None
    remaining = next((int(ms) / 1000 for ms in replies if int(ms) > 0), None)
    if remaining is None:
        return None, None
    age = (ttl or dedupe.result_ttl) - remaining
    return (age if age >= 0 else None), remaining


def log_duplicate(dedupe: Deduplicator, where: str, key: str, decision: Decision) -> None:
    """Log at INFO that ``decision`` (a DUPLICATE) was answered from the stored outcome."""
    if not log.isEnabledFor(logging.INFO):
        return  # no round trip for a line nobody reads
    claim: Any = decision.claim
    age, remaining = stored_age(dedupe, claim.stem, claim.ttl) if claim is not None else (None, None)
    when = (f"stored {age:.1f}s ago" if age is not None
            else f"stored earlier, kept {remaining:.0f}s more" if remaining is not None else "stored earlier")
    log.info("duplicate %s key=%s token=%s: answered from the outcome %s, body not run", where, key,
             decision.token, when)

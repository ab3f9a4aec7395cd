"""dedupe-worker: make at-least-once message delivery apply exactly once.

Claim an idempotency key in Redis (one Lua script, fencing token included), run the handler,
store its outcome only if our token still owns the claim, then ack, defer or dead-letter.

The public modules are this one, :mod:`dedupe_worker.asyncio`, :mod:`dedupe_worker.keys`,
:mod:`dedupe_worker.testing`, :mod:`dedupe_worker.observe`, :mod:`dedupe_worker.producers`, one
package per integration (``celery``, ``dramatiq``, ``faststream``, ``rabbitmq``, ``kafka``,
``http``, ``sql``, ``django``), :mod:`dedupe_worker.replay` and :mod:`dedupe_worker.cli`. Every
module whose name starts with ``_`` is the implementation and may move between releases; the
layers, from the bottom up: ``_protocol`` (the Lua scripts, the store, claims, lease renewal and
:class:`ClaimClient`, which speaks the protocol), ``_messages`` (the broker-neutral
:class:`Envelope`, dead-letter headers), ``_engine`` (the one place that runs work: claim, run,
store, verdict, and the one dispatch to broker actions), then the integrations.

:class:`Deduplicator` is the protocol client with the engine's ``run()`` on top;
:class:`dedupe_worker.asyncio.AsyncDeduplicator` is the same on ``redis.asyncio``.
"""

from __future__ import annotations

from ._decorators import idempotent
from ._deduplicator import Deduplicator
from ._engine import Action, ConsumerOptions, Decision, Hooks, Reason, current_claim, decide, decide_many
from ._errors import (
    AlreadyApplied,
    ClaimError,
    DedupeError,
    EvictionPolicyError,
    InProgress,
    InvalidKey,
    KeyConflict,
    LeaseLost,
    MissingKey,
    PreviouslyFailed,
    ResultNotSerializable,
    StoreUnavailable,
    UndecodableMessage,
    UnreadableRecord,
)
from ._messages.envelope import Envelope
from ._protocol import OMITTED, Claim, KeyState, Omitted, Outcome, State, Stored
from ._settings import ClientOptions, DedupeSettings
from ._sqlstore import SqlPool as _SqlPool  # noqa: F401 - registers the SQL store: from_url takes database URLs
from ._transport import ClaimClient

__all__ = [
    "OMITTED",
    "Action",
    "AlreadyApplied",
    "Claim",
    "ClaimClient",
    "ClaimError",
    "ClientOptions",
    "ConsumerOptions",
    "Decision",
    "DedupeError",
    "DedupeSettings",
    "Deduplicator",
    "Envelope",
    "EvictionPolicyError",
    "Hooks",
    "InProgress",
    "InvalidKey",
    "KeyConflict",
    "KeyState",
    "LeaseLost",
    "MissingKey",
    "Omitted",
    "Outcome",
    "PreviouslyFailed",
    "Reason",
    "ResultNotSerializable",
    "State",
    "StoreUnavailable",
    "Stored",
    "UndecodableMessage",
    "UnreadableRecord",
    "current_claim",
    "decide",
    "decide_many",
    "idempotent",
]

__version__ = "0.1.0"

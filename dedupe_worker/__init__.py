"""dedupe-worker: make at-least-once message delivery apply exactly once.

Claim an idempotency key in Redis (one Lua script, fencing token included), run the handler,
store its outcome only if our token still owns the claim, then ack, defer or dead-letter.

The layers, from the bottom up:

- :mod:`.protocol`: the Lua scripts, the store, the key layout, claims, lease renewal, and
  :class:`ClaimClient`, which speaks the protocol;
- :mod:`.messages`: the broker-neutral :class:`Envelope`, key strategies, dead-letter headers;
- :mod:`.engine`: the one place that runs work (claim, run, store, verdict) for every path;
- the integrations: :mod:`.celery`, :mod:`.rabbitmq`, :mod:`.kafka`, :mod:`.replay`, :mod:`.cli`.

:class:`Deduplicator` is the protocol client with the engine's ``run()`` on top;
:class:`dedupe_worker.asyncio.AsyncDeduplicator` is the same on ``redis.asyncio``. The modules
``handling``, ``keys``, ``envelope`` and ``context`` at this level are the import paths of earlier
releases, kept working.
"""

from __future__ import annotations

from .decorators import idempotent
from .deduplicator import Deduplicator
from .engine import Action, Decision, Hooks, Reason, current_claim, decide, decide_many
from .errors import (
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
)
from .messages.envelope import Envelope
from .protocol import OMITTED, Claim, ClaimClient, KeyState, Omitted, Outcome, State, Stored
from .settings import DedupeSettings

__all__ = [
    "OMITTED",
    "Action",
    "AlreadyApplied",
    "Claim",
    "ClaimClient",
    "ClaimError",
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
    "current_claim",
    "decide",
    "decide_many",
    "idempotent",
]

__version__ = "0.1.0"

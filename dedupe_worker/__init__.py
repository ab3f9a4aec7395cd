"""dedupe-worker: make at-least-once message delivery apply exactly once.

Claim an idempotency key in Redis (one Lua script, fencing token included), run the handler,
store its outcome only if our token still owns the claim, then ack, defer or dead-letter.
"""

from __future__ import annotations

from .claim import OMITTED, Claim, Omitted, Outcome
from .context import current_claim
from .decorators import idempotent
from .deduplicator import Deduplicator
from .envelope import Envelope
from .errors import (
    ClaimError,
    DedupeError,
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
from .handling import Action, Decision, Reason, decide, decide_many
from .settings import DedupeSettings
from .store import KeyState

__all__ = [
    "OMITTED",
    "Action",
    "Claim",
    "ClaimError",
    "Decision",
    "DedupeError",
    "DedupeSettings",
    "Deduplicator",
    "Envelope",
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
    "StoreUnavailable",
    "UndecodableMessage",
    "current_claim",
    "decide",
    "decide_many",
    "idempotent",
]

__version__ = "0.1.0"

"""The claim protocol: Lua scripts (``lua/``), the script runner, the Redis store and key layout,
claims and their outcomes, lease renewal, and :class:`ClaimClient`, which speaks it.

Nothing here runs a handler or decides a message's fate; that is :mod:`dedupe_worker._engine`.
"""

from __future__ import annotations

from .claim import OMITTED, Claim, Omitted, Outcome, State, Stored
from .client import KEY_HARD_LIMIT, ClaimClient, Request
from .codec import ClaimCodec
from .layout import KeyLayout
from .store import ClaimReply, KeyState, RedisStore

__all__ = [
    "KEY_HARD_LIMIT",
    "OMITTED",
    "Claim",
    "ClaimClient",
    "ClaimCodec",
    "ClaimReply",
    "KeyLayout",
    "KeyState",
    "Omitted",
    "Outcome",
    "RedisStore",
    "Request",
    "State",
    "Stored",
]

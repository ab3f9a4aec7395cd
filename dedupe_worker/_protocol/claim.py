"""What a claim attempt returns: an :class:`Outcome` and the :class:`Claim` that carries it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OMITTED", "Claim", "Omitted", "Outcome", "State", "Stored"]

_set = object.__setattr__


class Outcome(enum.Enum):
    """Every claim ends as exactly one of these."""

    #: We own the claim under a new fencing token: run the handler.
    ACQUIRED = 1
    #: An outcome is stored: the work was already done (or failed permanently).
    DUPLICATE = 2
    #: Another worker holds a live lease: defer the message, never drop it.
    IN_PROGRESS = 3
    #: The key was used before with a different payload fingerprint.
    CONFLICT = 4
    #: A record under the key's names is not one we write (another type, a truncated record):
    #: nothing was run or written; ``error`` is the :class:`~dedupe_worker.UnreadableRecord`.
    UNREADABLE = 5


class Stored(str, enum.Enum):
    """How an outcome is stored in the result record (its ``s`` field)."""

    #: Completed; the value is the handler's result as JSON.
    COMPLETED = "c"
    #: Completed; the value was too large (or not JSON) and is not kept.
    OMITTED = "o"
    #: Failed permanently; the value is the error as JSON.
    FAILED = "f"


class State(str, enum.Enum):
    """What a key's records say, read without changing them (:meth:`Deduplicator.status`)."""

    #: An outcome is stored.
    DONE = "done"
    #: A live lease is held.
    IN_PROGRESS = "in_progress"
    #: Never claimed, released, or its lease ran out.
    FREE = "free"


class Omitted(str):
    """Type of :data:`OMITTED`."""

    __slots__ = ()


#: Given as the result of a duplicate whose original result was larger than
#: ``max_result_bytes``: the work is known to be done but its body was not stored.
#: It is a ``str`` so it passes through JSON result backends; compare with ``is``.
OMITTED = Omitted("<dedupe-worker: result omitted, larger than max_result_bytes>")


@dataclass(frozen=True, init=False)
class Claim:
    """The answer to one claim attempt.

    ``token`` is the fencing token when ``outcome`` is ACQUIRED (and the token that stored the
    outcome for a DUPLICATE). ``result`` is the stored value for a DUPLICATE (:data:`OMITTED` when
    its body was too large to keep), ``error`` the stored error when the outcome was a permanent
    failure (then ``failed`` is true), or the :class:`~dedupe_worker.UnreadableRecord` when
    UNREADABLE. ``retry_after`` is how many seconds the other worker's lease
    still runs when IN_PROGRESS.
    """

    key: str
    outcome: Outcome
    token: int = 0
    result: Any = None
    retry_after: float = 0.0
    failed: bool = False
    error: Any = None
    #: The Redis key stem (``<namespace>:{<key or its hash>}``) the records live under.
    stem: str = field(default="", repr=False)
    fingerprint: str = field(default="", repr=False)
    #: For ACQUIRED: the key was claimed before (a re-run after a crash, an outage, a lost lease or
    #: a release), so an earlier run may have committed effects; ``False`` on a first claim.
    reclaimed: bool = field(default=False, repr=False)
    #: Seconds this message's outcome is kept, chosen when it was claimed (``begin(..., ttl=)``):
    #: ``complete`` and ``fail`` store it for that long; ``None``: the client's ``result_ttl``.
    ttl: float | None = field(default=None, repr=False)

    def __init__(self, key: str, outcome: Outcome, token: int = 0, result: Any = None, retry_after: float = 0.0,
                 failed: bool = False, error: Any = None, stem: str = "", fingerprint: str = "",
                 reclaimed: bool = False, ttl: float | None = None) -> None:
        # One per message on every path: a __dict__ built whole costs a fraction of the frozen
        # dataclass __init__ (one object.__setattr__ per field); the fields and defaults are the
        # ones declared above, and the instance stays frozen (docs/performance.md, bench.core's
        # batch and run cases).
        _set(self, "__dict__", {"key": key, "outcome": outcome, "token": token, "result": result,
                                "retry_after": retry_after, "failed": failed, "error": error, "stem": stem,
                                "fingerprint": fingerprint, "reclaimed": reclaimed, "ttl": ttl})

    @property
    def acquired(self) -> bool:
        return self.outcome is Outcome.ACQUIRED

    @property
    def omitted(self) -> bool:
        return self.result is OMITTED

"""Per-partition bookkeeping: what may be committed, where to rewind, what is already decided.

Kafka only remembers one number per partition (the committed offset), so the consumer may commit
an offset only when every message before it in that partition is decided: applied, duplicate or
dead-lettered. The first undecided message of a partition is its *hold*: the partition is paused,
rewound to it and resumed later. Messages after the hold that were decided in the same batch are
remembered as *decided behind* the hold, so their redelivery is not decided again (a dead-lettered message is not
dead-lettered twice); this memory lives only in the process and is dropped on revoke or restart,
after which a redelivery is simply decided again (the claim store answers DUPLICATE).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._engine import Decision
from ._deadletter import DeadLetter

__all__ = ["DONE", "Hold", "PartitionPlan", "PartitionState", "plan_partition"]


class _Done:
    """Type of :data:`DONE`."""

    def __repr__(self) -> str:
        return "DONE"


#: The message is decided and needs nothing more: it may be committed past.
DONE = _Done()


@dataclass(frozen=True)
class Hold:
    """The message is not decided: rewind to it and come back in ``delay`` seconds.

    ``dead_letter`` is set when the verdict was "dead-letter" but the delivery to the
    dead-letter topic failed; the redelivery then retries that delivery without deciding again.
    """

    delay: float
    dead_letter: DeadLetter | None = None
    #: The verdict that held the message, and its key (for the hook and the log line).
    decision: Decision | None = field(default=None, compare=False)
    key: str | None = field(default=None, compare=False)


@dataclass
class PartitionState:
    """What the consumer remembers about one assigned partition between batches."""

    #: ``time.monotonic()`` at which a paused partition is resumed; ``None`` when flowing.
    paused_until: float | None = None
    #: Offsets past the commit point already decided: ``None`` = done, a :class:`DeadLetter` =
    #: decided "dead-letter" but its delivery still has to succeed.
    decided_behind: dict[int, DeadLetter | None] = field(default_factory=dict)
    #: After a rewind: the offset the partition must deliver next (older fetches are dropped).
    rewound_to: int | None = None
    #: Handler errors seen so far per offset (for the dead-letter limit).
    attempts: dict[int, int] = field(default_factory=dict)
    #: Consecutive holds of this partition (for the backoff); reset when it moves on.
    holds: int = 0
    #: The held message, while the partition waits for its key to be decided elsewhere.
    held: Any = None

    def forget_below(self, offset: int) -> None:
        """Drop memory of offsets below ``offset`` (they are committed)."""
        self.decided_behind = {o: d for o, d in self.decided_behind.items() if o >= offset}
        self.attempts = {o: n for o, n in self.attempts.items() if o >= offset}


@dataclass(frozen=True)
class PartitionPlan:
    """What to do with one partition after a batch."""

    #: Offset to commit (the next message to read), or ``None`` when nothing moved.
    commit: int | None
    #: ``(offset, hold)`` of the first undecided message, or ``None``.
    rewind: tuple[int, Hold] | None


def plan_partition(state: PartitionState, outcomes: Sequence[tuple[int, _Done | Hold]]) -> PartitionPlan:
    """Turn the outcomes of one partition's messages (in offset order) into a commit and a rewind,
    updating ``state.decided_behind`` for what was decided after the first hold."""
    commit: int | None = None
    rewind: tuple[int, Hold] | None = None
    for offset, outcome in outcomes:
        if isinstance(outcome, Hold):
            if outcome.dead_letter is not None:
                state.decided_behind[offset] = outcome.dead_letter
            if rewind is None:
                rewind = (offset, outcome)
        elif rewind is None:
            commit = offset + 1
        else:
            state.decided_behind[offset] = None
    if commit is not None:
        state.forget_below(commit)
        state.holds = 0
    if rewind is not None:
        state.holds += 1
    return PartitionPlan(commit, rewind)

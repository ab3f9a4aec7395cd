"""Counting what a replay did, and showing it: the options, the summary, the plan table and the
live progress line. Nothing here talks to a broker."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from ._plan import Entry, Step

__all__ = ["Progress", "ReplayOptions", "Summary", "format_table"]


@dataclass(frozen=True)
class ReplayOptions:
    """How a replay runs (the same for both brokers).

    ``limit`` bounds the messages *examined*; ``rate`` bounds republished messages per second;
    ``on_start`` is called once with the number of messages to examine (``None`` when unknown, as
    for Kafka), ``on_entry`` after each message is done with, with the entry and its counter's name.
    """

    dry_run: bool = False
    limit: int | None = None
    rate: float | None = None
    keep_entries: bool = False
    on_start: Callable[[int | None], None] | None = None
    on_entry: Callable[[Entry, str], None] | None = None


@dataclass
class Summary:
    """What one run did (or, with ``dry_run``, would do). Every examined message is counted in
    exactly one of ``replayed``, ``already_applied``, ``left_in_place`` and ``failed``."""

    dry_run: bool = False
    replayed: int = 0
    already_applied: int = 0
    left_in_place: int = 0
    failed: int = 0
    entries: list[Entry] = field(default_factory=list)
    keep_entries: bool = False
    on_entry: Callable[[Entry, str], None] | None = field(default=None, repr=False)

    @classmethod
    def start(cls, options: ReplayOptions) -> Summary:
        return cls(dry_run=options.dry_run, keep_entries=options.keep_entries, on_entry=options.on_entry)

    @property
    def examined(self) -> int:
        return self.replayed + self.already_applied + self.left_in_place + self.failed

    def record(self, entry: Entry, ok: bool = True) -> str:
        """Count ``entry``; ``ok`` is False when its step could not be carried out. Returns the
        name of the counter that was increased."""
        if not ok or entry.unavailable:
            tally = "failed"
        elif entry.step is Step.REPLAY:
            tally = "replayed"
        elif entry.step is Step.DROP:
            tally = "already_applied"
        else:
            tally = "left_in_place"
        setattr(self, tally, getattr(self, tally) + 1)
        if self.keep_entries:
            self.entries.append(entry)
        if self.on_entry is not None:
            self.on_entry(entry, tally)
        return tally

    def counts(self) -> dict[str, int]:
        return {"examined": self.examined, "replayed": self.replayed,
                "already_applied": self.already_applied, "left_in_place": self.left_in_place,
                "failed": self.failed}

    def as_dict(self) -> dict[str, Any]:
        """The summary for ``--json``; ``plan`` lists the entries when they were kept."""
        data: dict[str, Any] = {"dry_run": self.dry_run, **self.counts()}
        if self.keep_entries:
            data["plan"] = [
                {"key": e.key, "state": e.state.value, "action": e.step.value, "reason": e.reason, "note": e.note,
                 "token": e.token}
                for e in self.entries
            ]
        return data

    def line(self) -> str:
        prefix = "dry run, would have: " if self.dry_run else ""
        return (f"{prefix}replayed {self.replayed}, already applied {self.already_applied}, "
                f"left in place {self.left_in_place}, failed {self.failed} "
                f"(of {self.examined} examined)")


def format_table(entries: list[Entry]) -> str:
    """A plain text table: key, state, action, dead-letter reason, note."""
    rows = [("KEY", "STATE", "ACTION", "REASON", "NOTE")]
    rows += [(e.key if e.key is not None else "-", e.state.value, e.step.value, e.reason or "-", e.note)
             for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4]
        for row in rows
    )


class Progress:
    """A one-line progress bar with live counts on ``stream``, redrawn at most ten times a second.

    Pass :meth:`start` and :meth:`entry` as :class:`ReplayOptions` ``on_start`` and ``on_entry``.
    """

    def __init__(self, stream: TextIO, width: int = 24) -> None:
        self.stream = stream
        self.width = width
        self.total: int | None = None
        self.counts = dict.fromkeys(("replayed", "already_applied", "left_in_place", "failed"), 0)
        self.last = 0.0

    def start(self, total: int | None) -> None:
        self.total = total

    def entry(self, _entry: Entry, tally: str) -> None:
        self.counts[tally] += 1
        self.draw()

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < 0.1:
            return
        self.last = now
        done = sum(self.counts.values())
        if self.total:
            filled = min(self.width, self.width * done // self.total)
            bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total}"
        else:
            bar = f"{done} examined"
        c = self.counts
        self.stream.write(f"\r{bar} replayed={c['replayed']} applied={c['already_applied']} "
                          f"left={c['left_in_place']} failed={c['failed']}")
        self.stream.flush()

    def close(self) -> None:
        self.draw(force=True)
        self.stream.write("\n")
        self.stream.flush()

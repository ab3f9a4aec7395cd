"""The leases a renewer keeps alive, and when a refused renewal means "lost": one rule for both.

Sans-I/O: :class:`LeaseBook` holds the table; the thread renewer
(:class:`~dedupe_worker._transport.renewer.LeaseRenewer`, under its lock) and the asyncio renewer
(:class:`~dedupe_worker.asyncio.AsyncLeaseRenewer`, one book per event loop) drive it.

A renewal that Redis refuses means the token no longer owns the claim. That is a loss only when
our own write did not end the lease: once ``complete.lua`` stored the outcome (it deletes the
started record) or ``release.lua`` gave the claim back, a renewal sent before the engine stopped
tracking the lease is refused too. So a claim whose completion or release has been sent is
marked *settling* until it is untracked, and a refusal then marks nothing: the write's own reply
says whether the claim was still ours, and that reply is the verdict
(:meth:`~dedupe_worker._protocol.codec.ClaimCodec.owns`).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..observe._base import current as observer

__all__ = ["Lease", "LeaseBook", "lost_in_round", "round_failed", "round_of"]

log = logging.getLogger(__name__)

#: A claim's identity: ``(stem, fencing token)``.
Lease = tuple[str, int]


class LeaseBook:
    """Tracked leases (a count of holders each), those renewal found lost, those settling.

    A batch tracks its claims as a *group*: the claims of one round trip, kept and given up
    together (:meth:`track_group`, :meth:`settle_group`, :meth:`untrack_group`), so a message
    costs the book nothing of its own; a renewal round still renews each of them, and a refused
    one is marked lost like any other."""

    __slots__ = ("groups", "live", "lost", "next_group", "settling", "settling_groups")

    def __init__(self) -> None:
        self.live: dict[Lease, int] = {}
        self.lost: set[Lease] = set()
        self.settling: set[Lease] = set()
        #: Group id -> its claims (anything with ``stem`` and ``token``).
        self.groups: dict[int, Sequence[Any]] = {}
        self.settling_groups: set[int] = set()
        self.next_group = 0

    def holds(self) -> bool:
        """Whether any lease is tracked."""
        return bool(self.live or self.groups)

    def track(self, lease: Lease) -> None:
        self.live[lease] = self.live.get(lease, 0) + 1

    def untrack(self, lease: Lease) -> None:
        """One holder less; the last one forgets the lease (lost and settling marks included)."""
        live = self.live
        left = live.pop(lease, 0) - 1
        if left > 0:
            live[lease] = left
        else:
            if self.lost:
                self.lost.discard(lease)
            self.settling.discard(lease)

    def track_group(self, claims: Sequence[Any]) -> int:
        """Track the leases of ``claims`` as one group, until :meth:`untrack_group`; returns its id."""
        group = self.next_group = self.next_group + 1
        self.groups[group] = claims
        return group

    def settle_group(self, group: int) -> None:
        """As :meth:`settle`, for every claim of ``group``."""
        if group in self.groups:
            self.settling_groups.add(group)

    def untrack_group(self, group: int) -> None:
        """Forget ``group`` (lost marks of its claims included)."""
        claims = self.groups.pop(group, ())
        self.settling_groups.discard(group)
        if self.lost:
            for claim in claims:
                self.lost.discard((claim.stem, claim.token))

    def settle(self, leases: Iterable[Lease]) -> None:
        """A completion or release of ``leases`` is about to be sent: from now until they are
        untracked, a refused renewal is that write's doing, not a loss. (Leases of a group are
        settled with :meth:`settle_group`.)"""
        live = self.live
        if live:  # else ``leases`` is not even iterated: a batch's are in groups
            settling = self.settling
            for lease in leases:  # a loop, not a generator: usually one message's one lease
                if lease in live:
                    settling.add(lease)

    def due(self) -> list[Lease]:
        """The leases to renew now."""
        lost = self.lost
        due = [lease for lease in self.live if lease not in lost]
        for claims in self.groups.values():
            due += [lease for lease in ((c.stem, c.token) for c in claims) if lease not in lost]
        return due

    def refused(self, lease: Lease) -> bool:
        """Renewal of ``lease`` was refused: mark it lost, unless it is no longer tracked or its
        completion or release is in flight. True when it is now marked lost."""
        if lease in self.live:
            if lease in self.settling:
                return False
        else:  # in a group? (a scan, on this rare path only)
            stem, token = lease
            group = next((g for g, claims in self.groups.items()
                          if any(c.token == token and c.stem == stem for c in claims)), None)
            if group is None or group in self.settling_groups:
                return False
        self.lost.add(lease)
        return True

    def clear(self) -> None:
        """Forget everything (a forked child holds none of its parent's leases)."""
        self.live.clear()
        self.lost.clear()
        self.settling.clear()
        self.groups.clear()
        self.settling_groups.clear()


def round_of(items: list[Lease]) -> bool:
    """Whether a renewal round over ``items`` (the book's :meth:`~LeaseBook.due`) is to be sent;
    counts them for the observers either way."""
    observer.leases(len(items))
    return bool(items)


def round_failed(items: list[Lease], exc: BaseException) -> None:
    """A renewal round failed (Redis down): nothing is marked lost, the next round tries again."""
    log.warning("lease renewal of %d claims failed, will retry: %s", len(items), exc)
    observer.renewal_failed(len(items))


def lost_in_round(items: list[Lease], renewed: list[bool], refused: Callable[[Lease], bool]) -> list[Lease]:
    """The leases of a round that Redis refused and the book marks lost (``refused``: the book's
    :meth:`~LeaseBook.refused`, under the caller's lock if it has one), each logged."""
    lost = []
    for lease, ok in zip(items, renewed, strict=True):
        if ok or not refused(lease):
            continue  # renewed; or completed or released (or being so) while we were renewing
        log.warning("lease lost: key=%s token=%s", *lease)
        observer.lease_lost()
        lost.append(lease)
    return lost


#: Every lease renewer of this process (thread or task), told to forget its leases in a forked child.
_renewers: weakref.WeakSet[Any] = weakref.WeakSet()


def forget_after_fork(renewer: Any) -> None:
    """In a forked child, ``renewer._forget_after_fork()`` runs: the parent's leases are not the
    child's to renew, and its thread or tasks did not survive the fork."""
    _renewers.add(renewer)


def _after_fork_in_child() -> None:
    for renewer in list(_renewers):
        renewer._forget_after_fork()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork()
    os.register_at_fork(after_in_child=_after_fork_in_child)

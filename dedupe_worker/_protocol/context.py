"""The claim of the message being handled, for handlers that fence their own writes.

A handler can pass the fencing token to its database so that a worker whose lease ran out cannot
overwrite the work of its successor, even outside Redis::

    claim = current_claim()
    cur.execute("UPDATE accounts SET balance = %s, fence = %s WHERE id = %s AND fence < %s",
                (balance, claim.token, account_id, claim.token))
    if cur.rowcount == 0: raise LeaseLost(claim.key, claim.token)   # a newer owner wrote first
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

from .claim import Claim

__all__ = ["Holding", "Tracker", "bind_claim", "current_claim"]

_current: ContextVar[Claim | None] = ContextVar("dedupe_worker_current_claim", default=None)


def current_claim() -> Claim | None:
    """Return the claim (key and fencing token) of the message being handled, else ``None``."""
    return _current.get()


#: ``bind(claim)`` makes ``claim`` what :func:`current_claim` returns and gives the token that
#: ``unbind(token)`` takes to restore the previous one: :class:`Holding`'s halves, for the engine's
#: per-message path (the bound methods themselves, no Python frame around them).
bind = _current.set
unbind = _current.reset


@contextmanager
def bind_claim(claim: Claim) -> Iterator[Claim]:
    """Make ``claim`` what :func:`current_claim` returns while inside."""
    reset = _current.set(claim)
    try:
        yield claim
    finally:
        _current.reset(reset)


class Tracker(Protocol):
    """What keeps leases alive: the sync :class:`~dedupe_worker._protocol.renewer.LeaseRenewer`, or
    the asyncio one (:mod:`dedupe_worker.asyncio`)."""

    def track(self, stem: str, token: int) -> None: ...
    def untrack(self, stem: str, token: int) -> None: ...


class Holding:
    """While inside: the lease of ``claim`` is renewed and ``current_claim()`` is ``claim``.

    A plain class rather than ``@contextmanager``: it runs once per message, and generator-based
    context managers cost several microseconds there.
    """

    __slots__ = ("claim", "renewer", "reset")

    def __init__(self, renewer: Tracker, claim: Claim) -> None:
        self.renewer = renewer
        self.claim = claim

    def __enter__(self) -> Claim:
        self.renewer.track(self.claim.stem, self.claim.token)
        self.reset = bind(self.claim)
        return self.claim

    def __exit__(self, *exc_info: object) -> None:
        unbind(self.reset)
        self.renewer.untrack(self.claim.stem, self.claim.token)

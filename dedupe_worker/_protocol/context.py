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
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Protocol

from .claim import Claim

if TYPE_CHECKING:
    from .codec import ClaimCodec

__all__ = ["Confirms", "Holding", "Run", "Tracker", "bind_claim", "bind_run", "current_claim", "current_run",
           "unbind_run"]

_current: ContextVar[Claim | None] = ContextVar("dedupe_worker_current_claim", default=None)


def current_claim() -> Claim | None:
    """Return the claim (key and fencing token) of the message being handled, else ``None``."""
    return _current.get()


#: ``bind(claim)`` makes ``claim`` what :func:`current_claim` returns and gives the token that
#: ``unbind(token)`` takes to restore the previous one: :class:`Holding`'s halves, for the engine's
#: per-message path (the bound methods themselves, no Python frame around them).
bind = _current.set
unbind = _current.reset


class Confirms(Protocol):
    """What confirms that the row an ``atomic()`` block wrote in a joined transaction committed:
    a ``SqlOutcomes`` (its table), or the SQL store (the claim's own row)."""

    def committed(self, claim: Claim) -> bool:
        """Whether ``claim``'s row (its fencing token) is committed (one query)."""

    async def committed_async(self, claim: Claim) -> bool:
        """:meth:`committed` on asyncio."""


class Run:
    """Handlers the engine runs for a client given SQL ``outcomes``, or on the SQL store (one
    message's, or one batch chunk's), shared by the engine and ``dedupe_worker.sql.atomic()``.

    ``client`` is the client that claimed them: ``atomic()`` encodes results and dates rows with
    its options, whatever other clients share the outcomes. ``joined`` maps ``(stem, token)`` of
    each claim whose ``atomic()`` block joined a transaction it did not open to what confirms its
    row: that row commits, or not, when the transaction ends, which the block cannot see, so the
    engine confirms it.
    """

    __slots__ = ("client", "joined", "reset")
    reset: Token[Run | None]

    def __init__(self, client: ClaimCodec) -> None:
        self.client = client
        self.joined: dict[tuple[str, int], Confirms] = {}


_run: ContextVar[Run | None] = ContextVar("dedupe_worker_current_run", default=None)


def current_run() -> Run | None:
    """The :class:`Run` of the handler being run, else ``None``."""
    return _run.get()


#: ``bind_run(run)`` makes ``run`` what :func:`current_run` returns, ``unbind_run(token)`` undoes it.
bind_run = _run.set
unbind_run = _run.reset


@contextmanager
def bind_claim(claim: Claim) -> Iterator[Claim]:
    """Make ``claim`` what :func:`current_claim` returns while inside."""
    reset = _current.set(claim)
    try:
        yield claim
    finally:
        _current.reset(reset)


class Tracker(Protocol):
    """What keeps leases alive: the sync :class:`~dedupe_worker._transport.renewer.LeaseRenewer`, or
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

"""Where the engine meets outcomes committed in the handler's database (:mod:`dedupe_worker.sql`).

The engine calls these hooks and nothing else of that feature:

- :func:`applied_before_flow`: a handler raised
  :class:`~dedupe_worker.AlreadyApplied` (its ``atomic()`` block found an earlier run's committed
  row). The verdict is DUPLICATE with the committed result, which is stored in Redis under the
  claim, so the next delivery is answered there in one round trip.
- :func:`found_before_flow`: before running the handler of a key claimed
  again after an earlier claim (``Claim.reclaimed``: a crash, an outage, a lost lease), look the
  key's row up (one query) and answer DUPLICATE from it without running the handler. First
  claims pay nothing.
- :func:`unclaimed_flow`: under ``fail_open`` with Redis down, the handler
  runs with a claim of token 0 bound, so ``atomic()`` still lets one copy of a key commit.
- :func:`opened` / :func:`closed`: around handlers, a
  :class:`~dedupe_worker._protocol.context.Run` that ``atomic()`` reads (the
  client that claimed: its serializer and ``result_ttl`` give the row's outcome and expiry) and
  writes (the claims whose block joined a transaction it did not open);
  :func:`uncommitted_flow` then confirms such a claim's row committed (one query) before its
  outcome is stored, else the claim is released (:class:`~dedupe_worker.sql.NotCommitted`).

Each is a flow (:mod:`dedupe_worker._protocol.flows`), so the sync and asyncio engines run the
same code: a committed-row lookup is ``outcomes.lookup`` on one and ``outcomes.lookup_async`` on
the other.

Crash story: the committed row is the truth. If the process dies after the row committed and
before Redis stored the outcome, the next delivery finds the row (here, or in ``atomic()``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import AlreadyApplied, LeaseLost, NotCommitted, ResultNotSerializable, StoreUnavailable
from .._protocol import Claim, ClientCore, Either, Flow, Handler, Outcome, Run, bind, bind_run, unbind, unbind_run
from .decision import Decision, Reason

if TYPE_CHECKING:
    from .._protocol import ClaimCodec
    from .._transport import ClaimClient

__all__ = ["Outcomes", "applied_before_flow", "closed", "found_before_flow", "lookup", "lookup_flow", "opened",
           "outcomes_of", "unbound_claim", "unclaimed_flow", "uncommitted_flow"]

log = logging.getLogger(__name__)


class Outcomes(Protocol):
    """What a client's ``outcomes=`` option is: :class:`dedupe_worker.sql.SqlOutcomes`."""

    def attach(self, client: ClaimCodec) -> None:
        """Called once by the client given these outcomes (its namespace, serializer, TTL)."""

    def lookup(self, claim: Claim) -> AlreadyApplied | None:
        """The committed outcome of ``claim``'s key, else ``None`` (one query)."""

    async def lookup_async(self, claim: Claim) -> AlreadyApplied | None:
        """:meth:`lookup` on asyncio."""

    def committed(self, claim: Claim) -> bool:
        """Whether ``claim``'s own row (its token) is committed (one query)."""

    async def committed_async(self, claim: Claim) -> bool:
        """:meth:`committed` on asyncio."""


def opened(dedupe: ClaimCodec) -> Run | None:
    """A :class:`Run` made current for the handlers about to run, when ``dedupe`` has
    ``outcomes`` or its store records outcomes on the claim's row (the SQL store), else ``None``,
    nothing done; :func:`closed` ends it."""
    if (getattr(dedupe, "outcomes", None) is None  # outcomes_of, inline: every message asks
            and not getattr(getattr(dedupe, "store", None), "outcomes_on_row", False)):
        return None
    run = Run(dedupe)
    run.reset = bind_run(run)
    return run


def closed(run: Run | None) -> None:
    """End a :class:`Run` made by :func:`opened`."""
    if run is not None:
        unbind_run(run.reset)


def uncommitted_flow(claim: Claim, run: Run) -> Flow[NotCommitted | None]:
    """``None`` when ``claim``'s outcome may be stored: its ``atomic()`` block opened its own
    transaction (nothing to confirm), or joined one whose commit is confirmed by one query. Else
    :class:`NotCommitted`: the caller must release the claim so that a redelivery runs again
    (safe even if that transaction commits later: the redelivery's ``atomic()`` finds the row)."""
    confirms = run.joined.get((claim.stem, claim.token))
    if confirms is None:
        return None
    try:
        committed = yield Either(lambda: confirms.committed(claim), lambda: confirms.committed_async(claim))
    except Exception as exc:
        log.warning("could not confirm the commit of key=%s token=%s, releasing it: %s", claim.key, claim.token, exc)
        committed = False
    if committed:
        return None
    log.warning("key=%s token=%s: the transaction atomic() joined did not commit; releasing the claim",
                claim.key, claim.token)
    return NotCommitted(claim.key, claim.token)


def outcomes_of(dedupe: object) -> Outcomes | None:
    """The ``outcomes`` a client was given, else ``None``."""
    return getattr(dedupe, "outcomes", None)


def duplicate(claim: Claim, found: AlreadyApplied) -> Decision:
    log.info("key=%s token=%s already applied by token=%s (committed in the database)",
             claim.key, claim.token, found.token)
    return Decision(Reason.DUPLICATE, claim, found.result)


def not_stored(claim: Claim, exc: Exception) -> None:
    # The row stays the truth: a later delivery finds it again, so the message is acked anyway.
    log.warning("could not store the committed result of key=%s token=%s in Redis: %s", claim.key, claim.token, exc)


def applied_before_flow(dedupe: ClientCore, claim: Claim, found: AlreadyApplied) -> Flow[Decision]:
    """DUPLICATE with ``found.result``, stored in Redis as ``claim``'s outcome (one round trip)."""
    try:
        yield from dedupe.complete_flow(claim, found.result, None)
    except (LeaseLost, ResultNotSerializable, StoreUnavailable) as exc:
        not_stored(claim, exc)
    return duplicate(claim, found)


def lookup_flow(dedupe: ClientCore, claim: Claim) -> Flow[AlreadyApplied | None]:
    """For a re-claimed key with ``outcomes`` set: its committed outcome, else ``None`` (run the
    handler). A failing lookup runs the handler: ``atomic()`` still refuses a second commit."""
    outcomes = outcomes_of(dedupe)
    if outcomes is None or not claim.reclaimed:
        return None
    try:
        found: AlreadyApplied | None = yield Either(lambda: outcomes.lookup(claim),
                                                    lambda: outcomes.lookup_async(claim))
    except Exception as exc:
        log.warning("outcome lookup failed key=%s token=%s, running the handler: %s", claim.key, claim.token, exc)
        return None
    return found


def found_before_flow(dedupe: ClientCore, claim: Claim) -> Flow[Decision | None]:
    """DUPLICATE from the committed row of a re-claimed key (stored in Redis), else ``None``."""
    found = yield from lookup_flow(dedupe, claim)
    return None if found is None else (yield from applied_before_flow(dedupe, claim, found))


def lookup(dedupe: ClaimClient, claim: Claim) -> AlreadyApplied | None:
    """:func:`lookup_flow` on the sync client (the batch engine's)."""
    return dedupe._drive(lookup_flow(dedupe, claim))


def unbound_claim(dedupe: ClaimCodec, key: str | bytes) -> Claim:
    request = dedupe.request(key)
    return Claim(request.key, Outcome.ACQUIRED, 0, stem=request.stem)


def unclaimed_flow(dedupe: ClientCore, key: str | bytes, handler: Callable[[], Any]) -> Flow[Any]:
    """``handler`` as ``fail_open`` runs it without a claim (its value, or its exception): with
    ``outcomes`` set, under a bound claim of token 0, so ``atomic()`` works and one copy commits
    (the others' ``AlreadyApplied`` is answered DUPLICATE with the committed result by the
    engine's outage path)."""
    if outcomes_of(dedupe) is None:
        return (yield Handler(handler))
    reset, run = bind(unbound_claim(dedupe, key)), opened(dedupe)
    try:  # nothing to confirm: with Redis down no outcome is stored
        return (yield Handler(handler))
    finally:
        closed(run)
        unbind(reset)

"""The :class:`Deduplicator`: the protocol client, with the engine's ``run()`` on top."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, Unpack

from ._engine import Outcomes, decide_flow, execute, handler_of, outcome, settle_failure, verdict_of
from ._protocol import KEY_HARD_LIMIT, Claim, ClientCore, Holding
from ._settings import ClientKeywords, ClientOptions, DedupeSettings
from ._transport import ClaimClient

__all__ = ["KEY_HARD_LIMIT", "Deduplicator", "DeduplicatorCore", "DeduplicatorKeywords", "sql_outcomes"]

T = TypeVar("T")
D = TypeVar("D", bound="DeduplicatorCore")


class DeduplicatorKeywords(ClientKeywords, total=False):
    """A deduplicator's keywords: a client's, and ``outcomes``."""

    outcomes: Outcomes | None


class DeduplicatorCore(ClientCore):
    """What both deduplicators add to their protocol client, written once: ``outcomes`` read from
    the settings, :meth:`hold` and :meth:`answer`."""

    outcomes: Outcomes | None

    def __init__(self, redis_client: Any, *, outcomes: Outcomes | None = None, options: ClientOptions | None = None,
                 **keywords: Unpack[ClientKeywords]) -> None:
        client: Any = super()  # the sync or asyncio client, next in the deduplicator's MRO
        client.__init__(redis_client, options=options, **keywords)
        #: Where ``atomic()`` commits outcomes (``None``: nowhere); see :mod:`dedupe_worker.sql`.
        self.outcomes = outcomes
        if outcomes is not None:
            outcomes.attach(self)

    @classmethod
    def from_url(cls: type[D], url: str, *, options: ClientOptions | None = None,
                 **keywords: Unpack[DeduplicatorKeywords]) -> D:
        """:meth:`ClaimClient.from_url <dedupe_worker.ClaimClient.from_url>`, taking ``outcomes`` too."""
        return cls._from_url(url, options, keywords)

    @classmethod
    def from_settings(cls: type[D], settings: DedupeSettings | None = None,
                      **keywords: Unpack[DeduplicatorKeywords]) -> D:
        """Build from :class:`DedupeSettings` (read from ``DEDUPE_*`` when not given), with
        ``outcomes`` from ``DEDUPE_SQL_DSN`` when it is set; keywords win over the settings."""
        s = settings or DedupeSettings()
        if "outcomes" not in keywords and s.sql_dsn:
            keywords["outcomes"] = sql_outcomes(s)
        return cls._from_url(s.claims_url, s.options(), keywords)

    def hold(self, claim: Claim) -> Holding:
        """While inside (``with``; in a coroutine on asyncio): the lease is renewed and
        ``current_claim()`` is ``claim``."""
        return Holding(self.renewer, claim)

    @staticmethod
    def answer(claim: Claim) -> Any:
        """The stored value of a DUPLICATE; raises for IN_PROGRESS, CONFLICT and stored failures."""
        decision = verdict_of(claim)
        if decision is None:
            raise ValueError(f"claim on {claim.key!r} was acquired; there is nothing stored to answer")
        return outcome(decision)


class Deduplicator(DeduplicatorCore, ClaimClient):
    """Makes at-least-once delivery apply once, with Redis as the store of claims and outcomes.

    The protocol calls (``begin``, ``complete``, ``fail``, ``release``, ``renew``, ``status`` and
    their batch forms) are :class:`~dedupe_worker.ClaimClient`'s; :meth:`run` and
    :meth:`apply` hand the work to the engine (:mod:`dedupe_worker._engine`), the same one every
    integration uses.

    What is guaranteed: while a key's records live (``result_ttl`` after completion), the work for
    that key is *completed* at most once; a claimant whose lease ran out can never store an outcome
    over its successor's (fencing tokens strictly increase per key); a failure of Redis never runs
    the handler unless ``fail_open`` is set.

    What is not: a worker that crashes mid-handler leaves its side effects half done and the claim
    held until the lease runs out; the next delivery then runs the handler again (make effects
    idempotent or fence them with :func:`~dedupe_worker.current_claim`). After a Redis failover with
    asynchronous replication a just-written claim or result can be lost. After ``result_ttl`` a
    redelivery is treated as new.

    Options: see :class:`~dedupe_worker.ClaimClient`, and ``outcomes``: a
    :class:`dedupe_worker.sql.SqlOutcomes` whose table ``dedupe_worker.sql.atomic()`` records each
    key's outcome in, inside the handler's own database transaction, so an effect committed there
    is never applied twice, even when Redis forgets the key or a crash comes before ``complete()``.
    """

    def run(self, key: str | bytes, fn: Callable[..., T], /, *args: Any, fingerprint: Any = None,
            wait: float = 0.0, ttl: float | None = None, **kwargs: Any) -> T:
        """Claim ``key``, run ``fn(*args, **kwargs)`` once, store and return its value (kept
        ``ttl`` seconds when given, instead of ``result_ttl``; the lease is unchanged).

        A duplicate returns the stored value without calling ``fn``. With ``wait``, a key held by
        another worker is waited on for up to that many seconds: its stored value is returned
        within about one round trip of its completion, and if it releases the key or its lease
        runs out, ``fn`` runs here. Raises :class:`InProgress`
        (with ``retry_after``), :class:`KeyConflict`, :class:`PreviouslyFailed`,
        :class:`LeaseLost` (``fn`` ran but a successor owns the key), :class:`ResultNotSerializable`
        (``fn`` ran; stored as omitted), :class:`StoreUnavailable` (``fn`` not run, unless
        ``fail_open``) and whatever ``fn`` raised (the claim is released, or for
        ``permanent_errors`` the failure stored).
        """
        return outcome(self._drive(decide_flow(  # type: ignore[no-any-return]
            self, key, handler_of(fn, args, kwargs), fingerprint, wait, "run", ttl)))

    def apply(self, claim: Claim, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` for an ACQUIRED ``claim`` and store its outcome; raises as :meth:`run`.

        If the process dies inside ``fn``, the claim stays held until the lease runs out; then
        another delivery may run ``fn`` again.
        """
        handler = (lambda: fn(*args, **kwargs)) if args or kwargs else fn
        return outcome(execute(self, claim, handler))  # type: ignore[no-any-return]

    def settle_failure(self, claim: Claim, exc: BaseException) -> None:
        """After work for ``claim`` raised ``exc``: store a permanent failure or release the
        claim. Never raises."""
        settle_failure(self, claim, exc)


def sql_outcomes(settings: DedupeSettings) -> Outcomes | None:
    """The :class:`~dedupe_worker.sql.SqlOutcomes` of ``sql_dsn`` and ``sql_table``, else ``None``
    (``from_settings`` of both deduplicators; the settings themselves import nothing of the package)."""
    if not settings.sql_dsn:
        return None
    from .sql import SqlOutcomes

    return SqlOutcomes(settings.sql_dsn, table=settings.sql_table)

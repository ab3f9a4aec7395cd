"""``atomic(connection)``: a handler's database work and its outcome, committed together once.

::

    with atomic(conn) as outcome:          # conn: psycopg Connection, SQLAlchemy Connection/Session
        conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (amount, account))
        outcome.result = {"account": account}
    return outcome.result

    async with atomic(session) as outcome: # psycopg AsyncConnection, SQLAlchemy AsyncConnection/AsyncSession
        ...

What is guaranteed: of all the runs of one key (redeliveries after a crash, a zombie whose lease
ran out, copies run under ``fail_open`` while Redis was down, a redelivery after Redis lost its
data) the first transaction to commit wins; every other run's block raises
:class:`~dedupe_worker.AlreadyApplied` with the winner's result, and nothing of it commits. The
engine answers that as DUPLICATE (stored in Redis, acked). The block adds at most two statements
to the transaction: an ``INSERT`` at entry (it waits while another run of the key holds an
uncommitted row) and an ``UPDATE`` with the outcome at exit (none when the outcome is ``None``);
two more when it takes over an expired row.

A row means what the Redis record means: past its expiry (the claim's ``ttl``, else its client's
``result_ttl``) it is absent, and the block replaces it in the same transaction; an unexpired row
written for another payload (another fingerprint) raises :class:`~dedupe_worker.KeyConflict`,
which the engine answers CONFLICT (dead-lettered), as Redis would.

Transactions: with no transaction open, the block is its own (committed at exit, rolled back
when it raises). Inside an open one it is a savepoint: what the block did is rolled back when it
raises, and the outcome commits when (and only if) the caller's transaction commits. The engine
then stores the outcome in Redis only once one query confirmed the row committed; if the caller
rolled back (or its transaction is still open when the handler returns), the claim is released,
the verdict is HANDLER_ERROR with :class:`~dedupe_worker.sql.NotCommitted` and a redelivery runs
the handler again (a claim held by hand, ``Deduplicator.hold()``, has no such check: call
``complete()`` after your commit). A caller that catches :class:`~dedupe_worker.AlreadyApplied`
and commits its own earlier writes commits those: let it propagate. Every isolation level works:
at READ COMMITTED (PostgreSQL's default) a copy waits for the winner and reads its row;
MySQL/MariaDB read it with a locking read; PostgreSQL's REPEATABLE READ and SERIALIZABLE make the
losers fail with a serialization error instead (retried, then answered from the row).

What it cannot do: effects outside this database (an e-mail, an HTTP call, another database)
are not in the transaction; a crash after them and before the commit runs them again.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

from .._protocol import Claim, ClaimCodec, Run, current_claim, current_run, drive, drive_async
from ._drivers import AsyncDriver, Driver, async_driver, sync_driver
from ._outcomes import SqlOutcomes, attached, namespace_of
from ._statements import Dialect, Statement, dialect_named, enter, leave

__all__ = ["Atomic", "AtomicOutcome", "atomic"]


class AtomicOutcome:
    """What ``with atomic(...) as outcome`` gives: set ``outcome.result`` to the handler's result
    (JSON, as the claim client stores it); it is recorded with the row at the block's exit."""

    __slots__ = ("claim", "result")

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self.result: Any = None


def _current() -> Claim:
    claim = current_claim()
    if claim is None:
        raise RuntimeError("atomic() must run inside a handler run by dedupe-worker (Deduplicator.run, "
                           "@idempotent, IdempotentTask or a Dedupe consumer): there is no current claim")
    return claim


def _recording(claim: Claim, outcomes: SqlOutcomes | None) -> tuple[SqlOutcomes, ClaimCodec, Run | None]:
    """The table, the codec and the engine's :class:`Run` of ``claim``: those of the client that
    claimed it (its ``result_ttl`` and serializer, not those of another client sharing the
    ``SqlOutcomes``). A claim bound by hand (``Deduplicator.hold``), or one of a nested run by a
    client without outcomes, gets the client attached for its namespace, and no run."""
    run = current_run()
    if run is not None and namespace_of(claim.stem) == run.client.layout.namespace:
        given = outcomes if outcomes is not None else getattr(run.client, "outcomes", None)
        if isinstance(given, SqlOutcomes):
            return given, run.client, run
    return (*attached(claim, outcomes), None)


class Atomic:
    """The context manager :func:`atomic` returns: ``with`` for sync connections, ``async with``
    for asyncio ones."""

    def __init__(self, connection: Any, outcomes: SqlOutcomes | None = None, driver: Driver | None = None) -> None:
        self.connection = connection
        self.claim = _current()
        self.outcomes, self.codec, self.run = _recording(self.claim, outcomes)
        self.outcome = AtomicOutcome(self.claim)
        self._driver = driver
        self._transaction: Any = None

    def _dialect(self, name: str) -> Dialect:
        return dialect_named(name, self.outcomes.table)

    def _entered(self, joined: bool) -> None:
        """This run's row is in the transaction; one the block joined commits out of its sight, so
        the engine confirms it before storing the outcome (engine/recorded.py)."""
        if joined and self.run is not None:
            self.run.joined[(self.claim.stem, self.claim.token)] = self.outcomes

    # -- sync -------------------------------------------------------------------------------------

    def __enter__(self) -> AtomicOutcome:
        driver = self._driver or sync_driver(self.connection)
        if driver is None:
            raise TypeError(f"atomic() takes a psycopg Connection or a SQLAlchemy Connection or Session "
                            f"(use 'async with' for asyncio ones), not {type(self.connection).__name__}")
        self._driver = driver
        dialect, joined = self._dialect(driver.dialect), driver.joined()
        self._transaction = transaction = driver.transaction()
        transaction.__enter__()
        try:
            drive(enter(dialect, self.codec, self.claim), {Statement: driver.execute})
        except BaseException as exc:
            transaction.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._entered(joined)
        return self.outcome

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        driver, transaction = self._driver, self._transaction
        assert driver is not None and transaction is not None
        record = None if kind is not None else leave(self._dialect(driver.dialect), self.codec, self.claim,
                                                          self.outcome.result)
        if record is not None:
            try:
                driver.execute(record)
            except BaseException as failed:
                transaction.__exit__(type(failed), failed, failed.__traceback__)
                raise
        return transaction.__exit__(kind, exc, tb)  # type: ignore[no-any-return]

    # -- asyncio ----------------------------------------------------------------------------------

    async def __aenter__(self) -> AtomicOutcome:
        driver = async_driver(self.connection)
        if driver is None:
            raise TypeError(f"'async with atomic()' takes a psycopg AsyncConnection or a SQLAlchemy "
                            f"AsyncConnection or AsyncSession, not {type(self.connection).__name__}")
        self._async_driver = driver
        dialect, joined = self._dialect(driver.dialect), driver.joined()
        self._transaction = transaction = driver.transaction()
        await transaction.__aenter__()
        try:
            await drive_async(enter(dialect, self.codec, self.claim), {Statement: driver.execute})
        except BaseException as exc:
            await transaction.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._entered(joined)
        return self.outcome

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        driver: AsyncDriver = self._async_driver
        transaction = self._transaction
        record = None if kind is not None else leave(self._dialect(driver.dialect), self.codec, self.claim,
                                                          self.outcome.result)
        if record is not None:
            try:
                await driver.execute(record)
            except BaseException as failed:
                await transaction.__aexit__(type(failed), failed, failed.__traceback__)
                raise
        return await transaction.__aexit__(kind, exc, tb)  # type: ignore[no-any-return]


#: Asked in turn by :func:`atomic` given no ``outcomes``: each takes the connection and answers
#: the block that records the current claim's outcome on the claim's own row, or ``None``. The
#: SQL store adds its own (:mod:`dedupe_worker._sqlstore.atomic`) when a client on it starts, so
#: this package imports nothing above it.
OWN_ROW: list[Callable[[Any], Any]] = []


def atomic(connection: Any, *, outcomes: SqlOutcomes | None = None) -> Atomic:
    """Run a block in a transaction on ``connection`` that also records the current claim's key
    and, at exit, the block's ``outcome.result``; raise :class:`~dedupe_worker.AlreadyApplied` at
    entry when an earlier run of the key committed (see the module's docstring).

    ``outcomes``: the :class:`SqlOutcomes` whose table to use; by default the one given to the
    ``Deduplicator`` (or ``AsyncDeduplicator``) that runs the handler. Raises :class:`KeyConflict`
    at entry when an unexpired row was committed for another payload. Raises ``RuntimeError``
    outside a handler run by the engine (no current claim) or when no ``SqlOutcomes`` is known.

    A deduplicator on the SQL store (``from_url("postgresql://...")``) given no ``SqlOutcomes``
    records the outcome on the claim's own row instead (:mod:`dedupe_worker._sqlstore.atomic`)."""
    if outcomes is None:
        for own_row in OWN_ROW:
            on_store = own_row(connection)
            if on_store is not None:
                return on_store  # type: ignore[no-any-return]
    return Atomic(connection, outcomes)


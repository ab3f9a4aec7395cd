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

from collections.abc import Generator
from types import TracebackType
from typing import Any

from .._protocol import Claim, ClaimCodec, Run, current_claim, current_run, drive, drive_async
from ._drivers import AsyncDriver, Driver, async_driver, sync_driver
from ._outcomes import SqlOutcomes, attached, namespace_of
from ._statements import Dialect, Statement, dialect_named, enter, leave

__all__ = ["Atomic", "AtomicOutcome", "Block", "atomic"]


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


class Block:
    """A block run in a transaction on a connection, with statements at its entry and at its exit,
    written once for sync connections (``with``) and asyncio ones (``async with``).

    Subclasses give the statements as flows (:meth:`entry`, :meth:`exit`: generators yielding
    :class:`Statement` and sent each one's answer), driven by the protocol's drivers. The block is
    its own transaction, or a savepoint in the caller's; a block that joined a transaction it did
    not open commits out of its sight, so it is registered with the engine's run (``confirms``
    answers whether the row committed) and the claim is completed only once the row is confirmed
    (engine/recorded.py)."""

    def __init__(self, connection: Any, claim: Claim, run: Run | None, confirms: Any,
                 driver: Driver | None = None) -> None:
        self.connection = connection
        self.claim = claim
        self.run = run
        self.confirms = confirms
        self.outcome = AtomicOutcome(claim)
        self._driver: Any = driver
        self._transaction: Any = None

    def entry(self, dialect: str) -> Generator[Statement, Any, None]:
        """The statements at entry; raises what the row says (``AlreadyApplied``, ``LeaseLost``, ...)."""
        raise NotImplementedError

    def exit(self, dialect: str) -> Generator[Statement, Any, None]:
        """The statements that record ``outcome.result`` at a clean exit."""
        raise NotImplementedError

    def _entered(self, joined: bool) -> None:
        if joined and self.run is not None:
            self.run.joined[(self.claim.stem, self.claim.token)] = self.confirms

    # -- sync -------------------------------------------------------------------------------------

    def __enter__(self) -> AtomicOutcome:
        driver = self._driver = self._driver or sync_driver(self.connection)
        if driver is None:
            raise TypeError(f"atomic() takes a psycopg Connection or a SQLAlchemy Connection or Session "
                            f"(use 'async with' for asyncio ones), not {type(self.connection).__name__}")
        joined = driver.joined()
        self._transaction = transaction = driver.transaction()
        transaction.__enter__()
        try:
            drive(self.entry(driver.dialect), {Statement: driver.execute})
        except BaseException as exc:
            transaction.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._entered(joined)
        return self.outcome

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        driver, transaction = self._driver, self._transaction
        assert driver is not None and transaction is not None
        if kind is None:
            try:
                drive(self.exit(driver.dialect), {Statement: driver.execute})
            except BaseException as failed:
                transaction.__exit__(type(failed), failed, failed.__traceback__)
                raise
        return transaction.__exit__(kind, exc, tb)  # type: ignore[no-any-return]

    # -- asyncio ----------------------------------------------------------------------------------

    async def __aenter__(self) -> AtomicOutcome:
        driver: AsyncDriver | None = async_driver(self.connection)
        if driver is None:
            raise TypeError(f"'async with atomic()' takes a psycopg AsyncConnection or a SQLAlchemy "
                            f"AsyncConnection or AsyncSession, not {type(self.connection).__name__}")
        self._driver = driver
        joined = driver.joined()
        self._transaction = transaction = driver.transaction()
        await transaction.__aenter__()
        try:
            await drive_async(self.entry(driver.dialect), {Statement: driver.execute})
        except BaseException as exc:
            await transaction.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._entered(joined)
        return self.outcome

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        driver, transaction = self._driver, self._transaction
        if kind is None:
            try:
                await drive_async(self.exit(driver.dialect), {Statement: driver.execute})
            except BaseException as failed:
                await transaction.__aexit__(type(failed), failed, failed.__traceback__)
                raise
        return await transaction.__aexit__(kind, exc, tb)  # type: ignore[no-any-return]


class Atomic(Block):
    """The block :func:`atomic` returns for a :class:`SqlOutcomes` table: ``with`` for sync
    connections, ``async with`` for asyncio ones."""

    def __init__(self, connection: Any, outcomes: SqlOutcomes | None = None, driver: Driver | None = None) -> None:
        claim = _current()
        self.outcomes, self.codec, run = _recording(claim, outcomes)
        super().__init__(connection, claim, run, self.outcomes, driver)

    def _dialect(self, name: str) -> Dialect:
        return dialect_named(name, self.outcomes.table)

    def entry(self, dialect: str) -> Generator[Statement, Any, None]:
        return enter(self._dialect(dialect), self.codec, self.claim)

    def exit(self, dialect: str) -> Generator[Statement, Any, None]:
        record = leave(self._dialect(dialect), self.codec, self.claim, self.outcome.result)
        if record is not None:
            yield record


def atomic(connection: Any, *, outcomes: SqlOutcomes | None = None) -> Block:
    """Run a block in a transaction on ``connection`` that also records the current claim's key
    and, at exit, the block's ``outcome.result``; raise :class:`~dedupe_worker.AlreadyApplied` at
    entry when an earlier run of the key committed (see the module's docstring).

    ``outcomes``: the :class:`SqlOutcomes` whose table to use; by default the one given to the
    ``Deduplicator`` (or ``AsyncDeduplicator``) that runs the handler. Raises :class:`KeyConflict`
    at entry when an unexpired row was committed for another payload. Raises ``RuntimeError``
    outside a handler run by the engine (no current claim) or when no ``SqlOutcomes`` is known.

    A deduplicator on the SQL store (``from_url("postgresql://...")``) given no ``SqlOutcomes``
    records the outcome on the claim's own row instead: its store registered a recorder for its
    namespace (:func:`~dedupe_worker.sql._outcomes.register`) whose ``block`` gives that block
    (:mod:`dedupe_worker._sqlstore.atomic`)."""
    if outcomes is None:
        claim = _current()
        recorder, _ = attached(claim)
        if not isinstance(recorder, SqlOutcomes):
            return recorder.block(connection, claim)  # type: ignore[no-any-return]
    return Atomic(connection, outcomes)

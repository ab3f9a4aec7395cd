"""``atomic(conn)`` on the SQL store's own database: the effect and the key's outcome in the
handler's transaction, on the claim's own row.

When the claims live in the database the handler writes to (the SQL store), ``atomic(conn)``
needs no outcome table: at entry it locks the claim's row in the handler's transaction
(``SELECT ... FOR UPDATE``) and checks that this claim's token still owns it; at exit it stores
the outcome on that row, checked against the token again, in the same transaction. The effect and
the outcome commit together or not at all: there is no window between them.

Crash story: killed after the block commits and before the engine stores the outcome, the row
already holds it; the redelivery's claim answers DUPLICATE from it (the handler does not run),
and the engine's own completion of the first run, were it to come, finds its outcome stored under
its token (answered as stored). Killed before the commit: nothing of the block is kept, the lease
runs out, the redelivery runs the handler.

Inside a transaction the block did not open (a savepoint in the caller's), the outcome commits
when, and only if, the caller's transaction commits: the engine then confirms, with one
``inspect`` of the row, that the outcome is there under this claim's token before it completes
the claim; if the caller rolled back, the claim is released (the verdict is HANDLER_ERROR with
:class:`~dedupe_worker.sql.NotCommitted`) and a redelivery runs the handler again. A handler
that returns with that transaction still open holds the row's lock: the release waits for it.

While the block runs the row is locked: a copy of the key claimed meanwhile waits for the
handler's transaction instead of answering IN_PROGRESS at once (keep such transactions short),
and the lease renewer waits too (the lease cannot be lost while the row is locked by its owner:
nobody else can take it). A run whose lease was lost finds another token on the row and raises
:class:`~dedupe_worker.LeaseLost` at entry: nothing of its block commits.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from .._errors import LeaseLost
from .._protocol import Claim, Stored, current_claim, current_run
from ..sql._atomic import OWN_ROW, AtomicOutcome
from ..sql._drivers import async_driver, sync_driver
from ..sql._statements import Statement, recorded
from .urls import POSTGRESQL

__all__ = ["StoreAtomic", "register", "store_atomic"]

#: namespace -> the claim client on a SQL store serving it (its codec encodes the outcome).
_clients: dict[str, Any] = {}


def register(client: Any) -> None:
    """Called by a claim client built on a SQL store: ``atomic()`` in its handlers uses its row."""
    _clients[client.layout.namespace] = client


def store_atomic(connection: Any) -> StoreAtomic | None:
    """The :class:`StoreAtomic` for the current claim when its client runs on a SQL store and was
    given no ``SqlOutcomes`` (those keep their own table), else ``None``."""
    claim = current_claim()
    if claim is None or ":{" not in claim.stem:
        return None
    client = _clients.get(claim.stem[:claim.stem.index(":{")])
    if client is None or getattr(client, "outcomes", None) is not None:
        return None
    return StoreAtomic(connection, claim, client)


OWN_ROW.append(store_atomic)  # atomic() given no SqlOutcomes asks it first

def _now(dialect: str) -> str:
    return "clock_timestamp()" if dialect == POSTGRESQL else "NOW(6)"


class StoreAtomic:
    """The context manager (``with``, or ``async with`` for asyncio connections) of the module doc."""

    def __init__(self, connection: Any, claim: Claim, client: Any) -> None:
        self.connection = connection
        self.claim = claim
        self.client = client
        self.outcome = AtomicOutcome(claim)
        self._driver: Any = None
        self._transaction: Any = None

    def _lock(self, dialect: str) -> Statement:
        return Statement("SELECT owner, status, token, value FROM dedupe_claims "
                         f"WHERE stem = %(stem)s AND expires_at > {_now(dialect)} FOR UPDATE",
                         {"stem": self.claim.stem.encode("utf-8")}, reads=True)

    def _check(self, row: Any) -> None:
        """Raise what the locked row says: AlreadyApplied (an outcome is stored), LeaseLost
        (another token owns it, or it is gone)."""
        claim = self.claim
        if row is None:
            raise LeaseLost(claim.key, claim.token)
        owner, status, token, value = row
        if status is not None:
            letter = status.decode() if isinstance(status, bytes) else str(status)
            raise recorded(self.client, claim, (token, letter, bytes(value) if value is not None else None))
        if int(owner) != claim.token:
            raise LeaseLost(claim.key, claim.token)

    def _entered(self, joined: bool) -> None:
        """A block that joined a transaction it did not open commits out of its sight: the
        engine's run confirms the row before the claim is completed (engine/recorded.py)."""
        run = current_run()
        if joined and run is not None and run.client.layout.namespace == self.client.layout.namespace:
            run.joined[(self.claim.stem, self.claim.token)] = self.client.store

    def _record(self, dialect: str) -> list[Statement]:
        claim, client = self.claim, self.client
        status, data, _ = client.encode(claim, self.outcome.result)
        params = {"stem": claim.stem.encode("utf-8"), "token": claim.token, "status": status.value,
                  "value": data if status is Stored.COMPLETED else b"", "ms": client.result_ttl_ms(claim.ttl)}
        expiry = ("clock_timestamp() + make_interval(secs => %(ms)s / 1000.0)" if dialect == POSTGRESQL
                  else "NOW(6) + INTERVAL %(ms)s * 1000 MICROSECOND")
        status_value = "%(status)s::\"char\"" if dialect == POSTGRESQL else "%(status)s"
        statements = []
        if dialect == POSTGRESQL:  # waiters are woken when the commit makes the outcome visible
            statements.append(Statement("SELECT pg_notify('dedupe_notice', md5(stem) || ':' || waiters) "
                                        "FROM dedupe_claims WHERE stem = %(stem)s AND waiters > 0", params, reads=True))
        statements.append(Statement(
            f"UPDATE dedupe_claims SET status = {status_value}, token = %(token)s, value = %(value)s, owner = 0, "
            f"deadline = NULL, waiters = 0, expires_at = {expiry} "
            "WHERE stem = %(stem)s AND owner = %(token)s AND status IS NULL", params))
        return statements

    def __enter__(self) -> Any:
        driver = self._driver = sync_driver(self.connection)
        if driver is None:
            raise TypeError(f"atomic() takes a psycopg Connection or a SQLAlchemy Connection or Session, "
                            f"not {type(self.connection).__name__}")
        joined = driver.joined()
        self._transaction = transaction = driver.transaction()
        transaction.__enter__()
        try:
            self._check(driver.execute(self._lock(driver.dialect)))
        except BaseException as exc:
            transaction.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._entered(joined)
        return self.outcome

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        driver, transaction = self._driver, self._transaction
        if kind is None:
            try:
                for statement in self._record(driver.dialect):
                    driver.execute(statement)
            except BaseException as failed:
                transaction.__exit__(type(failed), failed, failed.__traceback__)
                raise
        return transaction.__exit__(kind, exc, tb)  # type: ignore[no-any-return]

    async def __aenter__(self) -> Any:
        driver = self._driver = async_driver(self.connection)
        if driver is None:
            raise TypeError(f"'async with atomic()' takes a psycopg AsyncConnection or a SQLAlchemy "
                            f"AsyncConnection or AsyncSession, not {type(self.connection).__name__}")
        joined = driver.joined()
        self._transaction = transaction = driver.transaction()
        await transaction.__aenter__()
        try:
            self._check(await driver.execute(self._lock(driver.dialect)))
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
                for statement in self._record(driver.dialect):
                    await driver.execute(statement)
            except BaseException as failed:
                await transaction.__aexit__(type(failed), failed, failed.__traceback__)
                raise
        return await transaction.__aexit__(kind, exc, tb)  # type: ignore[no-any-return]

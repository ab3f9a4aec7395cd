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

from collections.abc import Generator
from typing import Any

from .._errors import LeaseLost
from .._protocol import Claim, Stored, current_run
from ..sql._atomic import Block
from ..sql._outcomes import register
from ..sql._statements import Statement, recorded
from .urls import POSTGRESQL

__all__ = ["OwnRows", "StoreAtomic"]


class OwnRows:
    """Where ``atomic()`` records for a claim client on the SQL store given no ``SqlOutcomes``:
    the claim's own row. Registered for the client's namespace when the client starts (a
    ``SqlOutcomes`` given to the client registers after it, and takes its place)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        register(client.layout.namespace, self, client)

    def block(self, connection: Any, claim: Claim) -> StoreAtomic:
        run = current_run()
        same = run is not None and run.client.layout.namespace == self.client.layout.namespace
        return StoreAtomic(connection, claim, self.client, run if same else None)


def _now(dialect: str) -> str:
    return "clock_timestamp()" if dialect == POSTGRESQL else "NOW(6)"


class StoreAtomic(Block):
    """The block (``with``, or ``async with`` for asyncio connections) of the module doc."""

    def __init__(self, connection: Any, claim: Claim, client: Any, run: Any) -> None:
        super().__init__(connection, claim, run, client.store)
        self.client = client

    def entry(self, dialect: str) -> Generator[Statement, Any, None]:
        """Lock the claim's row and raise what it says: AlreadyApplied (an outcome is stored),
        LeaseLost (another token owns it, or it is gone)."""
        claim = self.claim
        row = yield Statement("SELECT owner, status, token, value FROM dedupe_claims "
                              f"WHERE stem = %(stem)s AND expires_at > {_now(dialect)} FOR UPDATE",
                              {"stem": claim.stem.encode("utf-8")}, reads=True)
        if row is None:
            raise LeaseLost(claim.key, claim.token)
        owner, status, token, value = row
        if status is not None:
            letter = status.decode() if isinstance(status, bytes) else str(status)
            raise recorded(self.client, claim, (token, letter, bytes(value) if value is not None else None))
        if int(owner) != claim.token:
            raise LeaseLost(claim.key, claim.token)

    def exit(self, dialect: str) -> Generator[Statement, Any, None]:
        """Store the outcome on the row, checked against the token (PostgreSQL: waiters woken when
        the commit makes it visible)."""
        claim, client = self.claim, self.client
        status, data, _ = client.encode(claim, self.outcome.result)
        params = {"stem": claim.stem.encode("utf-8"), "token": claim.token, "status": status.value,
                  "value": data if status is Stored.COMPLETED else b"", "ms": client.result_ttl_ms(claim.ttl)}
        expiry = ("clock_timestamp() + make_interval(secs => %(ms)s / 1000.0)" if dialect == POSTGRESQL
                  else "NOW(6) + INTERVAL %(ms)s * 1000 MICROSECOND")
        status_value = "%(status)s::\"char\"" if dialect == POSTGRESQL else "%(status)s"
        if dialect == POSTGRESQL:
            yield Statement("SELECT pg_notify('dedupe_notice', md5(stem) || ':' || waiters) "
                            "FROM dedupe_claims WHERE stem = %(stem)s AND waiters > 0", params, reads=True)
        yield Statement(
            f"UPDATE dedupe_claims SET status = {status_value}, token = %(token)s, value = %(value)s, owner = 0, "
            f"deadline = NULL, waiters = 0, expires_at = {expiry} "
            "WHERE stem = %(stem)s AND owner = %(token)s AND status IS NULL", params)

"""The claim protocol on a SQL database: the Redis store's calls, run by a SQL runner.

:class:`SqlStore` is a :class:`~dedupe_worker._transport.store.RedisStore` whose script runner is
a SQL one (:mod:`.postgres`, :mod:`.mysql`): the flows build the same ``lua/*.lua`` calls, the
runner performs each as the same transition on the message's row and answers with the script's
reply (:mod:`.calls`). Everything above it (the codec, the flows, the engine, the integrations)
is unchanged. What the SQL store keeps of every promise, and how:

* keys compared byte for byte (a ``bytea`` / ``VARBINARY`` primary key: no collation folds case
  or trailing spaces);
* fencing tokens from one sequence, so they strictly increase per key across expiry, release,
  retention and ``forget``;
* leases timed by the database's clock; completion, failure, release and renewal checked against
  the owning token in the same statement or transaction;
* waiting (``wait=``) on a notice (PostgreSQL ``LISTEN/NOTIFY``) or by polling (MySQL).

Not kept: ``wait_replicas`` (Redis ``WAIT``; a database's durability is its commit settings, see
docs/store-sql.md) and record format 2 (a Redis layout: the row has one format).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from .._protocol import Claim, KeyLayout, State, key_state
from .._transport import AsyncRedisStore, RedisStore, StoreBase
from .notices import Notices, Wake

__all__ = ["AsyncSqlStore", "SqlStore"]


class Pool(Protocol):
    """What a SQL store uses of its :class:`~.pool.SqlPool`, named here: the pool builds its
    stores (``SqlPool.store``), so this module does not import it back."""

    notices: Notices

    def runner(self) -> Any:
        """The runner of the protocol's transitions on the pool."""

    def listen(self) -> None:
        """Listen for notices before a waiter is counted."""


def _committed(claim: Claim, reply: Sequence[Any]) -> bool:
    """Whether ``inspect``'s ``reply`` shows ``claim``'s outcome stored (committed) on its row."""
    state = key_state(*reply[:4])
    return state.state is State.DONE and state.token == claim.token


class _SqlStoreMixin:
    client: Pool
    format_args: tuple[str, ...]
    #: ``atomic(conn)`` in handlers records the outcome on the claim's row (:mod:`.atomic`).
    outcomes_on_row = True

    def write_format(self, record_format: int) -> None:
        """Record formats are Redis layouts: a SQL row has one (checked, then ignored)."""
        if record_format not in (1, 2):
            raise ValueError(f"record_format must be 1 or 2, not {record_format!r}")
        self.format_args = ()

    def require_replicas(self, replicas: int, timeout: float) -> None:
        if replicas:
            raise ValueError("wait_replicas is Redis' WAIT; on a SQL store durability is the database's "
                             "commit setting (synchronous_commit, innodb_flush_log_at_trx_commit)")
        del timeout

    def wake_pipeline(self, wake: str) -> Any:
        return Wake(self.client.notices, wake)


class SqlStore(_SqlStoreMixin, RedisStore):
    """The protocol's transitions on a :class:`~.pool.SqlPool` (see the module doc)."""

    def __init__(self, pool: Pool, layout: KeyLayout) -> None:
        StoreBase.__init__(self, pool, layout, pool.runner())

    def watch(self, stem: str) -> float:
        self.client.listen()  # before the waiter is counted: its notice cannot be missed
        return super().watch(stem)

    def committed(self, claim: Claim) -> bool:
        """Whether the transaction an ``atomic(conn)`` block joined committed ``claim``'s outcome
        on its row (one ``inspect``, read outside that transaction)."""
        return _committed(claim, self.scripts.call("inspect", KeyLayout.records(claim.stem), ()))


class AsyncSqlStore(_SqlStoreMixin, AsyncRedisStore):
    """:class:`SqlStore`, awaited; waits block a worker thread on the pool's notices."""

    def __init__(self, pool: Pool, layout: KeyLayout) -> None:
        StoreBase.__init__(self, pool, layout, pool.runner())

    async def watch(self, stem: str) -> float:
        await asyncio.to_thread(self.client.listen)
        return await super().watch(stem)

    async def committed_async(self, claim: Claim) -> bool:
        """:meth:`SqlStore.committed`, awaited."""
        return _committed(claim, await self.scripts.call("inspect", KeyLayout.records(claim.stem), ()))

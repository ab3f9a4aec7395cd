"""The SQL store's runner on MySQL / MariaDB (PyMySQL): each transition one transaction.

MySQL has no function that could return a batch's rows in one call, so a transition is a few
plain statements in one transaction, READ COMMITTED (no gap locks): the batch's rows made to
exist (``INSERT IGNORE`` of expired placeholders), locked (``SELECT ... FOR UPDATE``, in key
order), decided from what was read (:mod:`.mysql_transitions`: the decision each ``lua/*.lua``
script makes) and written in one multi-row upsert; then ``COMMIT``. The reply is the script's
(:mod:`.calls`). A transaction InnoDB picks as a deadlock's victim (two claims of one new key
meeting on its placeholder) was rolled back whole, and is run again. The clock is the database's
(``NOW(6)``, read in the locking statement). A failure rolls the whole transition back and is
:class:`~dedupe_worker.StoreUnavailable`.

asyncio: PyMySQL is blocking and aiomysql is not a dependency, so :class:`AsyncMySqlRunner` runs
each round trip on a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pymysql

from .._errors import StoreUnavailable
from .._protocol import Call
from .calls import SyncRunner, Transition, reply_of, transition_of
from .mysql_transitions import RUN
from .notices import PolledNotices
from .pool import SqlPool

__all__ = ["AsyncMySqlPool", "AsyncMySqlRunner", "MySqlPool", "MySqlRunner"]

class MySqlPool(SqlPool):
    """PyMySQL connections for one URL (autocommit, READ COMMITTED), one per round trip."""

    dialect = "mysql"

    def __init__(self, arguments: dict[str, Any], *, max_size: int = 16) -> None:
        super().__init__(max_size)
        self.arguments = arguments
        self.notices = PolledNotices(self._gone)

    def _connect(self) -> Any:
        conn = pymysql.connect(**self.arguments)
        with conn.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        return conn

    def _reusable(self, conn: Any) -> bool:
        return bool(conn.open)

    def runner(self) -> Any:
        return MySqlRunner(self)

    def _gone(self, stems: list[str]) -> list[str]:
        """Which of ``stems`` no live lease holds (done, released, lapsed or absent)."""
        keys = [s.encode("utf-8") for s in stems]
        with self.connection() as conn, conn.cursor() as cursor:
            cursor.execute(f"SELECT stem FROM dedupe_claims WHERE stem IN ({', '.join(['%s'] * len(keys))}) "
                           "AND status IS NULL AND owner > 0 AND deadline > NOW(6) AND expires_at > NOW(6)", keys)
            held = {bytes(r[0]).decode("utf-8") for r in cursor.fetchall()}
        return [s for s in stems if s not in held]


class MySqlRunner(SyncRunner):
    """The script runner's interface over a :class:`MySqlPool`: each call one transaction."""

    def __init__(self, pool: MySqlPool) -> None:
        self.pool = pool

    def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        del wait
        transitions = [transition_of(*call) for call in calls]
        try:
            with self.pool.connection() as conn:
                return [reply_of(t, _transaction(conn, t)) for t in transitions]
        except pymysql.Error as exc:
            raise StoreUnavailable(f"MySQL failed running {transitions[0].name}: {exc}") from exc


#: Deadlock found, lock wait timeout: InnoDB rolled the transaction back; it is run again.
_RETRIED = frozenset({1213, 1205})


def _transaction(conn: Any, t: Transition, attempts: int = 5) -> list[tuple[Any, ...]]:
    """Transition ``t`` in one transaction, run again (whole) when InnoDB chose it as a deadlock's
    victim: two claims of one new key both wait on the other's placeholder insert."""
    for attempt in range(attempts):
        conn.begin()
        try:
            with conn.cursor() as cursor:
                rows = RUN[t.name](cursor, t)
            conn.commit()
            return rows
        except pymysql.err.OperationalError as exc:
            conn.rollback()
            if exc.args[0] not in _RETRIED or attempt == attempts - 1:
                raise
        except BaseException:
            conn.rollback()
            raise
    raise AssertionError("unreachable")


class AsyncMySqlPool(MySqlPool):
    """:class:`MySqlPool` for asyncio: the same connections, used on worker threads."""

    def runner(self) -> Any:
        return AsyncMySqlRunner(self)

    async def blpop(self, keys: Sequence[str], timeout: float = 0) -> list[Any] | None:  # type: ignore[override]
        return await asyncio.to_thread(self.notices.blpop, keys, timeout)

    async def aclose(self) -> None:
        self.close()


class AsyncMySqlRunner:
    """:class:`MySqlRunner`, each round trip on a worker thread."""

    is_cluster = False
    held = None

    def __init__(self, pool: MySqlPool) -> None:
        self.sync = MySqlRunner(pool)

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return (await self.call_all([(name, keys, args)]))[0]

    async def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        return await asyncio.to_thread(self.sync.call_all, calls, wait)

    async def release_held(self) -> None:
        """Nothing is held."""

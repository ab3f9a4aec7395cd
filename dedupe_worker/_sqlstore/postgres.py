"""The SQL store's runner on PostgreSQL (psycopg 3): each transition one function call.

A transition (:mod:`.calls`) is one ``SELECT`` of its ``dedupe_v1_*`` function
(``postgresql.sql``), over arrays for a batch: one statement, one round trip, one transaction.
Several transitions of one round trip of the flows (store outcomes, release, claim the next chunk)
go in one pipeline (psycopg's pipeline mode): one round trip, each still its own transaction, run
in order. Connections are autocommit and pooled (:class:`PgPool`); every psycopg error is
:class:`~dedupe_worker.StoreUnavailable`, the message's work not run.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import psycopg

from .._errors import StoreUnavailable
from .._protocol import Call
from .calls import SyncRunner, Transition, reply_of, transition_of
from .notices import PgNotices
from .pool import SqlPool

__all__ = ["AsyncPgPool", "AsyncPgRunner", "PgPool", "PgRunner", "statement"]

_SQL = {
    "claim": "SELECT code, token, a, b FROM dedupe_v1_claim(%s::bytea[], %s::text[], %s::text[], %s, %s)",
    "complete": "SELECT dedupe_v1_complete(%s::bytea[], %s::bigint[], %s::text[], %s::bytea[], %s)",
    "release": "SELECT dedupe_v1_release(%s::bytea[], %s::bigint[], %s)",
    "renew": "SELECT dedupe_v1_renew(%s::bytea[], %s::bigint[], %s, %s)",
    "inspect": "SELECT code, token, a, b, fp FROM dedupe_v1_inspect(%s::bytea)",
    "watch": "SELECT dedupe_v1_watch(%s::bytea)",
    "forget": "SELECT code, token FROM dedupe_v1_forget(%s::bytea, %s::bigint, %s)",
    "send": "SELECT code, token, a, b, task_id FROM dedupe_v1_send(%s::bytea, %s, %s, %s, %s)",
    "unsend": "SELECT dedupe_v1_unsend(%s::bytea, %s)",
}


#: A transition of one stem calls the function of one key (the batch function loops over it).
_ONE = {
    "claim": "SELECT code, token, a, b FROM dedupe_v1_claim_key(%s, %s, %s, %s, %s)",
    "complete": "SELECT ARRAY[dedupe_v1_complete_key(%s, %s, %s, %s, %s)]",
    "release": "SELECT ARRAY[dedupe_v1_release_key(%s, %s, %s)]",
    "renew": "SELECT ARRAY[dedupe_v1_renew_key(%s, %s, %s, %s)]",
}


def statement(t: Transition) -> tuple[str, tuple[Any, ...]]:
    """The ``SELECT`` of transition ``t`` and its parameters."""
    if len(t.stems) == 1 and t.name in _ONE:
        return _ONE[t.name], (t.stems[0], *(column[0] for column in t.per_stem), *t.shared)
    if t.name in ("inspect", "watch"):
        return _SQL[t.name], (t.stems[0],)
    if t.name in ("forget", "send", "unsend"):
        return _SQL[t.name], (t.stems[0], *t.shared)
    return _SQL[t.name], (t.stems, *t.per_stem, *t.shared)


def _failed(transitions: Sequence[Transition], exc: BaseException) -> StoreUnavailable:
    hint = ""
    if isinstance(exc, (psycopg.errors.UndefinedFunction, psycopg.errors.UndefinedTable)):
        hint = " (is the schema installed? dedupe-worker sql init --store <url>)"
    return StoreUnavailable(f"PostgreSQL failed running {transitions[0].name}: {exc}{hint}")


class PgPool(SqlPool):
    """Autocommit psycopg connections for one URL, taken one per round trip and given back."""

    dialect = "postgresql"

    def __init__(self, conninfo: str, *, max_size: int = 16) -> None:
        super().__init__(max_size)
        self.conninfo = conninfo
        self.notices = PgNotices(self._connect)

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.conninfo, autocommit=True, connect_timeout=5)

    def _reusable(self, conn: Any) -> bool:
        return not conn.closed and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

    def runner(self) -> PgRunner:
        return PgRunner(self)

    def close(self) -> None:
        self.notices.close()
        super().close()


class PgRunner(SyncRunner):
    """The script runner's interface (``call``, ``call_all``) over a :class:`PgPool`."""

    def __init__(self, pool: PgPool) -> None:
        self.pool = pool

    def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        """Every call in one round trip (a pipeline for several), replies in order."""
        del wait  # durability on PostgreSQL is synchronous_commit's (see docs/store-sql.md)
        transitions = [transition_of(*call) for call in calls]
        try:
            with self.pool.connection() as conn:
                if len(transitions) == 1:
                    rows = [conn.execute(*statement(transitions[0])).fetchall()]
                else:
                    with conn.pipeline():
                        cursors = [conn.execute(*statement(t)) for t in transitions]
                    rows = [cursor.fetchall() for cursor in cursors]
        except psycopg.Error as exc:
            raise _failed(transitions, exc) from exc
        return [reply_of(t, r) for t, r in zip(transitions, rows, strict=True)]


class AsyncPgPool(PgPool):
    """:class:`PgPool` for asyncio: ``psycopg.AsyncConnection``\\ s, one event loop's each (a
    connection of another loop is dropped, not reused); the notices are the sync pool's thread."""

    def __init__(self, conninfo: str, *, max_size: int = 16) -> None:
        super().__init__(conninfo, max_size=max_size)
        self._async_idle: list[tuple[asyncio.AbstractEventLoop, psycopg.AsyncConnection[Any]]] = []
        self._async_lock = threading.Lock()
        self._loop_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = \
            weakref.WeakKeyDictionary()

    @asynccontextmanager
    async def aconnection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        loop = asyncio.get_running_loop()
        slots = self._loop_slots.setdefault(loop, asyncio.Semaphore(self.max_size))
        async with slots:
            conn = None
            with self._async_lock:
                while self._async_idle and conn is None:
                    owner, candidate = self._async_idle.pop()
                    conn = candidate if owner is loop and not candidate.closed else None
            if conn is None:
                conn = await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True, connect_timeout=5)
            try:
                yield conn
            finally:
                if self._reusable(conn):
                    with self._async_lock:
                        self._async_idle.append((loop, conn))
                else:
                    await conn.close()

    def runner(self) -> Any:
        return AsyncPgRunner(self)

    async def blpop(self, keys: Sequence[str], timeout: float = 0) -> list[Any] | None:  # type: ignore[override]
        """:meth:`SqlPool.blpop`, on a worker thread."""
        return await asyncio.to_thread(self.notices.blpop, keys, timeout)

    async def aclose(self) -> None:
        with self._async_lock:
            idle, self._async_idle = self._async_idle, []
        loop = asyncio.get_running_loop()
        for owner, conn in idle:
            if owner is loop:
                await conn.close()
        self.close()


class AsyncPgRunner:
    """:class:`PgRunner`, awaited."""

    is_cluster = False
    held = None

    def __init__(self, pool: AsyncPgPool) -> None:
        self.pool = pool

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return (await self.call_all([(name, keys, args)]))[0]

    async def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        del wait
        transitions = [transition_of(*call) for call in calls]
        try:
            async with self.pool.aconnection() as conn:
                if len(transitions) == 1:
                    rows = [await (await conn.execute(*statement(transitions[0]))).fetchall()]
                else:
                    async with conn.pipeline():
                        cursors = [await conn.execute(*statement(t)) for t in transitions]
                    rows = [await cursor.fetchall() for cursor in cursors]
        except psycopg.Error as exc:
            raise _failed(transitions, exc) from exc
        return [reply_of(t, r) for t, r in zip(transitions, rows, strict=True)]

    async def release_held(self) -> None:
        """Nothing is held (the Redis runner's held connection has no SQL twin)."""


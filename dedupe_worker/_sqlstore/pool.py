"""The SQL store's connections: a small pool per URL, and what the store's waiters block on.

A pool is what the SQL store holds where the Redis store holds a redis-py client
(``store.client``): it lends a connection for each round trip (:meth:`SqlPool.connection`), at most
``max_size`` at once (a caller past that waits, then gets :class:`~dedupe_worker.StoreUnavailable`),
and answers ``blpop`` for the waiters from its :class:`~.notices.Notices`. Connections are made
lazily, given back when idle and outside a transaction (else closed), and dropped after a fork
(the child makes its own).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .._errors import StoreUnavailable
from .._protocol import KeyLayout
from .._transport import StoreClient
from .notices import Notices

__all__ = ["SqlPool"]

#: Seconds a caller waits for a connection when ``max_size`` are lent.
ACQUIRE_TIMEOUT = 10.0


class SqlPool(StoreClient):
    """Connections to one SQL store (see the module doc); a subclass says how to connect."""

    dialect = ""
    notices: Notices

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._slots = threading.BoundedSemaphore(max_size)
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _connect(self) -> Any:
        raise NotImplementedError

    def _reusable(self, conn: Any) -> bool:
        raise NotImplementedError

    def runner(self) -> Any:
        """The runner of the protocol's transitions on this pool."""
        raise NotImplementedError

    def store(self, layout: KeyLayout, asynchronous: bool) -> Any:
        """The SQL store of ``layout`` on this pool (:mod:`.store`)."""
        from .store import AsyncSqlStore, SqlStore

        return (AsyncSqlStore if asynchronous else SqlStore)(self, layout)

    def attach(self, client: Any) -> None:
        """``atomic(conn)`` in the client's handlers records outcomes on the claim's own row."""
        from .atomic import OwnRows

        OwnRows(client)

    @contextmanager
    def connection(self) -> Iterator[Any]:
        """A connection for one round trip; given back after it (closed after an error)."""
        if not self._slots.acquire(timeout=ACQUIRE_TIMEOUT):
            raise StoreUnavailable(f"no {self.dialect} connection free within {ACQUIRE_TIMEOUT} s "
                                   f"({self.max_size} lent)")
        try:
            with self._lock:
                if self._pid != os.getpid():  # forked: the parent's sockets are not ours
                    self._idle, self._pid = [], os.getpid()
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._connect()
            try:
                yield conn
            finally:
                if self._reusable(conn):
                    with self._lock:
                        self._idle.append(conn)
                else:
                    conn.close()
        finally:
            self._slots.release()

    def listen(self) -> None:
        """Receive completion and release notices from now on (before counting a waiter)."""
        self.notices.listen()

    def blpop(self, keys: Sequence[str], timeout: float = 0) -> list[Any] | None:
        """Redis' ``BLPOP`` over notice lists and wake-ups, answered from the notices."""
        return self.notices.blpop(keys, timeout)

    def close(self) -> None:
        """Close the idle connections (lent ones close when given back)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            try:
                conn.close()
            except Exception:  # closing a broken connection: nothing left to do
                pass

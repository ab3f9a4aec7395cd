"""Script calls sent straight on a connection of the client's pool, without redis-py's
``Pipeline`` or ``execute_command``.

A coalesced round trip (see :mod:`dedupe_worker._transport.async_scripts`) carries the script calls of
concurrent coroutines. Sent as a redis-py asyncio ``Pipeline``, each call was packed by redis-py's
pure-Python ``pack_command`` and each reply read through the pipeline's parse layers and a timer
of its own: with 50 coroutines a quarter of the client's CPU went to packing and a sixth to
reading. :class:`DirectSender` does the same round trip with redis-py's public ``Connection``
methods: a connection from the client's own pool (``get_connection``/``release``), the whole
batch packed by the compiled ``dedupe_worker._resp.pack_command``, else ``hiredis.pack_command``
(only where that gives the connection's own bytes, as the sync held connection checks:
:func:`~dedupe_worker._transport.held.direct_packer`; ``DEDUPE_PURE_PYTHON=1`` skips the compiled one), one
``send_packed_command``, and each reply read with ``read_response``, all of them under one
deadline of the connection's ``socket_timeout`` rather than one timer per reply. A lone script
call (a claim or completion with nothing in flight) is sent the same way, a batch of one.

Why: it makes both a sequential ``await run()`` and 50 concurrent coroutines markedly faster
than redis-py's ``Pipeline``/``execute_command`` path, well past the 10% the project asks of a
second path (``python -m bench.asyncio_paths``, with and without ``DEDUPE_PURE_PYTHON=1``, which
keeps redis-py's path: :meth:`DirectSender.for_client`; the figures are in docs/performance.md).

**The held connection.** As the sync client does (:mod:`dedupe_worker._transport.held`), the
senders on a pool take one connection of it with their first round trip and keep it (one per pool,
however many clients use the pool), instead of getting one from the pool and giving it back each
time: redis-py 8.1's asyncio pool takes an ``asyncio.Lock`` twice, records four connection counts
and dispatches an event per round trip. One round trip at a time is sent on it (a flag, no lock:
the loop runs one step at a time); one that finds it busy takes a connection of the pool as
before. Before each use it is checked as the pool checks a connection given back
(``should_reconnect``) and one it hands out (``ensure_connection``: reconnected when idle data or
a closed socket says it is out of step); a round trip that fails or is cancelled disconnects it,
and the next reconnects. ``AsyncClaimClient.close`` gives it back once no other client on the
pool uses it. Not kept on a pool of fewer than :data:`~dedupe_worker._transport.held.MIN_POOL_SIZE`
connections. Why: the pool's bookkeeping is paid per round trip, so a lone call (FastStream's
path, one message at a time) pays it whole (``python -m bench.frameworks``; the figures are in
docs/performance.md).

What is kept of redis-py's own path: the connection's retry policy around the whole round trip
(a connection or timeout error disconnects, and the next attempt reconnects and sends the whole
batch again, as ``Pipeline.execute`` does: every script of the protocol answers a resent call
safely, a resent claim finding its own first attempt's lease (IN_PROGRESS, nothing run) and a
resent completion answering 1 again); error replies handed back as exception objects, each to its
own caller (``raise_on_error=False``), or raised for a lone call; a connection whose replies were
not all read (a failure, a cancellation) is disconnected before it goes back to the pool. Only a
plain ``redis.asyncio.Redis`` whose pool makes connections that write and read as redis-py's own
do gets it (:meth:`DirectSender.for_client`); any other client (a cluster, Sentinel's managed
connections, a test double that replaces the connection's reads, a subclass) keeps redis-py's
path.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import redis.asyncio
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._settings import accelerators_off
from .held import MIN_POOL_SIZE, direct_packer

if sys.version_info >= (3, 11):
    from asyncio import timeout as deadline

    def _move(window: Any, when: float) -> None:
        window.reschedule(when)
else:  # pragma: no cover - redis-py depends on async-timeout below 3.11.3
    from async_timeout import timeout as deadline

    def _move(window: Any, when: float) -> None:
        window.update(when)

__all__ = ["DirectSender"]

#: An unset packer: decided from the first connection.
_UNSET: Any = object()


def _takes_no_command_name(pool: Any) -> bool:
    """Whether ``pool.get_connection()`` is called without a command name (redis-py 5.3 made it
    optional and warns when one is given; before, it was required)."""
    try:
        parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
    except (TypeError, ValueError):  # pragma: no cover - not introspectable: assume the current form
        return True
    return parameter is None or parameter.default is not inspect.Parameter.empty


class DirectSender:
    """Sends a batch of commands on a connection of a ``redis.asyncio.Redis`` client's pool, in one
    write, every reply read in order (an error reply as its exception object)."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.pool: Any = client.connection_pool
        self._get_args: tuple[str, ...] = () if _takes_no_command_name(self.pool) else ("EVALSHA",)
        self._pack: Any = _UNSET
        #: Whether connections can be marked for reconnection (maintenance notifications), as the
        #: pool checks when one is given back.
        self._marks = hasattr(getattr(self.pool, "connection_class", None), "should_reconnect")
        #: The pool's held connection (shared with every sender on the pool), or ``None``.
        self._held = _Held.join(self.pool)

    @classmethod
    def for_client(cls, client: Any) -> DirectSender | None:
        """A sender for ``client``, or ``None`` when it is not a plain ``redis.asyncio.Redis`` whose
        pool makes connections that write and read as redis-py's own do (and ``None`` when
        :func:`~dedupe_worker._settings.accelerators_off`: redis-py's own path)."""
        if type(client) is not redis.asyncio.Redis:  # a subclass may route or count commands itself
            return None
        if accelerators_off():
            return None
        connection_class = getattr(getattr(client, "connection_pool", None), "connection_class", None)
        if not isinstance(connection_class, type) or not issubclass(connection_class, AbstractConnection):
            return None
        own = (connection_class.read_response is AbstractConnection.read_response
               and connection_class.send_packed_command is AbstractConnection.send_packed_command)
        return cls(client) if own else None

    async def execute(self, command: tuple[Any, ...]) -> Any:
        """One command, its reply; an error reply raised (as ``execute_command`` would)."""
        reply = (await self.execute_many((command,)))[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def execute_many(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``commands`` in one round trip, every reply in order, an error reply as its exception
        object; a connection or timeout error retried by the connection's policy, then raised.
        Sent on the held connection when it is free, else on one of the pool."""
        held = self._held
        if held is not None and not held.busy:
            held.busy = True
            try:
                connection = held.connection
                if connection is None:
                    connection = held.connection = await self.pool.get_connection(*self._get_args)
                else:  # checked as the pool checks a connection given back, then one it hands out
                    if self._marks and connection.should_reconnect():
                        await connection.disconnect()
                    await self.pool.ensure_connection(connection)
                return await self._round_trip(connection, commands)
            except BaseException:
                if held.connection is not None:  # replies may be left unread: the next call reconnects
                    await held.connection.disconnect(nowait=True)
                raise
            finally:
                held.busy = False
        connection = await self.pool.get_connection(*self._get_args)
        try:
            return await self._round_trip(connection, commands)
        except BaseException:
            await connection.disconnect(nowait=True)  # replies may be left unread: never reuse it
            raise
        finally:
            await self.pool.release(connection)

    async def release_held(self) -> None:
        """Stop using the pool's held connection (later calls take connections of the pool), and
        give it back to the pool when no other sender uses it; one a call is still using is
        disconnected first (that call fails as on a lost connection)."""
        held, self._held = self._held, None
        if held is None:
            return
        held.users -= 1
        connection = held.connection
        if held.users > 0 or connection is None:
            return
        held.connection = None
        if held.busy:
            await connection.disconnect(nowait=True)
        await self.pool.release(connection)

    async def _round_trip(self, connection: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``commands`` in one write on ``connection``, every reply read, under its retry policy."""
        if self._pack is _UNSET:
            self._pack = direct_packer(connection)
        pack = self._pack
        packed = ([b"".join([pack(command) for command in commands])] if pack is not None
                  else connection.pack_commands(commands))
        try:
            return await self._exchange(connection, packed, len(commands))
        except Exception as exc:
            return await self._retried(connection, packed, len(commands), exc)

    async def _retried(self, connection: Any, packed: Any, count: int, failure: Exception) -> list[Any]:
        """After a first attempt that raised ``failure``: the connection's retry policy, its first
        attempt being that failure (so the policy decides whether to try again, exactly as around
        every attempt), every later one :meth:`_exchange`; a connection or timeout error
        disconnects, and the next attempt reconnects. Why the policy only after a failure, as the
        sync held connection does: around every attempt it costs a coroutine, a closure and a
        few calls a round trip (``python -m bench.asyncio_paths``)."""
        first = [failure]

        async def attempt() -> list[Any]:
            if first:
                raise first.pop()
            return await self._exchange(connection, packed, count)

        async def failed(_error: Exception) -> None:
            await connection.disconnect()

        return await connection.retry.call_with_retry(attempt, failed)  # type: ignore[no-any-return]

    async def _exchange(self, connection: Any, packed: Any, count: int) -> list[Any]:
        """``send_packed_command``, then ``count`` replies (:meth:`_read`), each within the
        connection's ``socket_timeout``; a timeout raised as redis-py's ``TimeoutError`` (retried
        by its policy), the connection dropped.

        On Python before 3.12 redis-py's own bound on the write, ``asyncio.wait_for``, runs it as a
        task of its own (one more turn of the loop, a future and a timer per round trip): there
        the connection's ``socket_timeout`` is set aside for the write, and one deadline bounds
        the write, then, moved to a full ``socket_timeout`` after it, the reads. Why: a client from
        ``redis.asyncio.Redis.from_url`` has a ``socket_timeout`` (5 s by default in redis-py
        8.1), so every round trip would pay for that task; one deadline moved costs less than one
        for the write and one for the reads (``python -m bench.single_cpu``'s ``async run``; the
        figures are in docs/performance.md)."""
        timeout = connection.socket_timeout
        if not timeout or not _WAIT_FOR_TASK:
            await connection.send_packed_command(packed)
            return await self._read(connection, count)
        reading = False
        connection.socket_timeout = None  # only this round trip uses the connection meanwhile
        try:
            async with deadline(timeout) as window:
                try:
                    await connection.send_packed_command(packed)
                finally:
                    connection.socket_timeout = timeout
                reading = True
                _move(window, asyncio.get_running_loop().time() + timeout)
                return await self._replies(connection, count)
        except asyncio.TimeoutError as exc:  # cancelled inside: redis-py dropped the connection
            if reading:
                raise RedisTimeoutError(f"Timeout reading {count} replies") from exc
            raise RedisTimeoutError("Timeout writing to socket") from exc

    async def _read(self, connection: Any, count: int) -> list[Any]:
        """``count`` replies, all within one ``socket_timeout`` (none: no deadline); a timeout
        raised as redis-py's ``TimeoutError`` (retried by its policy), the connection dropped."""
        try:
            async with deadline(connection.socket_timeout):
                return await self._replies(connection, count)
        except asyncio.TimeoutError as exc:  # the deadline's: read_response dropped the connection
            raise RedisTimeoutError(f"Timeout reading {count} replies") from exc

    @staticmethod
    async def _replies(connection: Any, count: int) -> list[Any]:
        """``count`` replies, an error reply as its exception object, bounded by the caller's deadline."""
        replies: list[Any] = []
        for _ in range(count):
            try:  # math.inf: no timer of its own, the caller's deadline bounds the reads
                replies.append(await connection.read_response(timeout=_NO_TIMER))
            except ResponseError as exc:
                replies.append(exc)
        return replies


_NO_TIMER = float("inf")

class _Held:
    """The held connection of one pool: at most one per pool, shared by every sender on it (so
    that clients created on one pool and never closed cannot take its connections away), used by
    one round trip at a time (``busy``; the event loop runs one step at a time)."""

    __slots__ = ("__weakref__", "busy", "connection", "users")

    def __init__(self) -> None:
        self.connection: Any = None
        self.busy = False
        #: Senders using it; the last one to :meth:`DirectSender.release_held` gives it back.
        self.users = 0

    @staticmethod
    def join(pool: Any) -> _Held | None:
        """The held connection of ``pool``, counting one more user; ``None`` on a pool too small
        to spare one (:data:`~dedupe_worker._transport.held.MIN_POOL_SIZE`) or without a public
        check for a connection it hands out (``ensure_connection``, redis-py before 5.1)."""
        size = getattr(pool, "max_connections", None)
        if (size is not None and size < MIN_POOL_SIZE) or not hasattr(pool, "ensure_connection"):
            return None
        held = _by_pool.get(pool)
        if held is None:
            held = _by_pool[pool] = _Held()
        held.users += 1
        return held


#: The held connection of each pool (kept while the pool lives).
_by_pool: weakref.WeakKeyDictionary[Any, _Held] = weakref.WeakKeyDictionary()

#: Whether ``asyncio.wait_for`` runs its awaitable as a task of its own (before Python 3.12).
_WAIT_FOR_TASK = sys.version_info < (3, 12)

"""One Redis connection held between script calls: the per-message path without the pool.

redis-py gets a connection from its pool and gives it back on every command, with locking, a
readiness check and bookkeeping around both; on a loopback round trip that is a third to a half
of the client's CPU (figures in :mod:`.paths`, which chooses this path or the pool's).
:class:`HeldConnection` keeps one connection of the client's own pool and sends on it with
redis-py's public ``Connection`` methods (``pack_command``, ``send_packed_command``,
``read_response``, ``can_read``; packed straight where that gives the connection's own bytes, see
:func:`direct_packer`).

What is guaranteed: the same connection settings as the client (it is the client's pool that
made the connection: ``Redis(connection_pool=..., single_connection_client=True)``); one
caller at a time (a lock taken without blocking); never shared with a forked child (after a
fork the child drops it, and its lock, and takes its own). A connection with something to read
while idle (the server closed it) is reconnected before anything is sent on it, as the pool
checks a connection it hands out. After a connection or timeout error the connection is
disconnected and the next attempt reconnects, under the connection's own retry policy, exactly
as a plain ``client.evalsha`` would retry; when the attempts run out it is given back to the
pool. An error reply (``NOSCRIPT``, a script error) is a whole reply: the connection stays in
step and is kept. A streamed round trip hands each reply on as soon as it is read; once one was
handed on nothing is sent again, and a failure drops the connection rather than leave unread
replies on it.

**Packing.** :func:`direct_packer` chooses what packs a command's arguments into the bytes sent:
the compiled ``dedupe_worker._resp.pack_command`` (``dedupe_worker/_resp.c``, built with the
package where a C compiler is found; byte for byte what ``hiredis.pack_command`` gives, and
cheaper on a batch's hundreds of arguments: docs/performance.md), else ``hiredis.pack_command``,
each only where it packs a probe of every kind of argument exactly as the connection's own
``pack_command`` does, else the connection's own. ``DEDUPE_PURE_PYTHON=1`` in the environment
(read when a client is built and when a connection is first used) keeps every client on redis-py's
pool path, without a held connection or the compiled module: the plain path, which CI runs too
(``make test-oldest``).
``DEDUPE_NO_EXTENSIONS=1`` at install time builds the package without it.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeGuard

import redis
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from .._compiled import compiled_pack
from .._settings import accelerators_off

hiredis_pack: Any
try:
    from hiredis import pack_command as hiredis_pack
except ImportError:  # pragma: no cover - redis[hiredis] is a dependency
    hiredis_pack = None

logger = logging.getLogger(__name__)

__all__ = ["BUSY", "MIN_POOL_SIZE", "HeldConnection", "direct_packer"]

#: Returned by :class:`HeldConnection` when another thread holds the connection.
BUSY: Any = object()

#: One command: its arguments as ``execute_command`` takes them.
Command = tuple[Any, ...]

#: Pools smaller than this are left alone: holding one of few connections could starve the
#: threads (renewer, watcher) that fall back to the pool.
MIN_POOL_SIZE = 16

#: One held connection per connection pool, shared by every client object on that pool.
_by_pool: weakref.WeakKeyDictionary[Any, HeldConnection] = weakref.WeakKeyDictionary()
_by_pool_lock = threading.Lock()


class HeldConnection:
    """A connection taken from a pool once and kept, for one caller at a time.

    Get it with :meth:`for_client`: there is at most one per connection pool, however many
    clients (``Deduplicator``, ``ClaimClient``) use that pool, so creating clients never takes
    connections away from the pool beyond the first.
    """

    def __init__(self, client: redis.Redis) -> None:
        self._pool = weakref.ref(client.connection_pool)  # the registry's key: never held strongly
        self._lock = threading.Lock()
        #: ``Redis(connection_pool=..., single_connection_client=True)``: redis-py's own way to
        #: keep one connection of a pool; we use its ``connection`` and send on it ourselves.
        self._holder: redis.Redis | None = None
        self._pid = os.getpid()
        #: The compiled packer or ``hiredis.pack_command`` where it packs exactly as the connection
        #: does (see :func:`direct_packer`), else ``None``: redis-py's ``pack_command``.
        self._pack: Any = None

    @classmethod
    def for_client(cls, client: Any) -> HeldConnection | None:
        """The held connection of ``client``'s pool, or ``None`` when ``client`` does not suit."""
        if not cls.suits(client):
            return None
        pool = client.connection_pool
        with _by_pool_lock:
            held = _by_pool.get(pool)
            if held is None:
                held = _by_pool[pool] = cls(client)
        return held

    @staticmethod
    def suits(client: Any) -> TypeGuard[redis.Redis]:
        """Whether ``client`` is a plain ``redis.Redis`` on a non-blocking pool of at least
        :data:`MIN_POOL_SIZE` connections (not a cluster client, not a
        ``single_connection_client``, not a pipeline)."""
        if not isinstance(client, redis.Redis) or getattr(client, "connection", None) is not None:
            return False
        pool = getattr(client, "connection_pool", None)
        if pool is None or isinstance(pool, redis.BlockingConnectionPool):
            return False
        size = getattr(pool, "max_connections", None)
        return size is None or size >= MIN_POOL_SIZE

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's socket is not ours, and a lock a parent thread held
        at the fork would stay taken for good."""
        self._lock = threading.Lock()
        self._holder, self._pid = None, os.getpid()

    def execute(self, *args: Any) -> Any:
        """Send one command and return its reply, or :data:`BUSY` when another caller holds the
        connection. Retries as the client would (its connection's ``retry`` policy); raises what
        redis-py raises."""
        if not self._lock.acquire(False):
            return BUSY
        try:
            connection = self._take()
            packed = [self._pack(args)] if self._pack is not None else connection.pack_command(*args)
            try:  # _exchange's two steps, in this frame: once per round trip
                connection.send_packed_command(packed)
                return connection.read_response()
            except BaseException as exc:
                return self._retried(connection, exc, functools.partial(_exchange, connection, packed))
        finally:
            self._lock.release()

    def execute_many(self, commands: list[Command]) -> Any:
        """Send ``commands`` in one write and read every reply, an error reply as its exception
        object (like a pipeline with ``raise_on_error=False``); :data:`BUSY` as :meth:`execute`."""
        if not self._lock.acquire(False):
            return BUSY
        try:
            connection = self._take()
            packed = self._packed(connection, commands)
            try:
                return _exchange_many(connection, packed, len(commands))
            except BaseException as exc:
                return self._retried(connection, exc,
                                     functools.partial(_exchange_many, connection, packed, len(commands)))
        finally:
            self._lock.release()

    def execute_streamed(self, commands: list[Command], deliver: Callable[[int, Any], None]) -> Any:
        """:meth:`execute_many`, but each reply is handed to ``deliver(index, reply)`` as soon as it
        is read, before the next one is read: the caller works on it while Redis runs the later
        commands. Returns ``None``, or :data:`BUSY` as :meth:`execute`.

        Sending and reading the first reply are retried as in :meth:`execute_many`; once a reply
        was handed on nothing is sent again: a connection error then drops the connection and is
        raised (the replies not read are lost: those commands may have run or not). If
        ``deliver`` raises, the connection is dropped unless every reply was read."""
        if not self._lock.acquire(False):
            return BUSY
        try:
            connection = self._take()
            packed = self._packed(connection, commands)
            try:
                reply = _exchange_many(connection, packed, 1)[0]
            except BaseException as exc:
                reply = self._retried(connection, exc, functools.partial(_exchange_many, connection, packed, 1))[0]
            read = 1
            try:
                for i in range(len(commands)):
                    if i:
                        reply = _read(connection)
                        read += 1
                    deliver(i, reply)
            except BaseException:
                if read < len(commands):  # replies left unread (or a read failed): out of step
                    self._drop()
                raise
            return None
        finally:
            self._lock.release()

    def _packed(self, connection: Any, commands: list[Command]) -> list[bytes]:
        """``commands`` as the bytes of one write."""
        if self._pack is not None:
            return [b"".join([self._pack(c) for c in commands])]
        return connection.pack_commands(commands)  # type: ignore[no-any-return]

    def _retried(self, connection: Any, failure: BaseException, send: Callable[[], Any]) -> Any:
        """After a first attempt that raised ``failure``: the connection's retry policy, run as
        redis-py runs a command, its first attempt being that failure (so the policy decides
        whether to try again, exactly as around every attempt) and every later one ``send()``.
        A connection or timeout error disconnects (the next attempt reconnects). An error reply
        is a whole reply and keeps the connection; any other failure drops it.

        Why the policy only after a failure: around every attempt it costs a closure and a few
        calls a round trip (``python -m bench.core``)."""
        first = [failure]

        def attempt() -> Any:
            if first:
                raise first.pop()
            return send()

        try:
            return connection.retry.call_with_retry(attempt, lambda _error: connection.disconnect())
        except ResponseError:
            raise
        except BaseException:
            self._drop()
            raise

    def close(self) -> None:
        """Give the connection back to the pool (a later call takes one again)."""
        with self._lock:
            holder, self._holder = self._holder, None
            if holder is not None and self._pid == os.getpid():
                holder.close()  # releases the connection to the pool (the pool stays open)

    def _take(self) -> Any:
        """The held connection, ready to send: as the pool checks a connection it hands out, one
        with something to read while idle (the server closed it, or a stray reply) is reconnected
        before anything is sent on it. Every reply we asked for was read in full, so the parser
        holds nothing. (A forked child finds none held: the fork hook below dropped the parent's.)"""
        holder = self._holder
        if holder is None:
            pool = self._pool()
            if pool is None:  # pragma: no cover - the registry drops us with the pool
                raise ConnectionError("the connection pool is gone")
            holder = self._holder = redis.Redis(connection_pool=pool, single_connection_client=True)
            self._pack = direct_packer(holder.connection)
            return holder.connection
        connection: Any = holder.connection
        try:
            stale = bool(connection.can_read())
        except (ConnectionError, TimeoutError, OSError):
            stale = True
        if stale:
            connection.disconnect()
            connection.connect()
        return connection

    def _drop(self) -> None:
        """Disconnect the held connection and give it back to the pool."""
        holder, self._holder = self._holder, None
        connection: Any = holder.connection if holder is not None else None
        if holder is not None and connection is not None:
            connection.disconnect()
            holder.close()


#: Every kind of argument the protocol sends (and a non-ASCII text, a float): the probe
#: :func:`direct_packer` packs both ways.
_PROBE = ("EVALSHA", "0" * 40, 2, "ns:{k\u00e9}:started", b"\x00\xffv", -12, 30000, 0.5, "")


def direct_packer(connection: Any) -> Any:
    """What packs a command for ``connection``, called straight as ``pack(args) -> bytes``: the
    compiled ``dedupe_worker._resp.pack_command`` (unless ``DEDUPE_PURE_PYTHON`` is set), else
    ``hiredis.pack_command``, the first that packs :data:`_PROBE` byte for byte as ``connection``'s
    own (public) ``pack_command`` does; ``None`` when neither does.

    Called straight it skips redis-py's pass over the arguments (a Python step each, and a batch
    has hundreds: docs/performance.md, bench.held_connection); a connection with another encoding
    or a custom ``command_packer`` packs differently and keeps its own."""
    try:
        own = b"".join(connection.pack_command(*_PROBE))
    except Exception:  # a packer that refuses part of the probe: keep it
        return None
    for pack in (None if accelerators_off() else compiled_pack, hiredis_pack):
        if pack is None:
            continue
        try:
            if pack(_PROBE) == own:
                logger.debug("commands are packed by %s.%s", pack.__module__, pack.__name__)
                return pack
        except Exception:  # refuses part of the probe: not this one
            continue
    return None


def _exchange(connection: Any, packed: list[bytes]) -> Any:
    """Send one packed command on ``connection`` and read its reply (an error reply raised)."""
    connection.send_packed_command(packed)
    return connection.read_response()


def _exchange_many(connection: Any, packed: list[bytes], count: int) -> list[Any]:
    """Send packed commands on ``connection`` and read ``count`` replies (see :func:`_read`)."""
    connection.send_packed_command(packed)
    return [_read(connection) for _ in range(count)]


def _read(connection: Any) -> Any:
    """The next reply, an error reply as its exception object (a whole reply: the stream stays in step)."""
    try:
        return connection.read_response()
    except ResponseError as exc:
        return exc


def _after_fork_in_child() -> None:
    global _by_pool_lock
    _by_pool_lock = threading.Lock()
    for held in list(_by_pool.values()):
        held._forget_after_fork()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork()
    os.register_at_fork(after_in_child=_after_fork_in_child)

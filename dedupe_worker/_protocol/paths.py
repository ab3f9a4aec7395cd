"""How the protocol's commands reach Redis: a held connection, or redis-py's pool beside it.

Two paths with one small interface (:class:`RedisPath`), chosen in one place (:func:`path_for`):

* :class:`PoolPath`, plain redis-py: ``execute_command`` and a non-transactional pipeline, a
  connection from the client's pool for each. Every client gets it: clusters, Sentinel, a
  ``single_connection_client``, blocking or small pools.
* :class:`HeldPath`, on a plain ``redis.Redis`` with a large enough pool: one connection taken
  from the client's pool once and kept (:class:`HeldConnection`, one per pool), commands sent
  on it with redis-py's public ``Connection`` methods (``pack_command``, ``send_packed_command``,
  ``read_response``, ``can_read``; packed by ``hiredis.pack_command`` straight where that gives
  the connection's own bytes). redis-py gets a connection from its pool and gives it back on every
  command, with locking, a readiness check and bookkeeping around both; on a loopback round
  trip that is a third to a half of the client's CPU. A caller that finds the held connection
  busy (another thread: the lease renewer, the key watcher) takes the pool path. Only the held
  path streams: :meth:`RedisPath.execute_streamed` hands each reply on as it is read; the pool
  path hands them on after the round trip.

Why the held path is kept: ``python -m bench.held_connection`` (both paths in one process,
taking turns in 15 short rounds, median round), a private ``redis-server`` pinned with ``taskset``
to vCPU 0 and the client to the same vCPU or the other, three runs each (medians below), on a
machine shared with other work. Wall time of the held path as a share of the pool path's, and
client CPU per message held / pool::

                        same vCPU                    split vCPUs
                   wall     CPU µs              wall     CPU µs
    run()          0.69     32.9 / 59.0         0.79     62.7 / 95.9
    duplicate      0.72     15.4 / 25.8         0.78     30.6 / 44.2
    batch of 100   0.93      4.3 /  5.5         0.85      4.6 /  6.1
    decide_many    0.89      6.7 /  8.3         0.90      7.2 /  9.0

A first-seen ``run()`` takes about 30% less wall time and 40% less client CPU on the held path;
batches gain 7-15% (the pool's cost is per round trip, not per message).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import redis

from .held import BUSY, Command, HeldConnection

__all__ = ["HeldPath", "PoolPath", "RedisPath", "path_for"]


class RedisPath(Protocol):
    """What the script runner needs of Redis. Error replies of a round trip come back as
    exception objects (as a pipeline's with ``raise_on_error=False``); other failures raise
    what redis-py raises."""

    #: The held connection behind this path, or ``None`` (the pool path).
    held: HeldConnection | None

    def execute(self, command: Command) -> Any:
        """One command, its reply (an error reply raised)."""

    def execute_many(self, commands: Sequence[Command]) -> list[Any]:
        """``commands`` in one round trip, every reply in order."""

    def execute_streamed(self, commands: Sequence[Command], deliver: Callable[[int, Any], None]) -> bool:
        """``commands`` in one round trip, ``deliver(index, reply)`` called for each reply as
        soon as it is read; ``False`` (and nothing sent) when this path cannot stream now."""


class PoolPath:
    """Plain redis-py: a connection from the client's pool for every command or pipeline."""

    held: HeldConnection | None = None

    def __init__(self, client: Any) -> None:
        self.client = client

    def execute(self, command: Command) -> Any:
        return self.client.execute_command(*command)

    def execute_many(self, commands: Sequence[Command]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]

    def execute_streamed(self, commands: Sequence[Command], deliver: Callable[[int, Any], None]) -> bool:
        del commands, deliver
        return False


class HeldPath(PoolPath):
    """The held connection of the client's pool, and the pool path whenever it is busy."""

    def __init__(self, client: redis.Redis, held: HeldConnection) -> None:
        super().__init__(client)
        self.held = held

    def execute(self, command: Command) -> Any:
        assert self.held is not None
        reply = self.held.execute(*command)
        return super().execute(command) if reply is BUSY else reply

    def execute_many(self, commands: Sequence[Command]) -> list[Any]:
        assert self.held is not None
        replies = self.held.execute_many(list(commands))
        return super().execute_many(commands) if replies is BUSY else replies

    def execute_streamed(self, commands: Sequence[Command], deliver: Callable[[int, Any], None]) -> bool:
        assert self.held is not None
        return self.held.execute_streamed(list(commands), deliver) is not BUSY


def path_for(client: Any) -> RedisPath:
    """The one place the path is chosen: :class:`HeldPath` where :meth:`HeldConnection.suits`
    the client, else :class:`PoolPath`."""
    held = HeldConnection.for_client(client)
    return PoolPath(client) if held is None else HeldPath(client, held)

"""How the protocol's commands reach Redis: a held connection, or redis-py's pool beside it.

Two paths with one small interface (:class:`RedisPath`), chosen in one place (:func:`path_for`):

* :class:`PoolPath`, plain redis-py: ``execute_command`` and a non-transactional pipeline, a
  connection from the client's pool for each. Every client gets it: clusters, Sentinel, a
  ``single_connection_client``, blocking or small pools.
* :class:`ClusterPath`, on a ``RedisCluster``: the pool path, with every script call routed to
  the primary of its keys' slot by this library instead of by redis-py (see the class).
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

Why the held path is kept: it shortens ``run()``'s latency and a batch's time by more than the
10% the project asks of a second path (``python -m bench.held_connection`` runs both paths in one
process, taking turns; the figures are in docs/performance.md). The pool's cost is per round
trip, so the single-message paths gain most. ``DEDUPE_PURE_PYTHON=1`` keeps every client on
:class:`PoolPath` (:func:`~dedupe_worker._settings.accelerators_off`): the suite runs that way too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from .._settings import accelerators_off
from .held import BUSY, Command, HeldConnection

__all__ = ["ClusterPath", "HeldPath", "PoolPath", "RedisPath", "path_for"]

#: Script calls: ``(name, script or sha or function, numkeys, *keys, *args)``.
_SCRIPT_CALLS = frozenset({"EVALSHA", "EVAL", "FCALL", "EVALSHA_RO", "EVAL_RO", "FCALL_RO"})


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


class ClusterPath(PoolPath):
    """A ``RedisCluster``: every script call carries its target, the primary of its first key's
    slot (every key of one call shares that slot: one ``{...}`` hash tag per message).

    Why: redis-py finds the keys of an ``FCALL`` (5.0.1 and 8.1 checked), and redis-py 8.1 those of
    a pipelined ``EVALSHA`` too, by asking the server (``COMMAND GETKEYS``, one round trip per call,
    sent before the pipeline), so a batch of 500 keys cost about a thousand round trips; routed
    here, a batch is one round trip per primary (``python -m bench.kafka_consumer --cluster 3``;
    the figures are in docs/performance.md). A single call goes as a pipeline of one for the same
    reason.

    What redirections do: redis-py resends a pipelined command that met ``MOVED`` or ``ASK``
    (a slot migration, a failover) on its own, routed afresh, once the pipeline's round trip
    is over, exactly as without a target; a slot this client's table does not cover sends the
    call without a target (redis-py routes it, asking the server).
    """

    def __init__(self, client: RedisCluster) -> None:
        super().__init__(client)
        self.cluster = client

    def _target(self, command: Command) -> dict[str, Any]:
        if len(command) < 4 or str(command[0]).upper() not in _SCRIPT_CALLS or not int(command[2]):
            return {}
        try:
            node = self.cluster.get_node_from_key(command[3])  # type: ignore[no-untyped-call]
        except RedisClusterException:  # SlotNotCoveredError: a table being refreshed
            return {}
        return {"target_nodes": node}

    def execute(self, command: Command) -> Any:
        target = self._target(command)
        if not target:
            return super().execute(command)
        reply = self._pipelined([(command, target)])[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def execute_many(self, commands: Sequence[Command]) -> list[Any]:
        return self._pipelined([(command, self._target(command)) for command in commands])

    def _pipelined(self, routed: Sequence[tuple[Command, dict[str, Any]]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for command, target in routed:
            pipe.execute_command(*command, **target)
        return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]


class HeldPath(PoolPath):
    """The held connection of the client's pool, and the pool path whenever it is busy."""

    def __init__(self, client: redis.Redis, held: HeldConnection) -> None:
        super().__init__(client)
        self.held = held
        self._held = held

    def execute(self, command: Command) -> Any:
        reply = self._held.execute(*command)
        return reply if reply is not BUSY else super().execute(command)

    def execute_many(self, commands: Sequence[Command]) -> list[Any]:
        replies = self._held.execute_many(list(commands))
        return replies if replies is not BUSY else super().execute_many(commands)

    def execute_streamed(self, commands: Sequence[Command], deliver: Callable[[int, Any], None]) -> bool:
        return self._held.execute_streamed(list(commands), deliver) is not BUSY


def path_for(client: Any) -> RedisPath:
    """The one place the path is chosen: :class:`ClusterPath` for a ``RedisCluster``,
    :class:`HeldPath` where :meth:`HeldConnection.suits` the client (unless
    :func:`~dedupe_worker._settings.accelerators_off`), else :class:`PoolPath`."""
    if isinstance(client, RedisCluster):
        return ClusterPath(client)
    held = None if accelerators_off() else HeldConnection.for_client(client)
    return PoolPath(client) if held is None else HeldPath(client, held)

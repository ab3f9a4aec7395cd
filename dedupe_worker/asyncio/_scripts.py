"""The protocol's Lua scripts on ``redis.asyncio``: the asyncio driver of the script flows.

What a call sends, the ``NOSCRIPT`` handling (every script loaded, then only the calls that ran
nothing sent again), ``WAIT`` in the same round trip, the reply checks and the choice of script
texts for the server are written once in :mod:`dedupe_worker._protocol.script_flow` and shared
with the sync :class:`~dedupe_worker._protocol.scripts.ScriptRunner`; this module only carries
each request to Redis with ``redis.asyncio``. Every Redis failure is raised as
:class:`~dedupe_worker.StoreUnavailable`.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence
from typing import Any

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from .._protocol.script_flow import SCRIPT_NAMES, SENDER_SCRIPTS, Call, Flow, Library, ScriptFlows
from .._protocol.scripts import load_script

__all__ = ["AsyncRedis", "AsyncScriptRunner"]

#: The clients the asyncio store runs on.
AsyncRedis = redis.asyncio.Redis | RedisCluster


_REDIS_PY = os.path.dirname(redis.__file__) + os.sep


def torn_connection(exc: BaseException) -> RedisConnectionError | None:
    """``exc`` as the connection error it is, when redis-py's asyncio client raised it from inside
    its own connection code (``AttributeError``/``TypeError`` on a writer or transport that a
    concurrent disconnect, e.g. a Redis Cluster topology refresh, has just torn down: redis-py
    8.1 lets these through instead of ``ConnectionError``); else ``None``."""
    if not isinstance(exc, (AttributeError, TypeError)) or exc.__traceback__ is None:
        return None
    innermost = traceback.extract_tb(exc.__traceback__)[-1].filename
    if not innermost.startswith(_REDIS_PY):
        return None
    error = RedisConnectionError(f"connection torn down while in use: {exc!r}")
    error.__cause__ = exc
    return error


class AsyncScriptRunner:
    """Runs the protocol scripts on a ``redis.asyncio`` client (standalone or Cluster)."""

    def __init__(self, client: AsyncRedis) -> None:
        self.client = client
        self.is_cluster = isinstance(client, RedisCluster)
        self.flows = ScriptFlows({name: load_script(name) for name in (*SENDER_SCRIPTS, *SCRIPT_NAMES)})

    @property
    def sha(self) -> dict[str, str]:
        """Each script's SHA1, of the text this server gets; empty before the first call (the
        server's version, from ``INFO server``, decides the text: see :meth:`shas`)."""
        return self.flows.sha or {}

    async def shas(self) -> dict[str, str]:
        """:attr:`sha`, asking ``INFO server`` the first time (an error reply: no flags)."""
        return await self._drive(self.flows.shas())  # type: ignore[no-any-return]

    async def _drive(self, flow: Flow) -> Any:
        """Run ``flow``: each request carried by :meth:`_send`, its reply sent back into the flow,
        an exception thrown into it (:func:`~dedupe_worker._protocol.script_flow.drive` with await)."""
        reply: Any = None
        error: Exception | None = None
        try:
            while True:
                request = flow.throw(error) if error is not None else flow.send(reply)
                try:
                    reply, error = await self._send(request), None
                except Exception as exc:  # the flow decides what it means
                    reply, error = None, exc
        except StopIteration as stop:
            return stop.value

    async def _send(self, request: Any) -> Any:
        """Carry one request of a flow to Redis; a connection torn down inside redis-py raised as
        the connection error it is (:func:`torn_connection`)."""
        try:
            if type(request) is tuple:
                return await self.client.execute_command(*request)
            if type(request) is list:
                pipe = self.client.pipeline(transaction=False)
                for command in request:
                    pipe.execute_command(*command)
                return await pipe.execute(raise_on_error=False)
            if type(request) is str:
                return await self.client.script_load(request)
            if isinstance(request, Library):
                if isinstance(self.client, RedisCluster):
                    return await self.client.execute_command("FUNCTION", "LOAD", "REPLACE", request.text,
                                                             target_nodes=RedisCluster.PRIMARIES)
                return await self.client.execute_command(  # type: ignore[no-untyped-call]
                    "FUNCTION", "LOAD", "REPLACE", request.text)
            if isinstance(self.client, RedisCluster):  # every primary: versions may be mixed
                return await self.client.info("server", target_nodes=RedisCluster.PRIMARIES)
            return await self.client.info("server")
        except (AttributeError, TypeError) as exc:
            torn = torn_connection(exc)
            if torn is None:
                raise
            raise torn from exc

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One FCALL or EVALSHA of script ``name``; all ``keys`` must share a hash slot on a cluster."""
        return await self._drive(self.flows.call(name, keys, args))

    async def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        """Several FCALLs or EVALSHAs in one pipelined round trip, replies in the order of ``calls``; with
        ``wait=(replicas, timeout_ms)``, ``WAIT`` in the same pipeline and ``NotDurable``
        (with the replies) when fewer replicas acknowledged."""
        return await self._drive(self.flows.call_all(calls, wait))  # type: ignore[no-any-return]

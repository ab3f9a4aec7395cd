"""The protocol's Lua scripts on ``redis.asyncio``: the asyncio driver of the script flows.

What a call sends, the ``NOSCRIPT`` handling (every script loaded, then only the calls that ran
nothing sent again), ``WAIT`` in the same round trip, the reply checks and the choice of script
texts for the server are written once in :mod:`dedupe_worker._transport.script_flow` and shared
with the sync :class:`~dedupe_worker._transport.scripts.ScriptRunner`; this module only carries
each request to Redis with ``redis.asyncio``. Every Redis failure is raised as
:class:`~dedupe_worker.StoreUnavailable`.

**Coalesced round trips.** A single script call (``FCALL``/``EVALSHA``: a claim, a completion)
made while another round trip of this runner is in flight does not take a connection of its own:
it joins a queue, and one flush scheduled with ``loop.call_soon`` sends every call queued in that
event-loop turn as one pipeline, each caller getting its own reply or its own error (an error reply
raised to that caller only, ``NOSCRIPT``/function not found handled per call by the flow as
before). A call alone (nothing in flight) is sent at once, so sequential use pays nothing. A
connection error fails every call of that pipeline (each caller's flow raises
:class:`~dedupe_worker.StoreUnavailable`, and decides as before); a caller cancelled before the
flush is left out of the pipeline, one cancelled after it has its reply dropped; no other
caller's call changes. ``WAIT``, loads, ``INFO`` and multi-call pipelines are sent as before, and
nothing is coalesced on a cluster (the calls of one turn go to different nodes).

On a plain ``redis.asyncio.Redis``, script calls alone and coalesced batches are sent straight on a
connection of the client's pool, the one the runner holds when it is free, packed by hiredis
(:mod:`dedupe_worker._transport.async_direct`, where the figures are); any other client gets redis-py's
``execute_command`` and pipeline.
"""

from __future__ import annotations

import asyncio
import os
import traceback
from collections.abc import Generator, Sequence
from typing import Any

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from .._protocol import Call
from .async_direct import DirectSender
from .script_flow import SCRIPT_NAMES, SENDER_SCRIPTS, ScriptFlows, carried
from .scripts import load_script

__all__ = ["AsyncRedis", "AsyncScriptRunner"]

#: The clients the asyncio store runs on.
AsyncRedis = redis.asyncio.Redis | RedisCluster


#: The commands a lone call may share a pipeline with others' (never ``WAIT``: it can block).
_COALESCED = frozenset({"FCALL", "EVALSHA"})

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
        # EVALSHA on a cluster: redis-py's asyncio cluster client lost the target of a FUNCTION LOAD
        # retried during a slot migration ("No way to dispatch this command ... Missing key"),
        # while SCRIPT LOAD and EVALSHA route by key there (tests/test_slot_migration.py).
        self.flows = ScriptFlows({name: load_script(name) for name in (*SENDER_SCRIPTS, *SCRIPT_NAMES)},
                                 functions=not isinstance(client, RedisCluster))
        #: Round trips of this runner in flight (a single call alone is sent at once only when 0).
        self._in_flight = 0
        #: Script calls waiting for the next flush, each with its caller's future.
        self._queue: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        #: Pipelines being sent (kept referenced until they finish).
        self._flushes: set[asyncio.Task[None]] = set()
        #: Round trips sent (single commands and pipelines): tests count them.
        self.round_trips = 0
        #: How a coalesced batch is sent: straight on a pool connection, or ``None``: a pipeline.
        self._direct = DirectSender.for_client(client)

    async def release_held(self) -> None:
        """Give the held connection of lone calls back to the client's pool (see
        :mod:`dedupe_worker._transport.async_direct`); a later call takes one again."""
        if self._direct is not None:
            await self._direct.release_held()

    @property
    def sha(self) -> dict[str, str]:
        """Each script's SHA1, of the text this server gets; empty before the first call (the
        server's version, from ``INFO server``, decides the text: see :meth:`shas`)."""
        return self.flows.sha or {}

    async def shas(self) -> dict[str, str]:
        """:attr:`sha`, asking ``INFO server`` the first time (an error reply: no flags)."""
        return await self._drive(self.flows.shas())  # type: ignore[no-any-return]

    async def _drive(self, flow: Generator[Any, Any, Any]) -> Any:
        """Run ``flow``: each request carried by :meth:`_send`, its reply sent back into the flow,
        an exception thrown into it (:func:`~dedupe_worker._transport.script_flow.drive` with
        await, which says why it is not the protocol's driver)."""
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
                if request[0] in _COALESCED and not self.is_cluster and (self._in_flight or self._queue):
                    return await self._join(request)
                self._in_flight += 1
                self.round_trips += 1
                try:
                    if self._direct is not None and request[0] in _COALESCED:
                        return await self._direct.execute(request)
                    return await self.client.execute_command(*request)
                finally:
                    self._in_flight -= 1
            if type(request) is list:
                self._in_flight += 1
                self.round_trips += 1
                try:
                    return await self._pipeline(request)
                finally:
                    self._in_flight -= 1
            method, args, options = carried(request, self.is_cluster)
            return await getattr(self.client, method)(*args, **options)
        except (AttributeError, TypeError) as exc:
            torn = torn_connection(exc)
            if torn is None:
                raise
            raise torn from exc

    async def _pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``commands`` in one non-transactional pipeline; error replies as exception objects."""
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return await pipe.execute(raise_on_error=False)

    async def _join(self, command: tuple[Any, ...]) -> Any:
        """Queue ``command`` for the next flush (scheduled if none is) and await its own reply."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append((command, future))
        return await future

    def _flush(self) -> None:
        """Send the queued calls whose callers still wait as one pipeline (a task of its own, so
        no caller's cancellation cancels it)."""
        batch = [(command, future) for command, future in self._queue if not future.done()]
        self._queue = []
        if not batch:
            return
        self._in_flight += 1
        self.round_trips += 1
        task = asyncio.get_running_loop().create_task(self._send_batch(batch))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _send_batch(self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        """One pipeline of ``batch``; each future gets its own reply or error (a failure of the
        round trip: every future the same error); a cancelled caller's reply is dropped."""
        try:
            try:
                commands = [command for command, _ in batch]
                replies = await (self._direct.execute_many(commands) if self._direct is not None
                                 else self._pipeline(commands))
            except (AttributeError, TypeError) as exc:
                torn = torn_connection(exc)
                if torn is None:
                    raise
                raise torn from exc
        except Exception as exc:  # handed to every caller, whose flow decides
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        finally:
            self._in_flight -= 1
        for (_, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One FCALL or EVALSHA of script ``name``; all ``keys`` must share a hash slot on a cluster."""
        return (await self.call_all(((name, keys, args),)))[0]

    async def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        """Several FCALLs or EVALSHAs in one pipelined round trip, replies in the order of ``calls``; with
        ``wait=(replicas, timeout_ms)``, ``WAIT`` in the same pipeline and ``NotDurable``
        (with the replies) when fewer replicas acknowledged. The first request is sent here, the
        flow driven only when its reply needs more (as the sync runner's :meth:`call_all
        <dedupe_worker._transport.scripts.ScriptRunner.call_all>`)."""
        flows = self.flows
        request = flows.request(calls, wait)
        if request is None:
            return await self._drive(flows.call_all(calls, wait))  # type: ignore[no-any-return]
        try:
            reply = await self._send(request)
        except Exception as exc:  # the flow decides what it means
            reply = exc
        else:
            if type(request) is tuple:
                return [reply]
        return await self._drive(flows.call_all(calls, wait, reply))  # type: ignore[no-any-return]

"""The protocol's Lua scripts on ``redis.asyncio``: EVALSHA, loaded again on ``NOSCRIPT``.

The same scripts and the same rules as :class:`~dedupe_worker._protocol.scripts.ScriptRunner`:
one EVALSHA per call in the common case, several calls in one pipelined round trip, only the
calls that failed with ``NOSCRIPT`` (which ran nothing) sent again, ``WAIT`` in the same pipeline
when durability is asked, every Redis failure raised as
:class:`~dedupe_worker.StoreUnavailable`, and the same script texts for the same server
(``#!lua`` flags on Redis 7+, decided from ``INFO server`` at the first call).
"""

from __future__ import annotations

import hashlib
import os
import traceback
from collections.abc import Sequence
from typing import Any

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from .._errors import StoreUnavailable
from .._protocol.scripts import LOAD_ORDER, SCRIPT_NAMES, Call, checked, load_script, script_text, takes_flags

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
        self._source = {name: load_script(name) for name in SCRIPT_NAMES}
        self._text: dict[str, str] = {}
        self._sha: dict[str, str] | None = None

    @property
    def sha(self) -> dict[str, str]:
        """Each script's SHA1, of the text this server gets; empty before the first call (the
        server's version, from ``INFO server``, decides the text: see :meth:`shas`)."""
        return self._sha or {}

    async def shas(self) -> dict[str, str]:
        """:attr:`sha`, asking ``INFO server`` the first time (an error reply: no flags)."""
        if self._sha is None:
            try:
                if isinstance(self.client, RedisCluster):  # every primary: versions may be mixed
                    info = await self.client.info("server", target_nodes=RedisCluster.PRIMARIES)
                else:
                    info = await self.client.info("server")
            except ResponseError:
                info = None
            flags = takes_flags(info)
            self._text = {name: script_text(text, flags) for name, text in self._source.items()}
            self._sha = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in self._text.items()}
        return self._sha

    async def _evalsha(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        sha = self._sha or await self.shas()
        return await self.client.evalsha(sha[name], len(keys), *keys, *args)

    async def _load(self) -> None:
        """After a ``NOSCRIPT``: load every protocol script in :data:`LOAD_ORDER`, for the reason
        :meth:`ScriptRunner._load <dedupe_worker._protocol.scripts.ScriptRunner._load>` gives (a
        call sent again runs after the later calls of its pipeline)."""
        await self.shas()
        for script in LOAD_ORDER:
            await self.client.script_load(self._text[script])

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One EVALSHA of script ``name``; all ``keys`` must share a hash slot on a cluster."""
        try:
            try:
                return await self._evalsha(name, keys, args)
            except NoScriptError:
                await self._load()
                return await self._evalsha(name, keys, args)
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed running {name}.lua: {exc}") from exc
        except (AttributeError, TypeError) as exc:
            torn = torn_connection(exc)
            if torn is None:
                raise
            raise StoreUnavailable(f"Redis failed running {name}.lua: {torn}") from torn

    async def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        """Several EVALSHAs in one pipelined round trip, replies in the order of ``calls``; with
        ``wait=(replicas, timeout_ms)``, ``WAIT`` in the same pipeline and :class:`NotDurable`
        (with the replies) when fewer replicas acknowledged."""
        if len(calls) == 1 and wait is None:
            return [await self.call(*calls[0])]
        if not calls:
            return []
        try:
            sha = await self.shas()
            pipe = self.client.pipeline(transaction=False)
            for name, keys, args in calls:
                pipe.execute_command("EVALSHA", sha[name], len(keys), *keys, *args)
            if wait is not None:
                pipe.execute_command("WAIT", *wait)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            acked: Any = replies.pop() if wait is not None else None
            reloaded = False
            for i, reply in enumerate(replies):
                if isinstance(reply, NoScriptError):
                    name, keys, args = calls[i]
                    if not reloaded:
                        await self._load()
                    replies[i] = await self._evalsha(name, keys, args)
                    reloaded = True
            if wait is not None and (reloaded or isinstance(acked, Exception)):
                acked = await self.client.execute_command("WAIT", *wait)
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed running {calls[0][0]}.lua: {exc}") from exc
        except (AttributeError, TypeError) as exc:
            torn = torn_connection(exc)
            if torn is None:
                raise
            raise StoreUnavailable(f"Redis failed running {calls[0][0]}.lua: {torn}") from torn
        return checked(calls, replies, wait, acked)

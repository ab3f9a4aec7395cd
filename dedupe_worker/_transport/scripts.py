"""The Lua scripts of the claim protocol, loaded once and called by SHA: the sync driver.

Each script in ``lua/`` is one state transition and states its KEYS, ARGV and return values in
its header. We call them with EVALSHA and load them on ``NOSCRIPT`` (after a restart, failover or
``SCRIPT FLUSH``), so a call is one round trip in the common case. redis-py's ``Script`` objects
are not used in pipelines because they add a ``SCRIPT EXISTS`` round trip per execute.

The scripts that finish or give back work (complete, release, renew, forget) start with
``#!lua flags=allow-oom``: on Redis 7 and later they run at ``maxmemory`` with ``noeviction``,
so a claim taken just under the limit can still store its outcome, while ``claim.lua`` is
refused and new work deferred. Redis 6 does not know script flags: there the first line is
left out. Which one a server gets is decided once per runner from ``INFO server``
(:func:`takes_flags`); the SHA is always that of the text sent.

What to send, the ``NOSCRIPT`` handling and the reply checks are written once, without I/O, in
:mod:`.script_flow`, shared with the asyncio runner; this module carries the requests to Redis,
on the held connection or redis-py's pool (:mod:`.paths`), and streams replies
(:meth:`ScriptRunner.call_streamed`, sync only: it needs the held connection).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from .._errors import StoreUnavailable
from .._protocol import Call, StreamCut
from .held import BUSY
from .paths import path_for
from .script_flow import (
    INFO,
    LOAD_ORDER,
    SCRIPT_NAMES,
    SENDER_SCRIPTS,
    ScriptFlows,
    carried,
    checked,
    drive,
    failed,
    script_text,
    takes_flags,
)

__all__ = ["LOAD_ORDER", "SCRIPT_NAMES", "SENDER_SCRIPTS", "ScriptRunner", "checked", "load_script", "script_text",
           "takes_flags"]


def load_script(name: str) -> str:
    """Return the text of ``lua/<name>.lua``: from the installed wheel, else the source tree."""
    packaged = resources.files("dedupe_worker").joinpath("lua", f"{name}.lua")
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parents[2] / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def _parsed_info(reply: Any) -> dict[str, str]:
    """An ``INFO`` reply read raw (off the held connection) as ``{field: value}``."""
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


class ScriptRunner:
    """Runs the protocol scripts on a Redis client (standalone, Sentinel-managed or Cluster).

    Every Redis failure surfaces as :class:`StoreUnavailable`; the caller decides what that means
    for the message (by default: do not run the handler).
    """

    def __init__(self, client: redis.Redis | RedisCluster) -> None:
        self.client = client
        self.is_cluster = isinstance(client, RedisCluster)
        self.flows = ScriptFlows({name: load_script(name) for name in (*SENDER_SCRIPTS, *SCRIPT_NAMES)})
        #: How commands reach Redis (see :mod:`.paths`), chosen once here.
        self.path = path_for(client)
        #: The connection the per-message calls use, shared by every runner on the same pool;
        #: ``None`` on a cluster or a small or blocking pool (redis-py's pool path).
        self.held = self.path.held

    @property
    def sha(self) -> dict[str, str]:
        """Each script's SHA1, of the text this server gets (asks ``INFO server`` the first time)."""
        sha = self.flows.sha
        return sha if sha is not None else drive(self.flows.resolve(), self._send)

    @property
    def _text(self) -> dict[str, str]:
        """Each script's text as this server gets it."""
        self.sha  # noqa: B018 - the texts are chosen with the SHAs
        return self.flows.text

    def _send(self, request: Any) -> Any:
        """Carry one request of a flow to Redis (see :mod:`.script_flow` for the kinds)."""
        if type(request) is tuple:
            return self.path.execute(request)
        if type(request) is list:
            return self.path.execute_many(request)
        if request is INFO and self.held is not None:  # a runner on the held connection takes no second one
            reply = self.held.execute("INFO", "server")
            if reply is not BUSY:
                return _parsed_info(reply)
        method, args, options = carried(request, self.is_cluster)
        return getattr(self.client, method)(*args, **options)

    def command(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
        """The command that runs script ``name`` on this server (``FCALL`` or ``EVALSHA``), for
        callers that pipeline it themselves (a reply :meth:`ran_nothing` means: :meth:`call` it)."""
        self.sha  # noqa: B018 - the server's version decides the command
        return self.flows.command(name, keys, args)

    def ran_nothing(self, reply: Any) -> bool:
        """Whether ``reply``, of a :meth:`command` sent by the caller, ran nothing and needs a
        reload (``NOSCRIPT``, function not found, functions refused): :meth:`call` it again."""
        return self.flows.ran_nothing(reply, True)

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One FCALL or EVALSHA of script ``name``; all ``keys`` must share a hash slot on a cluster."""
        return self.call_all(((name, keys, args),))[0]

    def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        """Several FCALLs or EVALSHAs in one pipelined round trip (see :meth:`ScriptFlows.call_all
        <dedupe_worker._transport.script_flow.ScriptFlows.call_all>`): its first request sent
        here, the flow driven only when the reply needs more (:meth:`ScriptFlows.request
        <dedupe_worker._transport.script_flow.ScriptFlows.request>`)."""
        flows = self.flows
        request = flows.request(calls, wait)
        if request is None:
            return drive(flows.call_all(calls, wait), self._send)  # type: ignore[no-any-return]
        try:
            if type(request) is tuple:  # a lone call: its reply is the result
                return [self.path.execute(request)]
            reply: Any = self.path.execute_many(request)
        except Exception as exc:  # the flow decides what it means
            reply = exc
        return drive(flows.call_all(calls, wait, reply), self._send)  # type: ignore[no-any-return]

    def call_streamed(self, calls: Sequence[Call], first: int, deliver: Callable[[Any], None]) -> list[Any]:
        """:meth:`call_all` (without ``WAIT``) in one write, where each reply of ``calls[first:]``
        is handed to ``deliver`` in order as soon as it is read: the caller works on it while Redis
        runs the later calls. Returns the replies of ``calls[:first]``, all read before anything
        is delivered.

        Every reply is still read, and delivered, in order. A failed reply holds back the ones
        after it until the round trip is over; then, as in :meth:`call_all`, the calls that met
        ``NOSCRIPT`` are sent again once every script is loaded, and the rest is delivered.
        Raises :class:`StoreUnavailable` when Redis failed before anything was delivered, and
        :class:`StreamCut` (what was read, how much was delivered) after. Without a held
        connection (or while another thread uses it) the round trip is :meth:`call_all`'s and
        the replies are delivered after it."""
        if not calls:
            return []
        replies: list[Any] = []
        delivered = 0
        held_back = False

        def take(i: int, reply: Any) -> None:
            nonlocal delivered, held_back
            replies.append(reply)
            held_back = held_back or isinstance(reply, Exception)
            if i >= first and not held_back:
                delivered += 1
                deliver(reply)

        try:
            self.sha  # noqa: B018 - the server's version decides the commands
            commands = [self.flows.command(*call) for call in calls]
            if not self.path.execute_streamed(commands, take):
                replies = self.call_all(calls)
            elif held_back:
                drive(self.flows.retry_noscript(calls, replies), self._send)
                checked(calls, replies, None, None)
        except (RedisError, StoreUnavailable) as exc:
            if not delivered:
                if isinstance(exc, StoreUnavailable):
                    raise
                raise failed(calls[0][0], exc) from exc
            raise StreamCut(f"Redis failed after {delivered} replies: {exc}", replies[:first], delivered) from exc
        for reply in replies[first + delivered:]:
            deliver(reply)
        return replies[:first]

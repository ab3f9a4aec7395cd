"""The Lua scripts of the claim protocol, loaded once and called by SHA.

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
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError, ResponseError

from .._errors import StoreUnavailable
from .held import BUSY, HeldConnection

__all__ = ["LOAD_ORDER", "SCRIPT_NAMES", "SENDER_SCRIPTS", "Call", "CallFailed", "NotDurable", "ScriptRunner",
           "StreamCut", "checked", "load_script", "script_text", "takes_flags"]

SCRIPT_NAMES = ("claim", "complete", "release", "renew", "inspect", "watch", "forget")

#: Scripts a producer runs before it publishes (``send.lua``): never pipelined with the worker's,
#: so they are loaded first after a ``NOSCRIPT``. Kept apart from :data:`SCRIPT_NAMES`, the
#: scripts workers of every release share records through.
SENDER_SCRIPTS = ("send",)

#: The order scripts are loaded in after a ``NOSCRIPT``: those a pipeline sends last (it sends
#: complete, release, then claim) are loaded last, so whenever one is loaded so are the earlier.
LOAD_ORDER = ("forget", "inspect", "watch", "renew", "complete", "release", "claim")

#: One script call: ``(script name, KEYS, ARGV)``.
Call = tuple[str, Sequence[str], Sequence[Any]]


class CallFailed(StoreUnavailable):
    """A call of a pipelined round trip failed (the error is chained); ``replies`` holds every
    call's reply, the failed ones as exception objects: the calls that answered did run."""

    def __init__(self, message: str, replies: list[Any]) -> None:
        super().__init__(message)
        self.replies = replies


class NotDurable(StoreUnavailable):
    """The writes ran on the primary, but fewer replicas than asked acknowledged them in time
    (``WAIT``): a failover now could lose them. ``replies`` are the scripts' replies."""

    def __init__(self, acked: int, wanted: int, timeout_ms: int, replies: list[Any]) -> None:
        super().__init__(f"not durable: {acked} of {wanted} replica(s) acknowledged within {timeout_ms} ms")
        self.replies = replies


class StreamCut(StoreUnavailable):
    """Redis failed after ``delivered`` replies of a streamed round trip were handed on
    (:meth:`ScriptRunner.call_streamed`): ``head`` holds the replies read before them; the calls
    after them may have run or not."""

    def __init__(self, message: str, head: list[Any], delivered: int) -> None:
        super().__init__(message)
        self.head = head
        self.delivered = delivered
        #: Filled in by the client: whether each outcome was stored and each claim released, and
        #: how many of the requests were answered (and handed on).
        self.stored: list[bool] = []
        self.released: list[bool] = []
        self.claimed = 0


def checked(calls: Sequence[Call], replies: list[Any], wait: tuple[int, int] | None, acked: Any) -> list[Any]:
    """The replies of a pipelined round trip once every ``NOSCRIPT`` was retried: raise
    :class:`StoreUnavailable` for a call that failed, :class:`NotDurable` (with the replies) when
    fewer replicas than ``wait`` asked acknowledged (``acked``), else return them."""
    for (name, _, _), reply in zip(calls, replies, strict=True):
        if isinstance(reply, Exception):
            raise CallFailed(f"Redis failed running {name}.lua: {reply}", replies) from reply
    if wait is not None and int(acked) < wait[0]:
        raise NotDurable(int(acked), wait[0], wait[1], replies)
    return replies


def load_script(name: str) -> str:
    """Return the text of ``lua/<name>.lua``: from the installed wheel, else the source tree."""
    packaged = resources.files("dedupe_worker").joinpath("lua", f"{name}.lua")
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parents[2] / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def takes_flags(info: Any) -> bool:
    """Whether the server(s) whose ``INFO server`` reply is ``info`` accept script flags (the
    ``#!lua`` first line): Redis 7 and later. ``info`` is one node's reply (a dict with
    ``redis_version``), a cluster's (a dict of such dicts, one per node: every node must be 7+),
    or ``None`` when ``INFO`` was refused (fakeredis, some managed services): no flags then."""
    if not isinstance(info, dict):
        return False
    if "redis_version" in info:
        try:
            return int(str(info["redis_version"]).split(".", 1)[0]) >= 7
        except ValueError:
            return False
    nodes = [node for node in info.values() if isinstance(node, dict)]
    return bool(nodes) and all(takes_flags(node) for node in nodes)


def script_text(text: str, flags: bool) -> str:
    """``text`` as sent to a server that takes script flags (``flags``), else without its
    ``#!lua`` first line (Redis 6 reads it as a syntax error)."""
    if flags or not text.startswith("#!"):
        return text
    return text.split("\n", 1)[1] if "\n" in text else ""


def server_info(client: Any, held: HeldConnection | None = None) -> Any:
    """``INFO server`` of ``client`` (through ``held`` when given and free, so a runner on a
    held connection takes no second one), or ``None`` when the server refuses the command (an
    error reply: fakeredis, a managed service's ACL). A connection error propagates."""
    try:
        if held is not None:
            reply = held.execute("INFO", "server")
            if reply is not BUSY:
                text = reply.decode() if isinstance(reply, bytes) else str(reply)
                return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if isinstance(client, RedisCluster):  # every primary: a cluster mid-upgrade may mix versions
            return client.info("server", target_nodes=RedisCluster.PRIMARIES)
        return client.info("server")
    except ResponseError:
        return None


class ScriptRunner:
    """Runs the protocol scripts on a Redis client (standalone, Sentinel-managed or Cluster).

    Every Redis failure surfaces as :class:`StoreUnavailable`; the caller decides what that means
    for the message (by default: do not run the handler).
    """

    def __init__(self, client: redis.Redis | RedisCluster) -> None:
        self.client = client
        self.is_cluster = isinstance(client, RedisCluster)
        self._source = {name: load_script(name) for name in (*SENDER_SCRIPTS, *SCRIPT_NAMES)}
        self._text: dict[str, str] = {}
        self._sha: dict[str, str] | None = None
        #: The connection the per-message calls use, shared by every runner on the same pool
        #: (see :mod:`.held`); ``None`` on a cluster or a small or blocking pool.
        self.held = HeldConnection.for_client(client)

    @property
    def sha(self) -> dict[str, str]:
        """Each script's SHA1, of the text this server gets (asks ``INFO server`` the first time)."""
        return self._sha if self._sha is not None else self._resolve()

    def _resolve(self) -> dict[str, str]:
        flags = takes_flags(server_info(self.client, self.held))
        self._text = {name: script_text(text, flags) for name, text in self._source.items()}
        self._sha = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in self._text.items()}
        return self._sha

    def _command(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
        """The ``EVALSHA`` command of one call."""
        return ("EVALSHA", self.sha[name], len(keys), *keys, *args)

    def _evalsha(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        command = self._command(name, keys, args)
        if self.held is not None:
            reply = self.held.execute(*command)
            if reply is not BUSY:
                return reply
        return self.client.execute_command(*command)  # type: ignore[no-untyped-call]

    def _load(self, name: str) -> None:
        """After a ``NOSCRIPT`` for ``name``: load every protocol script, not just ``name``.

        A pipeline runs its calls in order, but a call that failed with ``NOSCRIPT`` is sent
        again after the later calls already ran: were ``release.lua`` missing while
        ``claim.lua`` was loaded, a claim given back and claimed again in one round trip would
        meet our own lease (IN_PROGRESS, a needless deferral). Loading all of them, in
        :data:`LOAD_ORDER`, means no client of ours leaves the server with a script of a later
        pipeline position loaded and an earlier one missing. (Scripts vanish all at once, on a
        restart, failover or ``SCRIPT FLUSH``; a client of another version loading a subset can
        still cause such a deferral, never a second transition.)
        """
        del name
        self.sha  # noqa: B018 - the texts are chosen with the SHAs
        for script in (*SENDER_SCRIPTS, *LOAD_ORDER):
            self.client.script_load(self._text[script])

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One EVALSHA of script ``name``; all ``keys`` must share a hash slot on a cluster."""
        try:
            try:
                return self._evalsha(name, keys, args)
            except NoScriptError:
                self._load(name)
                return self._evalsha(name, keys, args)
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed running {name}.lua: {exc}") from exc

    def _pipelined(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """``commands`` in one round trip, error replies as exception objects."""
        if self.held is not None:
            replies = self.held.execute_many(commands)
            if replies is not BUSY:
                return replies  # type: ignore[no-any-return]
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error=False)

    def _retry_noscript(self, calls: Sequence[Call], replies: list[Any]) -> bool:
        """Send again, in order, each call whose reply is ``NOSCRIPT`` (it ran nothing), once
        every script is loaded; put the new replies in ``replies``. Whether any was sent again."""
        reloaded = False
        for i, reply in enumerate(replies):
            if isinstance(reply, NoScriptError):
                name, keys, args = calls[i]
                if not reloaded:
                    self._load(name)
                    reloaded = True
                replies[i] = self._evalsha(name, keys, args)
        return reloaded

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
            commands = [self._command(*call) for call in calls]
            if self.held is None or self.held.execute_streamed(commands, take) is BUSY:
                replies = self.call_all(calls)
            elif held_back:
                self._retry_noscript(calls, replies)
                checked(calls, replies, None, None)
        except (RedisError, StoreUnavailable) as exc:
            if not delivered:
                if isinstance(exc, StoreUnavailable):
                    raise
                raise StoreUnavailable(f"Redis failed running {calls[0][0]}.lua: {exc}") from exc
            raise StreamCut(f"Redis failed after {delivered} replies: {exc}", replies[:first], delivered) from exc
        for reply in replies[first + delivered:]:
            deliver(reply)
        return replies[:first]

    def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> list[Any]:
        """Several EVALSHAs, each ``(name, keys, args)``, in one pipelined round trip; replies in
        the order of ``calls``. Redis runs them one after the other, each atomically.

        Only the calls that failed with ``NOSCRIPT`` (which ran nothing) are sent again, so no
        transition runs twice. ``wait=(replicas, timeout_ms)`` adds ``WAIT`` to the same pipeline
        and raises :class:`NotDurable` (with the replies) when fewer replicas acknowledged.
        """
        if len(calls) == 1 and wait is None:
            return [self.call(*calls[0])]
        if not calls:
            return []
        try:
            replies: list[Any] = self._pipelined(
                [self._command(*call) for call in calls]
                + ([("WAIT", *wait)] if wait is not None else []))
            acked: Any = replies.pop() if wait is not None else None
            reloaded = self._retry_noscript(calls, replies)
            if wait is not None and (reloaded or isinstance(acked, Exception)):
                acked = self.client.execute_command("WAIT", *wait)  # type: ignore[no-untyped-call]
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed running {calls[0][0]}.lua: {exc}") from exc
        return checked(calls, replies, wait, acked)

"""What the script runners do, written once without I/O: the sync and asyncio runners drive it.

Each operation of :class:`ScriptFlows` is a generator that yields what to send and receives the
reply (an error reply or a Redis failure is thrown into it), as httpx writes its auth flows. The
drivers (:class:`~dedupe_worker._transport.scripts.ScriptRunner` with redis-py,
:class:`~dedupe_worker._transport.async_scripts.AsyncScriptRunner` with ``redis.asyncio``) only carry
each request to Redis. A request is one of:

* a ``tuple``: one command (``EVALSHA ...``, ``WAIT ...``); the reply is sent back;
* a ``list`` of such tuples: one pipelined round trip; the replies come back in order, error
  replies as exception objects (as a pipeline's with ``raise_on_error=False``);
* a ``str``: a script text to ``SCRIPT LOAD`` (on every primary of a cluster);
* :data:`INFO`: ``INFO server`` (of every primary of a cluster), as redis-py parses it;
* a :class:`Library`: ``FUNCTION LOAD REPLACE`` of the function library (on every primary).

Written here once: which text and SHA each server gets (``#!lua`` flags on Redis 7+, from
``INFO server`` at the first call), what a call sends, the ``NOSCRIPT`` handling (every script
loaded, in :data:`LOAD_ORDER`, then only the calls that ran nothing sent again, in order),
``WAIT`` in the same round trip and asked again after a reload, and the reply checks.

**Functions.** On Redis 7+ and Valkey the scripts are called as one function library
(``FCALL``), loaded with ``FUNCTION LOAD``: the server keeps it in its RDB/AOF and replicates it,
so a restart with persistence or a failover to a replica needs no reload (a script loaded with
``SCRIPT LOAD`` is neither persisted nor replicated: the first call after either met ``NOSCRIPT``). The
library is built at load time from the same ``lua/*.lua`` files, one function per script with the
same KEYS/ARGV (:func:`library_text`), and named by a hash of those texts (:func:`library_name`),
so the libraries of two releases coexist on a server through a rolling upgrade. The choice is made
once per runner: functions when ``INFO server`` says 7 or later and :data:`SCRIPTS_ENV` is not
``eval``; a refused ``FUNCTION LOAD`` or ``FCALL`` (``NOPERM``, unknown command: managed services,
the in-memory double) switches the runner to ``EVALSHA`` for good, logged once per process. A
"function not found" reply (``FUNCTION FLUSH``, a server without persistence restarted) loads
the library again, as ``NOSCRIPT`` loads the scripts.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoPermissionError, NoScriptError, RedisError, ResponseError

from .._errors import StoreUnavailable
from .._protocol import Call, CallFailed, NotDurable
from .._settings import SCRIPTS_ENV, eval_forced

__all__ = ["INFO", "LIBRARY_PREFIX", "LOAD_ORDER", "PER_CALL", "SCRIPTS_ENV", "SCRIPT_NAMES", "SENDER_SCRIPTS", "Flow",
           "Library", "ScriptFlows", "checked", "function_missing", "library_name", "library_text", "refused",
           "script_text", "split_definitions", "takes_flags"]

log = logging.getLogger(__name__)


#: What every library of ours is named with (then the hash of its sources): ``doctor`` lists them.
LIBRARY_PREFIX = "dedupe_"

_logged: set[str] = set()

SCRIPT_NAMES = ("claim", "complete", "release", "renew", "inspect", "watch", "forget")

#: Scripts a producer runs around a publish (``send.lua``, ``unsend.lua``): never pipelined with
#: the worker's, so they are loaded first after a ``NOSCRIPT``. Kept apart from
#: :data:`SCRIPT_NAMES`, the scripts workers of every release share records through.
SENDER_SCRIPTS = ("send", "unsend")

#: The order scripts are loaded in after a ``NOSCRIPT``: those a pipeline sends last (it sends
#: complete, release, then claim) are loaded last, so whenever one is loaded so are the earlier.
LOAD_ORDER = ("forget", "inspect", "watch", "renew", "complete", "release", "claim")

class _Info:
    def __repr__(self) -> str:
        return "INFO"


#: The request for ``INFO server``.
INFO: Any = _Info()

#: An operation: yields requests, receives replies, returns its result.
Flow = Generator[Any, Any, Any]

#: ``sent`` of :meth:`ScriptFlows.call_all` when the driver sent nothing yet.
UNSENT: Any = object()


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


def script_flags(text: str) -> list[str]:
    """The flags of a script's ``#!lua flags=a,b`` first line (none without one)."""
    first = text.split("\n", 1)[0]
    if not first.startswith("#!lua"):
        return []
    for word in first.split()[1:]:
        if word.startswith("flags="):
            return [flag for flag in word[len("flags="):].split(",") if flag]
    return []


#: Flags a script's function gets besides its ``#!lua`` ones: ``inspect`` only reads.
_EXTRA_FLAGS = {"inspect": ["no-writes"]}


def library_name(source: Mapping[str, str]) -> str:
    """``dedupe_<hash8>``: the library of these script texts; another text, another name."""
    digest = hashlib.sha1()
    for name in sorted(source):
        digest.update(f"{name}\0{source[name]}\0".encode())
    return LIBRARY_PREFIX + digest.hexdigest()[:8]


#: The line of a script after which it runs per call; what comes before it only defines helpers
#: and constants (it reads no KEYS or ARGV, and no call changes it: one call's state would carry
#: over to the next), so a function library defines them once, at load.
PER_CALL = "-- per call"


def split_definitions(text: str) -> tuple[str, str]:
    """``text`` (without its ``#!lua`` line) as its definitions and what runs per call: split at
    its :data:`PER_CALL` line, or ``("", text)`` for a script without one."""
    before, marker, after = script_text(text, False).partition(f"\n{PER_CALL}\n")
    return (before + "\n", after) if marker else ("", before)


def library_text(source: Mapping[str, str], library: str) -> str:
    """The function library of ``source`` (name -> script text): each script, its ``#!lua`` line
    left out, becomes ``<library>_<name>(KEYS, ARGV)``, with the script's flags (``allow-oom``) and
    ``no-writes`` for ``inspect``. What runs per call is the function's body; the definitions
    before its :data:`PER_CALL` line run once, when the library is loaded, in a ``do`` block of
    their own, so each script sees only its own helpers. Nothing else in the text changes."""
    parts = [f"#!lua name={library}"]
    for name in sorted(source):
        text = source[name]
        definitions, per_call = split_definitions(text)
        flags = ", ".join(f"'{flag}'" for flag in [*script_flags(text), *_EXTRA_FLAGS.get(name, [])])
        function = (f"redis.register_function{{function_name='{library}_{name}', "
                    f"callback=function(KEYS, ARGV)\n{per_call}\nend, flags={{{flags}}}}}")
        parts.append(f"do\n{definitions}{function}\nend" if definitions else function)
    return "\n".join(parts) + "\n"


@dataclass(frozen=True)
class Library:
    """The request to load the function library ``name`` (``text``) on every primary."""

    name: str
    text: str


def carried(request: Any, cluster: bool) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """How a runner's client (sync or asyncio: the same method names) carries a request that is
    not a command or a round trip: the method, its arguments and options. ``SCRIPT LOAD`` of a
    text (redis-py sends it to every primary of a cluster itself), ``FUNCTION LOAD REPLACE`` of a
    :class:`Library`, and :data:`INFO`, on every primary of a cluster (one mid-upgrade may mix
    versions)."""
    if type(request) is str:
        return "script_load", (request,), {}
    primaries: dict[str, Any] = {"target_nodes": "primaries"} if cluster else {}
    if isinstance(request, Library):
        return "execute_command", ("FUNCTION", "LOAD", "REPLACE", request.text), primaries
    return "info", ("server",), primaries


def function_missing(reply: Any) -> bool:
    """Whether ``reply`` says the function called is not loaded (``FUNCTION FLUSH``, a restart
    without persistence): the call ran nothing."""
    return isinstance(reply, ResponseError) and "function not found" in str(reply).lower()


def refused(reply: Any) -> bool:
    """Whether ``reply`` says this user or server does not run functions (``NOPERM`` for
    ``FCALL`` or ``FUNCTION``, an unknown command or subcommand): the call ran nothing. A
    ``NOPERM`` for a key is not one: ``EVALSHA`` would be refused the same."""
    if not isinstance(reply, ResponseError):
        return False
    text = str(reply).lower()
    if isinstance(reply, NoPermissionError) or text.startswith("noperm"):
        return "'fcall" in text or "'function" in text
    return "unknown command" in text or "unknown subcommand" in text


def failed(name: str, exc: BaseException) -> StoreUnavailable:
    """The error a caller gets when Redis failed running ``name``.lua."""
    return StoreUnavailable(f"Redis failed running {name}.lua: {exc}")


class ScriptFlows:
    """The protocol scripts of one server: their texts and SHAs, and the flows that call them.

    ``source`` maps each script name to its text in ``lua/`` (with its ``#!lua`` line).
    """

    def __init__(self, source: dict[str, str], *, functions: bool = True) -> None:
        self.source = source
        #: Whether this runner may call functions at all (``False``: always ``EVALSHA``).
        self.functions_allowed = functions
        #: Each script's text as this server gets it; empty until :attr:`sha` is known.
        self.text: dict[str, str] = {}
        #: Each script's SHA1, of :attr:`text`; ``None`` until the server's version is known.
        self.sha: dict[str, str] | None = None
        #: The function library of these scripts: ``dedupe_<hash8>``.
        self.library = library_name(source)
        #: Whether calls are ``FCALL`` calls of :attr:`library` (else ``EVALSHA``); decided with :attr:`sha`.
        self.functions = False
        #: How many times this runner loaded the library or the scripts (tests count reloads).
        self.loads = 0
        #: Each script's function in :attr:`library`.
        self.function = {name: f"{self.library}_{name}" for name in source}

    def resolve(self) -> Flow:
        """Ask ``INFO server`` (an error reply: no flags) and choose the texts and SHAs, and
        whether to call functions (Redis 7+, unless :data:`SCRIPTS_ENV` is ``eval``)."""
        try:
            info = yield INFO
        except ResponseError:
            info = None
        flags = takes_flags(info)
        self.functions = (self.functions_allowed and flags
                          and not eval_forced())
        self.text = {name: script_text(text, flags) for name, text in self.source.items()}
        self.sha = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in self.text.items()}
        return self.sha

    def command(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
        """The command that runs script ``name`` (once :attr:`sha` is known): ``FCALL`` of its
        function, or ``EVALSHA``."""
        if self.functions:
            return ("FCALL", self.function[name], len(keys), *keys, *args)
        assert self.sha is not None
        return ("EVALSHA", self.sha[name], len(keys), *keys, *args)

    def ran_nothing(self, reply: Any, fcall: bool) -> bool:
        """Whether ``reply`` (of an ``FCALL`` when ``fcall``) is an error that ran nothing and is
        cured by :meth:`reload`: ``NOSCRIPT``, function not found, or functions refused."""
        return isinstance(reply, NoScriptError) or function_missing(reply) or (fcall and refused(reply))

    def reload(self, reply: Any) -> Flow:
        """:meth:`load` after ``reply`` (see :meth:`ran_nothing`); functions refused: ``EVALSHA``
        from now on."""
        if self.functions and refused(reply):
            self.fall_back(reply)
        yield from self.load()

    def fall_back(self, reason: Any) -> None:
        """Call ``EVALSHA`` from now on: this server or user refuses functions."""
        self.functions = False
        key = type(reason).__name__ + str(reason).split(" ", 1)[0]
        if key not in _logged:
            _logged.add(key)
            log.warning("Redis Functions refused (%s): the scripts run with EVALSHA instead (a restart "
                        "or failover then reloads them)", reason)

    def load(self) -> Flow:
        """After a ``NOSCRIPT``: load every protocol script, not just the missing one.

        A pipeline runs its calls in order, but a call that failed with ``NOSCRIPT`` is sent
        again after the later calls already ran: were ``release.lua`` missing while
        ``claim.lua`` was loaded, a claim given back and claimed again in one round trip would
        meet our own lease (IN_PROGRESS, a needless deferral). Loading all of them, in
        :data:`LOAD_ORDER`, means no client of ours leaves the server with a script of a later
        pipeline position loaded and an earlier one missing. (Scripts vanish all at once, on a
        restart, failover or ``SCRIPT FLUSH``; a client of another version loading a subset can
        still cause such a deferral, never a second transition.)
        """
        if self.sha is None:
            yield from self.resolve()
        self.loads += 1
        if self.functions:
            try:
                yield Library(self.library, library_text(self.source, self.library))
                return
            except ResponseError as exc:
                if not refused(exc):
                    raise
                self.fall_back(exc)
        for name in (*SENDER_SCRIPTS, *LOAD_ORDER):
            if name in self.text:
                yield self.text[name]

    def shas(self) -> Flow:
        """:attr:`sha`, asking ``INFO server`` the first time."""
        return self.sha if self.sha is not None else (yield from self.resolve())

    def request(self, calls: Sequence[Call], wait: tuple[int, int] | None = None) -> Any:
        """What :meth:`call_all` ``(calls, wait)`` sends first, once :attr:`sha` is known (else
        ``None``): a lone call's command, or the commands (and ``WAIT``) as one list.

        A driver sends it itself and hands the outcome (the reply, or the exception sending it
        raised) to :meth:`call_all` as ``sent``, which goes on from there; a lone call's reply
        is its result, so the flow is only needed for anything else. Why: a round trip that
        needs nothing more then runs no generator (``python -m bench.core``)."""
        if self.sha is None or not calls:
            return None
        if len(calls) == 1 and wait is None:
            name, keys, args = calls[0]
            return self.command(name, keys, args)
        commands = [self.command(*call) for call in calls]
        if wait is not None:
            commands.append(("WAIT", *wait))
        return commands

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any], sent: Any = UNSENT) -> Flow:
        """One FCALL or EVALSHA of script ``name``, loaded again on ``NOSCRIPT`` or function not
        found; every Redis failure raised as :class:`StoreUnavailable`. ``sent``: the outcome of
        its command, sent by the driver (see :meth:`request`)."""
        try:
            if sent is UNSENT and self.sha is None:
                yield from self.resolve()
            fcall = self.functions
            try:
                if sent is UNSENT:
                    return (yield self.command(name, keys, args))
                if isinstance(sent, BaseException):
                    raise sent
                return sent
            except ResponseError as exc:
                if not self.ran_nothing(exc, fcall):
                    raise
                yield from self.reload(exc)
                return (yield self.command(name, keys, args))
        except RedisError as exc:
            raise failed(name, exc) from exc

    def retry_noscript(self, calls: Sequence[Call], replies: list[Any]) -> Flow:
        """Send again, in order, each call whose reply is ``NOSCRIPT`` or function not found (it
        ran nothing), once every script is loaded; put the new replies in ``replies``. Returns
        whether any was."""
        fcall = self.functions
        retry = [i for i, reply in enumerate(replies) if self.ran_nothing(reply, fcall)]
        if retry:
            yield from self.reload(replies[retry[0]])
        for i in retry:
            replies[i] = yield self.command(*calls[i])
        return bool(retry)

    def call_all(self, calls: Sequence[Call], wait: tuple[int, int] | None = None, sent: Any = UNSENT) -> Flow:
        """Several FCALLs or EVALSHAs, each ``(name, keys, args)``, in one pipelined round trip; replies in
        the order of ``calls``. Redis runs them one after the other, each atomically.

        Only the calls that failed with ``NOSCRIPT`` (which ran nothing) are sent again, so no
        transition runs twice. ``wait=(replicas, timeout_ms)`` adds ``WAIT`` to the same round
        trip and raises :class:`NotDurable` (with the replies) when fewer replicas acknowledged.
        ``sent``: the outcome of :meth:`request`, sent by the driver.
        """
        if len(calls) == 1 and wait is None:
            name, keys, args = calls[0]
            return [(yield from self.call(name, keys, args, sent))]
        if not calls:
            return []
        try:
            if sent is UNSENT:
                if self.sha is None:
                    yield from self.resolve()
                sent = yield self.request(calls, wait)
            elif isinstance(sent, BaseException):
                raise sent
            replies: list[Any] = sent
            acked: Any = replies.pop() if wait is not None else None
            reloaded = yield from self.retry_noscript(calls, replies)
            if wait is not None and (reloaded or isinstance(acked, Exception)):
                acked = yield ("WAIT", *wait)
        except RedisError as exc:
            raise failed(calls[0][0], exc) from exc
        return checked(calls, replies, wait, acked)


def drive(flow: Flow, send: Any) -> Any:
    """Run ``flow`` with ``send(request) -> reply`` (the sync driver's loop; the asyncio one is
    the same with ``await``): a reply is sent into the flow, an exception thrown into it.

    A loop of its own, not :func:`~dedupe_worker._protocol.flows.drive`: the requests are of the
    few kinds above, carried by one ``send`` (no table of performers, no ``Steps``), and only an
    ``Exception`` is thrown in: a ``KeyboardInterrupt`` or a cancellation leaves the flow at once
    (the connection it interrupted is dropped by the transport). The runners run it only when a
    round trip needs more than its first request (:meth:`ScriptFlows.request`)."""
    reply: Any = None
    error: Exception | None = None
    try:
        while True:
            request = flow.throw(error) if error is not None else flow.send(reply)
            try:
                reply, error = send(request), None
            except Exception as exc:  # the flow decides what it means
                reply, error = None, exc
    except StopIteration as stop:
        return stop.value

"""The claim protocol's multi-step operations, written once and without I/O.

Each operation of the client (claim, with or without a wait; complete, with the finishing retry;
fail; release; settle a batch's outcomes and claim the next chunk) is a generator *flow* here, as
httpx writes its auth flows: it yields an *effect* (a round trip, a pause, a wait for a notice, a
handler to call) and receives its result, or has its exception thrown in. It never touches a
socket, a clock it sleeps on, or an event loop. Two drivers run the same flows:

- ``ClaimClient._drive`` performs effects with blocking calls;
- ``AsyncClaimClient._drive`` awaits them.

The loop that advances a flow is written once too (:class:`Steps`): a driver only performs each
effect, by a call or an ``await``.

So the sync and asyncio clients cannot drift: a verdict, a retry or a wait is decided in one
place. What differs between them is only how an effect is performed (the script runner, the
lease renewer thread or task, the key watcher or waiter, the connection pool), and those are
the deliberate twins.

Effects (the result the driver sends back):

- :class:`Send` ``(calls, wait)``: the script calls in one pipelined round trip
  (``scripts.call_all``), one reply per call; raises :class:`~dedupe_worker.StoreUnavailable`.
- :class:`Sleep` ``(seconds)``: pause; ``None``.
- :class:`Wait` ``(stem, timeout)``: wait, counted as a waiter, until the key's holder completes
  or releases it or ``timeout`` passes; ``None``.
- :class:`CheckStore`: check, once, the store's eviction policy (``check_store``); ``None``.
- :class:`Either` ``(sync, asynchronous)``: ``sync()``, or ``await asynchronous()`` on asyncio.
- :class:`Stream` ``(outcomes, releases, claims, each, step)``: ``settle_and_stream``'s round
  trip, the flow ``each`` run for ``claim.lua``'s replies as they come in (the batch engine's
  round trip).
- :class:`Handler` ``(fn)``: the handler's value (``fn()``, or ``await fn()`` on asyncio); its
  exception is thrown into the flow.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, Unpack

from .._errors import ClaimError, LeaseLost, ResultNotSerializable, StoreUnavailable
from .._settings import ClientKeywords, ClientOptions, DedupeSettings, options_in_query
from .calls import Call, CallFailed, ClaimItem, KeyState, NotDurable, StoreCalls, StreamCut, acquired_in, key_state
from .claim import Claim, Outcome, Stored
from .codec import ClaimCodec, Prepared, Request, ttl_ms
from .layout import KeyLayout
from .leases import Lease, lost_in_round, round_failed, round_of
from .retry import FinishRetry

__all__ = ["CHECK_STORE", "CheckStore", "ClientCore", "Effect", "Either", "Flow", "Handler", "KeptLeases", "Send",
           "Sleep", "Steps", "Stream", "Wait", "drive", "drive_async"]

log = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C", bound="ClientCore")


class Send(NamedTuple):
    """One round trip of script calls (with ``WAIT replicas timeout_ms`` when ``wait`` is set);
    answered with one reply per call, or :class:`~dedupe_worker.StoreUnavailable` (``NotDurable``
    when too few replicas acknowledged)."""

    calls: list[Call]
    wait: tuple[int, int] | None


class Sleep(NamedTuple):
    """Pause ``seconds`` (a finishing write's backoff)."""

    seconds: float


class Wait(NamedTuple):
    """Wait on a held key until its holder finishes it, at most ``timeout`` seconds."""

    stem: str
    timeout: float


class CheckStore(NamedTuple):
    """Check the store's eviction policy once."""


class Handler(NamedTuple):
    """Call (or await) a handler; answered with its value, or its exception thrown in."""

    fn: Callable[[], Any]


class Stream(NamedTuple):
    """Store ``outcomes``, release ``releases`` and claim ``claims`` (``(stem, fingerprint,
    original)``, as :meth:`~.calls.StoreCalls.claim_calls` takes them) in one round trip, running
    the flow ``each(start, flat)`` for every ``step`` claims with their flat ``claim.lua`` reply
    (four values a claim), on the sync client while Redis still claims the later ones; answered
    with ``(stored, released)``. The replies are handed on raw so that a batch builds objects
    only for the claims that need them."""

    outcomes: Sequence[tuple[Claim, Stored, bytes]]
    releases: Sequence[Claim]
    claims: Sequence[ClaimItem]
    each: Callable[[int, list[Any]], Flow[None]]
    step: int


class Either(NamedTuple):
    """A call with a sync and an asyncio form: ``sync()`` on the sync driver, ``await
    asynchronous()`` on the asyncio one (a committed-row lookup in the handler's database)."""

    sync: Callable[[], Any]
    asynchronous: Callable[[], Awaitable[Any]]


CHECK_STORE = CheckStore()

Effect = Send | Sleep | Wait | CheckStore | Handler | Either | Stream
#: A flow: yields effects, receives their results, returns ``T``.
Flow = Generator[Effect, Any, T]

class Steps(Generic[T]):
    """The driver loop, written once for both drivers (httpx keeps two; this is the shared part).

    Each :meth:`next` advances ``flow`` with the last effect's value, or throws its exception in,
    keeps the effect it yields in :attr:`effect` and returns how to perform it, that effect's
    entry in the client's table (``ClientCore.performers``); once the flow returns, ``None``, and
    :attr:`result` holds its value. Around each effect the driver writes only how it is
    performed, called (:func:`drive`) or awaited (:func:`drive_async`).

    The driver keeps the effect's exception (``BaseException``: a cancelled handler's claim is
    settled too) in :attr:`error`, thrown into the flow at the next step. An exception the flow
    does not catch leaves the loop as the driver's own. (A method called in a ``while`` rather
    than an iterator, and a ``try`` rather than ``with steps``: the loop runs for every effect of
    every message, and the iterator protocol and a context manager each cost calls more.)"""

    __slots__ = ("effect", "error", "flow", "perform", "result", "value")

    def __init__(self, flow: Generator[Any, Any, T], perform: Mapping[type[Any], Callable[[Any], Any]]) -> None:
        self.flow = flow
        self.perform = perform
        self.value: Any = None
        self.error: BaseException | None = None
        self.effect: Any = None
        self.result: T

    def next(self) -> Callable[[Any], Any] | None:
        try:
            effect = self.flow.send(self.value) if self.error is None else self.flow.throw(self.error)
        except StopIteration as stop:
            self.result = stop.value
            return None
        finally:
            self.error = None  # no cycle: the driver's frame -> self -> the error -> its traceback
        self.effect = effect
        return self.perform[type(effect)]


def drive(flow: Generator[Any, Any, T], perform: Mapping[type[Any], Callable[[Any], Any]]) -> T:
    """Run ``flow`` to its end, performing each effect it yields with ``perform[type(effect)]``
    called (blocking); an effect's exception is thrown into the flow (:class:`Steps`). The driver
    of the flows above the transport: the protocol's, the HTTP layer's claim, ``atomic()``'s
    statements. (The transport's script flows keep their own loop, which throws only
    ``Exception`` in: see ``_transport/script_flow.drive``.)"""
    steps = Steps(flow, perform)
    while (call := steps.next()) is not None:
        try:
            steps.value = call(steps.effect)
        except BaseException as exc:
            steps.error = exc
    return steps.result


async def drive_async(flow: Generator[Any, Any, T],
                      perform: Mapping[type[Any], Callable[[Any], Awaitable[Any]]]) -> T:
    """:func:`drive` with each effect's call awaited: only the ``await`` differs."""
    steps = Steps(flow, perform)
    while (call := steps.next()) is not None:
        try:
            steps.value = await call(steps.effect)
        except BaseException as exc:
            steps.error = exc
    return steps.result


_ACQUIRED, _DUPLICATE, _IN_PROGRESS = Outcome.ACQUIRED, Outcome.DUPLICATE, Outcome.IN_PROGRESS
#: A renewal round's answer: when it began, and the leases found lost.
Renewed = tuple[float, list[Lease]]


class Leases(Protocol):
    """What the flows need of a lease renewer (a thread on sync, a task per loop on asyncio)."""

    interval: float

    def track(self, stem: str, token: int) -> None: ...
    def untrack(self, stem: str, token: int) -> None: ...
    def track_many(self, leases: Iterable[tuple[str, int]]) -> None: ...
    def untrack_many(self, leases: Iterable[tuple[str, int]]) -> None: ...
    def track_group(self, claims: Sequence[Any]) -> int: ...
    def settle_group(self, group: int) -> None: ...
    def untrack_group(self, group: int) -> None: ...
    def settle(self, leases: Iterable[tuple[str, int]]) -> None: ...
    def is_lost(self, stem: str, token: int) -> bool: ...
    def last_renewal(self) -> float: ...


class ClientCore(ClaimCodec):
    """The flows of the claim protocol's client, over a codec's options. The sync and asyncio
    clients subclass it and add a driver, the store, the renewer and the waiting; their options
    are one :class:`~dedupe_worker.ClientOptions`, taken whole here."""

    store: StoreCalls
    renewer: Leases
    #: Whether a flow may call a handler itself instead of yielding :class:`Handler`: true where
    #: the driver would perform that effect as a plain call (the sync client), false where it
    #: awaits it (asyncio). The flow's logic around the call is the same either way.
    calls_handlers: bool = False

    def __init__(
        self,
        store_for: Callable[[KeyLayout], Any],
        renewer_for: Callable[[Callable[[list[Lease], Callable[[Lease], bool]], Any], float], Any],
        options: ClientOptions,
    ) -> None:
        super().__init__(options)
        allow_eviction = options.allow_eviction
        self.allow_eviction = allow_eviction
        #: True once Redis' eviction policy was checked (or ``allow_eviction``): claims skip the check.
        self.store_checked = allow_eviction
        self.store = store_for(self.layout)
        self.store.require_replicas(options.wait_replicas, options.wait_timeout)
        self.permanent_errors = options.permanent_errors
        self.fail_open = options.fail_open
        drive: Any = self._drive  # the subclass's driver: each round is one flow it runs
        self.renewer = renewer_for(lambda items, refused: drive(self.renewal_flow(items, refused)),
                                   options.renew_interval or options.lease / 3)
        #: How completions and releases are retried on transient store errors (:mod:`.retry`).
        self.finish_retry = FinishRetry(options.lease, self.renewer.interval)
        #: Whether :meth:`from_url` built the Redis client (then ``close`` closes it too).
        self.owns_redis = False
        #: How the driver performs each effect, by the effect's type (:meth:`performers`).
        self.perform = self.performers()

    @classmethod
    def from_url(cls: type[C], url: str, *, options: ClientOptions | None = None,
                 **keywords: Unpack[ClientKeywords]) -> C:
        """Build from a Redis URL; ``redis+cluster://`` or ``?cluster=1`` selects Redis Cluster.
        Client options may ride in the query (``?namespace=billing&lease=10``): they are taken
        out of the URL before it is connected to, and keywords win over them. The client's
        ``close()`` (``aclose()`` on asyncio) closes the Redis client built here; a client passed
        to the constructor is the caller's to close."""
        return cls._from_url(url, options, keywords)

    @classmethod
    def _from_url(cls: type[C], url: str, options: ClientOptions | None, keywords: Mapping[str, Any]) -> C:
        """:meth:`from_url` for any constructor's keywords (a deduplicator's take ``outcomes`` too)."""
        url, in_query = options_in_query(url)
        build: Any = cls  # a client's constructor (ClientCore's own takes the store and renewer)
        client: C = build(cls._connect(url), options=options, **{**in_query, **keywords})
        client.owns_redis = True
        return client

    @classmethod
    def from_settings(cls: type[C], settings: DedupeSettings | None = None, **keywords: Unpack[ClientKeywords]) -> C:
        """Build from :class:`DedupeSettings` (read from ``DEDUPE_*`` when not given); keywords
        win over the settings."""
        s = settings or DedupeSettings()
        return cls.from_url(s.claims_url, options=s.options(), **keywords)

    @staticmethod
    def _connect(url: str) -> Any:
        """The Redis client :meth:`from_url` builds for ``url``."""
        raise NotImplementedError

    def keep_leases(self, claims: Sequence[Claim]) -> KeptLeases:
        """While inside (``with``, or ``async with`` on asyncio), the renewer keeps the leases of
        ``claims`` from running out."""
        return KeptLeases(self.renewer, claims)

    # -- effects --------------------------------------------------------------------------------

    def performers(self) -> dict[type[Any], Callable[[Any], Any]]:
        """How each effect is performed, written once for both drivers: the sync ``_drive`` calls
        the entry for an effect's type and sends its value into the flow; the asyncio one awaits it
        (on the asyncio client the store's calls, the handler, the sleep, the wait and the store
        check return awaitables). What differs is the client's: ``_sleep``, ``_wait``, ``_either``,
        ``_drive`` (its driver), ``check_store`` and ``stream_claims``."""
        client: Any = self
        return {
            Send: lambda e: client.store.scripts.call_all(e.calls, e.wait),
            Handler: lambda e: e.fn(),
            Stream: lambda e: client.stream_claims(
                e.outcomes, e.releases, e.claims, lambda start, flat: client._drive(e.each(start, flat)), e.step),
            Either: client._either,
            Sleep: lambda e: client._sleep(e.seconds),
            Wait: lambda e: client._wait(*e),
            CheckStore: lambda e: client.check_store(),
        }

    def _drive(self, flow: Flow[Any]) -> Any:
        """The client's driver (its ``_drive``; the asyncio one's value is awaited)."""
        raise NotImplementedError

    # -- round trips ----------------------------------------------------------------------------

    def round_trip(self, groups: tuple[list[Call], ...]) -> Flow[list[list[Any]]]:
        """Send every call of every group in one round trip; return each group's replies flattened
        (one value per item for complete/release/renew, four per item for claim).

        With the store's ``durability`` set, a round trip that claims or completes also waits for
        the replicas; when too few acknowledge it raises :class:`NotDurable` (a
        :class:`~dedupe_worker.StoreUnavailable`), after giving back the claims it took: they
        could be lost in a failover, and the caller will not run their work now."""
        calls = groups[0] if len(groups) == 1 else [call for group in groups for call in group]
        durable = self.store.durability
        if durable is not None and not any(name in ("claim", "complete") for name, _, _ in calls):
            durable = None
        if durable is None and len(groups) == 1 and len(calls) == 1:  # one call: one reply, nothing to split
            return [(yield Send(calls, None))[0]]
        try:
            replies = iter((yield Send(calls, durable)))
        except NotDurable as exc:
            taken = acquired_in(calls, exc.replies)
            if taken:
                try:
                    yield Send(self.store.release_calls(taken, 1), None)
                except StoreUnavailable as inner:  # the leases run out by themselves
                    log.warning("could not give back %d claims after a write that was not durable: %s",
                                len(taken), inner)
            raise exc
        return [[v for _ in group for v in next(replies)] for group in groups]

    # -- claims ---------------------------------------------------------------------------------

    def claim_send(self, key: str | bytes, fingerprint: Any, ttl: float | None) -> tuple[Prepared, Send]:
        """One key's claim, ready to send: its request's fields (:meth:`~.codec.ClaimCodec.prepare`)
        and the :class:`Send` of its ``claim.lua`` call, with the store's ``durability``. Raises
        :class:`~dedupe_worker.InvalidKey`. Sent as it is (``(yield send)``) when
        the store needs no check and no replicas, else through :meth:`claim_round_trip`."""
        prepared = self.prepare(key, fingerprint)
        store = self.store
        return prepared, Send(store.claim_calls((prepared[1:],), self._lease_ms,
                                                self._retention_ms if ttl is None else self.retention_ms(ttl)),
                              store.durability)

    def claim_round_trip(self, calls: list[Call]) -> Flow[list[list[Any]]]:
        """A claim's round trip in the general case: the store checked first (once), and with
        ``durability`` the claims given back when too few replicas acknowledged (:meth:`round_trip`)."""
        if not self.store_checked:
            yield CHECK_STORE
        return (yield from self.round_trip((calls,)))

    def begin_flow(self, key: str | bytes, fingerprint: Any, wait: float, ttl: float | None = None) -> Flow[Claim]:
        """``begin``: one claim (one round trip), and with ``wait`` the wait on a held key. The
        claim carries ``ttl`` (seconds its outcome is kept; ``None``: ``result_ttl``). The engine's
        ``decide_flow`` makes its claim here."""
        prepared, send = self.claim_send(key, fingerprint, ttl)
        replies = (yield send) if send.wait is None and self.store_checked else (
            yield from self.claim_round_trip(send.calls))
        claim = self.claimed(prepared, replies[0], ttl)
        if wait > 0 and claim.outcome is _IN_PROGRESS:
            return (yield from self.wait_flow(Request(*prepared), claim, time.monotonic() + wait))
        return claim

    def begin_many_flow(self, keys: Sequence[str | bytes], fingerprints: Sequence[Any] | None,
                        wait: float, ttl: float | None = None
                        ) -> Flow[tuple[list[Claim], list[tuple[int, Request]]]]:
        """``begin_many``'s round trip: the claims, and with ``wait`` the ``(index, request)`` of
        those held by another worker, which the caller waits on (a repeated key held by our own
        claim in this batch is not waited on)."""
        fps = fingerprints if fingerprints is not None else [None] * len(keys)
        if len(fps) != len(keys):
            raise ValueError("fingerprints must match keys one to one")
        requests = [self.request(k, f) for k, f in zip(keys, fps, strict=True)]
        claims = yield from self.claims_flow(requests, ttl)
        if wait <= 0:
            return claims, []
        ours = {(c.stem, c.token) for c in claims if c.acquired}
        return claims, [(i, request) for i, (request, c) in enumerate(zip(requests, claims, strict=True))
                        if c.outcome is _IN_PROGRESS and (c.stem, c.token) not in ours]

    def wait_flow(self, request: Request, claim: Claim, deadline: float) -> Flow[Claim]:
        """``wait_for``: wait on a key ``claim`` found held, until ``deadline``
        (``time.monotonic()``), then claim again; see ``ClaimClient.wait_for``."""
        while claim.outcome is _IN_PROGRESS:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            yield Wait(request.stem, left)
            claim = (yield from self.claims_flow((request,), claim.ttl))[0]
        return claim

    def claims_flow(self, requests: Sequence[Request], ttl: float | None = None) -> Flow[list[Claim]]:
        """Claim ``requests`` in one round trip; the claims carry ``ttl`` (their outcomes'
        retention), and the started keys are kept at least that long (:meth:`retention_ms`)."""
        replies = yield from self.claim_round_trip(self.store.claim_calls([(r[1], r[2], r[3]) for r in requests],
                                                                          self._lease_ms, self.retention_ms(ttl)))
        return self.claims_from(requests, replies[0], ttl)

    # -- settling a batch and claiming the next chunk -------------------------------------------

    def settle_and_claim_flow(self, outcomes: Sequence[tuple[Claim, Stored, bytes]], releases: Sequence[Claim],
                              requests: Sequence[Request], ttl: float | None = None
                              ) -> Flow[tuple[list[bool], list[bool], list[Claim]]]:
        """``settle_and_claim``: store ``outcomes``, release ``releases``, claim ``requests``
        (carrying ``ttl``), in one round trip; see ``ClaimClient.settle_and_claim`` for the errors."""
        stored, released, flat = yield from self.settle_and_claim_raw_flow(
            outcomes, releases, [(r[1], r[2], r[3]) for r in requests], ttl)
        return stored, released, self.claims_from(requests, flat, ttl)

    def claims_from(self, requests: Sequence[Request], flat: Sequence[Any], ttl: float | None = None) -> list[Claim]:
        """The claims of ``requests`` from ``claim.lua``'s flat reply, carrying ``ttl`` (logged at DEBUG)."""
        claims = self.with_ttl(self._claims(requests, flat), ttl)
        _log_claims(claims)
        return claims

    def claimed(self, prepared: Prepared, flat: Sequence[Any], ttl: float | None) -> Claim:
        """The claim of one key (``prepared``, :meth:`claim_send`'s) from its four values of
        ``claim.lua``'s reply, carrying ``ttl`` (logged at DEBUG): :meth:`claims_from` for one
        message, the stored value of a completed duplicate read here too."""
        code, token, status, value = flat
        if code == 1:
            claim = Claim(prepared[0], _ACQUIRED, token, None, 0.0, False, None, prepared[1], prepared[2],
                          status == 1, ttl)
        elif code == 2 and status == b"c":
            claim = Claim(prepared[0], _DUPLICATE, token, self.stored_result(prepared[0], token, value), 0.0, False,
                          None, prepared[1], prepared[2], False, ttl)
        else:
            claim = self.claim_of(Request(*prepared), code, token, status, value)
            if ttl is not None:
                claim = dataclasses.replace(claim, ttl=ttl)
        if log.isEnabledFor(logging.DEBUG):
            _log_claims([claim])
        return claim

    def settle_and_claim_raw_flow(self, outcomes: Sequence[tuple[Claim, Stored, bytes]], releases: Sequence[Claim],
                                  claims: Sequence[ClaimItem], ttl: float | None = None
                                  ) -> Flow[tuple[list[bool], list[bool], list[Any]]]:
        """:meth:`settle_and_claim_flow`'s round trip, the claims' replies returned flat and
        unread (four values a claim; ``ttl`` only lengthens the started keys' retention)."""
        completes, frees = self.settle_calls(outcomes, releases)
        if completes or frees:
            self.renewer.settle(leases_of(outcomes, releases))
        if claims and not self.store_checked:
            yield CHECK_STORE
        claim_calls = self.store.claim_calls(claims, self._lease_ms, self.retention_ms(ttl))
        try:
            stored, released, replies = yield from self.round_trip((completes, frees, claim_calls))
        except StoreUnavailable as exc:
            settled = yield from self.settle_failed_flow(exc, outcomes, releases, completes, frees, claims)
            return (*settled, [])
        return (*self.settled(outcomes, stored, released), replies)

    def handed_on_flow(self, outcomes: Sequence[tuple[Claim, Stored, bytes]], releases: Sequence[Claim],
                       claims: Sequence[ClaimItem], each: Callable[[int, list[Any]], Any],
                       step: int) -> Flow[tuple[list[bool], list[bool]]]:
        """``stream_claims`` without a stream: :meth:`settle_and_claim_raw_flow`'s round trip, then
        the claims' flat replies handed to ``each(start, flat)`` (called, or awaited on asyncio)
        ``step`` claims at a time. Returns whether each outcome was stored and each claim released."""
        stored, released, flat = yield from self.settle_and_claim_raw_flow(outcomes, releases, claims)
        width = 4 * step
        for start in range(0, len(flat), width):
            yield Handler(functools.partial(each, start // 4, flat[start:start + width]))
        return stored, released

    def settle_failed_flow(self, error: StoreUnavailable, outcomes: Sequence[tuple[Claim, Stored, bytes]],
                           releases: Sequence[Claim], completes: list[Call], frees: list[Call],
                           requests: Sequence[Any]) -> Flow[tuple[list[bool], list[bool]]]:
        """A round trip that stores ``outcomes``, releases ``releases`` and claims ``requests``
        failed with ``error``. The outcomes and releases are settled anyway: read from the
        replies when their calls answered (a claim after them failed, e.g. refused at
        ``maxmemory``), else sent again, alone, while the error is transient and the leases last.
        Then, with ``requests``, :class:`StreamCut` (nothing claimed, ``stored`` and ``released``
        filled in): the claims are not retried. Raises ``error`` when nothing was to be settled."""
        if not completes and not frees:
            raise error
        settle_calls = len(completes) + len(frees)
        if isinstance(error, CallFailed) and not any(isinstance(r, Exception) for r in error.replies[:settle_calls]):
            replies = iter(error.replies[:settle_calls])
            stored = [v for _ in completes for v in next(replies)]
            released = [v for _ in frees for v in next(replies)]
        else:
            stored, released = yield from self.finish_again_flow(error, (completes, frees))
        settled = self.settled(outcomes, stored, released)
        if not requests:
            return settled
        cut = StreamCut(f"outcomes settled, claims not answered: {error}", [], 0)
        cut.stored, cut.released = settled
        raise cut from error

    def settle_calls(self, outcomes: Sequence[tuple[Claim, Stored, bytes]],
                     releases: Sequence[Claim]) -> tuple[list[Call], list[Call]]:
        """The script calls that store ``outcomes`` and release ``releases``, in their order; each
        outcome kept for its claim's ``ttl`` (one call list per run of equal ttls)."""
        store = self.store
        if not any(c.ttl is not None for c, _, _ in outcomes):  # the common case: one list, one call
            completes = store.complete_calls([(c.stem, c.token, status, data) for c, status, data in outcomes],
                                             self._result_ttl_ms)
        else:
            completes = []
            for ttl, run in itertools.groupby(outcomes, key=_ttl_of):
                completes += store.complete_calls([(c.stem, c.token, status, data) for c, status, data in run],
                                                  self.result_ttl_ms(ttl))
        return (completes, store.release_calls([(c.stem, c.token) for c in releases],
                                               self.retention_ms(max_ttl(releases))))

    def settled(self, outcomes: Sequence[tuple[Claim, Stored, bytes]], stored: Sequence[Any],
                released: Sequence[Any]) -> tuple[list[bool], list[bool]]:
        """Whether each outcome counts as stored (:meth:`owns`) and each claim was released."""
        return ([self.owns(c, bool(ok)) for (c, _, _), ok in zip(outcomes, stored, strict=True)],
                [bool(ok) for ok in released])

    # -- finishing writes -----------------------------------------------------------------------

    def finishing_flow(self, leases: Sequence[tuple[str, int]], send: tuple[list[Call], ...]) -> Flow[list[list[Any]]]:
        """A finishing write (complete, fail, release) of ``leases``: their renewals stop counting
        against them, then ``send``; sent again while :meth:`finish_again_flow` says so."""
        self.renewer.settle(leases)
        try:
            return (yield from self.round_trip(send))
        except StoreUnavailable as exc:
            return (yield from self.finish_again_flow(exc, send))

    def finish_again_flow(self, error: StoreUnavailable, send: tuple[list[Call], ...]) -> Flow[list[list[Any]]]:
        """After a finishing write failed with ``error``: send it again while :attr:`finish_retry`
        says the error is transient and the lease lasts (the renewer keeps extending it meanwhile);
        raise the last error once it says stop. Claims are never sent through here. Safe to
        repeat: ``complete.lua`` answers 1 again for an outcome it stored under the same token,
        and every write is fenced by the token."""
        if isinstance(error, (NotDurable, StreamCut)):
            raise error  # it ran (not durable), or claims were handed on: not ours to repeat
        attempts = self.finish_retry.attempts(time.monotonic())
        while True:
            delay = attempts.after(error, time.monotonic(), self.renewer.last_renewal())
            if delay is None:
                if attempts.failures > 1:
                    log.warning("giving up a finishing write after %d attempts: %s", attempts.failures, error)
                raise error
            log.info("finishing write failed (attempt %d), again in %.3f s: %s", attempts.failures, delay, error)
            yield Sleep(delay)
            try:
                return (yield from self.round_trip(send))
            except StoreUnavailable as exc:
                if isinstance(exc, (NotDurable, StreamCut)):
                    raise
                error = exc

    def complete_flow(self, claim: Claim, value: Any, ttl: float | None) -> Flow[None]:
        """``complete``: store ``value`` if ``claim``'s token still owns the key; raises
        :class:`LeaseLost` (nothing written) and :class:`ResultNotSerializable` (stored as omitted).
        One frame: the round trip is yielded here, and only a failed one enters
        :meth:`finish_again_flow` (what :meth:`finishing_flow` does for ``fail`` and ``release``);
        the engine's ``execute_flow`` stores its outcome here."""
        send, problem = self.complete_send(claim, value, ttl)
        try:
            replies = yield send
        except StoreUnavailable as exc:
            replies = yield from self.finish_again_flow(exc, (send.calls,))
        self.completed(claim, replies[0][0], problem)

    def complete_send(self, claim: Claim, value: Any, ttl: float | None) -> tuple[Send, ResultNotSerializable | None]:
        """:meth:`complete_flow`'s round trip, ready to send: ``value`` encoded (:meth:`encode`),
        the lease checked (:class:`LeaseLost` when renewal found it lost) and settled with the
        renewer (its renewals stop counting against it), the :class:`Send` of its
        ``complete.lua`` call, and the :class:`ResultNotSerializable` to raise once it is stored."""
        status, data, problem = self.encode(claim, value)
        stem, token = claim.stem, claim.token
        renewer = self.renewer
        if renewer.is_lost(stem, token):
            raise LeaseLost(claim.key, token)
        if ttl is None:
            ttl = claim.ttl
        store = self.store
        calls = store.complete_calls(((stem, token, status, data),),
                                     self._result_ttl_ms if ttl is None else ttl_ms(ttl))
        renewer.settle(((stem, token),))
        return Send(calls, store.durability), problem

    def completed(self, claim: Claim, stored: Any, problem: ResultNotSerializable | None) -> None:
        """After ``complete.lua`` answered ``stored`` for ``claim``: :class:`LeaseLost` unless the
        outcome is ours (:meth:`owns`), else the ``problem`` :meth:`complete_send` gave, if any."""
        if not self.owns(claim, stored):
            raise LeaseLost(claim.key, claim.token)
        if problem is not None:
            raise problem

    def complete_each_flow(self, items: Sequence[tuple[Claim, Any]]) -> Flow[list[ClaimError | ResultNotSerializable
                                                                                   | None]]:
        """``complete_each``: per item ``None`` (stored), :class:`LeaseLost` (nothing written) or
        :class:`ResultNotSerializable` (stored as omitted)."""
        encoded = [self.encode(claim, value) for claim, value in items]
        stored, _, _ = yield from self.settle_and_claim_flow(
            [(claim, status, data) for (claim, _), (status, data, _) in zip(items, encoded, strict=True)], (), ())
        return [problem if ok else LeaseLost(claim.key, claim.token)
                for (claim, _), ok, (_, _, problem) in zip(items, stored, encoded, strict=True)]

    def complete_many_flow(self, items: Sequence[tuple[Claim, Any]]) -> Flow[list[bool]]:
        """``complete_many``: whether each outcome was stored (``False``: the lease was lost)."""
        problems = yield from self.complete_each_flow(items)
        return [not isinstance(problem, LeaseLost) for problem in problems]

    def fail_flow(self, claim: Claim, error: BaseException | str) -> Flow[None]:
        """``fail``: store a permanent failure as the outcome; raises :class:`LeaseLost`."""
        calls = self.store.complete_calls(((claim.stem, claim.token, Stored.FAILED, self.encode_failure(error)),),
                                          self.result_ttl_ms(claim.ttl))
        stored = yield from self.finishing_flow(((claim.stem, claim.token),), (calls,))
        if not self.owns(claim, stored[0][0]):
            raise LeaseLost(claim.key, claim.token)
        log.warning("stored permanent failure key=%s token=%s: %s", claim.key, claim.token, error)

    def release_flow(self, claims: Sequence[Claim]) -> Flow[list[bool]]:
        """``release_many``: give the claims up; ``False`` where the token no longer owned it."""
        items = [(c.stem, c.token) for c in claims]
        released = yield from self.finishing_flow(items, (self.store.release_calls(items,
                                                                                   self.retention_ms(max_ttl(claims))),))
        return [bool(v) for v in released[0]]

    # -- single calls ---------------------------------------------------------------------------

    def renewal_flow(self, items: list[Lease], refused: Callable[[Lease], bool]) -> Flow[Renewed | None]:
        """One round of the lease renewer (thread or task) over ``items``, its book's due leases,
        in one ``renew.lua`` round trip: ``(began, lost)``, when the round began
        (``time.monotonic()``) and the leases Redis refused that the book (``refused``) marks lost,
        each logged. ``None`` when nothing was due, or when Redis failed: logged, nothing is
        marked lost, the next round tries again."""
        if not round_of(items):
            return None
        began = time.monotonic()
        try:
            replies = yield Send(self.store.renew_calls(items, self._lease_ms, self._retention_ms), None)
        except StoreUnavailable as exc:
            round_failed(items, exc)
            return None
        return began, lost_in_round(items, [bool(v) for reply in replies for v in reply], refused)

    def renew_flow(self, claim: Claim) -> Flow[bool]:
        """``renew``: extend the lease by ``lease`` from now; ``False`` when no longer owned."""
        replies = yield from self.round_trip((self.store.renew_calls(((claim.stem, claim.token),), self._lease_ms,
                                                    self._retention_ms),))
        return bool(replies[0][0])

    def forget_flow(self, key: str | bytes, token: int | None, force: bool) -> Flow[bool]:
        """``forget``: remove the key's records, ownership-checked (``forget.lua``)."""
        stem = self.request(key).stem
        args = ("" if token is None else token, "1" if force else "0")
        replies = yield from self.round_trip(([("forget", KeyLayout.names(stem), args)],))
        return int(replies[0][0]) == 1

    def status_flow(self, key: str | bytes) -> Flow[KeyState]:
        """``status``: the key's records, unchanged (``inspect.lua``)."""
        stem = self.request(key).stem
        replies = yield from self.round_trip(([("inspect", KeyLayout.records(stem), ())],))
        return key_state(*replies[0])


class KeptLeases:
    """:meth:`ClientCore.keep_leases`: tracks the leases while inside, sync or async."""

    def __init__(self, renewer: Leases, claims: Sequence[Claim]) -> None:
        self.renewer = renewer
        self.claims = claims

    def __enter__(self) -> None:
        for claim in self.claims:
            self.renewer.track(claim.stem, claim.token)

    def __exit__(self, *exc_info: object) -> None:
        for claim in self.claims:
            self.renewer.untrack(claim.stem, claim.token)

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, *exc_info: object) -> None:
        self.__exit__()


def leases_of(outcomes: Sequence[tuple[Claim, Stored, bytes]], releases: Sequence[Claim]) -> Iterator[tuple[str, int]]:
    """``(stem, token)`` of every claim settled by ``outcomes`` and ``releases`` (made as they are
    read: the renewer reads none when it tracks no lease of its own, a batch's being in groups)."""
    return itertools.chain(((c.stem, c.token) for c, _, _ in outcomes), ((c.stem, c.token) for c in releases))


def _ttl_of(outcome: tuple[Claim, Stored, bytes]) -> float | None:
    return outcome[0].ttl


def max_ttl(claims: Iterable[Claim]) -> float | None:
    """The longest ``ttl`` among ``claims`` (``None`` when none has one): a release keeps the
    started keys of a call for the longest of them."""
    ttls = [c.ttl for c in claims if c.ttl is not None]
    return max(ttls) if ttls else None


def _log_claims(claims: list[Claim]) -> None:
    if log.isEnabledFor(logging.DEBUG):
        for claim in claims:
            log.debug("claim key=%s token=%s outcome=%s", claim.key, claim.token, claim.outcome.name)

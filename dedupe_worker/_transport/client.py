"""The protocol client: claim a key, store its outcome, release or renew it. No verdicts here.

Its logic is in :mod:`~dedupe_worker._protocol.flows`, run by :meth:`ClaimClient.drive` (blocking); the asyncio client
runs the same flows, and performs their effects from the same table (``ClientCore.performers``).
The deliberate twins are the one line of the driver loop that performs an effect (a call here,
an ``await`` there; the loop itself is ``flows.Steps``), the key watcher, the renewer thread,
``close`` and the context manager's spelling, and the connection pool (the URL schemes and the
retry policy are :mod:`.connection`'s for both), plus streamed claims on a held connection (sync
only).

:class:`ClaimClient` turns keys into Redis records and Lua replies into :class:`Claim` objects.
It never runs a handler and never decides what a message's fate is: that is the engine's
(:mod:`dedupe_worker._engine`), and :class:`~dedupe_worker.Deduplicator` is this client with the
engine's ``run()`` on top.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import redis
from redis.cluster import RedisCluster

from .._errors import ClaimError, ResultNotSerializable, StoreUnavailable
from .._protocol import (
    C,
    Claim,
    ClaimItem,
    ClientCore,
    Either,
    Flow,
    KeyState,
    Request,
    Stored,
    StreamCut,
    T,
    drive,
    leases_of,
)
from .._settings import ClientKeywords, ClientOptions, client_options
from .backends import StoreClient, connect
from .connection import redis_from_url
from .eviction import check_store
from .renewer import LeaseRenewer
from .store import RedisStore
from .watcher import KeyWatcher

__all__ = ["ClaimClient"]

log = logging.getLogger(__name__)


class ClaimClient(ClientCore):
    """The claim protocol's client, with Redis as the store of claims and outcomes.

    What is guaranteed: while a key's records live (``result_ttl`` after completion), at most one
    outcome is stored for it; a claimant whose lease ran out can never store an outcome over its
    successor's (fencing tokens strictly increase per key, and every write checks ownership in
    the same script).

    What is not: after a Redis failover with asynchronous replication a just-written claim or
    result can be lost. After ``result_ttl`` a redelivery is treated as new.

    :param redis_client: a ``redis.Redis`` or ``redis.cluster.RedisCluster``.
    :param options: a :class:`~dedupe_worker.ClientOptions` (default: every option at its default).
    :param keywords: options by name (``lease=10``), each a field of
        :class:`~dedupe_worker.ClientOptions` (what each means and its default are written
        there); they win over ``options``. Another name raises ``TypeError``; ``retention``, the
        old name of ``token_retention``, is taken with a ``DeprecationWarning`` for one release.
    """

    store: RedisStore
    renewer: LeaseRenewer
    calls_handlers = True  # a Handler effect is a plain call here: the batch engine calls it itself

    def __init__(
        self,
        redis_client: redis.Redis | RedisCluster | StoreClient,
        *,
        options: ClientOptions | None = None,
        **keywords: Unpack[ClientKeywords],
    ) -> None:
        # another store's client (from_url of a database URL): the same protocol on it
        super().__init__(functools.partial(redis_client.store, asynchronous=False)
                         if isinstance(redis_client, StoreClient) else functools.partial(RedisStore, redis_client),
                         LeaseRenewer, client_options(options, keywords))
        self._watcher: KeyWatcher | None = None
        if isinstance(redis_client, StoreClient):
            self.store_checked = True  # the eviction check is Redis's
            redis_client.attach(self)

    # -- construction ---------------------------------------------------------------------------

    @staticmethod
    def _connect(url: str) -> Any:
        """A redis-py client for a Redis URL; for another store's (a database's), its client."""
        return connect(url, False) or redis_from_url(url)

    @property
    def watcher(self) -> KeyWatcher:
        """The :class:`KeyWatcher` of this client (one thread, started on first use)."""
        if self._watcher is None:
            self._watcher = KeyWatcher(self.store)
        return self._watcher

    def close(self) -> None:
        """Stop the lease renewer (and the key watcher, if one was started), give the held
        connection back to the client's pool (a later call takes one again), and close the Redis
        client if :meth:`from_url` built it. Claims still held are no longer renewed."""
        self.renewer.close()
        if self._watcher is not None:
            self._watcher.close()
        if self.store.scripts.held is not None:
            self.store.scripts.held.close()
        if self.owns_redis:
            self.store.client.close()
            pool = getattr(self.store.client, "connection_pool", None)
            if pool is not None:  # a pool from_url built itself: its sockets go too
                pool.disconnect()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def check_store(self) -> None:
        """Check, once, that Redis will not evict our records (:mod:`.eviction`): raises
        :class:`EvictionPolicyError` for an evicting ``maxmemory-policy`` on any primary, logs a
        warning where ``CONFIG GET`` is refused, raises :class:`StoreUnavailable` (and checks again
        next time) when Redis cannot be reached. The first claim calls it; consumers call it as
        they start. Skipped with ``allow_eviction``."""
        if not self.allow_eviction and not isinstance(self.store.client, StoreClient):
            check_store(self.store.client)
        self.store_checked = True

    # -- the driver -----------------------------------------------------------------------------

    def _drive(self, flow: Flow[T]) -> T:
        """Run ``flow`` (:mod:`dedupe_worker._protocol.flows`) to its end, performing each effect
        it yields with blocking calls (:meth:`performers`): a round trip on the store,
        ``time.sleep``, a wait on the key watcher's notice, the handler called. An effect's
        exception is thrown into the flow (:func:`~dedupe_worker._protocol.flows.drive`)."""
        return drive(flow, self.perform)

    _sleep = staticmethod(time.sleep)

    @staticmethod
    def _either(effect: Either) -> Any:
        return effect.sync()

    def _wait(self, stem: str, timeout: float) -> None:
        """The :class:`~dedupe_worker._protocol.flows.Wait` effect: ``watch.lua`` counts us as a
        waiter while the holder's lease is live, and we block (BLPOP) on the notice its
        ``complete.lua`` or ``release.lua`` pushes, at most until its lease would end."""
        holder_left = self.store.watch(stem)
        if holder_left > 0:
            self.store.wait_notice(stem, min(timeout, holder_left + 0.005))

    # -- transitions ----------------------------------------------------------------------------

    def begin(self, key: str | bytes, *, fingerprint: Any = None, wait: float = 0.0,
              ttl: float | None = None) -> Claim:
        """Try to claim ``key``: one round trip, one :class:`Claim` with one :class:`Outcome`.

        ``fingerprint`` identifies the payload (a short string, or any JSON-like value that is
        hashed); with it, the same key seen with a different payload answers CONFLICT.

        ``wait``: when another worker holds the key, wait up to this many seconds for it instead
        of answering IN_PROGRESS at once (see :meth:`wait_for`): DUPLICATE with its value once it
        stores its outcome, ACQUIRED once it releases the key or its lease runs out. Raises
        :class:`InvalidKey` and :class:`StoreUnavailable`. A record under the key's names that is
        not one we write answers UNREADABLE (its ``error``, an :class:`~dedupe_worker.UnreadableRecord`, says what
        lies there; nothing is written): :meth:`forget` with ``force`` removes it.

        ``ttl``: seconds this message's outcome is kept, instead of ``result_ttl``. The claim
        carries it (:attr:`Claim.ttl`), so :meth:`complete` and :meth:`fail` store the outcome for
        that long; the lease is unchanged, and a released key's token counter is kept at least as
        long (``token_retention`` is raised to ``ttl`` for this key). Raises ``ValueError`` unless it is
        a positive number.
        """
        return self._drive(self.begin_flow(key, fingerprint, wait, ttl))

    def begin_many(
        self, keys: Sequence[str | bytes], *, fingerprints: Sequence[Any] | None = None, wait: float = 0.0,
        ttl: float | None = None,
    ) -> list[Claim]:
        """Claim a batch of keys in one round trip; answers come in the order of ``keys``.

        A key that appears twice in one batch is ACQUIRED once; its later copies answer
        IN_PROGRESS (held by our own token) until the first is completed or released. With
        ``wait``, keys held by others are waited on as in :meth:`begin`, one after the other, all
        within ``wait`` seconds in total. ``ttl``: as in :meth:`begin`, for every key.
        """
        claims, held = self._drive(self.begin_many_flow(keys, fingerprints, wait, ttl))
        deadline = time.monotonic() + wait
        for i, request in held:  # one after the other
            claims[i] = self.wait_for(request, claims[i], deadline)
        return claims

    def wait_for(self, request: Request, claim: Claim, deadline: float) -> Claim:
        """Wait, until ``deadline`` (``time.monotonic()``), on a key that ``claim`` found held.

        Woken by the protocol, not by polling: ``watch.lua`` counts us as a waiter while the
        lease is live, and the holder's ``complete.lua`` or ``release.lua`` pushes a notice we
        block on (BLPOP). Then, or when the holder's lease runs out, we claim again: DUPLICATE
        with the stored value, ACQUIRED, or (the holder renewed, or another took the key)
        IN_PROGRESS and wait on. A waiter never holds the claim; the wait never outlasts
        ``deadline``; every record it touches keeps a TTL.
        """
        return self._drive(self.wait_flow(request, claim, deadline))

    def claim_requests(self, requests: Sequence[Request]) -> list[Claim]:
        """:meth:`begin_many` for requests already checked by :meth:`request`."""
        return self._drive(self.claims_flow(requests))

    def settle_and_claim(
        self,
        outcomes: Sequence[tuple[Claim, Stored, bytes]],
        releases: Sequence[Claim],
        requests: Sequence[Request],
    ) -> tuple[list[bool], list[bool], list[Claim]]:
        """In one round trip: store ``outcomes`` (``(claim, status, data)``), release ``releases``,
        then claim ``requests``. Returns whether each outcome was stored and each claim released
        (``False``: the token no longer owned it, nothing written), and the new claims.

        Redis runs the three scripts one after the other, so a request for a key whose outcome is
        stored in the same call answers DUPLICATE.

        A transient store error (a reconnect, a slot migration, ``LOADING``, ``BUSY``, ``OOM``)
        does not cost the outcomes: they and the releases are settled anyway (sent again alone
        while the leases last, see :mod:`~dedupe_worker._protocol.retry`), and then, when there were requests,
        :class:`~dedupe_worker._protocol.calls.StreamCut` is raised with ``stored``,
        ``released`` and ``claimed=0`` (the claims are not retried). Otherwise raises
        :class:`StoreUnavailable`; the outcomes may then have been stored or not.
        """
        return self._drive(self.settle_and_claim_flow(outcomes, releases, requests))

    def settle_and_stream(
        self,
        outcomes: Sequence[tuple[Claim, Stored, bytes]],
        releases: Sequence[Claim],
        requests: Sequence[Request],
        each: Callable[[int, list[Claim]], None],
        step: int,
    ) -> tuple[list[bool], list[bool]]:
        """:meth:`settle_and_claim`, with ``requests`` claimed by one call per ``step`` of them,
        all sent in the same write: the claims of each call are handed to ``each(start, claims)``
        (``start``: the index in ``requests`` of the first) as soon as its reply is read, while
        Redis runs the later calls. Returns whether each outcome was stored and each claim
        released, once every claim was handed on.

        Raises :class:`StoreUnavailable` as :meth:`settle_and_claim` when Redis failed before any
        claim was handed on; after, :class:`~dedupe_worker._protocol.calls.StreamCut` with
        ``stored``, ``released`` and ``claimed`` (how many requests were answered): the requests
        after those may have been claimed or not. For ``step`` requests or fewer, with ``WAIT``
        (``wait_replicas``), on a cluster, or while another thread holds the connection, the round
        trip is :meth:`settle_and_claim`'s and the claims are handed on after it."""
        def claimed(start: int, flat: list[Any]) -> None:
            claims = self.claims_from(requests[start:start + len(flat) // 4], flat)
            each(start, claims)

        return self.stream_claims(outcomes, releases, [(r[1], r[2], r[3]) for r in requests], claimed, step)

    def stream_claims(
        self,
        outcomes: Sequence[tuple[Claim, Stored, bytes]],
        releases: Sequence[Claim],
        claims: Sequence[ClaimItem],
        each: Callable[[int, list[Any]], None],
        step: int,
    ) -> tuple[list[bool], list[bool]]:
        """:meth:`settle_and_stream` with ``claims`` as ``(stem, fingerprint, original)`` and each
        call's reply handed to ``each(start, flat)`` as ``claim.lua`` returned it (four values a
        claim, read by :meth:`~.codec.ClaimCodec.claims_of`): the batch engine's round trip
        (the :class:`~.flows.Stream` effect), which builds objects only for the claims that need
        them."""
        store = self.store
        if len(claims) <= step or store.durability is not None or store.scripts.held is None:
            return self._drive(self.handed_on_flow(outcomes, releases, claims, each, step))
        completes, frees = self.settle_calls(outcomes, releases)
        if completes or frees:
            self.renewer.settle(leases_of(outcomes, releases))
        if not self.store_checked:
            self.check_store()
        head = [*completes, *frees]
        lease_ms, retention_ms = self._lease_ms, self._retention_ms
        calls = [*head, *(call for start in range(0, len(claims), step)
                          for call in store.claim_calls(claims[start:start + step], lease_ms, retention_ms))]
        answered = 0

        def deliver(reply: Any) -> None:
            nonlocal answered
            answered += 1
            each((answered - 1) * step, reply)

        try:
            replies = store.scripts.call_streamed(calls, len(head), deliver)
        except StreamCut as exc:
            exc.stored, exc.released = self.settled(outcomes, *_head(outcomes, releases, exc.head))
            exc.claimed = min(len(claims), answered * step)
            raise
        except StoreUnavailable as exc:  # before any claim was handed on
            return self._drive(self.settle_failed_flow(exc, outcomes, releases, completes, frees, claims))
        return self.settled(outcomes, *_head(outcomes, releases, replies))

    def complete(self, claim: Claim, value: Any, *, ttl: float | None = None) -> None:
        """Store ``value`` as the outcome, only if ``claim``'s token still owns the key.

        ``ttl``: seconds this outcome is kept, instead of ``result_ttl``. Raises
        :class:`LeaseLost` (nothing written) when fenced off, and
        :class:`ResultNotSerializable` after storing "completed, body omitted" for a value JSON
        cannot hold. A transient store error is retried while the lease lasts (:mod:`~dedupe_worker._protocol.retry`).
        """
        self._drive(self.complete_flow(claim, value, ttl))

    def complete_many(self, items: Sequence[tuple[Claim, Any]]) -> list[bool]:
        """Store outcomes for a batch in one round trip; ``False`` where the lease was lost.

        Values that cannot be serialised are stored as omitted (and logged), as in :meth:`complete`.
        """
        return self._drive(self.complete_many_flow(items))

    def complete_each(self, items: Sequence[tuple[Claim, Any]]) -> list[ClaimError | ResultNotSerializable | None]:
        """:meth:`complete_many`, telling per item what :meth:`complete` would have raised: ``None``
        when stored, :class:`LeaseLost` when nothing was written, :class:`ResultNotSerializable`
        when the outcome was stored as omitted."""
        return self._drive(self.complete_each_flow(items))

    def fail(self, claim: Claim, error: BaseException | str) -> None:
        """Store a permanent failure as the outcome: later deliveries answer DUPLICATE with
        ``failed=True`` instead of running again. Raises :class:`LeaseLost` when fenced off."""
        self._drive(self.fail_flow(claim, error))

    def release(self, claim: Claim) -> bool:
        """Give the claim up after a retryable failure so the next delivery may claim again.
        ``False`` when the token no longer owned it (nothing changed)."""
        return self._drive(self.release_flow((claim,)))[0]

    def release_many(self, claims: Sequence[Claim]) -> list[bool]:
        """:meth:`release` for a batch, in one round trip (sent again on a transient store error
        while the leases last, as completions are)."""
        return self._drive(self.release_flow(claims))

    def renew(self, claim: Claim) -> bool:
        """Extend the lease by ``lease`` from now; ``False`` when the token no longer owns it."""
        return self._drive(self.renew_flow(claim))

    def forget(self, key: str | bytes, *, token: int | None = None, force: bool = False) -> bool:
        """Remove ``key``'s records (one ``forget.lua`` call), so its next delivery is new work.

        Ownership-checked like every write: with ``token``, only if the key carries that token
        (the live lease's owner, the token that stored the outcome, or the last one handed out);
        without it, a live lease is freed only with ``force``, and so is a record that is not one
        we write (removed whatever its type, the send mark with it; refused with a token). With
        ``token=0`` and ``force``, only such a record is removed (it carries no token; a claim
        answered UNREADABLE has ``token`` 0): a live lease or a stored outcome someone wrote
        since is refused. True when records were removed, False when there were none or the
        check refused (nothing changed)."""
        return self._drive(self.forget_flow(key, token, force))

    def status(self, key: str | bytes) -> KeyState:
        """Look at a key's records without changing them (for replay and inspection). Raises
        :class:`~dedupe_worker.UnreadableRecord` (a :class:`StoreUnavailable`) for a record that is not one we write."""
        return self._drive(self.status_flow(key))


def _head(outcomes: Sequence[Any], releases: Sequence[Claim], replies: list[Any]) -> tuple[list[Any], list[Any]]:
    """The complete and release replies of a streamed round trip (one call each, standalone)."""
    return (replies[0] if outcomes else []), (replies[1 if outcomes else 0] if releases else [])

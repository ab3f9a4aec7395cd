"""The protocol client: claim a key, store its outcome, release or renew it. No verdicts here.

:class:`ClaimClient` turns keys into Redis records and Lua replies into :class:`Claim` objects.
It never runs a handler and never decides what a message's fate is: that is the engine's
(:mod:`dedupe_worker._engine`), and :class:`~dedupe_worker.Deduplicator` is this client with the
engine's ``run()`` on top.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster

from .._errors import ClaimError, LeaseLost, ResultNotSerializable, StoreUnavailable
from .._settings import DedupeSettings
from .claim import Claim, Outcome, Stored
from .codec import KEY_HARD_LIMIT, ClaimCodec, Request
from .connection import redis_from_url
from .eviction import check_store
from .renewer import LeaseRenewer
from .retry import FinishRetry
from .scripts import Call, CallFailed, NotDurable, StreamCut
from .serialization import Serializer
from .store import KeyState, RedisStore
from .watcher import KeyWatcher

__all__ = ["KEY_HARD_LIMIT", "ClaimClient", "Request"]

log = logging.getLogger(__name__)
C = TypeVar("C", bound="ClaimClient")
T = TypeVar("T")


class ClaimClient(ClaimCodec):
    """The claim protocol's client, with Redis as the store of claims and outcomes.

    What is guaranteed: while a key's records live (``result_ttl`` after completion), at most one
    outcome is stored for it; a claimant whose lease ran out can never store an outcome over its
    successor's (fencing tokens strictly increase per key, and every write checks ownership in
    the same script).

    What is not: after a Redis failover with asynchronous replication a just-written claim or
    result can be lost. After ``result_ttl`` a redelivery is treated as new.

    :param redis_client: a ``redis.Redis`` or ``redis.cluster.RedisCluster``.
    :param namespace: prefix of every key written.
    :param lease: seconds a claim is held before others may take it; renewed while work runs.
    :param result_ttl: seconds an outcome is kept.
    :param retention: seconds the token counter outlives a lease (default ``result_ttl``).
    :param max_key_length: longer keys are stored as their sha256.
    :param max_result_bytes: results whose stored (compressed) form is larger are stored as
        "completed, body omitted".
    :param permanent_errors: exception types stored as a failed outcome instead of released.
    :param fail_open: when Redis is down, run the work anyway (logged as an error).
    :param renew_interval: seconds between lease renewals (default a third of ``lease``).
    :param serializer: how results are stored (default JSON; never pickle).
    :param wait_replicas: send ``WAIT wait_replicas`` in the same round trip as every claim and
        completion; fewer acknowledgements within ``wait_timeout`` seconds raise
        :class:`StoreUnavailable` (the claims it took are given back). Not consensus: see README.
    :param allow_eviction: accept a Redis whose ``maxmemory-policy`` evicts keys (evicted keys run
        again). Off: the first claim raises :class:`EvictionPolicyError` there (:meth:`check_store`).
    :param compress_above: results (and stored failures) over this many bytes are stored
        compressed, when that makes them smaller; ``None``: never. Readers decompress whatever
        they find, and read values stored uncompressed as before.
    :param compression: ``"auto"`` (zstd where installed, ``pip install 'dedupe-worker[zstd]'``,
        else zlib), ``"zstd"`` or ``"zlib"``. Every worker of a namespace must read what the
        others write: where some lack zstd, pin ``"zlib"``.
    """

    def __init__(
        self,
        redis_client: redis.Redis | RedisCluster,
        *,
        namespace: str = "dedupe",
        lease: float = 30.0,
        result_ttl: float = 86400.0,
        retention: float | None = None,
        max_key_length: int = 200,
        max_result_bytes: int = 1_000_000,
        permanent_errors: tuple[type[BaseException], ...] = (),
        fail_open: bool = False,
        renew_interval: float | None = None,
        serializer: Serializer | None = None,
        wait_replicas: int = 0,
        wait_timeout: float = 0.1,
        allow_eviction: bool = False,
        compress_above: int | None = 1024,
        compression: str = "auto",
    ) -> None:
        super().__init__(namespace=namespace, lease=lease, result_ttl=result_ttl, retention=retention,
                         max_key_length=max_key_length, max_result_bytes=max_result_bytes, serializer=serializer,
                         compress_above=compress_above, compression=compression)
        self.allow_eviction = allow_eviction
        #: True once Redis' eviction policy was checked (or ``allow_eviction``): claims skip the check.
        self.store_checked = allow_eviction
        self.store = RedisStore(redis_client, self.layout)
        self.store.require_replicas(wait_replicas, wait_timeout)
        self.permanent_errors = permanent_errors
        self.fail_open = fail_open
        self.renewer = LeaseRenewer(
            self.store, self._lease_ms, self._retention_ms, renew_interval or lease / 3
        )
        #: How completions and releases are retried on transient store errors (:mod:`.retry`).
        self.finish_retry = FinishRetry(lease, self.renewer.interval)
        self._watcher: KeyWatcher | None = None

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_url(cls: type[C], url: str, **options: Any) -> C:
        """Build from a Redis URL; ``redis+cluster://`` or ``?cluster=1`` selects Redis Cluster."""
        return cls(redis_from_url(url), **options)

    @classmethod
    def from_settings(cls: type[C], settings: DedupeSettings | None = None, **options: Any) -> C:
        """Build from :class:`DedupeSettings` (read from ``DEDUPE_*`` when not given)."""
        s = settings or DedupeSettings()
        return cls.from_url(s.redis_url, **{**s.client_options(), **options})

    @property
    def watcher(self) -> KeyWatcher:
        """The :class:`KeyWatcher` of this client (one thread, started on first use)."""
        if self._watcher is None:
            self._watcher = KeyWatcher(self.store)
        return self._watcher

    def close(self) -> None:
        """Stop the lease renewer (and the key watcher, if one was started) and give the held
        connection back to the client's pool (a later call takes one again)."""
        self.renewer.close()
        if self._watcher is not None:
            self._watcher.close()
        if self.store.scripts.held is not None:
            self.store.scripts.held.close()

    def check_store(self) -> None:
        """Check, once, that Redis will not evict our records (:mod:`.eviction`): raises
        :class:`EvictionPolicyError` for an evicting ``maxmemory-policy`` on any primary, logs a
        warning where ``CONFIG GET`` is refused, raises :class:`StoreUnavailable` (and checks again
        next time) when Redis cannot be reached. The first claim calls it; consumers call it as
        they start. Skipped with ``allow_eviction``."""
        if not self.allow_eviction:
            check_store(self.store.client)
        self.store_checked = True

    # -- finishing writes, retried --------------------------------------------------------------

    def _finish_again(self, error: StoreUnavailable, send: Callable[[], T]) -> T:
        """After a finishing write (complete, fail, release) failed with ``error``: send it again
        while :attr:`finish_retry` says the error is transient and the lease lasts (the renewer
        keeps extending it meanwhile); raise the last error once it says stop. Claims are never
        sent through here. Safe to repeat: ``complete.lua`` answers 1 again for an outcome it
        stored under the same token, and every write is fenced by the token."""
        if isinstance(error, (NotDurable, StreamCut)):
            raise error  # it ran (not durable), or claims were handed on: not ours to repeat
        attempts = self.finish_retry.attempts(time.monotonic())
        while True:
            delay = attempts.after(error, time.monotonic(), self.renewer.renewed_at)
            if delay is None:
                if attempts.failures > 1:
                    log.warning("giving up a finishing write after %d attempts: %s", attempts.failures, error)
                raise error
            log.info("finishing write failed (attempt %d), again in %.3f s: %s", attempts.failures, delay, error)
            time.sleep(delay)
            try:
                return send()
            except StoreUnavailable as exc:
                if isinstance(exc, (NotDurable, StreamCut)):
                    raise
                error = exc

    # -- transitions ----------------------------------------------------------------------------

    def begin(self, key: str | bytes, *, fingerprint: Any = None, wait: float = 0.0) -> Claim:
        """Try to claim ``key``: one round trip, one :class:`Claim` with one :class:`Outcome`.

        ``fingerprint`` identifies the payload (a short string, or any JSON-like value that is
        hashed); with it, the same key seen with a different payload answers CONFLICT.

        ``wait``: when another worker holds the key, wait up to this many seconds for it instead
        of answering IN_PROGRESS at once (see :meth:`wait_for`): DUPLICATE with its value once it
        stores its outcome, ACQUIRED once it releases the key or its lease runs out. Raises
        :class:`InvalidKey` and :class:`StoreUnavailable`.
        """
        request = self.request(key, fingerprint)
        if not self.store_checked:
            self.check_store()
        reply = self.store.claim_one(request.stem, request.fingerprint, request.original,
                                     self._lease_ms, self._retention_ms)
        claim = self._claim(request, reply)
        if wait > 0 and claim.outcome is Outcome.IN_PROGRESS:
            return self.wait_for(request, claim, time.monotonic() + wait)
        return claim

    def begin_many(
        self, keys: Sequence[str | bytes], *, fingerprints: Sequence[Any] | None = None, wait: float = 0.0
    ) -> list[Claim]:
        """Claim a batch of keys in one round trip; answers come in the order of ``keys``.

        A key that appears twice in one batch is ACQUIRED once; its later copies answer
        IN_PROGRESS (held by our own token) until the first is completed or released. With
        ``wait``, keys held by others are waited on as in :meth:`begin`, all within ``wait``
        seconds in total.
        """
        fps = fingerprints if fingerprints is not None else [None] * len(keys)
        if len(fps) != len(keys):
            raise ValueError("fingerprints must match keys one to one")
        requests = [self.request(k, f) for k, f in zip(keys, fps, strict=True)]
        claims = self.claim_requests(requests)
        if wait > 0:
            ours = {(c.stem, c.token) for c in claims if c.acquired}  # a repeated key held by us: no wait
            deadline = time.monotonic() + wait
            claims = [self.wait_for(r, c, deadline)
                      if c.outcome is Outcome.IN_PROGRESS and (c.stem, c.token) not in ours else c
                      for r, c in zip(requests, claims, strict=True)]
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
        while claim.outcome is Outcome.IN_PROGRESS:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            holder_left = self.store.watch(request.stem)
            if holder_left > 0:
                self.store.wait_notice(request.stem, min(left, holder_left + 0.005))
            reply = self.store.claim_one(request.stem, request.fingerprint, request.original,
                                         self._lease_ms, self._retention_ms)
            claim = self._claim(request, reply)
        return claim

    def claim_requests(self, requests: Sequence[Request]) -> list[Claim]:
        """:meth:`begin_many` for requests already checked by :meth:`request`."""
        return self.settle_and_claim((), (), requests)[2]

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
        while the leases last, see :mod:`.retry`), and then, when there were requests,
        :class:`~dedupe_worker._protocol.scripts.StreamCut` is raised with ``stored``,
        ``released`` and ``claimed=0`` (the claims are not retried). Otherwise raises
        :class:`StoreUnavailable`; the outcomes may then have been stored or not.
        """
        completes, frees = self._settle_calls(outcomes, releases)
        if completes or frees:
            self.renewer.settle(self._leases(outcomes, releases))
        try:
            stored, released, replies = self.store.run(completes, frees, self._claim_calls(requests))
        except StoreUnavailable as exc:
            stored, released = self._settle_failed(exc, outcomes, releases, completes, frees, requests)
            replies = []
        claims = self._claims(requests, replies)
        self._log_claims(claims)
        return (*self._settled(outcomes, stored, released), claims)

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
        claim was handed on; after, :class:`~dedupe_worker._protocol.scripts.StreamCut` with
        ``stored``, ``released`` and ``claimed`` (how many requests were answered): the requests
        after those may have been claimed or not. For ``step`` requests or fewer, with ``WAIT``
        (``wait_replicas``), on a cluster, or while another thread holds the connection, the round
        trip is :meth:`settle_and_claim`'s and the claims are handed on after it."""
        store = self.store
        if len(requests) <= step or store.durability is not None or store.scripts.held is None:
            stored, released, claims = self.settle_and_claim(outcomes, releases, requests)
            for start in range(0, len(claims), step):
                each(start, claims[start:start + step])
            return stored, released
        parts = [requests[start:start + step] for start in range(0, len(requests), step)]
        completes, frees = self._settle_calls(outcomes, releases)
        if completes or frees:
            self.renewer.settle(self._leases(outcomes, releases))
        head = [*completes, *frees]
        calls = [*head, *(call for part in parts for call in self._claim_calls(part))]
        answered = 0

        def deliver(reply: Any) -> None:
            nonlocal answered
            part = parts[answered]
            claims = self._claims(part, reply)
            self._log_claims(claims)
            answered += 1
            each((answered - 1) * step, claims)

        try:
            replies = store.scripts.call_streamed(calls, len(head), deliver)
        except StreamCut as exc:
            exc.stored, exc.released = self._settled(outcomes, *self._head(outcomes, releases, exc.head))
            exc.claimed = min(len(requests), answered * step)
            raise
        except StoreUnavailable as exc:  # before any claim was handed on
            return self._settle_failed(exc, outcomes, releases, completes, frees, requests)
        return self._settled(outcomes, *self._head(outcomes, releases, replies))

    @staticmethod
    def _leases(outcomes: Sequence[tuple[Claim, Stored, bytes]], releases: Sequence[Claim]) -> list[tuple[str, int]]:
        return [*((c.stem, c.token) for c, _, _ in outcomes), *((c.stem, c.token) for c in releases)]

    def _settle_failed(self, error: StoreUnavailable, outcomes: Sequence[tuple[Claim, Stored, bytes]],
                       releases: Sequence[Claim], completes: list[Call], frees: list[Call],
                       requests: Sequence[Request]) -> tuple[list[bool], list[bool]]:
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
            stored, released = self._finish_again(error, lambda: tuple(self.store.run(completes, frees)))
        settled = self._settled(outcomes, stored, released)
        if not requests:
            return settled
        cut = StreamCut(f"outcomes settled, claims not answered: {error}", [], 0)
        cut.stored, cut.released = settled
        raise cut from error

    def _settle_calls(self, outcomes: Sequence[tuple[Claim, Stored, bytes]],
                      releases: Sequence[Claim]) -> tuple[list[Call], list[Call]]:
        """The script calls that store ``outcomes`` and release ``releases``."""
        store = self.store
        return (store.complete_calls([(c.stem, c.token, status, data) for c, status, data in outcomes],
                                     self._result_ttl_ms),
                store.release_calls([(c.stem, c.token) for c in releases], self._retention_ms))

    def _claim_calls(self, requests: Sequence[Request]) -> list[Call]:
        """The script calls that claim ``requests``."""
        if not self.store_checked:
            self.check_store()
        return self.store.claim_calls([(r[1], r[2], r[3]) for r in requests], self._lease_ms, self._retention_ms)

    @staticmethod
    def _head(outcomes: Sequence[Any], releases: Sequence[Claim], replies: list[Any]) -> tuple[list[Any], list[Any]]:
        """The complete and release replies of a streamed round trip (one call each, standalone)."""
        return (replies[0] if outcomes else []), (replies[1 if outcomes else 0] if releases else [])

    def _settled(self, outcomes: Sequence[tuple[Claim, Stored, bytes]], stored: Sequence[Any],
                 released: Sequence[Any]) -> tuple[list[bool], list[bool]]:
        return ([self.owns(c, bool(ok)) for (c, _, _), ok in zip(outcomes, stored, strict=True)],
                [bool(ok) for ok in released])

    @staticmethod
    def _log_claims(claims: list[Claim]) -> None:
        if log.isEnabledFor(logging.DEBUG):
            for claim in claims:
                log.debug("claim key=%s token=%s outcome=%s", claim.key, claim.token, claim.outcome.name)

    def complete(self, claim: Claim, value: Any, *, ttl: float | None = None) -> None:
        """Store ``value`` as the outcome, only if ``claim``'s token still owns the key.

        ``ttl``: seconds this outcome is kept, instead of ``result_ttl``. Raises
        :class:`LeaseLost` (nothing written) when fenced off, and
        :class:`ResultNotSerializable` after storing "completed, body omitted" for a value JSON
        cannot hold.
        """
        status, data, problem = self.encode(claim, value)
        stem, token = claim.stem, claim.token
        if self.renewer.is_lost(stem, token):
            raise LeaseLost(claim.key, token)
        self.renewer.settle(((stem, token),))
        ttl_ms = self.result_ttl_ms(ttl)
        try:
            stored = self.store.complete_one(stem, token, status, data, ttl_ms)
        except StoreUnavailable as exc:
            stored = self._finish_again(exc, lambda: self.store.complete_one(stem, token, status, data, ttl_ms))
        if not self.owns(claim, stored):
            raise LeaseLost(claim.key, token)
        if problem is not None:
            raise problem

    def complete_many(self, items: Sequence[tuple[Claim, Any]]) -> list[bool]:
        """Store outcomes for a batch in one round trip; ``False`` where the lease was lost.

        Values that cannot be serialised are stored as omitted (and logged), as in :meth:`complete`.
        """
        return [not isinstance(problem, LeaseLost) for problem in self.complete_each(items)]

    def complete_each(self, items: Sequence[tuple[Claim, Any]]) -> list[ClaimError | ResultNotSerializable | None]:
        """:meth:`complete_many`, telling per item what :meth:`complete` would have raised: ``None``
        when stored, :class:`LeaseLost` when nothing was written, :class:`ResultNotSerializable`
        when the outcome was stored as omitted."""
        encoded = [self.encode(claim, value) for claim, value in items]
        stored, _, _ = self.settle_and_claim(
            [(claim, status, data) for (claim, _), (status, data, _) in zip(items, encoded, strict=True)], (), ())
        return [problem if ok else LeaseLost(claim.key, claim.token)
                for (claim, _), ok, (_, _, problem) in zip(items, stored, encoded, strict=True)]

    def fail(self, claim: Claim, error: BaseException | str) -> None:
        """Store a permanent failure as the outcome: later deliveries answer DUPLICATE with
        ``failed=True`` instead of running again. Raises :class:`LeaseLost` when fenced off."""
        data = self.encode_failure(error)
        items = [(claim.stem, claim.token, Stored.FAILED, data)]
        self.renewer.settle([(claim.stem, claim.token)])
        try:
            stored = self.store.complete(items, self._result_ttl_ms)
        except StoreUnavailable as exc:
            stored = self._finish_again(exc, lambda: self.store.complete(items, self._result_ttl_ms))
        if not self.owns(claim, stored[0]):
            raise LeaseLost(claim.key, claim.token)
        log.warning("stored permanent failure key=%s token=%s: %s", claim.key, claim.token, error)

    def release(self, claim: Claim) -> bool:
        """Give the claim up after a retryable failure so the next delivery may claim again.
        ``False`` when the token no longer owned it (nothing changed)."""
        return self.release_many([claim])[0]

    def release_many(self, claims: Sequence[Claim]) -> list[bool]:
        """:meth:`release` for a batch, in one round trip (sent again on a transient store error
        while the leases last, as completions are)."""
        items = [(c.stem, c.token) for c in claims]
        self.renewer.settle(items)
        try:
            return self.store.release(items, self._retention_ms)
        except StoreUnavailable as exc:
            return self._finish_again(exc, lambda: self.store.release(items, self._retention_ms))

    def renew(self, claim: Claim) -> bool:
        """Extend the lease by ``lease`` from now; ``False`` when the token no longer owns it."""
        return self.store.renew([(claim.stem, claim.token)], self._lease_ms, self._retention_ms)[0]

    def forget(self, key: str | bytes, *, token: int | None = None, force: bool = False) -> bool:
        """Remove ``key``'s records (one ``forget.lua`` call), so its next delivery is new work.

        Ownership-checked like every write: with ``token``, only if the key carries that token
        (the live lease's owner, the token that stored the outcome, or the last one handed out);
        without it, a live lease is freed only with ``force``. True when records were removed,
        False when there were none or the check refused (nothing changed)."""
        code, _ = self.store.forget(self.request(key).stem, token, force)
        return code == 1

    def status(self, key: str | bytes) -> KeyState:
        """Look at a key's records without changing them (for replay and inspection)."""
        return self.store.inspect(self.request(key).stem)

    @contextmanager
    def keep_leases(self, claims: Sequence[Claim]) -> Iterator[None]:
        """While inside, the shared renewer keeps the leases of ``claims`` from running out."""
        for claim in claims:
            self.renewer.track(claim.stem, claim.token)
        try:
            yield
        finally:
            for claim in claims:
                self.renewer.untrack(claim.stem, claim.token)

"""The protocol client on asyncio: claim a key, store its outcome, release or renew it, awaited.

:class:`AsyncClaimClient` is :class:`~dedupe_worker.ClaimClient` with every round trip
awaited: the same options, the same Lua scripts, the same key checks, reply decoding and result
encoding (both subclass :class:`~dedupe_worker._protocol.codec.ClaimCodec`), so a key claimed by
one is seen by the other exactly as by itself. No verdicts here: that is the engine's
(:mod:`dedupe_worker.asyncio._engine`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from .._errors import LeaseLost, StoreUnavailable
from .._protocol.calls import KeyState
from .._protocol.claim import Claim, Outcome, Stored
from .._protocol.codec import ClaimCodec, Request
from .._protocol.eviction import check_store_async
from .._protocol.retry import FinishRetry
from .._protocol.scripts import NotDurable
from .._protocol.serialization import Serializer
from .._settings import DedupeSettings
from ._connection import async_redis_from_url
from ._renewer import AsyncLeaseRenewer
from ._scripts import AsyncRedis
from ._store import AsyncRedisStore
from ._waiter import AsyncKeyWaiter

__all__ = ["AsyncClaimClient"]

log = logging.getLogger(__name__)
C = TypeVar("C", bound="AsyncClaimClient")
T = TypeVar("T")


class AsyncClaimClient(ClaimCodec):
    """The claim protocol's client on ``redis.asyncio``; options as
    :class:`~dedupe_worker.ClaimClient`'s, and the same guarantees: while a key's records
    live, at most one outcome is stored for it, and a claimant whose lease ran out can never
    store over its successor's (fencing tokens).

    Leases of claims being worked on are renewed by one task per event loop
    (:class:`AsyncLeaseRenewer`); :meth:`aclose` cancels it.

    :param redis_client: a ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``. Its
        pool must allow as many connections as coroutines that call at once, or queue them
        (``BlockingConnectionPool``, as :meth:`from_url` builds).
    :param allow_eviction: as for the sync client: off, the first claim raises
        :class:`~dedupe_worker.EvictionPolicyError` on a Redis that may evict our records.
    """

    def __init__(
        self,
        redis_client: AsyncRedis,
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
        self.store = AsyncRedisStore(redis_client, self.layout)
        self.store.require_replicas(wait_replicas, wait_timeout)
        self.permanent_errors = permanent_errors
        self.fail_open = fail_open
        self.renewer = AsyncLeaseRenewer(self.store, self._lease_ms, self._retention_ms, renew_interval or lease / 3)
        #: How completions and releases are retried on transient store errors (shared policy).
        self.finish_retry = FinishRetry(lease, self.renewer.interval)
        self.waiter = AsyncKeyWaiter(self.store)
        self._owns_client = False

    @classmethod
    def from_url(cls: type[C], url: str, **options: Any) -> C:
        """Build from a Redis URL (see :func:`async_redis_from_url`); :meth:`aclose` closes the
        client built here."""
        client = cls(async_redis_from_url(url), **options)
        client._owns_client = True
        return client

    @classmethod
    def from_settings(cls: type[C], settings: DedupeSettings | None = None, **options: Any) -> C:
        """Build from :class:`DedupeSettings` (read from ``DEDUPE_*`` when not given)."""
        s = settings or DedupeSettings()
        return cls.from_url(s.redis_url, **{**s.client_options(), **options})

    async def aclose(self) -> None:
        """Cancel the lease renewer and key waiter tasks; close the Redis client if :meth:`from_url` built it.
        Claims still held are no longer renewed: their leases run out."""
        await self.renewer.aclose()
        await self.waiter.aclose()
        if self._owns_client:
            await self.store.client.aclose()

    async def __aenter__(self: C) -> C:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _finishing(self, leases: list[tuple[str, int]], send: Callable[[], Awaitable[T]]) -> T:
        """``await send()``, a finishing write (complete, fail, release) of ``leases``: sent again
        on a transient store error while the leases last, as
        :meth:`ClaimClient._finish_again <dedupe_worker._protocol.ClaimClient._finish_again>` does
        (the same :class:`~dedupe_worker._protocol.retry.FinishRetry` policy, awaited sleeps)."""
        self.renewer.settle(leases)
        try:
            return await send()
        except NotDurable:
            raise
        except StoreUnavailable as exc:
            error = exc
        attempts = self.finish_retry.attempts(time.monotonic())
        while True:
            delay = attempts.after(error, time.monotonic(), self.renewer.renewed_at())
            if delay is None:
                if attempts.failures > 1:
                    log.warning("giving up a finishing write after %d attempts: %s", attempts.failures, error)
                raise error
            log.info("finishing write failed (attempt %d), again in %.3f s: %s", attempts.failures, delay, error)
            await asyncio.sleep(delay)
            try:
                return await send()
            except NotDurable:
                raise
            except StoreUnavailable as exc:
                error = exc

    async def check_store(self) -> None:
        """:meth:`ClaimClient.check_store <dedupe_worker._protocol.ClaimClient.check_store>`, awaited."""
        if not self.allow_eviction:
            await check_store_async(self.store.client)
        self.store_checked = True

    # -- transitions ----------------------------------------------------------------------------

    async def begin(self, key: str | bytes, *, fingerprint: Any = None, wait: float = 0.0) -> Claim:
        """Try to claim ``key``: one round trip, one :class:`Claim`; as
        :meth:`ClaimClient.begin <dedupe_worker._protocol.ClaimClient.begin>`, ``wait`` included.
        Raises :class:`InvalidKey` and :class:`StoreUnavailable`."""
        request = self.request(key, fingerprint)
        if not self.store_checked:
            await self.check_store()
        reply = await self.store.claim_one(request.stem, request.fingerprint, request.original,
                                           self._lease_ms, self._retention_ms)
        claim = self._claim(request, reply)
        if wait > 0 and claim.outcome is Outcome.IN_PROGRESS:
            return await self.wait_for(request, claim, time.monotonic() + wait)
        return claim

    async def begin_many(self, keys: Sequence[str | bytes], *, fingerprints: Sequence[Any] | None = None,
                         wait: float = 0.0) -> list[Claim]:
        """Claim a batch of keys in one round trip, answers in the order of ``keys``; a key twice
        in the batch is ACQUIRED once. With ``wait``, held keys are waited on concurrently, all
        within ``wait`` seconds."""
        fps = fingerprints if fingerprints is not None else [None] * len(keys)
        if len(fps) != len(keys):
            raise ValueError("fingerprints must match keys one to one")
        requests = [self.request(k, f) for k, f in zip(keys, fps, strict=True)]
        claims = await self.claim_requests(requests)
        if wait > 0:
            ours = {(c.stem, c.token) for c in claims if c.acquired}  # a repeated key held by us: no wait
            deadline = time.monotonic() + wait

            async def settled(request: Request, claim: Claim) -> Claim:
                if claim.outcome is Outcome.IN_PROGRESS and (claim.stem, claim.token) not in ours:
                    return await self.wait_for(request, claim, deadline)
                return claim

            claims = list(await asyncio.gather(*(settled(r, c) for r, c in zip(requests, claims, strict=True))))
        return claims

    async def wait_for(self, request: Request, claim: Claim, deadline: float) -> Claim:
        """Wait, until ``deadline`` (``time.monotonic()``), on a key that ``claim`` found held:
        ``watch.lua`` counts a waiter, the holder's completion or release pushes a notice that the
        loop's :class:`AsyncKeyWaiter` task wakes us on (one task and one blocked connection for
        every coroutine that waits), or the holder's lease ends; then we claim again. A waiter
        never holds the claim and the wait never outlasts ``deadline``."""
        while claim.outcome is Outcome.IN_PROGRESS:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await self.waiter.wait(request.stem, left)
            reply = await self.store.claim_one(request.stem, request.fingerprint, request.original,
                                               self._lease_ms, self._retention_ms)
            claim = self._claim(request, reply)
        return claim

    async def claim_requests(self, requests: Sequence[Request]) -> list[Claim]:
        """:meth:`begin_many` for requests already checked by :meth:`request`."""
        if not self.store_checked:
            await self.check_store()
        replies = (await self.store.run(self.store.claim_calls(
            [(r.stem, r.fingerprint, r.original) for r in requests], self._lease_ms, self._retention_ms)))[0]
        claims = [self._claim(r, reply) for r, reply in zip(requests, self.store.claim_replies(replies), strict=True)]
        if log.isEnabledFor(logging.DEBUG):
            for claim in claims:
                log.debug("claim key=%s token=%s outcome=%s", claim.key, claim.token, claim.outcome.name)
        return claims

    async def complete(self, claim: Claim, value: Any, *, ttl: float | None = None) -> None:
        """Store ``value`` as the outcome, only if ``claim``'s token still owns the key, kept
        ``ttl`` seconds (default ``result_ttl``). Raises :class:`LeaseLost` (nothing written) and
        :class:`ResultNotSerializable` (stored as omitted)."""
        status, data, problem = self.encode(claim, value)
        if self.renewer.is_lost(claim.stem, claim.token):
            raise LeaseLost(claim.key, claim.token)
        items = [(claim.stem, claim.token, status, data)]
        ttl_ms = self.result_ttl_ms(ttl)
        stored = await self._finishing([(claim.stem, claim.token)], lambda: self.store.complete(items, ttl_ms))
        if not self.owns(claim, stored[0]):
            raise LeaseLost(claim.key, claim.token)
        if problem is not None:
            raise problem

    async def complete_many(self, items: Sequence[tuple[Claim, Any]]) -> list[bool]:
        """Store outcomes for a batch in one round trip; ``False`` where the lease was lost.
        Values that cannot be serialised are stored as omitted (and logged)."""
        encoded = [self.encode(claim, value) for claim, value in items]
        records = [(claim.stem, claim.token, status, data)
                   for (claim, _), (status, data, _) in zip(items, encoded, strict=True)]
        stored = await self._finishing([(claim.stem, claim.token) for claim, _ in items],
                                       lambda: self.store.complete(records, self._result_ttl_ms))
        return [self.owns(claim, ok) for (claim, _), ok in zip(items, stored, strict=True)]

    async def fail(self, claim: Claim, error: BaseException | str) -> None:
        """Store a permanent failure as the outcome; raises :class:`LeaseLost` when fenced off."""
        data = self.encode_failure(error)
        items = [(claim.stem, claim.token, Stored.FAILED, data)]
        stored = await self._finishing([(claim.stem, claim.token)],
                                       lambda: self.store.complete(items, self._result_ttl_ms))
        if not self.owns(claim, stored[0]):
            raise LeaseLost(claim.key, claim.token)
        log.warning("stored permanent failure key=%s token=%s: %s", claim.key, claim.token, error)

    async def release(self, claim: Claim) -> bool:
        """Give the claim up so the next delivery may claim again; ``False`` when the token no
        longer owned it (nothing changed)."""
        return (await self.release_many([claim]))[0]

    async def release_many(self, claims: Sequence[Claim]) -> list[bool]:
        """:meth:`release` for a batch, in one round trip."""
        items = [(c.stem, c.token) for c in claims]
        return await self._finishing(items, lambda: self.store.release(items, self._retention_ms))

    async def renew(self, claim: Claim) -> bool:
        """Extend the lease by ``lease`` from now; ``False`` when the token no longer owns it."""
        return (await self.store.renew([(claim.stem, claim.token)], self._lease_ms, self._retention_ms))[0]

    async def forget(self, key: str | bytes, *, token: int | None = None, force: bool = False) -> bool:
        """Remove ``key``'s records, ownership-checked as
        :meth:`ClaimClient.forget <dedupe_worker._protocol.ClaimClient.forget>`."""
        code, _ = await self.store.forget(self.request(key).stem, token, force)
        return code == 1

    async def status(self, key: str | bytes) -> KeyState:
        """Look at a key's records without changing them."""
        return await self.store.inspect(self.request(key).stem)

    @asynccontextmanager
    async def keep_leases(self, claims: Sequence[Claim]) -> AsyncIterator[None]:
        """While inside, the loop's renewer task keeps the leases of ``claims`` from running out."""
        for claim in claims:
            self.renewer.track(claim.stem, claim.token)
        try:
            yield
        finally:
            for claim in claims:
                self.renewer.untrack(claim.stem, claim.token)

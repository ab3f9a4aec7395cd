"""The protocol client on asyncio: claim a key, store its outcome, release or renew it, awaited.

A deliberate twin of :mod:`dedupe_worker._transport.client`, kept to what truly differs: the
driver's one line that performs an effect (it awaits where the sync one blocks; the loop is
``flows.Steps`` and how each effect is performed is one table, ``ClientCore.performers``, both
shared), the waiter, the renewer task, ``close`` and the context manager's spelling. Its logic
is not here: every operation is a flow of :mod:`dedupe_worker._protocol.flows`, and each public
method is a typed one-line call of ``AsyncClaimClient._drive_async`` on one.

:class:`AsyncClaimClient` is :class:`~dedupe_worker.ClaimClient` with every round trip
awaited: the same options, the same Lua scripts, the same key checks, reply decoding and result
encoding (both subclass :class:`~dedupe_worker._protocol.codec.ClaimCodec`), so a key claimed by
one is seen by the other exactly as by itself. No verdicts here: that is the engine's
(:mod:`dedupe_worker.asyncio._engine`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Unpack

from .._errors import ClaimError, ResultNotSerializable
from .._protocol import C, Claim, ClaimItem, ClientCore, Either, Flow, KeyState, Request, Stored, T, drive_async
from .._settings import ClientKeywords, ClientOptions, client_options
from .async_connection import async_redis_from_url
from .async_renewer import AsyncLeaseRenewer
from .async_scripts import AsyncRedis
from .async_store import AsyncRedisStore
from .async_waiter import AsyncKeyWaiter
from .backends import StoreClient, connect
from .eviction import check_store_async

__all__ = ["AsyncClaimClient"]


class AsyncClaimClient(ClientCore):
    """The claim protocol's client on ``redis.asyncio``; options as
    :class:`~dedupe_worker.ClaimClient`'s, and the same guarantees: while a key's records
    live, at most one outcome is stored for it, and a claimant whose lease ran out can never
    store over its successor's (fencing tokens).

    Leases of claims being worked on are renewed by one task per event loop
    (:class:`AsyncLeaseRenewer`); :meth:`aclose` cancels it.

    :param redis_client: a ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``. Its
        pool must allow as many connections as coroutines that call at once, or queue them
        (``BlockingConnectionPool``, as :meth:`from_url` builds).

    The ``allow_eviction`` option works as for the sync client: off, the first claim raises
    :class:`~dedupe_worker.EvictionPolicyError` on a Redis that may evict our records.
    """

    store: AsyncRedisStore
    renewer: AsyncLeaseRenewer

    def __init__(
        self,
        redis_client: AsyncRedis | StoreClient,
        *,
        options: ClientOptions | None = None,
        **keywords: Unpack[ClientKeywords],
    ) -> None:
        # another store's client (from_url of a database URL): the same protocol on it
        super().__init__(functools.partial(redis_client.store, asynchronous=True)
                         if isinstance(redis_client, StoreClient) else functools.partial(AsyncRedisStore, redis_client),
                         AsyncLeaseRenewer, client_options(options, keywords))
        #: Wakes the coroutines waiting on held keys (one task per loop); also :attr:`watcher`.
        self.waiter = AsyncKeyWaiter(self.store)
        if isinstance(redis_client, StoreClient):
            self.store_checked = True  # the eviction check is Redis's
            redis_client.attach(self)

    @staticmethod
    def _connect(url: str) -> Any:
        """A ``redis.asyncio`` client for a Redis URL; for another store's (a database's), its client."""
        return connect(url, True) or async_redis_from_url(url)

    @property
    def watcher(self) -> AsyncKeyWaiter:
        """What waits on held keys for this client: the :class:`AsyncKeyWaiter` (one task per
        loop), the asyncio counterpart of :class:`~dedupe_worker.ClaimClient`'s key watcher."""
        return self.waiter

    async def close(self) -> None:
        """Cancel the lease renewer and key waiter tasks, give the held connection back to the
        client's pool (a later call takes one again), and close the Redis client if
        :meth:`from_url` built it. Claims still held are no longer renewed: their leases run out."""
        await self.renewer.aclose()
        await self.waiter.aclose()
        await self.store.scripts.release_held()
        if self.owns_redis:
            await self.store.client.aclose()

    async def aclose(self) -> None:
        """:meth:`close` (the name asyncio libraries use)."""
        await self.close()

    async def __aenter__(self: C) -> C:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _drive_async(self, flow: Flow[T]) -> T:
        """Run ``flow`` (:mod:`dedupe_worker._protocol.flows`) to its end, awaiting each effect it
        yields (:meth:`performers`): a round trip on the store, ``asyncio.sleep``, a wait on the
        loop's :class:`AsyncKeyWaiter`, the handler awaited. An effect's exception is thrown into
        the flow (``CancelledError`` included, so a cancelled handler's claim is settled):
        :func:`~dedupe_worker._protocol.flows.drive_async`."""
        return await drive_async(flow, self.perform)

    #: The name the flows written once for both clients call their driver by.
    _drive = _drive_async

    _sleep = staticmethod(asyncio.sleep)

    @staticmethod
    def _either(effect: Either) -> Awaitable[Any]:
        return effect.asynchronous()

    def _wait(self, stem: str, timeout: float) -> Awaitable[bool]:
        return self.waiter.wait(stem, timeout)

    async def check_store(self) -> None:
        """:meth:`ClaimClient.check_store <dedupe_worker._transport.ClaimClient.check_store>`, awaited."""
        if not self.allow_eviction and not isinstance(self.store.client, StoreClient):
            await check_store_async(self.store.client)
        self.store_checked = True

    # -- transitions: the flows of :mod:`dedupe_worker._protocol.flows`, awaited -----------------

    async def begin(self, key: str | bytes, *, fingerprint: Any = None, wait: float = 0.0,
                    ttl: float | None = None) -> Claim:
        """Try to claim ``key``: one round trip, one :class:`Claim`; as
        :meth:`ClaimClient.begin <dedupe_worker.ClaimClient.begin>`, ``wait`` and ``ttl`` included.
        Raises :class:`InvalidKey` and :class:`StoreUnavailable`."""
        return await self._drive_async(self.begin_flow(key, fingerprint, wait, ttl))

    async def begin_many(self, keys: Sequence[str | bytes], *, fingerprints: Sequence[Any] | None = None,
                         wait: float = 0.0, ttl: float | None = None) -> list[Claim]:
        """Claim a batch of keys in one round trip, answers in the order of ``keys``; a key twice
        in the batch is ACQUIRED once. With ``wait``, held keys are waited on concurrently, all
        within ``wait`` seconds. ``ttl``: as :meth:`begin`, for every key."""
        claims, held = await self._drive_async(self.begin_many_flow(keys, fingerprints, wait, ttl))
        deadline = time.monotonic() + wait
        waited = await asyncio.gather(*(self.wait_for(request, claims[i], deadline) for i, request in held))
        for (i, _), claim in zip(held, waited, strict=True):
            claims[i] = claim
        return claims

    async def wait_for(self, request: Request, claim: Claim, deadline: float) -> Claim:
        """Wait, until ``deadline`` (``time.monotonic()``), on a key that ``claim`` found held:
        ``watch.lua`` counts a waiter, the holder's completion or release pushes a notice that the
        loop's :class:`AsyncKeyWaiter` task wakes us on (one task and one blocked connection for
        every coroutine that waits), or the holder's lease ends; then we claim again. A waiter
        never holds the claim and the wait never outlasts ``deadline``."""
        return await self._drive_async(self.wait_flow(request, claim, deadline))

    async def claim_requests(self, requests: Sequence[Request]) -> list[Claim]:
        """:meth:`begin_many` for requests already checked by :meth:`request`."""
        return await self._drive_async(self.claims_flow(requests))

    async def settle_and_claim(self, outcomes: Sequence[tuple[Claim, Stored, bytes]], releases: Sequence[Claim],
                               requests: Sequence[Request]) -> tuple[list[bool], list[bool], list[Claim]]:
        """In one round trip: store ``outcomes``, release ``releases``, claim ``requests``; as
        :meth:`ClaimClient.settle_and_claim <dedupe_worker.ClaimClient.settle_and_claim>`."""
        return await self._drive_async(self.settle_and_claim_flow(outcomes, releases, requests))

    async def settle_and_stream(self, outcomes: Sequence[tuple[Claim, Stored, bytes]], releases: Sequence[Claim],
                                requests: Sequence[Request], each: Callable[[int, list[Claim]], Awaitable[None]],
                                step: int) -> tuple[list[bool], list[bool]]:
        """:meth:`settle_and_claim`, the claims handed to ``await each(start, claims)`` ``step`` at
        a time once the round trip is read (asyncio has no held connection to stream replies on);
        as :meth:`ClaimClient.settle_and_stream <dedupe_worker.ClaimClient.settle_and_stream>`."""
        async def claimed(start: int, flat: list[Any]) -> None:
            claims = self.claims_from(requests[start:start + len(flat) // 4], flat)
            await each(start, claims)

        return await self.stream_claims(outcomes, releases, [(r[1], r[2], r[3]) for r in requests], claimed, step)

    async def stream_claims(self, outcomes: Sequence[tuple[Claim, Stored, bytes]], releases: Sequence[Claim],
                            claims: Sequence[ClaimItem], each: Callable[[int, list[Any]], Awaitable[None]],
                            step: int) -> tuple[list[bool], list[bool]]:
        """:meth:`settle_and_stream` with ``claims`` as ``(stem, fingerprint, original)`` and the
        flat ``claim.lua`` replies handed to ``await each(start, flat)``; as
        :meth:`ClaimClient.stream_claims <dedupe_worker.ClaimClient.stream_claims>`."""
        return await self._drive_async(self.handed_on_flow(outcomes, releases, claims, each, step))

    async def complete(self, claim: Claim, value: Any, *, ttl: float | None = None) -> None:
        """Store ``value`` as the outcome, only if ``claim``'s token still owns the key, kept
        ``ttl`` seconds (default ``result_ttl``). Raises :class:`LeaseLost` (nothing written) and
        :class:`ResultNotSerializable` (stored as omitted)."""
        await self._drive_async(self.complete_flow(claim, value, ttl))

    async def complete_many(self, items: Sequence[tuple[Claim, Any]]) -> list[bool]:
        """Store outcomes for a batch in one round trip; ``False`` where the lease was lost.
        Values that cannot be serialised are stored as omitted (and logged)."""
        return await self._drive_async(self.complete_many_flow(items))

    async def complete_each(self, items: Sequence[tuple[Claim, Any]]) -> list[ClaimError | ResultNotSerializable
                                                                              | None]:
        """:meth:`complete_many`, telling per item what :meth:`complete` would have raised."""
        return await self._drive_async(self.complete_each_flow(items))

    async def fail(self, claim: Claim, error: BaseException | str) -> None:
        """Store a permanent failure as the outcome; raises :class:`LeaseLost` when fenced off."""
        await self._drive_async(self.fail_flow(claim, error))

    async def release(self, claim: Claim) -> bool:
        """Give the claim up so the next delivery may claim again; ``False`` when the token no
        longer owned it (nothing changed)."""
        return (await self._drive_async(self.release_flow((claim,))))[0]

    async def release_many(self, claims: Sequence[Claim]) -> list[bool]:
        """:meth:`release` for a batch, in one round trip."""
        return await self._drive_async(self.release_flow(claims))

    async def renew(self, claim: Claim) -> bool:
        """Extend the lease by ``lease`` from now; ``False`` when the token no longer owns it."""
        return await self._drive_async(self.renew_flow(claim))

    async def forget(self, key: str | bytes, *, token: int | None = None, force: bool = False) -> bool:
        """Remove ``key``'s records, ownership-checked as
        :meth:`ClaimClient.forget <dedupe_worker.ClaimClient.forget>`."""
        return await self._drive_async(self.forget_flow(key, token, force))

    async def status(self, key: str | bytes) -> KeyState:
        """Look at a key's records without changing them."""
        return await self._drive_async(self.status_flow(key))

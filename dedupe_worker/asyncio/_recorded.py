"""The asyncio forms of :mod:`dedupe_worker._engine.recorded`'s hooks, for the asyncio engine."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._engine.decision import Decision
from .._engine.recorded import duplicate, not_stored, outcomes_of, unbound_claim
from .._errors import AlreadyApplied, LeaseLost, ResultNotSerializable, StoreUnavailable
from .._protocol.claim import Claim
from .._protocol.context import bind_claim
from ._client import AsyncClaimClient

__all__ = ["applied_before_async", "found_before_async", "unclaimed_async"]

log = logging.getLogger(__name__)


async def applied_before_async(dedupe: AsyncClaimClient, claim: Claim, found: AlreadyApplied) -> Decision:
    """:func:`applied_before` on asyncio."""
    try:
        await dedupe.complete(claim, found.result)
    except (LeaseLost, ResultNotSerializable, StoreUnavailable) as exc:
        not_stored(claim, exc)
    return duplicate(claim, found)


async def found_before_async(dedupe: AsyncClaimClient, claim: Claim) -> Decision | None:
    """:func:`found_before` on asyncio."""
    outcomes = outcomes_of(dedupe)
    if outcomes is None or not claim.reclaimed:
        return None
    try:
        found = await outcomes.lookup_async(claim)
    except Exception as exc:
        log.warning("outcome lookup failed key=%s token=%s, running the handler: %s", claim.key, claim.token, exc)
        return None
    return None if found is None else await applied_before_async(dedupe, claim, found)


def unclaimed_async(dedupe: AsyncClaimClient, key: str | bytes,
                    handler: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
    """:func:`unclaimed` on asyncio."""
    if outcomes_of(dedupe) is None:
        return handler
    claim = unbound_claim(dedupe, key)

    async def run() -> Any:
        with bind_claim(claim):
            return await handler()

    return run

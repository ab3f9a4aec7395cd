"""Claiming a request's key, with records the layer cannot read treated as absent.

Written once as a flow (a generator of the steps to perform, :data:`BEGIN` and :data:`FORGET`),
driven by the sync middleware (:func:`drive`) and by the ASGI one (:func:`drive_async`), as the
claim protocol's own flows are.

A key's records can be unreadable two ways, and both end in the protocol's own removal,
``forget(key, token=claim.token, force=True)`` (``forget.lua``, ownership-checked):

- the stored response decodes to nothing the layer wrote (truncated, foreign, invalid base64, a
  body that inflates past its bound): the claim answers DUPLICATE under the token that stored it,
  and that token is the one forgotten;
- a record is not even the protocol's (another Redis type under a name, a truncated record): the
  claim answers UNREADABLE, whose token is 0, and ``forget.lua`` removes with token 0 only a
  record that carries no token, never a live lease or an outcome stored since by a concurrent
  request (that one is then answered as it says: 409, or its replay).

Either is logged once, replaced, and the request runs; a record still unreadable when claimed
again is answered as the store being unavailable (503), or run without a claim (``fail_open``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any

from .._errors import StoreUnavailable
from .._protocol import Claim
from ._rules import UNREADABLE, Attempt, IdempotencyRules
from ._stored import Response

__all__ = ["BEGIN", "FORGET", "claim_flow", "drive", "drive_async"]

#: The steps of :func:`claim_flow`: ``(BEGIN, None)`` claim the attempt's key;
#: ``(FORGET, token)`` remove its unreadable records, ``forget(key, token=token, force=True)``.
BEGIN, FORGET = "begin", "forget"

Step = tuple[str, Any]
Flow = Generator[Step, Any, "tuple[Claim | None, Response | None]"]


def claim_flow(rules: IdempotencyRules, attempt: Attempt, fail_open: bool) -> Flow:
    """Claim ``attempt``'s key: ``(claim, None)`` run the app under it; ``(claim, response)``
    answer with it (a replay, a 409, a 422); ``(None, response)`` the store is down (503);
    ``(None, None)`` run without a claim (``fail_open``)."""
    for first in (True, False):
        try:
            claim = yield BEGIN, None
        except StoreUnavailable as exc:
            return None, rules.store_down(attempt, exc, fail_open)
        answer = rules.answer(claim)
        if answer is not UNREADABLE:
            return claim, answer
        if not first:
            return None, rules.store_down(attempt, StoreUnavailable("the replaced record is unreadable"), fail_open)
        try:
            yield FORGET, claim.token
        except StoreUnavailable as exc:
            return None, rules.store_down(attempt, exc, fail_open)
    raise AssertionError("unreachable")


def drive(flow: Flow, perform: Callable[[str, Any], Any]) -> tuple[Claim | None, Response | None]:
    """Run ``flow`` with ``perform(step, argument)`` doing each step (sync)."""
    reply: Any = None
    error: StoreUnavailable | None = None
    while True:
        try:
            step = flow.send(reply) if error is None else flow.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            reply, error = perform(*step), None
        except StoreUnavailable as exc:
            reply, error = None, exc


async def drive_async(flow: Flow, perform: Callable[[str, Any], Awaitable[Any]]) -> tuple[Claim | None,
                                                                                          Response | None]:
    """Run ``flow`` with ``await perform(step, argument)`` doing each step (asyncio)."""
    reply: Any = None
    error: StoreUnavailable | None = None
    while True:
        try:
            step = flow.send(reply) if error is None else flow.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            reply, error = await perform(*step), None
        except StoreUnavailable as exc:
            reply, error = None, exc

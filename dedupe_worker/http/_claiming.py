"""Claiming a request's key, with records the layer cannot read treated as absent.

Written once as a flow (a generator of the steps to perform, :data:`Begin`, :data:`Forget`,
:data:`Repair`), driven by the sync middleware (:func:`drive`) and by the ASGI one
(:func:`drive_async`), as the claim protocol's own flows are.

A key's records can be unreadable two ways. The stored response decodes to nothing the layer
wrote (truncated, foreign, invalid base64, a body that inflates past its bound): the claim
answers DUPLICATE and :meth:`IdempotencyRules.answer` says :data:`UNREADABLE`; the record is
forgotten under the token that stored it (ownership-checked) and the key claimed again. Or a
record is not even the protocol's (another Redis type under the name, a truncated record): the
claim script fails, and :data:`REPAIR_SCRIPT` deletes exactly those names, in one script, leaving
a live lease and any readable record alone. Either is logged once and the request runs; a
second failure in a row is answered as the store being unavailable (503).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from .._errors import StoreUnavailable
from .._protocol.claim import Claim
from .._protocol.layout import KeyLayout
from ._rules import UNREADABLE, Attempt, IdempotencyRules
from ._stored import Response

__all__ = ["BEGIN", "FORGET", "REPAIR", "REPAIR_SCRIPT", "claim_flow", "drive", "drive_async", "record_names"]

log = logging.getLogger(__name__)

BEGIN, FORGET, REPAIR = "begin", "forget", "repair"

#: Deletes a key's records that the claim scripts cannot read, and nothing else.
#: KEYS[1] - the started hash, KEYS[2] - the stem (record format 2, a string),
#: KEYS[3] - the result hash (record format 1), KEYS[4] - the notice list.
#: Returns how many names were deleted. A name of another Redis type than the protocol writes, or
#: a format-2 record shorter than its own lengths say, is deleted; a readable record, a live
#: lease and an absent name are left as they are.
REPAIR_SCRIPT = """
local expected = {'hash', 'string', 'hash', 'list'}
local removed = 0
for i = 1, 4 do
  local kind = redis.call('TYPE', KEYS[i]).ok
  local bad = kind ~= 'none' and kind ~= expected[i]
  if not bad and i == 2 and kind == 'string' then
    local raw = redis.call('GET', KEYS[2])
    local letter = string.sub(raw, 1, 1)
    if #raw < 9 then
      bad = true
    elseif letter ~= string.lower(letter) then
      if #raw < 11 then
        bad = true
      else
        local fp_end = 11 + string.byte(raw, 10) * 256 + string.byte(raw, 11)
        if #raw < fp_end + 2 then
          bad = true
        else
          bad = #raw < fp_end + 2 + string.byte(raw, fp_end + 1) * 256 + string.byte(raw, fp_end + 2)
        end
      end
    end
  end
  if bad then
    redis.call('DEL', KEYS[i])
    removed = removed + 1
  end
end
return removed
"""

Step = tuple[str, Any]
Flow = Generator[Step, Any, "tuple[Claim | None, Response | None]"]


def record_names(client: Any, key: str) -> list[str]:
    """The Redis names of ``key``'s records, as :data:`REPAIR_SCRIPT` takes them."""
    stem = client.request(key).stem
    return [*KeyLayout.records(stem), KeyLayout.notice(stem)]


def claim_flow(rules: IdempotencyRules, attempt: Attempt, fail_open: bool) -> Flow:
    """Claim ``attempt``'s key: ``(claim, None)`` run the app under it; ``(claim, response)``
    answer with it (a replay, a 409, a 422); ``(None, response)`` the store is down (503);
    ``(None, None)`` run without a claim (``fail_open``)."""
    for first in (True, False):
        try:
            claim = yield BEGIN, None
        except StoreUnavailable as exc:
            if not (first and rules.unreadable(exc)):
                return None, rules.store_down(attempt, exc, fail_open)
            log.warning("records of key=%s are not the protocol's (%s): treated as absent, replaced", attempt.key, exc)
            try:
                yield REPAIR, None
            except StoreUnavailable as again:
                return None, rules.store_down(attempt, again, fail_open)
            continue
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

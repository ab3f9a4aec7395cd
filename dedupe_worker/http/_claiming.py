"""Claiming a request's key, with records the layer cannot read treated as absent.

Written once as a flow (a generator of the effects to perform, :class:`Begin` and
:class:`Forget`), driven by the sync middleware and by the ASGI one with the claim protocol's own
drivers (``drive``, ``drive_async``), as the protocol's flows are.

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

from collections.abc import Generator
from typing import Any, NamedTuple

from .._errors import StoreUnavailable
from .._protocol import Claim
from ._rules import UNREADABLE, Attempt, IdempotencyRules
from ._stored import Response

__all__ = ["Begin", "Forget", "claim_flow"]


class Begin(NamedTuple):
    """Claim the attempt's key; answered with the :class:`Claim`."""


class Forget(NamedTuple):
    """Remove the key's unreadable records: ``forget(key, token=token, force=True)``."""

    token: int


Flow = Generator[Begin | Forget, Any, "tuple[Claim | None, Response | None]"]


def claim_flow(rules: IdempotencyRules, attempt: Attempt, fail_open: bool) -> Flow:
    """Claim ``attempt``'s key: ``(claim, None)`` run the app under it; ``(claim, response)``
    answer with it (a replay, a 409, a 422); ``(None, response)`` the store is down (503);
    ``(None, None)`` run without a claim (``fail_open``)."""
    for first in (True, False):
        try:
            claim = yield Begin()
        except StoreUnavailable as exc:
            return None, rules.store_down(attempt, exc, fail_open)
        answer = rules.answer(claim)
        if answer is not UNREADABLE:
            return claim, answer
        if not first:
            return None, rules.store_down(attempt, StoreUnavailable("the replaced record is unreadable"), fail_open)
        try:
            yield Forget(claim.token)
        except StoreUnavailable as exc:
            return None, rules.store_down(attempt, exc, fail_open)
    raise AssertionError("unreachable")

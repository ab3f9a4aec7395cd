"""Send-side checks over Redis: whether a producer should publish work for a key, in one round trip.

What ``send.lua`` is sent and what its reply means are the state machine's
(:mod:`dedupe_worker._protocol.sending`); this module makes the round trips on the client's store.
"""

from __future__ import annotations

from typing import Any

from .._protocol import KeyLayout, SendAnswer, send_answer, send_call
from .client import ClaimClient

__all__ = ["check_send", "unsend"]


def check_send(client: ClaimClient, key: str | bytes, task_id: str, *, ttl: float,
               fingerprint: Any = None) -> SendAnswer:
    """One round trip: may a send of ``task_id`` for ``key`` publish? See :class:`SendState`.

    ``ttl`` is how long, in seconds, the mark answers QUEUED (include any countdown); after it
    the mark keeps naming the task for the client's ``result_ttl``. Raises :class:`InvalidKey`
    and :class:`StoreUnavailable` (nothing decided: the caller publishes).
    """
    request = client.request(key, fingerprint)
    reply = client.store.scripts.call(*send_call(request, task_id, int(ttl * 1000), client._result_ttl_ms))
    return send_answer(client, request, reply)


def unsend(client: ClaimClient, key: str | bytes, task_id: str) -> bool:
    """One round trip: remove ``key``'s send mark if it still names ``task_id`` (whose publish
    raised), so the next send publishes. ``False``: the mark names another send, or is gone.
    Raises :class:`StoreUnavailable` (the mark then lapses after its ``ttl``)."""
    request = client.request(key)
    return bool(client.store.scripts.call("unsend", (KeyLayout.sent(request.stem),), (task_id,)))

"""Claim stores other than Redis, plugged in from above.

The protocol's clients take a redis-py client, or a :class:`StoreClient`: the client of another
store that runs the same transitions behind the script runner's interface (the SQL store,
:mod:`dedupe_worker._sqlstore`, which sits above this layer and registers itself in
:data:`CONNECTORS` when the package is imported). ``from_url`` asks :func:`connect` first and
builds a Redis client only when no store takes the URL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._protocol import KeyLayout

__all__ = ["CONNECTORS", "StoreClient", "connect"]


class StoreClient:
    """The client of a claim store other than Redis, taken where a redis-py client is."""

    def store(self, layout: KeyLayout, asynchronous: bool) -> Any:
        """The store (a ``RedisStore`` in interface) of ``layout`` on this client."""
        raise NotImplementedError

    def attach(self, client: Any) -> None:
        """Called once by each claim client built on this store."""


#: ``connect(url, asynchronous)`` of each registered store: its client for ``url``, else ``None``.
CONNECTORS: list[Callable[[str, bool], StoreClient | None]] = []


def connect(url: str, asynchronous: bool) -> StoreClient | None:
    """The client of the first registered store that takes ``url``, else ``None`` (Redis)."""
    for connector in CONNECTORS:
        found = connector(url, asynchronous)
        if found is not None:
            return found
    return None

"""A test double for your unit tests: a real :class:`~dedupe_worker.Deduplicator` without a Redis server.

::

    from dedupe_worker.testing import in_memory

    def test_charge_applies_once():
        dedupe = in_memory()
        assert dedupe.run("charge:1", charge, 1, 100) == dedupe.run("charge:1", charge, 1, 100)

It is backed by fakeredis with Lua (``pip install 'dedupe-worker[testing]'``), so the same Lua
scripts run as on Redis: claims, fencing tokens, leases (on the real clock), conflicts, stored
failures and waiting on keys behave exactly as in production. Each call starts an empty store of
its own. With the package installed, pytest gets a ``dedupe`` fixture built this way (see
:mod:`dedupe_worker._pytest_plugin`). :func:`in_memory_async` is the same for
:class:`~dedupe_worker.asyncio.AsyncDeduplicator`. Not for production: nothing is shared between
processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._deduplicator import Deduplicator
from ._extras import require

if TYPE_CHECKING:
    from .asyncio import AsyncDeduplicator

__all__ = ["in_memory", "in_memory_async"]


def in_memory(namespace: str = "test", **options: Any) -> Deduplicator:
    """A :class:`Deduplicator` on a fresh in-memory store; ``options`` as for the constructor."""
    fakeredis = require("fakeredis", "testing")
    require("lupa", "testing")  # fakeredis runs Lua through lupa
    options.setdefault("allow_eviction", True)  # fakeredis has no CONFIG GET and never evicts
    return Deduplicator(fakeredis.FakeRedis(server=fakeredis.FakeServer()), namespace=namespace, **options)


def in_memory_async(namespace: str = "test", **options: Any) -> AsyncDeduplicator:
    """An :class:`~dedupe_worker.asyncio.AsyncDeduplicator` on a fresh in-memory store (fakeredis'
    asyncio client, the same Lua scripts); ``options`` as for the constructor."""
    from .asyncio import AsyncDeduplicator

    fakeredis = require("fakeredis", "testing")
    require("lupa", "testing")
    options.setdefault("allow_eviction", True)
    return AsyncDeduplicator(fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer()), namespace=namespace, **options)

"""The claim protocol's transport: what carries the state machine's calls to Redis and back.

The state machine (:mod:`dedupe_worker._protocol`) yields what to send; everything that sends it
is here, sync and asyncio side by side:

* the clients that drive the flows, :class:`ClaimClient` (blocking) and :class:`AsyncClaimClient`,
  and the send-side round trips (:func:`check_send`, :func:`unsend`);
* the stores and their script runners, ``store``/``scripts`` and ``async_store``/``async_scripts``:
  the seam. A runner is handed lists of :data:`~dedupe_worker._protocol.Call` and answers with
  the replies; what it sends and how it reloads scripts is written once, without I/O, in
  ``script_flow``. Stores other than Redis plug in behind the same interface (``backends``);
* how a command reaches Redis, behind one small interface (``paths.RedisPath``): by default
  redis-py's public API (``execute_command``, a pipeline, its cluster client). The accelerators
  sit behind that interface and the runners only: the held connection (``held``), the library's
  own cluster routing (``paths.ClusterPath``), the asyncio direct sender (``async_direct``) and
  the compiled packer they use. Deleting them touches nothing of the state machine;
  ``DEDUPE_PURE_PYTHON=1`` turns them off;
* clients built from a URL (``connection``, ``async_connection``), the start-up eviction check
  (``eviction``), the threads and tasks that renew leases (``renewer``, ``async_renewer``) and
  wait on held keys (``watcher``, ``async_waiter``), and records read from outside a script
  (``record``).

This ``__init__`` is the package's door: every module outside ``_transport/`` imports from here,
never from a submodule (``tests/test_packaging.py`` checks it). Tests may reach past it.
"""

from __future__ import annotations

from .async_client import AsyncClaimClient
from .async_connection import async_redis_from_url
from .async_renewer import AsyncLeaseRenewer
from .async_store import AsyncRedisStore
from .async_waiter import AsyncKeyWaiter
from .backends import CONNECTORS, StoreClient, connect
from .client import ClaimClient
from .connection import redis_from_url
from .eviction import is_evicting
from .held import MIN_POOL_SIZE, direct_packer
from .record import queue_size_read, read_result, size_from_replies
from .script_flow import LIBRARY_PREFIX, SCRIPT_NAMES, SENDER_SCRIPTS, library_name
from .scripts import load_script
from .sending import check_send, unsend
from .store import RedisStore, StoreBase

# Grouped by what they are, not sorted.
__all__ = [  # noqa: RUF022
    # the clients that drive the protocol's flows, and the send-side round trips
    "AsyncClaimClient", "ClaimClient", "check_send", "unsend",
    # the stores on Redis, and stores other than Redis plugged in behind the same interface
    "AsyncRedisStore", "RedisStore", "StoreBase",
    "CONNECTORS", "StoreClient", "connect",
    # the Lua scripts and the function library they are loaded as
    "LIBRARY_PREFIX", "SCRIPT_NAMES", "SENDER_SCRIPTS", "library_name", "load_script",
    # Redis clients from a URL, and the start-up eviction check
    "async_redis_from_url", "redis_from_url", "is_evicting",
    # the tasks that renew leases and wait on held keys on asyncio
    "AsyncKeyWaiter", "AsyncLeaseRenewer",
    # the held connection's pool floor and packer (the benchmarks compare them)
    "MIN_POOL_SIZE", "direct_packer",
    # reading records from outside a script
    "queue_size_read", "read_result", "size_from_replies",
]

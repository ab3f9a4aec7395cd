"""The claim protocol: Lua scripts (``lua/``), the script runner, the Redis store and key layout,
claims and their outcomes, lease renewal, and :class:`ClaimClient`, which speaks it.

Nothing here runs a handler or decides a message's fate; that is :mod:`dedupe_worker._engine`.

This ``__init__`` is the protocol's door: every module of the package outside ``_protocol/``
imports from here, never from a submodule (``tests/test_packaging.py`` checks it), so the
submodules can move, merge or split behind it. What it hands on comes in two halves: the state
machine (claims, keys, records, the flows; no I/O) and the transport (scripts, stores,
connections, the threads that renew and wait). Tests may reach past it.
"""

from __future__ import annotations

from .backends import CONNECTORS, StoreClient, connect
from .calls import STORED, WITH_FINGERPRINT, ClaimItem, key_state, key_state_and_fingerprint
from .claim import OMITTED, Claim, Omitted, Outcome, State, Stored
from .client import KEY_HARD_LIMIT, ClaimClient, Request
from .codec import ClaimCodec, ttl_ms
from .connection import by_scheme, redis_from_url, retry_policy, sentinel_options
from .context import Holding, Run, bind, bind_claim, bind_run, current_claim, current_run, unbind, unbind_run
from .eviction import check_store_async, is_evicting
from .fingerprint import canonical_json, content_hash, fingerprint_of, request_fingerprint
from .flows import ClientCore, Either, Flow, Handler, Renewed, Stream, drive, drive_async
from .held import MIN_POOL_SIZE, direct_packer
from .layout import NOTICE, SENT, STARTED, KeyLayout
from .leases import Lease, LeaseBook, forget_after_fork
from .record import queue_size_read, read_result, size_from_replies
from .script_flow import LIBRARY_PREFIX, SCRIPT_NAMES, SENDER_SCRIPTS, Call, Library, ScriptFlows, library_name
from .scripts import StreamCut, load_script
from .sending import SendAnswer, SendState, check_send, unsend
from .serialization import Serializer, TooLarge, inflate, unpack
from .store import ClaimReply, KeyState, RedisStore, StoreBase
from .watcher import Watched

# Grouped by what they are, not sorted: the state machine first, then the transport.
__all__ = [  # noqa: RUF022
    # -- the state machine (no I/O) ---------------------------------------------------------------
    # a claim and what a claim attempt returns
    "OMITTED", "Claim", "Omitted", "Outcome", "State", "Stored",
    # keys into requests, replies into claims, results into records
    "KEY_HARD_LIMIT", "ClaimCodec", "Request", "ttl_ms",
    # where a message's records live
    "NOTICE", "SENT", "STARTED", "KeyLayout",
    # each transition's script call and its reply
    "STORED", "WITH_FINGERPRINT", "ClaimItem", "ClaimReply", "KeyState", "key_state", "key_state_and_fingerprint",
    # how results are stored, and payload fingerprints
    "Serializer", "TooLarge", "inflate", "unpack",
    "canonical_json", "content_hash", "fingerprint_of", "request_fingerprint",
    # the multi-step operations, written once for sync and asyncio, and the leases they keep
    "ClientCore", "Either", "Flow", "Handler", "Renewed", "Stream", "drive", "drive_async",
    "Lease", "LeaseBook", "forget_after_fork",
    # the send-side check's answer
    "SendAnswer", "SendState",
    # the claim, and the SQL run, of the message being handled
    "Holding", "Run", "bind", "bind_claim", "bind_run", "current_claim", "current_run", "unbind", "unbind_run",
    # -- the transport (round trips, connections, threads) ----------------------------------------
    # the client that speaks the protocol, and the send-side check on it
    "ClaimClient", "check_send", "unsend",
    # the Lua scripts and their runners' shared flows
    "LIBRARY_PREFIX", "SCRIPT_NAMES", "SENDER_SCRIPTS", "Call", "Library", "ScriptFlows", "StreamCut",
    "library_name", "load_script",
    # the store on Redis, and stores other than Redis plugged in from above
    "RedisStore", "StoreBase",
    "CONNECTORS", "StoreClient", "connect",
    # Redis clients from a URL, and the start-up eviction check
    "by_scheme", "redis_from_url", "retry_policy", "sentinel_options",
    "check_store_async", "is_evicting",
    # the held connection, and reading records from outside a script
    "MIN_POOL_SIZE", "direct_packer",
    "queue_size_read", "read_result", "size_from_replies",
    # the thread that waits on held keys
    "Watched",
]

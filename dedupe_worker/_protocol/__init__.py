"""The claim protocol's state machine: claims and their outcomes, keys, records, the script calls
of each transition and their replies, and the flows that chain them. No I/O.

Nothing here opens a connection, sends a command, sleeps or starts a thread: the flows yield what
to send and are answered by a driver. The drivers, and everything that reaches Redis (scripts,
stores, connections, the threads that renew and wait, the clients), are the transport
(:mod:`dedupe_worker._transport`), which builds on this package; nothing here imports it. Nothing
here runs a handler or decides a message's fate either; that is :mod:`dedupe_worker._engine`.

This ``__init__`` is the package's door: every module outside ``_protocol/`` imports from here,
never from a submodule (``tests/test_packaging.py`` checks it), so the submodules can move, merge
or split behind it. Tests may reach past it.
"""

from __future__ import annotations

from .calls import (
    STORED,
    WITH_FINGERPRINT,
    Call,
    CallFailed,
    ClaimItem,
    ClaimReply,
    KeyState,
    NotDurable,
    StoreCalls,
    StreamCut,
    block_limit,
    key_state,
    key_state_and_fingerprint,
)
from .claim import OMITTED, Claim, Omitted, Outcome, State, Stored
from .codec import KEY_HARD_LIMIT, ClaimCodec, Request, ttl_ms
from .context import Holding, Run, bind, bind_claim, bind_run, current_claim, current_run, unbind, unbind_run
from .fingerprint import canonical_json, content_hash, fingerprint_of, request_fingerprint
from .flows import C, ClientCore, Either, Flow, Handler, Renewed, Stream, T, drive, drive_async, leases_of
from .layout import NOTICE, SENT, STARTED, KeyLayout
from .leases import Lease, LeaseBook, forget_after_fork
from .sending import SendAnswer, SendState, send_answer, send_call
from .serialization import Serializer, TooLarge, inflate, unpack

# Grouped by what they are, not sorted.
__all__ = [  # noqa: RUF022
    # a claim and what a claim attempt returns
    "OMITTED", "Claim", "Omitted", "Outcome", "State", "Stored",
    # keys into requests, replies into claims, results into records
    "KEY_HARD_LIMIT", "ClaimCodec", "Request", "ttl_ms",
    # where a message's records live
    "NOTICE", "SENT", "STARTED", "KeyLayout",
    # each transition's script call and its reply, and how a round trip of them fails
    "STORED", "WITH_FINGERPRINT", "Call", "ClaimItem", "ClaimReply", "KeyState", "StoreCalls", "block_limit",
    "key_state", "key_state_and_fingerprint",
    "CallFailed", "NotDurable", "StreamCut",
    # how results are stored, and payload fingerprints
    "Serializer", "TooLarge", "inflate", "unpack",
    "canonical_json", "content_hash", "fingerprint_of", "request_fingerprint",
    # the multi-step operations, written once for sync and asyncio, and the leases they keep
    "ClientCore", "Either", "Flow", "Handler", "Renewed", "Stream", "drive", "drive_async", "leases_of",
    "C", "T",  # the flows' type variables, which the clients' drivers share
    "Lease", "LeaseBook", "forget_after_fork",
    # the send-side check's call and answer
    "SendAnswer", "SendState", "send_answer", "send_call",
    # the claim, and the SQL run, of the message being handled
    "Holding", "Run", "bind", "bind_claim", "bind_run", "current_claim", "current_run", "unbind", "unbind_run",
]

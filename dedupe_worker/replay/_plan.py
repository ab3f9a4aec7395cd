"""The broker-neutral half of the replay: what to do with one dead-lettered message.

For every message the replay derives the idempotency key exactly as the consumer does (the
engine's :class:`~dedupe_worker._engine.Identify` with the same key strategy, applied to the same
:class:`~dedupe_worker.Envelope`) and reads the key's state with
``inspect.lua`` (what :meth:`Deduplicator.status` runs; it changes nothing in Redis), together with
the stored outcome's fingerprint: one pipelined round trip for a whole batch of messages
(:meth:`Planner.judge_many`). The verdict:

================  ===========  ==========================================================
key state         step         why
================  ===========  ==========================================================
held back         LEAVE        dead-lettered as ``conflict`` or ``undecodable`` and not
                               named by ``--filter``: replayed unchanged it only bounces back
done (c / o)      DROP         already applied: the stored outcome's fingerprint is this
                               message's payload fingerprint; remove it from the dead-letter
                               queue
conflict          LEAVE        an outcome is stored for a *different* payload under this key:
                               this payload never ran (forget the key, or re-key the message)
unproven          LEAVE        an outcome is stored without a fingerprint (or this message's
                               could not be computed): nothing shows this payload ran (with
                               ``key_only``, ``--key-only``: DROP, the key alone is the proof)
done (f)          LEAVE        a stored permanent failure; the consumer would only ack it
                               as ``previously_failed``, so replaying cannot help
in_progress       LEAVE        another copy is being handled right now
free              REPLAY       republish, wait for the broker's confirmation, then remove
no key            LEAVE        the consumer could not derive a key either
key mismatch      LEAVE        the key differs from the ``x-dedupe-key`` the consumer wrote:
                               the replay's key options do not match the consumer's
filtered          LEAVE        its dead-letter reason is not one of ``--filter``
unavailable       LEAVE        Redis could not be asked; counted as failed
================  ===========  ==========================================================

So a message is dropped only when its own payload is proven to have run: the fingerprint is
computed from the dead-lettered message exactly as the consumer computed it (by default
:func:`~dedupe_worker.keys.body_fingerprint`, the hash of the body bytes) and compared
with the fingerprint the consumer's claim stored with the outcome (``inspect.lua`` reads it from
a result of either record format). With ``fingerprint=None`` (a
consumer run without conflict detection) a stored outcome counts as applied for any payload, as
that consumer itself would answer it. With ``key_only`` (the command's ``--key-only``) an outcome
stored *without* a fingerprint (by ``run()``, ``@idempotent`` or a consumer with
``fingerprint=None``) counts as applied by its key alone, while one stored with a fingerprint is
still compared: the risk is a message whose key was reused for another payload by such a caller,
dropped though its payload never ran.

The planner is advisory: between the look-up and the consumer's claim anything may happen, and
the consumer's own deduplication is what finally prevents a second application.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from .._deduplicator import Deduplicator
from .._engine import Identify, Identity
from .._errors import InvalidKey, StoreUnavailable
from .._messages.deadletter import ATTEMPTS, KEY, REPLAYED
from .._messages.envelope import Envelope
from .._protocol import (
    WITH_FINGERPRINT,
    KeyLayout,
    KeyState,
    State,
    Stored,
    key_state_and_fingerprint,
    request_fingerprint,
)
from ..keys import KeyStrategy, body_fingerprint

__all__ = ["HELD_BACK", "REPLAYED", "Entry", "Found", "Pacer", "Planner", "Step", "replay_headers"]

log = logging.getLogger(__name__)

#: Dead-letter reasons left in place unless ``--filter`` names them, and why: replayed unchanged,
#: such a message would only be dead-lettered again.
HELD_BACK = {
    "conflict": "dead-lettered as conflict: its key was used for a different payload, so a replay "
                "bounces back; forget the key or re-key the message, then --filter conflict",
    "undecodable": "dead-lettered as undecodable: the consumer could not decode it, so a replay "
                   "bounces back; fix the consumer or the message, then --filter undecodable",
}


class Found(str, enum.Enum):
    """What the planner found for a message (``Entry.state``); the values are what the plan
    table and ``--json`` show."""

    APPLIED = "applied"
    CONFLICT = "conflict"
    UNPROVEN = "unproven"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FREE = "free"
    NO_KEY = "no_key"
    KEY_MISMATCH = "key_mismatch"
    FILTERED = "filtered"
    UNAVAILABLE = "unavailable"


class Step(str, enum.Enum):
    """What the replay does with one message."""

    REPLAY = "replay"
    DROP = "drop"
    LEAVE = "leave"


@dataclass(frozen=True)
class Entry:
    """The plan for one message: its key (``None`` when none could be derived), the key's state,
    the step, the dead-letter reason the message carried, a note for the operator, and the
    fencing token Redis reported for the key (the last one issued; 0 when never claimed)."""

    key: str | None
    state: Found
    step: Step
    reason: str = ""
    note: str = ""
    token: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", Found(self.state))  # also accepts the value as text

    @property
    def unavailable(self) -> bool:
        """True when the message is left only because Redis could not be asked."""
        return self.state is Found.UNAVAILABLE


class Planner:
    """Decides the :class:`Entry` of each message; shared by the RabbitMQ and Kafka replays.

    :param dedupe: the consumer's :class:`Deduplicator` settings (namespace!); only read from.
    :param key_strategy: the consumer's key strategy.
    :param reasons: replay only messages whose dead-letter reason is one of these (``None``: all
        but those of :data:`HELD_BACK`, ``conflict`` and ``undecodable``).
    :param fingerprint: the consumer's ``Envelope -> fingerprint`` (default: the consumers'
        default, :func:`~dedupe_worker.keys.body_fingerprint`); ``None`` when the
        consumer ran without conflict detection.
    :param key_only: an outcome stored without a fingerprint counts as this message's (dropped as
        applied) instead of ``unproven``; an outcome stored with one is still compared.
    """

    def __init__(self, dedupe: Deduplicator, key_strategy: KeyStrategy,
                 reasons: Collection[str] | None = None,
                 fingerprint: Callable[[Envelope], Any] | None = body_fingerprint, *,
                 key_only: bool = False) -> None:
        self.dedupe = dedupe
        self.key_strategy = key_strategy
        #: The key as the consumer identifies it (the fingerprint is computed only when an outcome
        #: is stored, the ttl is not read: the replay claims nothing).
        self.identify: Identify[Envelope] = Identify(None, key_strategy, ttl_header=None)
        self.reasons = frozenset(reasons) if reasons else None
        self.fingerprint = fingerprint
        self.key_only = key_only

    def judge(self, envelope: Envelope, reason: str = "") -> Entry:
        """The plan for one message (:meth:`judge_many` of one). Never raises."""
        return self.judge_many([(envelope, reason)])[0]

    def judge_many(self, messages: Sequence[tuple[Envelope, str]]) -> list[Entry]:
        """The plan for each ``(envelope, dead-letter reason)``, in order. Never raises.

        Redis is read at most once for the whole batch: one pipelined round trip carries, for
        every message that gets as far as a look-up, ``inspect.lua`` (the key's state, read at one
        instant) and the stored outcome's fingerprint. A call that fails inside the round trip
        (a wrong type, a script error) leaves only its own message UNAVAILABLE; a round trip that
        fails as a whole (connection lost, timeout) leaves every looked-up message UNAVAILABLE.
        UNAVAILABLE messages are never dropped or replayed, so a Redis error costs a later run,
        never a message."""
        entries: list[Entry | None] = []
        lookups: list[tuple[int, str, str]] = []  # (index, key, stem)
        for envelope, reason in messages:
            entry, key = self._before_lookup(envelope, reason)
            if entry is None:
                assert key is not None
                try:
                    lookups.append((len(entries), key, self.dedupe.request(key).stem))
                except InvalidKey as exc:
                    entry = Entry(key, Found.NO_KEY, Step.LEAVE, reason, str(exc))
            entries.append(entry)
        for (index, key, _), found in zip(lookups, self._read([stem for _, _, stem in lookups]), strict=True):
            envelope, reason = messages[index]
            entries[index] = self._verdict(envelope, key, reason, found)
        return [entry for entry in entries if entry is not None]

    def _before_lookup(self, envelope: Envelope, reason: str) -> tuple[Entry | None, str | None]:
        """The verdicts that need no Redis (filtered, no key, key mismatch); else ``(None, key)``."""
        found = self.identify(envelope)
        key, problem = (found.key, "") if isinstance(found, Identity) else (None, found.detail)
        if self.reasons is not None and reason not in self.reasons:
            return Entry(key, Found.FILTERED, Step.LEAVE, reason, "reason not selected by --filter"), key
        if self.reasons is None and reason in HELD_BACK:
            return Entry(key, Found.FILTERED, Step.LEAVE, reason, HELD_BACK[reason]), key
        if key is None:
            return Entry(None, Found.NO_KEY, Step.LEAVE, reason, problem), key
        recorded = envelope.header(KEY)
        if recorded is not None and recorded != key:
            log.warning("replay key=%s differs from recorded %s=%s: check the key options",
                        key, KEY, recorded)
            return Entry(key, Found.KEY_MISMATCH, Step.LEAVE, reason, f"consumer recorded key {recorded!r}"), key
        return None, key

    def _read(self, stems: Sequence[str]) -> list[tuple[KeyState, Any] | StoreUnavailable]:
        """Each stem's state and stored fingerprint (``None`` when no outcome is stored), in one
        pipelined round trip of ``inspect.lua`` per stem (which reads the fingerprint from a result
        of either record format); a failed read as a :class:`StoreUnavailable` in its place."""
        if not stems:
            return []
        store = self.dedupe.store
        try:
            commands = [store.scripts.command("inspect", KeyLayout.records(stem), WITH_FINGERPRINT) for stem in stems]
            # Read-only commands, so the held connection's retry on a connection error is safe. The
            # path tries the held connection and takes the pool when it is busy (on a cluster, each
            # call routed to its slot's primary).
            replies = store.scripts.path.execute_many(commands)
        except (RedisError, StoreUnavailable) as exc:
            failed = StoreUnavailable(f"Redis failed reading {len(stems)} keys: {exc}")
            return [failed] * len(stems)
        found: list[tuple[KeyState, Any] | StoreUnavailable] = []
        for stem, reply in zip(stems, replies, strict=True):
            try:
                if store.scripts.ran_nothing(reply):  # scripts flushed: the single call loads them
                    reply = store.scripts.call(
                        "inspect", KeyLayout.records(stem), WITH_FINGERPRINT)
                if isinstance(reply, Exception):
                    found.append(StoreUnavailable(f"Redis failed reading {stem}: {reply}"))
                else:
                    found.append(key_state_and_fingerprint(reply))
            except StoreUnavailable as exc:
                found.append(exc)
            except (KeyError, ValueError, TypeError) as exc:  # not a record this release wrote
                found.append(StoreUnavailable(f"unreadable record at {stem}: {exc!r}"))
        return found

    def _verdict(self, envelope: Envelope, key: str, reason: str,
                 found: tuple[KeyState, Any] | StoreUnavailable) -> Entry:
        if isinstance(found, StoreUnavailable):
            log.error("replay key=%s left in place, Redis unavailable: %s", key, found)
            return Entry(key, Found.UNAVAILABLE, Step.LEAVE, reason, str(found))
        state, stored = found
        if state.state is State.DONE:
            if state.status is Stored.FAILED:
                return Entry(key, Found.FAILED, Step.LEAVE, reason, "permanent failure stored", state.token)
            return self._applied(envelope, key, reason, state, stored)
        if state.state is State.IN_PROGRESS:
            return Entry(key, Found.IN_PROGRESS, Step.LEAVE, reason,
                         f"lease held for {state.remaining_ms} ms more", state.token)
        return Entry(key, Found.FREE, Step.REPLAY, reason, "", state.token)

    def _applied(self, envelope: Envelope, key: str, reason: str, state: KeyState, raw: Any) -> Entry:
        """A stored outcome: DROP only when it is this payload's (same fingerprint, ``raw`` as
        read with the state)."""
        if self.fingerprint is None:
            return Entry(key, Found.APPLIED, Step.DROP, reason, "outcome stored", state.token)
        stored = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw or "")
        if not stored and self.key_only:
            return Entry(key, Found.APPLIED, Step.DROP, reason,
                         "outcome stored without a fingerprint: applied by its key (--key-only)", state.token)
        try:
            ours = request_fingerprint(self.fingerprint(envelope))
        except Exception as exc:  # a user's fingerprint function; nothing proves the payload ran
            return Entry(key, Found.UNPROVEN, Step.LEAVE, reason,
                         f"fingerprint of this message failed: {type(exc).__name__}: {exc}", state.token)
        if stored and stored == ours:
            return Entry(key, Found.APPLIED, Step.DROP, reason, "outcome of this payload stored", state.token)
        if stored:
            log.warning("replay key=%s token=%s left in place: outcome stored for another payload "
                        "(fingerprint %s, this message %s)", key, state.token, stored, ours)
            return Entry(key, Found.CONFLICT, Step.LEAVE, reason,
                         f"outcome stored for a different payload (fingerprint {stored}, this message {ours}): "
                         "this one never ran", state.token)
        return Entry(key, Found.UNPROVEN, Step.LEAVE, reason,
                     "outcome stored without a fingerprint: nothing shows this payload ran "
                     "(--key-only drops it on its key alone)", state.token)


def replay_headers(headers: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The headers of a republished message: all of ``headers`` in order, except that
    ``x-dedupe-attempts`` is dropped (a fresh retry budget) and ``x-dedupe-replayed`` is set to
    one more than before."""
    kept: list[tuple[str, Any]] = []
    previous = 0
    for name, value in headers:
        lowered = name.lower()
        if lowered == ATTEMPTS:
            continue
        if lowered == REPLAYED:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            previous = int(text) if text.strip().isdigit() else previous
            continue
        kept.append((name, value))
    kept.append((REPLAYED, str(previous + 1)))
    return kept


class Pacer:
    """Spaces calls to :meth:`wait` at least ``1/rate`` seconds apart (``rate`` ``None``: no limit)."""

    def __init__(self, rate: float | None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if rate is not None and rate <= 0:
            raise ValueError("rate must be positive")
        self.interval = 1.0 / rate if rate else 0.0
        self.clock = clock
        self.sleep = sleep
        self.next_at = 0.0

    def wait(self) -> None:
        if not self.interval:
            return
        now = self.clock()
        if now < self.next_at:
            self.sleep(self.next_at - now)
            now = self.next_at
        self.next_at = now + self.interval

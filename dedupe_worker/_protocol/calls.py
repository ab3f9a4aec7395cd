"""The I/O-free half of the Redis store: the script calls of each transition, their replies, and
how a round trip of them can fail.

Shared by the transport's stores (:class:`~dedupe_worker._transport.RedisStore`, the asyncio one
and the SQL store's runner), so all send the same calls and read the same replies; only how a
round trip is made differs. The failures (:class:`CallFailed`, :class:`NotDurable`,
:class:`StreamCut`) are raised by the transport and read by the flows: they live here, on the
state machine's side of the seam.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from .._errors import StoreUnavailable, UnreadableRecord
from .._settings import RECORD_FORMATS, record_format_from_env
from .claim import Outcome, State, Stored
from .layout import KeyLayout

__all__ = ["RECORD_FORMATS", "STORED", "WITH_FINGERPRINT", "Call", "CallFailed", "ClaimItem", "ClaimReply", "KeyState",
           "NotDurable", "StoreCalls", "StreamCut", "acquired_in", "block_limit", "key_state",
           "key_state_and_fingerprint", "record_format_from_env"]

#: One claim as ``claim.lua`` takes it: ``(stem, fingerprint, original)`` (the original key when
#: the stem holds its hash, else ``""``).
ClaimItem = tuple[str, str, str]


#: One script call: ``(script name, KEYS, ARGV)``.
Call = tuple[str, Sequence[str], Sequence[Any]]


class CallFailed(StoreUnavailable):
    """A call of a pipelined round trip failed (the error is chained); ``replies`` holds every
    call's reply, the failed ones as exception objects: the calls that answered did run."""

    def __init__(self, message: str, replies: list[Any]) -> None:
        super().__init__(message)
        self.replies = replies


class NotDurable(StoreUnavailable):
    """The writes ran on the primary, but fewer replicas than asked acknowledged them in time
    (``WAIT``): a failover now could lose them. ``replies`` are the scripts' replies."""

    def __init__(self, acked: int, wanted: int, timeout_ms: int, replies: list[Any]) -> None:
        super().__init__(f"not durable: {acked} of {wanted} replica(s) acknowledged within {timeout_ms} ms")
        self.replies = replies


class StreamCut(StoreUnavailable):
    """Redis failed after ``delivered`` replies of a streamed round trip were handed on (the
    transport's ``ScriptRunner.call_streamed``): ``head`` holds the replies read before them; the
    calls after them may have run or not."""

    def __init__(self, message: str, head: list[Any], delivered: int) -> None:
        super().__init__(message)
        self.head = head
        self.delivered = delivered
        #: Filled in by the client: whether each outcome was stored and each claim released, and
        #: how many of the requests were answered (and handed on).
        self.stored: list[bool] = []
        self.released: list[bool] = []
        self.claimed = 0


_OUTCOMES = {int(o.value): o for o in Outcome}
#: The per-key code of a record the scripts cannot read (claim.lua's and inspect.lua's).
_UNREADABLE = int(Outcome.UNREADABLE.value)
#: ``Stored`` by the status as Redis returns it (bytes from hiredis, str when decoding): a dict
#: look-up is several times cheaper than ``Stored(value)`` on this per-message path.
STORED: dict[Any, Stored] = {**{s.value: s for s in Stored}, **{s.value.encode(): s for s in Stored}}
#: The letter ``complete.lua`` takes for each ``Stored`` (``.value`` is an enum property look-up).
_LETTER = {s: s.value for s in Stored}
_PREFIX = {s: s.value.encode() for s in Stored}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _status(letter: Any) -> Stored:
    """The :class:`Stored` of a record's status letter. The scripts check the letters they read
    (a record they cannot read is answered UNREADABLE for its key); one we never write reaching
    here all the same is :class:`UnreadableRecord`, never a message run as new."""
    status = STORED.get(letter)
    if status is None:
        raise UnreadableRecord("", f"status {letter!r} is not one dedupe-worker writes")
    return status


def _claim_reply(code: Any, token: Any, a: Any, b: Any) -> ClaimReply:
    """One key's four values of ``claim.lua``'s reply. UNREADABLE carries what the script found
    (``value``, as text); an unknown code is a script of another release: ``KeyError``."""
    outcome = _OUTCOMES[int(code)]
    if outcome is Outcome.DUPLICATE:
        return ClaimReply(outcome, int(token), _status(a), b)
    if outcome is Outcome.IN_PROGRESS:
        return ClaimReply(outcome, int(token), remaining_ms=int(a))
    if outcome is Outcome.UNREADABLE:
        return ClaimReply(outcome, 0, value=_text(a))
    return ClaimReply(outcome, int(token), reclaimed=bool(a))


class ClaimReply(NamedTuple):
    """One key's answer from ``claim.lua``: the raw material of a :class:`~dedupe_worker.Claim`."""

    outcome: Outcome
    token: int
    #: How the outcome is stored, for a DUPLICATE.
    status: Stored | None = None
    value: bytes | str | None = None
    remaining_ms: int = 0
    #: For ACQUIRED: the key was claimed before (its token counter existed).
    reclaimed: bool = False


@dataclass(frozen=True)
class KeyState:
    """What ``inspect.lua`` saw. ``state`` and ``status`` are ``str`` enums, so they also compare
    equal to their values (``"done"``, ``"c"``)."""

    state: State
    token: int
    status: Stored | None = None
    value: bytes | str | None = None
    remaining_ms: int = 0


def key_state(code: Any, token: Any, a: Any, b: Any) -> KeyState:
    """``inspect.lua``'s reply as a :class:`KeyState`; :class:`UnreadableRecord` (its key ``""``:
    the caller names it) when a record under the key's names is not one we write (code 5)."""
    if int(code) == _UNREADABLE:
        raise UnreadableRecord("", _text(a))
    if int(code) == 2:
        return KeyState(State.DONE, int(token), _status(a), b)
    if int(code) == 3:
        return KeyState(State.IN_PROGRESS, int(token), remaining_ms=int(a))
    return KeyState(State.FREE, int(token))


#: ``inspect.lua``'s ARGV for a reply that also carries the stored outcome's fingerprint.
WITH_FINGERPRINT = ("f",)


def key_state_and_fingerprint(reply: Sequence[Any]) -> tuple[KeyState, Any]:
    """``inspect.lua``'s reply to :data:`WITH_FINGERPRINT`: the :class:`KeyState` and the stored
    outcome's fingerprint (``b""``/``""`` when the claim had none, ``None`` when no outcome is
    stored), read by the script from a result of either record format."""
    return key_state(*reply[:4]), (reply[4] if len(reply) > 4 else None)


def acquired_in(calls: Sequence[Call], replies: Sequence[Any]) -> list[tuple[str, int]]:
    """``(stem, token)`` of every claim that ``calls`` (answered by ``replies``) acquired."""
    taken = []
    for (name, keys, _), reply in zip(calls, replies, strict=True):
        if name == "claim":
            for i in range(0, len(reply), 4):
                if int(reply[i]) == int(Outcome.ACQUIRED.value):
                    taken.append((keys[(i // 4) * 3][: -len(":started")], int(reply[i + 1])))
    return taken


def block_limit(client: Any) -> float:
    """Longest single blocking wait, in seconds, on ``client`` (waits are split into such pieces).

    A blocking wait must end before the client's socket timeout would cut it (redis-py 8 defaults
    to 5 s), and Redis may end it up to ~100 ms late (timeouts run at ``hz`` 10)."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    socket_timeout = kwargs.get("socket_timeout") or kwargs.get("orig_socket_timeout") or 5.0
    return max(0.05, min(2.0, float(socket_timeout) - 0.3))


class _Scripts(Protocol):
    is_cluster: bool


class StoreCalls:
    """Builds the script calls of one transition over a batch (``*_calls``) and reads replies.

    A subclass provides ``scripts`` (whose ``is_cluster`` says how calls are grouped) and the
    round trips.
    """

    scripts: _Scripts
    #: Whether ``atomic(conn)`` records outcomes on the claim's own row (the SQL store): the
    #: engine then confirms a block that joined a transaction it did not open (``committed``).
    outcomes_on_row = False
    #: ``(replicas, timeout_ms)``: claims and completions wait for that many replicas
    #: (``WAIT``, in the same pipeline); ``None``: they do not.
    durability: tuple[int, int] | None = None
    #: The trailing argument of every ``complete.lua`` call: ``("2",)`` writes results in the
    #: compact format 2 (the default), ``()`` in format 1 (see
    #: :func:`~dedupe_worker._settings.record_format_from_env`).
    format_args: tuple[str, ...] = ("2",)

    def __init__(self) -> None:
        self.write_format(record_format_from_env())

    def write_format(self, record_format: int) -> None:
        """Write results in ``record_format`` (1 or 2) from now on; reading takes both always."""
        if record_format not in RECORD_FORMATS:
            raise ValueError(f"record_format must be 1 or 2, not {record_format!r}")
        self.format_args = ("2",) if record_format == 2 else ()

    @property
    def record_format(self) -> int:
        return 2 if self.format_args else 1

    def require_replicas(self, replicas: int, timeout: float) -> None:
        """Make every claim and completion wait for ``replicas`` replicas (0: do not wait)."""
        if replicas and self.scripts.is_cluster:
            raise ValueError("wait_replicas is not supported on Redis Cluster (WAIT has no key to route by); "
                             "use min-replicas-to-write on its primaries")
        self.durability = (replicas, max(1, int(timeout * 1000))) if replicas else None

    def _calls(self, name: str, keys: Sequence[Sequence[str]], shared: Sequence[Any],
               per_item: Sequence[Sequence[Any]]) -> list[Call]:
        """One call over every item (standalone), or one per item (cluster: one slot per call)."""
        if not keys:
            return []
        if not self.scripts.is_cluster:
            flat_keys = [k for ks in keys for k in ks]
            return [(name, flat_keys, [*shared, *(a for args in per_item for a in args)])]
        return [(name, ks, [*shared, *args]) for ks, args in zip(keys, per_item, strict=True)]

    #: ``claim.lua``'s KEYS for one message: the started key and the outcome in both formats.
    claim_keys: Callable[[str], tuple[str, ...]] = staticmethod(KeyLayout.records)
    #: ``complete.lua``'s KEYS for one message: as :attr:`claim_keys`, then the notice list.
    complete_keys: Callable[[str], tuple[str, ...]] = staticmethod(KeyLayout.completion)

    def claim_calls(self, items: Sequence[ClaimItem], lease_ms: int, retention_ms: int) -> list[Call]:
        """``items`` are ``(stem, fingerprint, original_key)``."""
        if len(items) == 1:  # one message (decide, run): the same call, built without the batch's loops
            stem, fingerprint, original = items[0]
            return [("claim", self.claim_keys(stem),
                     (lease_ms, retention_ms, fingerprint, original, *self.format_args))]
        if not items:
            return []
        calls = self._calls("claim", [self.claim_keys(s) for s, _, _ in items],
                            (lease_ms, retention_ms), [(fp, orig) for _, fp, orig in items])
        if self.format_args:  # claim.lua reads the format this worker writes first
            return [(name, keys, [*args, *self.format_args]) for name, keys, args in calls]
        return calls

    def complete_calls(self, items: Sequence[tuple[str, int, Stored, bytes]], result_ttl_ms: int) -> list[Call]:
        """``items`` are ``(stem, token, status, value)``."""
        if len(items) == 1:  # one message: as claim_calls
            stem, token, status, value = items[0]
            return [("complete", self.complete_keys(stem),
                     (result_ttl_ms, token, _LETTER[status], self.record(token, status, value), *self.format_args))]
        if not items:
            return []
        calls = self._calls("complete", [self.complete_keys(s) for s, _, _, _ in items],
                            (result_ttl_ms,), [(token, _LETTER[status], self.record(token, status, value))
                                               for _, token, status, value in items])
        if self.format_args:
            return [(name, keys, [*args, *self.format_args]) for name, keys, args in calls]
        return calls

    def record(self, token: int, status: Stored, value: bytes) -> bytes:
        """What ``complete.lua`` gets as the value: ``value`` itself (record format 1), or the
        compact record (format 2): the status letter, the token as 8 bytes big-endian, ``value``."""
        if not self.format_args:
            return value
        return _PREFIX[status] + token.to_bytes(8, "big") + value

    def release_calls(self, items: Sequence[tuple[str, int]], retention_ms: int) -> list[Call]:
        """``items`` are ``(stem, token)``."""
        return self._calls("release", [(KeyLayout.started(s), KeyLayout.notice(s)) for s, _ in items],
                           (retention_ms,), [(token,) for _, token in items])

    def renew_calls(self, items: Sequence[tuple[str, int]], lease_ms: int, retention_ms: int) -> list[Call]:
        """``items`` are ``(stem, token)``."""
        return self._calls("renew", [(KeyLayout.started(s),) for s, _ in items], (lease_ms, retention_ms),
                           [(token,) for _, token in items])

    @staticmethod
    def claim_replies(flat: Sequence[Any]) -> list[ClaimReply]:
        return [_claim_reply(*flat[i : i + 4]) for i in range(0, len(flat), 4)]

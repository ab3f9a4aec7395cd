"""What an operator wants to know about one key: its state, token, lease, stored result and TTLs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .._errors import UnreadableRecord
from .._protocol import KeyLayout, State, Stored, unpack
from .._sqlstore import SqlPool
from .._sqlstore.operate import row_times
from .._transport import ClaimClient, read_result

__all__ = ["KeyReport", "describe"]

PREVIEW = 120


@dataclass(frozen=True)
class KeyReport:
    """``state`` is ``done``, ``failed``, ``in_progress``, ``free`` or ``unreadable`` (a record under
    the key's names is not one we write: ``result_preview`` says what lies there); TTLs in ms (-2: no record);
    ``result_ttl_ms`` is the TTL of the outcome in whichever record format it is stored."""

    key: str
    state: str
    token: int
    remaining_lease_ms: int
    result_preview: str
    started_ttl_ms: int
    result_ttl_ms: int
    redis_key: str
    original_key: str
    #: The Redis key holding the outcome: the stem itself (record format 2) or ``<stem>:result``
    #: (format 1); ``""`` when none is stored.
    result_key: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _text(stored: bytes | str | None, limit: int) -> str:
    """A stored value as text: decompressed when it was stored compressed (at most ``limit`` bytes)."""
    try:
        data = unpack(stored, limit) if stored else b""
    except Exception as exc:  # a codec this process lacks, or corrupted data: say so, show nothing
        return f"(stored compressed, {len(stored or b'')} bytes, unreadable here: {exc})"
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)


def describe(dedupe: ClaimClient, key: str) -> KeyReport:
    """Read ``key``'s records (``inspect.lua`` for the state, one pipeline for TTLs and ``orig``)."""
    request = dedupe.request(key)
    stem = request.stem
    try:
        state = dedupe.store.inspect(stem)
    except UnreadableRecord as exc:
        return _unreadable(dedupe, key, stem, exc.detail)
    if isinstance(dedupe.store.client, SqlPool):  # one row: its time left on the claim or the outcome
        started_ttl, result_ttl, orig_started = row_times(dedupe.store.client, stem)
        result_key, orig_result = (stem if result_ttl != -2 else ""), b""
    else:
        started_ttl, result_ttl, result_key, orig_started, orig_result = _redis_records(dedupe, stem, state.state)
    name = state.state.value
    if state.state is State.DONE and state.status is Stored.FAILED:
        name = "failed"
    value = _text(state.value, dedupe.decode_limit)
    if state.status is Stored.OMITTED:
        value = "(omitted: larger than max_result_bytes, or not JSON)"
    preview = value if len(value) <= PREVIEW else value[:PREVIEW] + f"... ({len(value)} chars)"
    orig = orig_result or orig_started or b""
    return KeyReport(key, name, state.token, state.remaining_ms, preview, int(started_ttl), int(result_ttl),
                     stem, orig.decode("utf-8", "replace") if isinstance(orig, bytes) else str(orig), result_key)


def _unreadable(dedupe: ClaimClient, key: str, stem: str, detail: str) -> KeyReport:
    """The report of a key whose records ``inspect.lua`` could not read: what lies there and the
    TTLs (``PTTL`` reads a key of any type), nothing parsed."""
    pipe = dedupe.store.client.pipeline(transaction=False)
    for name in KeyLayout.records(stem):
        pipe.pttl(name)
    started_ttl, record_ttl, hash_ttl = (int(ttl) for ttl in pipe.execute())
    result_key = KeyLayout.record(stem) if record_ttl != -2 else KeyLayout.result(stem) if hash_ttl != -2 else ""
    return KeyReport(key, "unreadable", 0, 0, detail, started_ttl, record_ttl if record_ttl != -2 else hash_ttl,
                     stem, "", result_key)


def _redis_records(dedupe: ClaimClient, stem: str, state: State) -> tuple[int, int, str, Any, Any]:
    """The Redis records' TTLs (one pipeline), where the outcome is, and the original key as the
    claim and the outcome keep it."""
    pipe = dedupe.store.client.pipeline(transaction=False)
    pipe.pttl(KeyLayout.started(stem))
    pipe.pttl(KeyLayout.record(stem))
    pipe.pttl(KeyLayout.result(stem))
    pipe.hget(KeyLayout.started(stem), "orig")
    started_ttl, record_ttl, hash_ttl, orig_started = pipe.execute()
    # at most one of the two outcome records exists (-2: this one does not)
    result_key = (KeyLayout.record(stem) if int(record_ttl) != -2
                  else KeyLayout.result(stem) if int(hash_ttl) != -2 else "")
    result_ttl = record_ttl if int(record_ttl) != -2 else hash_ttl
    stored = read_result(dedupe.store.client, stem) if state is State.DONE else None
    orig_result = stored.original if stored is not None else b""
    return int(started_ttl), int(result_ttl), result_key, orig_started, orig_result

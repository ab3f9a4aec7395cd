"""Exceptions raised by dedupe-worker.

One root, so ``except DedupeError`` catches everything this package raises::

    DedupeError
    ├── InvalidKey            empty, missing, too long or unencodable idempotency key
    │   └── MissingKey        the message carries no key where one is required
    ├── UndecodableMessage    the message body cannot be decoded to derive a key
    ├── StoreUnavailable      Redis could not be reached; nothing was run
    │   └── UnreadableRecord  a record under the key's names is not one we write; not run
    ├── EvictionPolicyError   Redis may evict our records (maxmemory-policy); nothing was run
    ├── ResultNotSerializable the handler's value cannot be stored as JSON
    ├── AlreadyApplied        an earlier run of the key committed in the database (``.result``)
    ├── NotCommitted          the transaction ``atomic()`` joined did not commit; released, runs again
    └── ClaimError            the claim protocol answered "no"
        ├── InProgress        another worker holds a live lease (carries ``retry_after``)
        ├── KeyConflict       the key was used before for a different payload
        ├── LeaseLost         our fencing token no longer owns the claim
        └── PreviouslyFailed  a permanent failure is stored for this key
"""

from __future__ import annotations

__all__ = [
    "AlreadyApplied",
    "ClaimError",
    "DedupeError",
    "EvictionPolicyError",
    "InProgress",
    "InvalidKey",
    "KeyConflict",
    "LeaseLost",
    "MissingKey",
    "NotCommitted",
    "PreviouslyFailed",
    "ResultNotSerializable",
    "StoreUnavailable",
    "UndecodableMessage",
    "UnreadableRecord",
]


class DedupeError(Exception):
    """Root of every exception raised by dedupe-worker."""


class InvalidKey(DedupeError, ValueError):
    """The idempotency key is empty or cannot be encoded."""


class MissingKey(InvalidKey):
    """The message carries no idempotency key where the key strategy requires one."""


class UndecodableMessage(DedupeError, ValueError):
    """The message body cannot be decoded (bad JSON, bad encoding, failed validation)."""


class StoreUnavailable(DedupeError):
    """Redis could not be reached or answered with an error; the handler was not run."""


class UnreadableRecord(StoreUnavailable):
    """A record under ``key``'s Redis names is not one dedupe-worker writes (``detail`` says
    what lies there): another program's key of another type under the namespace, a truncated or
    foreign string at the key's stem. Nothing was run and nothing was written for the key; the
    other keys of its batch are decided as usual.

    The engine dead-letters the message as ``unreadable_record``: whether its work was done is not
    known, so it is neither run nor acked. Until the record expires or is removed (``dedupe-worker
    forget KEY --force`` removes whatever lies under the key's names), every message of the key is
    answered so. A subclass of :class:`StoreUnavailable`, as the store cannot be read for this
    key; ``args`` holds ``(key, detail)``, so it survives pickling.
    """

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(key, detail)
        self.key = key
        self.detail = detail

    def __str__(self) -> str:
        where = f" for key {self.key!r}" if self.key else ""
        return f"unreadable record{where}: {self.detail} (dedupe-worker forget --force removes it)"


class EvictionPolicyError(DedupeError, RuntimeError):
    """Redis may evict our records: a primary's ``maxmemory-policy`` is ``allkeys-*`` or
    ``volatile-*`` (every record has a TTL, so both evict them), and an evicted claim or result
    lets a duplicate apply again. Raised before the first claim, so nothing was run.

    ``args`` holds ``[(node, policy), ...]``. Fix: ``maxmemory-policy noeviction`` on every
    primary; or build the client with ``allow_eviction=True`` (``DEDUPE_ALLOW_EVICTION=1``,
    Celery ``dedupe_allow_eviction``) to accept that evicted keys run again.
    """

    def __init__(self, evicting: list[tuple[str, str]]) -> None:
        super().__init__(evicting)
        self.evicting = evicting

    def __str__(self) -> str:
        where = ", ".join(f"{policy} on {node}" for node, policy in self.evicting)
        return (f"Redis may evict dedupe records (maxmemory-policy {where}): an evicted claim or result "
                "lets a duplicate apply again. Set maxmemory-policy noeviction on every primary "
                "(CONFIG SET maxmemory-policy noeviction, and in redis.conf), or pass allow_eviction=True "
                "(DEDUPE_ALLOW_EVICTION=1) to accept that evicted keys run again.")


class ResultNotSerializable(DedupeError, TypeError):
    """The handler's return value cannot be serialised as JSON.

    The handler did run, so the outcome is stored as "completed, body omitted" (duplicates get
    :data:`~dedupe_worker.OMITTED`) rather than released: releasing would let a redelivery apply
    the side effects again.
    """


class AlreadyApplied(DedupeError):
    """An earlier run of ``key`` already committed its effects and outcome in the database
    (:func:`dedupe_worker.sql._atomic`); nothing of this run's ``atomic()`` block commits.

    Raised inside a handler run by the engine, it is not a failure: the engine answers DUPLICATE
    with ``result`` (the committed run's outcome), stores that in Redis and acks. ``token`` is
    the fencing token of the run that committed. ``args`` holds the constructor's arguments, so
    the exception survives pickling.
    """

    def __init__(self, key: str, result: object = None, token: int = 0) -> None:
        super().__init__(key, result, token)
        self.key = key
        self.result = result
        self.token = token

    def __str__(self) -> str:
        return f"{self.key!r} was already applied (committed by fencing token {self.token})"


class NotCommitted(DedupeError):
    """The handler returned, but the transaction its ``atomic()`` block joined (one the block did
    not open) did not commit: the caller rolled it back, or it was still open when the handler
    returned. Nothing of the block is known to have committed, so no outcome is stored: the claim
    is released and a redelivery runs the handler again (the verdict is HANDLER_ERROR, a retry).
    If that transaction commits later after all, the redelivery's ``atomic()`` finds its row.
    """

    def __init__(self, key: str, token: int = 0) -> None:
        super().__init__(key, token)
        self.key = key
        self.token = token

    def __str__(self) -> str:
        return (f"the transaction atomic() joined for {self.key!r} (fencing token {self.token}) did not commit "
                "before the handler returned: released, the message runs again")


class ClaimError(DedupeError):
    """The claim protocol refused: base of the outcomes that are not "go ahead".

    ``args`` holds the constructor's arguments (not the message), so these exceptions survive
    pickling and Celery's JSON result backend, which rebuild them as ``type(*args)``.
    """

    def __init__(self, key: str, message: str, *args: object) -> None:
        super().__init__(key, *args)
        self.key = key
        self.message = message

    def __str__(self) -> str:
        return self.message


class InProgress(ClaimError):
    """Another worker holds a live lease on ``key``; try again after ``retry_after`` seconds.

    The message must be deferred, never dropped: the other worker may still crash.
    """

    def __init__(self, key: str, retry_after: float, owner_token: int = 0) -> None:
        super().__init__(key, f"{key!r} is in progress elsewhere; retry in {retry_after:.3f}s",
                         retry_after, owner_token)
        self.retry_after = retry_after
        self.owner_token = owner_token


class KeyConflict(ClaimError):
    """``key`` was used before with a different payload fingerprint."""

    def __init__(self, key: str) -> None:
        super().__init__(key, f"{key!r} was used before for a different payload")


class LeaseLost(ClaimError):
    """Our fencing token no longer owns the claim: the lease ran out and another worker took it.

    Nothing was written. Side effects the handler made outside Redis may have happened; fence
    them with :func:`dedupe_worker.current_claim` to make them safe.
    """

    def __init__(self, key: str, token: int) -> None:
        super().__init__(key, f"lease on {key!r} lost (fencing token {token})", token)
        self.token = token


class PreviouslyFailed(ClaimError):
    """A permanent failure is stored as the outcome of ``key``; the work is not attempted again."""

    def __init__(self, key: str, error: object) -> None:
        super().__init__(key, f"{key!r} failed permanently before: {error}", error)
        self.error = error

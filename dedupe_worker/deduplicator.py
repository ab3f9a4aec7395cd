"""The :class:`Deduplicator`: claim a key, run the work once, store the outcome."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster

from .claim import OMITTED, Claim, Outcome
from .connection import redis_from_url
from .context import _current
from .errors import (
    ClaimError,
    InProgress,
    InvalidKey,
    KeyConflict,
    LeaseLost,
    PreviouslyFailed,
    ResultNotSerializable,
    StoreUnavailable,
)
from .keys import content_hash, fingerprint_of
from .layout import KeyLayout
from .renewer import LeaseRenewer
from .serialization import JsonSerializer, Serializer
from .settings import DedupeSettings
from .store import ClaimReply, KeyState, RedisStore

__all__ = ["Deduplicator"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Keys longer than this (bytes) are refused outright instead of hashed: almost surely a bug.
KEY_HARD_LIMIT = 8192


class _Holding:
    """:meth:`Deduplicator.hold` as a plain class: it runs once per message, and two nested
    generator-based context managers cost several microseconds there."""

    __slots__ = ("claim", "renewer", "reset")

    def __init__(self, renewer: LeaseRenewer, claim: Claim) -> None:
        self.renewer = renewer
        self.claim = claim

    def __enter__(self) -> Claim:
        self.renewer.track(self.claim.stem, self.claim.token)
        self.reset = _current.set(self.claim)
        return self.claim

    def __exit__(self, *exc_info: object) -> None:
        _current.reset(self.reset)
        self.renewer.untrack(self.claim.stem, self.claim.token)


class Deduplicator:
    """Makes at-least-once delivery apply once, with Redis as the store of claims and outcomes.

    What is guaranteed: while a key's records live (``result_ttl`` after completion), the work for
    that key is *completed* at most once; a claimant whose lease ran out can never store an outcome
    over its successor's (fencing tokens strictly increase per key); a failure of Redis never runs
    the handler unless ``fail_open`` is set.

    What is not: a worker that crashes mid-handler leaves its side effects half done and the claim
    held until the lease runs out; the next delivery then runs the handler again (make effects
    idempotent or fence them with :func:`~dedupe_worker.current_claim`). After a Redis failover with
    asynchronous replication a just-written claim or result can be lost. After ``result_ttl`` a
    redelivery is treated as new.

    :param redis_client: a ``redis.Redis`` or ``redis.cluster.RedisCluster``.
    :param namespace: prefix of every key written.
    :param lease: seconds a claim is held before others may take it; renewed while work runs.
    :param result_ttl: seconds an outcome is kept.
    :param retention: seconds the token counter outlives a lease (default ``result_ttl``).
    :param max_key_length: longer keys are stored as their sha256.
    :param max_result_bytes: larger results are stored as "completed, body omitted".
    :param permanent_errors: exception types stored as a failed outcome instead of released.
    :param fail_open: when Redis is down, run the work anyway (logged as an error).
    :param renew_interval: seconds between lease renewals (default a third of ``lease``).
    :param serializer: how results are stored (default JSON; never pickle).
    """

    def __init__(
        self,
        redis_client: redis.Redis | RedisCluster,
        *,
        namespace: str = "dedupe",
        lease: float = 30.0,
        result_ttl: float = 86400.0,
        retention: float | None = None,
        max_key_length: int = 200,
        max_result_bytes: int = 1_000_000,
        permanent_errors: tuple[type[BaseException], ...] = (),
        fail_open: bool = False,
        renew_interval: float | None = None,
        serializer: Serializer | None = None,
    ) -> None:
        if lease <= 0 or result_ttl <= 0:
            raise ValueError("lease and result_ttl must be positive")
        self.layout = KeyLayout(namespace, max_key_length)
        self.store = RedisStore(redis_client, self.layout)
        self.lease = lease
        self.result_ttl = result_ttl
        self.max_result_bytes = max_result_bytes
        self.permanent_errors = permanent_errors
        self.fail_open = fail_open
        self.serializer: Serializer = serializer or JsonSerializer()
        self._lease_ms = max(1, int(lease * 1000))
        self._result_ttl_ms = max(1, int(result_ttl * 1000))
        self._retention_ms = max(self._lease_ms, int((retention or result_ttl) * 1000))
        self.renewer = LeaseRenewer(
            self.store, self._lease_ms, self._retention_ms, renew_interval or lease / 3
        )

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Deduplicator:
        """Build from a Redis URL; ``redis+cluster://`` or ``?cluster=1`` selects Redis Cluster."""
        return cls(redis_from_url(url), **options)

    @classmethod
    def from_settings(cls, settings: DedupeSettings | None = None, **options: Any) -> Deduplicator:
        """Build from :class:`DedupeSettings` (read from ``DEDUPE_*`` when not given)."""
        s = settings or DedupeSettings()
        base: dict[str, Any] = dict(
            namespace=s.namespace,
            lease=s.lease,
            result_ttl=s.result_ttl,
            max_key_length=s.max_key_length,
            max_result_bytes=s.max_result_bytes,
            fail_open=s.fail_open,
        )
        return cls.from_url(s.redis_url, **{**base, **options})

    def close(self) -> None:
        """Stop the lease renewer."""
        self.renewer.close()

    # -- claims ---------------------------------------------------------------------------------

    def check_key(self, key: str | bytes) -> tuple[str, str]:
        """Return ``(stored, original)`` as :meth:`KeyLayout.stored_key`; raise :class:`InvalidKey`
        for an empty key, one that is not str/bytes, or one longer than ``KEY_HARD_LIMIT``."""
        if isinstance(key, (str, bytes)) and len(key) > KEY_HARD_LIMIT:
            raise InvalidKey(f"idempotency key is {len(key)} long; the limit is {KEY_HARD_LIMIT}")
        return self.layout.stored_key(key)

    def _request(self, key: str | bytes, fingerprint: Any) -> tuple[str, str, str, str]:
        stored, original = self.check_key(key)
        text = key if isinstance(key, str) else key.decode("utf-8", "backslashreplace")
        if fingerprint is None or fingerprint == "":
            fp = ""
        elif isinstance(fingerprint, str) and len(fingerprint) <= 64:
            fp = fingerprint
        elif isinstance(fingerprint, (str, bytes)):
            fp = content_hash(fingerprint)
        else:
            fp = fingerprint_of(fingerprint)
        return text, self.layout.stem(stored), fp, original

    def _claim(self, key: str, stem: str, fp: str, reply: ClaimReply) -> Claim:
        outcome = reply.outcome
        if outcome is Outcome.DUPLICATE:
            if reply.status == "f":
                error = self._stored(key, reply)
                return Claim(key, outcome, reply.token, failed=True, error=error, stem=stem, fingerprint=fp)
            result = OMITTED if reply.status == "o" else self._stored(key, reply)
            return Claim(key, outcome, reply.token, result=result, stem=stem, fingerprint=fp)
        if outcome is Outcome.IN_PROGRESS:
            return Claim(key, outcome, reply.token, retry_after=reply.remaining_ms / 1000,
                         stem=stem, fingerprint=fp)
        return Claim(key, outcome, reply.token, stem=stem, fingerprint=fp)

    def _stored(self, key: str, reply: ClaimReply) -> Any:
        """Decode a stored value. One that does not parse (written by something else, or
        corrupted) still proves the work was done: it is answered as :data:`OMITTED`, never
        executed or unpickled."""
        try:
            return self.serializer.loads(reply.value or b"null")
        except Exception as exc:
            log.error("stored value of key=%s token=%s does not decode, answering OMITTED: %s",
                      key, reply.token, exc)
            return OMITTED

    def begin(self, key: str | bytes, *, fingerprint: Any = None) -> Claim:
        """Try to claim ``key``: one round trip, one :class:`Claim` with one :class:`Outcome`.

        ``fingerprint`` identifies the payload (a short string, or any JSON-like value that is
        hashed); with it, the same key seen with a different payload answers CONFLICT. Raises
        :class:`InvalidKey` and :class:`StoreUnavailable`.
        """
        text, stem, fp, original = self._request(key, fingerprint)
        reply = self.store.claim_one(stem, fp, original, self._lease_ms, self._retention_ms)
        return self._claim(text, stem, fp, reply)

    def begin_many(
        self, keys: Sequence[str | bytes], *, fingerprints: Sequence[Any] | None = None
    ) -> list[Claim]:
        """Claim a batch of keys in one round trip; answers come in the order of ``keys``.

        A key that appears twice in one batch is ACQUIRED once; its later copies answer
        IN_PROGRESS (held by our own token) until the first is completed or released.
        """
        fps = fingerprints if fingerprints is not None else [None] * len(keys)
        if len(fps) != len(keys):
            raise ValueError("fingerprints must match keys one to one")
        requests = [self._request(k, f) for k, f in zip(keys, fps, strict=True)]
        replies = self.store.claim(
            [(stem, fp, orig) for _, stem, fp, orig in requests], self._lease_ms, self._retention_ms
        )
        claims = [self._claim(key, stem, fp, r) for (key, stem, fp, _), r in zip(requests, replies, strict=True)]
        if log.isEnabledFor(logging.DEBUG):
            for claim in claims:
                log.debug("claim key=%s token=%s outcome=%s", claim.key, claim.token, claim.outcome.name)
        return claims

    def _encode(self, claim: Claim, value: Any) -> tuple[str, bytes, ResultNotSerializable | None]:
        try:
            data = self.serializer.dumps(value)
        except ResultNotSerializable as exc:
            log.error("result of key=%s token=%s not serialisable, stored as omitted: %s",
                      claim.key, claim.token, exc)
            return "o", b"", exc
        if len(data) > self.max_result_bytes:
            log.info("result of key=%s token=%s is %d bytes, stored as omitted",
                     claim.key, claim.token, len(data))
            return "o", b"", None
        return "c", data, None

    def complete(self, claim: Claim, value: Any) -> None:
        """Store ``value`` as the outcome, only if ``claim``'s token still owns the key.

        Raises :class:`LeaseLost` (nothing written) when fenced off, and
        :class:`ResultNotSerializable` after storing "completed, body omitted" for a value JSON
        cannot hold.
        """
        status, data, problem = self._encode(claim, value)
        if self.renewer.is_lost(claim.stem, claim.token) or not self.store.complete_one(
            claim.stem, claim.token, status, data, self._result_ttl_ms
        ):
            raise LeaseLost(claim.key, claim.token)
        if problem is not None:
            raise problem

    def complete_many(self, items: Sequence[tuple[Claim, Any]]) -> list[bool]:
        """Store outcomes for a batch in one round trip; ``False`` where the lease was lost.

        Values that cannot be serialised are stored as omitted (and logged), as in :meth:`complete`.
        """
        return [not isinstance(problem, LeaseLost) for problem in self.complete_each(items)]

    def complete_each(self, items: Sequence[tuple[Claim, Any]]) -> list[ClaimError | ResultNotSerializable | None]:
        """:meth:`complete_many`, telling per item what :meth:`complete` would have raised: ``None``
        when stored, :class:`LeaseLost` when nothing was written, :class:`ResultNotSerializable`
        when the outcome was stored as omitted."""
        rows, problems = [], []
        for claim, value in items:
            status, data, problem = self._encode(claim, value)
            rows.append((claim.stem, claim.token, status, data))
            problems.append(problem)
        stored = self.store.complete(rows, self._result_ttl_ms)
        return [
            problem if ok and not self.renewer.is_lost(c.stem, c.token) else LeaseLost(c.key, c.token)
            for (c, _), ok, problem in zip(items, stored, problems, strict=True)
        ]

    def fail(self, claim: Claim, error: BaseException | str) -> None:
        """Store a permanent failure as the outcome: later deliveries answer DUPLICATE with
        ``failed=True`` instead of running again. Raises :class:`LeaseLost` when fenced off."""
        detail = (
            {"type": f"{type(error).__module__}.{type(error).__qualname__}", "message": str(error)}
            if isinstance(error, BaseException)
            else {"type": "error", "message": str(error)}
        )
        data = self.serializer.dumps(detail)
        if not self.store.complete([(claim.stem, claim.token, "f", data)], self._result_ttl_ms)[0]:
            raise LeaseLost(claim.key, claim.token)
        log.warning("stored permanent failure key=%s token=%s: %s", claim.key, claim.token, detail)

    def release(self, claim: Claim) -> bool:
        """Give the claim up after a retryable failure so the next delivery may claim again.
        ``False`` when the token no longer owned it (nothing changed)."""
        return self.release_many([claim])[0]

    def release_many(self, claims: Sequence[Claim]) -> list[bool]:
        """:meth:`release` for a batch, in one round trip."""
        return self.store.release([(c.stem, c.token) for c in claims], self._retention_ms)

    def renew(self, claim: Claim) -> bool:
        """Extend the lease by ``lease`` from now; ``False`` when the token no longer owns it."""
        return self.store.renew([(claim.stem, claim.token)], self._lease_ms, self._retention_ms)[0]

    def status(self, key: str | bytes) -> KeyState:
        """Look at a key's records without changing them (for replay and inspection)."""
        _, stem, _, _ = self._request(key, None)
        return self.store.inspect(stem)

    # -- running work ---------------------------------------------------------------------------

    @contextmanager
    def keep_leases(self, claims: Sequence[Claim]) -> Iterator[None]:
        """While inside, the shared renewer keeps the leases of ``claims`` from running out."""
        for claim in claims:
            self.renewer.track(claim.stem, claim.token)
        try:
            yield
        finally:
            for claim in claims:
                self.renewer.untrack(claim.stem, claim.token)

    def hold(self, claim: Claim) -> _Holding:
        """While inside: the lease is renewed and ``current_claim()`` is ``claim``."""
        return _Holding(self.renewer, claim)

    def apply(self, claim: Claim, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` for an ACQUIRED ``claim`` and store its outcome.

        If ``fn`` raises, the claim is released (or, for ``permanent_errors``, the failure is
        stored) and the exception propagates. If the process dies inside ``fn``, the claim stays
        held until the lease runs out; then another delivery may run ``fn`` again.
        """
        with self.hold(claim):
            try:
                value = fn(*args, **kwargs)
            except BaseException as exc:
                self.settle_failure(claim, exc)
                raise
            self.complete(claim, value)
        return value

    def settle_failure(self, claim: Claim, exc: BaseException) -> None:
        """After ``fn`` raised ``exc``: store a permanent failure or release the claim. Never raises:
        if Redis is down the lease simply runs out."""
        try:
            if isinstance(exc, self.permanent_errors):
                self.fail(claim, exc)
            elif not self.release(claim):
                log.warning("release found lease lost key=%s token=%s", claim.key, claim.token)
        except Exception as inner:  # Redis down: the lease will run out by itself
            log.warning("could not settle key=%s token=%s after %r: %s", claim.key, claim.token, exc, inner)

    def run(
        self, key: str | bytes, fn: Callable[..., T], /, *args: Any, fingerprint: Any = None, **kwargs: Any
    ) -> T:
        """Claim ``key``, run ``fn(*args, **kwargs)`` once, store and return its value.

        A duplicate returns the stored value without calling ``fn``. Raises :class:`InProgress`
        (with ``retry_after``), :class:`KeyConflict`, :class:`PreviouslyFailed`,
        :class:`LeaseLost` (``fn`` ran but a successor owns the key) and :class:`StoreUnavailable`
        (``fn`` not run, unless ``fail_open``).
        """
        try:
            claim = self.begin(key, fingerprint=fingerprint)
        except StoreUnavailable:
            if not self.fail_open:
                raise
            log.error("Redis unavailable; fail_open runs key=%s WITHOUT deduplication", key)
            return fn(*args, **kwargs)
        return self.apply(claim, fn, *args, **kwargs) if claim.acquired else self.answer(claim)

    @staticmethod
    def answer(claim: Claim) -> Any:
        """The stored value of a DUPLICATE; raises for IN_PROGRESS, CONFLICT and stored failures."""
        if claim.outcome is Outcome.DUPLICATE:
            if claim.failed:
                raise PreviouslyFailed(claim.key, claim.error)
            return claim.result
        if claim.outcome is Outcome.IN_PROGRESS:
            raise InProgress(claim.key, claim.retry_after, claim.token)
        if claim.outcome is Outcome.CONFLICT:
            raise KeyConflict(claim.key)
        raise ValueError(f"claim on {claim.key!r} was acquired; there is nothing stored to answer")

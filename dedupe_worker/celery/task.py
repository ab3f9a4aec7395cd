"""``IdempotentTask``: a Celery task base class whose body is applied once per idempotency key.

Usage::

    @app.task(base=IdempotentTask, bind=True,
              idempotency_key=lambda order_id, **_: f"charge:{order_id}")
    def charge(self, order_id, amount):
        token = self.request.fencing_token      # or dedupe_worker.current_claim().token
        ...

How each verdict of :func:`dedupe_worker.handling.decide` becomes a Celery outcome:

===================  ======================================================================
verdict              the task ...
===================  ======================================================================
applied              returns the body's value (also stored in Redis for later duplicates)
duplicate            returns the stored value without running the body (``on_duplicate``)
previously_failed    fails with :class:`~dedupe_worker.PreviouslyFailed`, not retried
in_progress,         is re-sent by ``self.retry(countdown=...)`` with backoff and jitter, at
lease_lost,          the earliest when the other worker's lease can have ended; a deferral
store_unavailable    does not count against ``max_retries`` and is repeated until it runs
handler_error        the claim is released and the body's exception re-raised, so
                     ``autoretry_for`` / ``self.retry()`` work and the retry claims again
conflict,            fails with the error (:class:`~dedupe_worker.KeyConflict`,
invalid_key,         :class:`~dedupe_worker.InvalidKey`, the permanent error, ...), never
permanent_failure,   retried
unserializable_result
===================  ======================================================================
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, NoReturn

import celery
from celery._state import _task_stack
from celery.exceptions import Reject

from ..backoff import backoff
from ..deduplicator import Deduplicator
from ..engine import Action, Decision, Reason, decide, poison
from ..engine.context import current_claim
from ..errors import DedupeError, InProgress, InvalidKey, PreviouslyFailed
from ..protocol.claim import Claim
from .options import bind_arguments, deduplicator_for, derive_fingerprint, derive_key

__all__ = ["DEFERRALS_HEADER", "IdempotentTask"]

log = logging.getLogger(__name__)

#: Message header counting how often a task was deferred (drives the backoff, not max_retries).
DEFERRALS_HEADER = "dedupe_deferrals"


class IdempotentTask(celery.Task):  # type: ignore[misc]
    """A task whose body runs to completion at most once per idempotency key (see module doc).

    **Deferral without spending retries.** Celery's ``retry()`` re-sends the message with
    ``retries + 1`` and refuses once that exceeds ``max_retries``. A deferral ("another worker
    holds the key", "Redis is down") is not a failed attempt, so :meth:`defer` lowers
    ``request.retries`` by one around its ``self.retry()`` call: the re-sent message carries the
    same ``retries`` as the one deferred, the ``max_retries`` check cannot trip, and the budget is
    left whole for real failures. The number of deferrals travels in the ``dedupe_deferrals``
    header and only grows the backoff (capped at ``defer_cap``); a deferred task is never dropped.

    **Crash safety.** ``acks_late`` and ``reject_on_worker_lost`` are on by default: the message
    is acknowledged only after the body finished, and when a pool process dies mid-task (SIGKILL,
    OOM, hard time limit) the message is requeued instead of being marked failed. The dead
    process's claim stays held until its lease ends (it is no longer renewed), so the redelivery is
    deferred until then and runs the body once more. Effects the dead process made before dying
    are not undone: fence them with ``self.request.fencing_token``. Turning either option off
    trades that redelivery for the risk of losing the task.

    **Not guaranteed.** A body that finishes its effects but dies before the outcome is stored is
    run again after the lease. After ``dedupe_result_ttl`` a resend counts as new. Duplicates
    return the value as JSON gave it back (tuples become lists; :data:`~dedupe_worker.OMITTED`
    when it was larger than ``dedupe_max_result_bytes``). Exception types listed in
    ``permanent_errors`` must not also be in ``autoretry_for`` (Celery retries them first).
    In eager mode and on direct calls there is no broker to defer to: the task raises
    :class:`~dedupe_worker.InProgress` / :class:`~dedupe_worker.StoreUnavailable` instead.
    """

    #: The idempotency key: a callable receiving the task's arguments as keywords by parameter
    #: name (defaults applied), or a format string over them (``"charge:{order_id}"``).
    #: :const:`None`: the ``idempotency_header`` message header, else a hash of the task name
    #: and its arguments.
    idempotency_key: str | Callable[..., Any] | None = None

    #: Message header read for the key (``apply_async(headers={"idempotency_key": ...})``) when
    #: ``idempotency_key`` is not set.
    idempotency_header: str = "idempotency_key"

    #: What identifies the payload behind a key: a callable over the arguments (like
    #: ``idempotency_key``), :const:`False` for no check, :const:`None` for a hash of the task name
    #: and its arguments. The same key seen with another fingerprint fails with ``KeyConflict``.
    idempotency_fingerprint: Callable[..., Any] | bool | None = None

    #: Redis URL of the claim store. :const:`None`: ``app.conf.dedupe_redis_url``, else
    #: ``DEDUPE_REDIS_URL``.
    dedupe_redis_url: str | None = None

    #: Prefix of the Redis keys. :const:`None`: ``app.conf.dedupe_namespace``, else
    #: ``DEDUPE_NAMESPACE``.
    dedupe_namespace: str | None = None

    #: Seconds a claim survives without renewal (renewed every third of it while the body runs):
    #: how long a crashed worker's task waits before it runs again. :const:`None`:
    #: ``app.conf.dedupe_lease``, else ``DEDUPE_LEASE``.
    dedupe_lease: float | None = None

    #: Seconds a stored result protects against duplicates. :const:`None`:
    #: ``app.conf.dedupe_result_ttl``, else ``DEDUPE_RESULT_TTL``.
    dedupe_result_ttl: float | None = None

    #: Results larger than this many bytes are stored as "done, body omitted". :const:`None`:
    #: ``app.conf.dedupe_max_result_bytes``, else ``DEDUPE_MAX_RESULT_BYTES``.
    dedupe_max_result_bytes: int | None = None

    #: Run the body without deduplication when Redis is down (logged as an error). :const:`None`:
    #: ``app.conf.dedupe_fail_open``, else ``DEDUPE_FAIL_OPEN`` (off: the task is deferred).
    dedupe_fail_open: bool | None = None

    #: Exception types (or dotted names) stored as the key's outcome instead of released:
    #: later sends fail with ``PreviouslyFailed`` without running. :const:`None`:
    #: ``app.conf.dedupe_permanent_errors``, else none.
    permanent_errors: tuple[type[BaseException] | str, ...] | None = None

    #: Backoff of deferrals: full jitter over ``defer_base * 2 ** n`` seconds, capped at
    #: ``defer_cap``, added to the other worker's remaining lease.
    defer_base: float = 0.5
    defer_cap: float = 30.0

    #: Acknowledge after the body ran, so a crash redelivers (see the class docstring).
    acks_late = True

    #: Requeue when the pool process dies mid-task, instead of marking it failed.
    reject_on_worker_lost = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # app.task(idempotency_key=lambda ...) puts a plain function in the class dict, which
        # would otherwise bind the task instance as its first argument.
        for name in ("idempotency_key", "idempotency_fingerprint"):
            value = cls.__dict__.get(name)
            if inspect.isfunction(value):
                setattr(cls, name, staticmethod(value))

    # -- hooks ----------------------------------------------------------------------------------

    def on_duplicate(self, decision: Decision) -> None:
        """Called when the body did not run because an outcome is stored for the key."""

    def on_defer(self, decision: Decision, countdown: float) -> None:
        """Called before the task is re-sent to run again in ``countdown`` seconds."""

    # -- machinery ------------------------------------------------------------------------------

    @functools.cached_property
    def deduplicator(self) -> Deduplicator:
        """The :class:`Deduplicator` this task claims keys with, from the settings as they are on
        first use (later changes to ``app.conf`` or the environment are not seen)."""
        return deduplicator_for(self)

    @functools.cached_property
    def _run_signature(self) -> inspect.Signature | None:
        try:
            return inspect.signature(self.run)
        except (TypeError, ValueError):
            return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request_stack.top is not None:  # worker or apply(): the tracer pushed our request
            return self.run_once(args, kwargs)
        _task_stack.push(self)  # called directly, like a function: as celery.Task.__call__ does
        self.push_request(args=args, kwargs=kwargs)
        try:
            return self.run_once(args, kwargs)
        finally:
            self.pop_request()
            _task_stack.pop()

    def run_once(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Derive the key, let :func:`decide` claim it and run the body, and act on its verdict."""
        request = self.request
        named = bind_arguments(self._run_signature, args, kwargs)
        try:
            key = derive_key(self.name, self.idempotency_key, self._header(request, self.idempotency_header),
                             named, args, kwargs)
            fingerprint = derive_fingerprint(self.name, self.idempotency_fingerprint, named, args, kwargs)
        except InvalidKey as exc:
            return self._settle(poison(exc), "")
        except Exception as exc:  # a fingerprint function that fails on this input
            return self._settle(poison(InvalidKey(f"idempotency_fingerprint failed: {exc!r}")), "")
        request.dedupe_key = key
        request.fencing_token = None
        body = functools.partial(self._body, request, args, kwargs)
        return self._settle(decide(self.deduplicator, key, body, fingerprint=fingerprint), key)

    def _body(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        claim = current_claim()
        request.fencing_token = claim.token if claim is not None else None
        log.debug("running task=%s id=%s key=%s token=%s", self.name, request.id, request.dedupe_key,
                  request.fencing_token)
        return self.run(*args, **kwargs)

    def _settle(self, decision: Decision, key: str) -> Any:
        token = decision.claim.token if decision.claim is not None else None
        action = decision.action
        if decision.reason is Reason.APPLIED:
            return decision.value
        if action is Action.ACK:
            log.info("duplicate task=%s id=%s key=%s token=%s reason=%s", self.name, self.request.id, key,
                     token, decision.reason.value)
            self.on_duplicate(decision)
            if decision.reason is Reason.PREVIOUSLY_FAILED:
                raise PreviouslyFailed(key, decision.claim.error if decision.claim else None)
            return decision.value
        if action is Action.DEFER:
            self.defer(decision, key)
        if action is Action.RETRY:
            log.info("body failed, claim released task=%s id=%s key=%s token=%s: %s", self.name,
                     self.request.id, key, token, decision.detail)
        else:
            log.error("failing without retry task=%s id=%s key=%s token=%s reason=%s: %s", self.name,
                      self.request.id, key, token, decision.reason.value, decision.detail)
        raise decision.error or DedupeError(f"{key!r}: {decision.reason.value}")

    def defer(self, decision: Decision, key: str) -> NoReturn:
        """Re-send this task to run later, without spending ``max_retries`` (see class doc)."""
        request = self.request
        deferrals = int(self._header(request, DEFERRALS_HEADER) or 0) + 1
        countdown = backoff(deferrals, base=self.defer_base, cap=self.defer_cap, floor=decision.retry_after)
        claim: Claim | None = decision.claim
        log.info("deferring task=%s id=%s key=%s token=%s reason=%s by %.3fs (deferral %d)", self.name,
                 request.id, key, claim.token if claim else None, decision.reason.value, countdown, deferrals)
        if request.is_eager or request.called_directly:
            error = decision.error
            if error is None and claim is not None:
                error = InProgress(key, decision.retry_after, claim.token)
            raise error or DedupeError(f"{key!r} deferred ({decision.reason.value})")
        self.on_defer(decision, countdown)
        request.retries -= 1  # retry() sends retries + 1: the re-sent message keeps our count
        try:
            raise self.retry(countdown=countdown, headers={DEFERRALS_HEADER: deferrals})
        except Reject as exc:
            # retry() could not publish the copy and would drop the message: requeue it instead.
            log.warning("re-send failed, requeueing task=%s id=%s key=%s: %s", self.name, request.id, key,
                        exc.reason)
            raise Reject(exc.reason, requeue=True) from exc
        finally:
            request.retries += 1

    def signature_from_request(self, request: Any = None, args: Any = None, kwargs: Any = None,
                               queue: Any = None, **extra: Any) -> Any:
        """As Celery's, but the re-sent message keeps the headers that identify it (the key
        header) on top of those given, so a retry or a deferral claims the same key."""
        request = self.request if request is None else request
        kept = request.as_execution_options().get("headers") or {}
        value = self._header(request, self.idempotency_header)
        if value is not None:
            kept[self.idempotency_header] = value
        extra["headers"] = {**kept, **(extra.get("headers") or {})}
        return super().signature_from_request(request, args, kwargs, queue=queue, **extra)

    @staticmethod
    def _header(request: Any, name: str) -> Any:
        """A message header: custom headers are request attributes on a worker, and in
        ``request.headers`` under ``apply()``."""
        value = getattr(request, name, None)
        if value is None:
            value = (getattr(request, "headers", None) or {}).get(name)
        return value

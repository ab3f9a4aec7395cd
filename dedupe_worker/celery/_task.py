"""``IdempotentTask``: a Celery task base class whose body is applied once per idempotency key.

Usage::

    @app.task(base=IdempotentTask, bind=True,
              idempotency_key=lambda order_id, **_: f"charge:{order_id}")
    def charge(self, order_id, amount):
        token = self.request.fencing_token      # or dedupe_worker.current_claim().token
        ...

How each verdict of the engine (:func:`dedupe_worker.decide`) becomes a Celery outcome
(the value or exception is :func:`dedupe_worker._engine.outcome`'s, as for ``run()``):

===================  ======================================================================
verdict              the task ...
===================  ======================================================================
applied              returns the body's value (also stored in Redis for later duplicates)
duplicate            returns the stored value without running the body (``on_duplicate``)
previously_failed    fails with :class:`~dedupe_worker.PreviouslyFailed`, not retried
in_progress         first waits up to ``defer_wait`` on the key: returns the holder's stored
                     value as soon as it is stored, or runs the body if the holder released
                     the key or its lease ran out; then, as below
lease_lost,          is re-sent by ``self.retry(countdown=...)`` with a backoff that starts at
store_unavailable    tens of ms and never outlasts the holder's lease; a deferral does not
                     count against ``max_retries`` and is repeated until it runs (so is a task
                     that meets an evicting Redis on a worker: the worker checked at start, see
                     :mod:`.startup`; called eagerly, it raises ``EvictionPolicyError``)
handler_error        the claim is released; an exception in ``autoretry_for``, or a
                     ``self.retry()`` in the body, is retried by Celery as usual; any other
                     exception is retried after ``retry_delay`` until ``max_attempts``
                     runs, then the task fails with it
conflict,            fails with the error (:class:`~dedupe_worker.KeyConflict`,
invalid_key,         :class:`~dedupe_worker.InvalidKey`, the permanent error,
permanent_failure,   :class:`~dedupe_worker.UnreadableRecord`, ...), never retried
unserializable_result,
unreadable_record
===================  ======================================================================
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import celery
from celery._state import _task_stack
from celery.exceptions import Reject, Retry

from .._deduplicator import Deduplicator
from .._engine import (
    ACKED,
    TTL_HEADER,
    Acted,
    ConsumerOptions,
    Decision,
    Done,
    Hooks,
    Identify,
    Reason,
    RetryPolicy,
    decide,
    dispatch,
    outcome,
    parse_ttl,
)
from .._errors import EvictionPolicyError
from .._protocol import current_claim, ttl_ms
from ._duplicates import log_duplicate
from ._options import (
    AppSettings,
    Call,
    call_fingerprint,
    call_key,
    consumer_options,
    deduplicator_for,
    deprecated_names,
)
from ._send import send_once

__all__ = ["DEFERRALS_HEADER", "IdempotentTask"]

log = logging.getLogger(__name__)

#: Message header counting how often a task was deferred (drives the backoff, not max_retries).
DEFERRALS_HEADER = "dedupe_deferrals"


class IdempotentTask(celery.Task, Hooks, RetryPolicy):  # type: ignore[misc]
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

    #: URL of the claim store, Redis or a database (``postgresql://``, ``mysql://``: the SQL
    #: store); wins over ``dedupe_redis_url``. :const:`None`: ``app.conf.dedupe_store_url``, else
    #: ``DEDUPE_STORE_URL``.
    dedupe_store_url: str | None = None

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

    #: Results larger than this many bytes are stored compressed. :const:`None`:
    #: ``app.conf.dedupe_compress_above``, else ``DEDUPE_COMPRESS_ABOVE`` (1024).
    dedupe_compress_above: int | None = None

    #: ``"auto"`` (zstd where installed, else zlib), ``"zstd"`` or ``"zlib"``. :const:`None`:
    #: ``app.conf.dedupe_compression``, else ``DEDUPE_COMPRESSION``.
    dedupe_compression: str | None = None

    #: Run the body without deduplication when Redis is down (logged as an error). :const:`None`:
    #: ``app.conf.dedupe_fail_open``, else ``DEDUPE_FAIL_OPEN`` (off: the task is deferred).
    dedupe_fail_open: bool | None = None

    #: Exception types (or dotted names) stored as the key's outcome instead of released:
    #: later sends fail with ``PreviouslyFailed`` without running. :const:`None`:
    #: ``app.conf.dedupe_permanent_errors``, else none.
    permanent_errors: tuple[type[BaseException] | str, ...] | None = None

    #: Check the key before publishing (``delay``, ``apply_async``, signatures, chains, beat) and
    #: skip the send when its work is done, queued or running: ``apply_async`` then returns the
    #: stored outcome or the ``AsyncResult`` of the task already sent (see
    #: :mod:`dedupe_worker.celery._send`). Also per call: ``apply_async(..., dedupe_on_send=True)``.
    #: :const:`None`: ``app.conf.dedupe_on_send``, else off.
    dedupe_on_send: bool | None = None

    #: Seconds a send's mark answers "queued" to later sends (a countdown or eta is added): the
    #: longest a lost message or a killed worker keeps the same work from being sent again.
    #: :const:`None`: ``app.conf.dedupe_send_ttl``, else ``dedupe_lease`` plus 60 s of queue time.
    dedupe_send_ttl: float | None = None

    #: Seconds this task's outcomes are kept, instead of ``dedupe_result_ttl`` (the lease is
    #: unchanged). Per call: ``apply_async(..., dedupe_ttl=60)``, or the ``x-dedupe-ttl`` message
    #: header, which wins over this. A header value that is not a positive number fails the task
    #: (``UndecodableMessage``, not retried). :const:`None`: ``app.conf.dedupe_ttl``, else
    #: ``dedupe_result_ttl``.
    dedupe_ttl: float | None = None

    #: The options every integration shares, whole (:class:`~dedupe_worker.ConsumerOptions`);
    #: each ``dedupe_<name>`` below sets one on top. :const:`None`: ``app.conf.dedupe_options``,
    #: else the defaults.
    dedupe_options: ConsumerOptions | None = None

    #: The message header holding a call's ttl in seconds (``""``: not read). :const:`None`:
    #: ``app.conf.dedupe_ttl_header``, else ``x-dedupe-ttl``.
    dedupe_ttl_header: str | None = None

    #: Handler attempts, and their backoff, before the task fails for good; set
    #: ``dedupe_max_attempts = 1`` to fail at once on an exception, as a plain Celery task does.
    #: :const:`None` for each: ``app.conf.dedupe_<name>``, else the shared default
    #: (:class:`~dedupe_worker.ConsumerOptions`). Their old names (``max_attempts``, ...) still
    #: work for one release, with a ``DeprecationWarning``.
    dedupe_max_attempts: int | None = None
    dedupe_retry_base: float | None = None
    dedupe_retry_cap: float | None = None

    #: Backoff of deferrals, and how long a copy of a task in flight waits on the key on a worker
    #: (the pool slot stays busy meanwhile) to return the holder's stored result before it is
    #: re-sent with a short backoff. :const:`None` for each: as above.
    dedupe_defer_base: float | None = None
    dedupe_defer_cap: float | None = None
    dedupe_defer_wait: float | None = None

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
        deprecated_names(cls, cls.__dict__)

    # -- hooks ----------------------------------------------------------------------------------
    # on_applied, on_duplicate, on_deferred, on_lease_lost, on_dead_letter: the hooks every
    # integration shares (dedupe_worker.Hooks); ``message`` is ``self.request``.

    # -- machinery ------------------------------------------------------------------------------

    @functools.cached_property
    def deduplicator(self) -> Deduplicator:
        """The :class:`Deduplicator` this task claims keys with, from the settings as they are on
        first use (later changes to ``app.conf`` or the environment are not seen)."""
        return deduplicator_for(self)

    @functools.cached_property
    def options(self) -> ConsumerOptions:
        """This task's :class:`~dedupe_worker.ConsumerOptions` (see ``dedupe_options``), as they
        are on first use; its retry and deferral options are taken on the task then."""
        options = consumer_options(self)
        self.use(options)
        return options

    @functools.cached_property
    def identify(self) -> Identify[Call]:
        """Each call's key, fingerprint and ttl (the ttl header, else ``dedupe_ttl``), or its refusal."""
        return Identify("celery", call_key, call_fingerprint, ttl_header=self.options.ttl_header,
                        headers=self._ttl_headers, default_ttl=self._default_ttl)

    @functools.cached_property
    def _app_settings(self) -> AppSettings:
        """``app.conf``'s answers for the settings read on every call (see :class:`.AppSettings`)."""
        return AppSettings(self.app.conf)

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
        """Identify the call, let :func:`decide` claim its key and run the body, and act on its verdict."""
        request = self.request
        found = self.identify(Call.of(self, args, kwargs, self._header(request, self.idempotency_header), request))
        if isinstance(found, Decision):
            return self._act(found, "", request)
        key, fingerprint, ttl = found
        request.dedupe_key = key
        request.fencing_token = None
        body = functools.partial(self._body, request, args, kwargs)
        # On a worker, a copy of work in flight waits a little on the key before re-sending itself:
        # it returns the holder's result within a round trip of its completion.
        offline = request.is_eager or request.called_directly  # no broker to defer to
        wait = 0.0 if offline else self.defer_wait
        try:
            decision = decide(self.deduplicator, key, body, fingerprint=fingerprint, wait=wait,
                              integration="celery", ttl=ttl)
        except EvictionPolicyError as exc:
            if offline:
                raise  # no message to lose: the caller gets the error
            # The worker checked at start; the policy changed since. Failing would consume the
            # message (early acks) or spend its attempts: defer it until Redis is fixed.
            log.error("Redis may evict our records, deferring task=%s id=%s key=%s token=0: %s", self.name,
                      request.id, key, exc)
            decision = Decision(Reason.STORE_UNAVAILABLE, error=exc)
        return self._act(decision, key, request)

    def _body(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        claim = current_claim()
        request.fencing_token = claim.token if claim is not None else None
        log.debug("running task=%s id=%s key=%s token=%s", self.name, request.id, request.dedupe_key,
                  request.fencing_token)
        return self.run(*args, **kwargs)

    def _act(self, decision: Decision, key: str, request: Any) -> Any:
        """Act on the engine's verdict through :func:`~dedupe_worker._engine.dispatch.dispatch`
        (hooks after the action): return the value, re-send the task, or raise. A duplicate is
        also logged at INFO (Celery's own line calls it a success like any other)."""
        if decision.reason is Reason.DUPLICATE:
            log_duplicate(self.deduplicator, f"task={self.name} id={request.id}", key, decision)
        dispatch(_TaskSteps(self, key, request.is_eager or request.called_directly), self, request, key, decision)
        return outcome(decision)

    def defer(self, decision: Decision, key: str) -> Acted:
        """Re-send this task to run later, without spending ``max_retries`` (see class doc).
        Returns the deferral with the ``Retry`` the task raises once the hooks ran."""
        request = self.request
        deferrals = int(self._header(request, DEFERRALS_HEADER) or 0) + 1
        countdown = self.defer_delay(deferrals, decision.retry_after or None)
        request.retries -= 1  # retry() sends retries + 1: the re-sent message keeps our count
        try:
            sent = self.retry(countdown=countdown, headers={DEFERRALS_HEADER: deferrals}, throw=False)
        except Reject as exc:
            # retry() could not publish the copy and would drop the message: requeue it instead.
            log.warning("re-send failed, requeueing task=%s id=%s key=%s: %s", self.name, request.id, key,
                        exc.reason)
            raise Reject(exc.reason, requeue=True) from exc
        finally:
            request.retries += 1
        return Acted(Done.DEFERRED, countdown, then=sent)

    def retry_failed(self, decision: Decision, key: str) -> Acted:
        """Re-send the task after a body that raised, ``retry_delay`` later, while attempts are left
        (``request.retries + 1`` of ``max_attempts``): RETRIED, with the ``Retry`` to raise; when
        none are, DEAD_LETTERED (the task fails with the error)."""
        request = self.request
        attempt = request.retries + 1
        if attempt >= self.max_attempts:
            return Acted(Done.DEAD_LETTERED)
        countdown = self.retry_delay(attempt)
        assert decision.error is not None
        sent = self.retry(exc=decision.error, countdown=countdown, max_retries=self.max_attempts - 1, throw=False)
        return Acted(Done.RETRIED, countdown, then=sent)

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Celery's ``apply_async``; with ``dedupe_on_send``, first asks Redis whether the work is
        done, queued or running, and then does not publish (see :mod:`dedupe_worker.celery._send`).
        ``dedupe_ttl``: seconds this call's outcome is kept (sent as the ``x-dedupe-ttl`` header);
        ``ValueError`` unless it is a positive number."""
        ttl = options.pop("dedupe_ttl", None)
        if ttl is not None:
            ttl_ms(ttl)
            options["headers"] = {**(options.get("headers") or {}), self.options.ttl_header or TTL_HEADER: ttl}
        return send_once(self, super().apply_async, args, kwargs, options)

    def signature_from_request(self, request: Any = None, args: Any = None, kwargs: Any = None,
                               queue: Any = None, **extra: Any) -> Any:
        """As Celery's, but the re-sent message keeps the headers that identify it (the key
        header) on top of those given, so a retry or a deferral claims the same key."""
        request = self.request if request is None else request
        kept = request.as_execution_options().get("headers") or {}
        value = self._header(request, self.idempotency_header)
        if value is not None:
            kept[self.idempotency_header] = value
        name = self.options.ttl_header or TTL_HEADER
        ttl = self._header(request, name)
        if ttl is not None:
            kept[name] = ttl
        extra["headers"] = {**kept, **(extra.get("headers") or {})}
        return super().signature_from_request(request, args, kwargs, queue=queue, **extra)

    def _ttl_headers(self, call: Call) -> dict[str, Any]:
        """The ttl header of ``call``'s request, as the headers :attr:`identify` reads."""
        name = self.options.ttl_header or TTL_HEADER
        return {name: self._header(call.request, name)}

    def _default_ttl(self, call: Call) -> float | None:
        """Seconds a call's outcome is kept when its message carries no ttl header: ``dedupe_ttl``,
        else ``app.conf.dedupe_ttl``, else ``None`` (``dedupe_result_ttl``)."""
        option = self.dedupe_ttl if self.dedupe_ttl is not None else self._app_settings.get("dedupe_ttl")
        return None if option is None else parse_ttl(option, f"dedupe_ttl of {self.name}")

    @staticmethod
    def _header(request: Any, name: str) -> Any:
        """A message header: custom headers are request attributes on a worker, and in
        ``request.headers`` under ``apply()``."""
        value = getattr(request, name, None)
        if value is None:
            value = (getattr(request, "headers", None) or {}).get(name)
        return value


class _TaskSteps:
    """The dispatch port of :class:`IdempotentTask` (:class:`~dedupe_worker._engine.dispatch.Broker`)
    for one call. Eager and direct calls have no broker to re-send through: a deferral is not done
    and a handler error goes to the caller (:func:`~dedupe_worker._engine.outcome` raises it)."""

    __slots__ = ("key", "offline", "task")

    def __init__(self, task: IdempotentTask, key: str, offline: bool) -> None:
        self.task = task
        self.key = key
        self.offline = offline

    def ack(self, request: Any, decision: Decision) -> Acted:
        return ACKED  # acks_late: Celery acks once the task returns the value

    def defer(self, request: Any, decision: Decision) -> Acted:
        return Acted(Done.NOT_DONE) if self.offline else self.task.defer(decision, self.key)

    def retry(self, request: Any, decision: Decision) -> Acted:
        # Celery's own retries (autoretry_for, self.retry() in the body) stay in charge of theirs
        if self.offline or isinstance(decision.error, (Retry, *getattr(self.task, "autoretry_for", ()))):
            return Acted(Done.HANDED_OVER)
        return self.task.retry_failed(decision, self.key)

    def dead_letter(self, request: Any, decision: Decision) -> Acted:
        return Acted(Done.DEAD_LETTERED)  # the task fails with the error, without retry

    def where(self, request: Any) -> str:
        return f"task={self.task.name} id={request.id}"

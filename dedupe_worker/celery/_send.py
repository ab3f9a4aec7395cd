"""Send-side deduplication of :class:`~dedupe_worker.celery.IdempotentTask` (``dedupe_on_send``).

With the option on, ``apply_async`` (and so ``delay``, signatures, chain steps and beat) derives
the key and fingerprint the worker will derive (:func:`~dedupe_worker.celery._options.identify`)
and asks Redis in one round trip (``send.lua``) what to do:

==============  ==========================================================================
the key is ...  the send ...
==============  ==========================================================================
done            publishes nothing; returns an ``EagerResult`` whose ``.get()`` gives the stored
                value at once (or raises ``PreviouslyFailed`` for a stored failure); ``.id``
                is the task id the producing run was sent with (this send's own when no mark
                names it); a chain's next step and ``link`` callbacks are sent with the value
queued/running publishes nothing; returns ``AsyncResult`` of the task already sent for the key
conflict       raises :class:`~dedupe_worker.KeyConflict` (same key, other arguments)
otherwise       publishes as usual; the mark records its task id for ``dedupe_send_ttl``
==============  ==========================================================================

What is guaranteed: nothing more than without it. The mark is a hint with a TTL: when the
message is lost, the next send after ``dedupe_send_ttl`` publishes again; once a worker has
claimed the key, a send publishes as soon as no live lease holds it (the worker released it after
a retryable failure, or died), and the worker's claim still makes the body run once. When Redis
cannot be reached the send publishes (logged as a warning), and a publish that raises takes its
mark back (below): a send is never lost to the check, but for the rare cases the crash story
lists, each bounded by ``dedupe_send_ttl``.

The mark follows the publish. ``send.lua`` writes it *before* publishing, in the same round trip
that decides, so of two senders racing on a key exactly one is told PUBLISH and the other is
answered with its task id (one publish per key). Writing it only after the publish would let
both decide "free" and both publish. When the publish raises (broker down, connection refused,
a publish timeout), ``unsend.lua`` removes the mark, fenced by this send's task id (a later
send's mark stays), and the error reaches the caller: its retry publishes. Crash story:

* the publish raised after the broker took the message (a lost confirm): the mark is removed,
  so the caller's retry publishes a second copy; the worker's claim answers it as a duplicate;
* the publish raised and Redis is unreachable for ``unsend.lua`` too (logged as a warning): the
  mark lapses after ``dedupe_send_ttl``; until then sends of the key answer "queued";
* the sending process dies between the mark and the publish: the same, the mark lapses;
* a sender that raced with a publish that then raised, and was answered "queued" in between,
  holds the id of a task that was never sent: rare (both within one publish attempt) and bounded
  by ``dedupe_send_ttl``, as above.

A send whose task id the caller fixed (chain steps, group members, ``apply_async(task_id=...)``)
is skipped only when done, and the stored outcome is then also written to the result backend
under that id, so the handle the caller holds answers.

Not skipped (published as usual, the worker's claim answers them): re-sends of a task by
``retry()`` and by deferrals; eager mode; chord members; a queued or running key whose send has
a fixed task id or carries a chain or callbacks (the task already sent has its own).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery import signature, states
from celery.result import AsyncResult, EagerResult
from celery.utils import uuid
from redis.exceptions import RedisError

from .._deduplicator import Deduplicator
from .._errors import DedupeError, InvalidKey, KeyConflict, StoreUnavailable
from .._protocol import SendAnswer, SendState
from .._transport import check_send, unsend
from ..observe._base import current as observer
from ._options import key_and_fingerprint

__all__ = ["EXPECTED_QUEUE_TIME", "send_once", "send_ttl", "sends_deduplicated"]

log = logging.getLogger(__name__)

#: Seconds of queue time ``dedupe_send_ttl`` allows by default, on top of the lease.
EXPECTED_QUEUE_TIME = 60.0

def sends_deduplicated(task: Any, options: dict[str, Any]) -> bool:
    """Whether this send is checked: the per-call ``dedupe_on_send`` (taken out of ``options``),
    else the task's option, else ``app.conf.dedupe_on_send``, else off."""
    value = options.pop("dedupe_on_send", None)
    if value is None:
        value = getattr(task, "dedupe_on_send", None)
    if value is None:
        value = task._app_settings.get("dedupe_on_send")
    return bool(value)


def send_ttl(task: Any) -> float:
    """``dedupe_send_ttl`` of ``task``: its option, else ``app.conf.dedupe_send_ttl``, else the
    lease plus :data:`EXPECTED_QUEUE_TIME`."""
    value = getattr(task, "dedupe_send_ttl", None)
    if value is None:
        value = task._app_settings.get("dedupe_send_ttl")
    if value is None:
        value = task.deduplicator.lease + EXPECTED_QUEUE_TIME
    return float(value)


def _postponed(options: dict[str, Any]) -> float:
    """Seconds the message waits before it may run (``countdown`` or ``eta``)."""
    if options.get("countdown"):
        return max(0.0, float(options["countdown"]))
    eta = options.get("eta")
    if eta is None:
        return 0.0
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=timezone.utc)
    return max(0.0, (eta - datetime.now(timezone.utc)).total_seconds())


def send_once(task: Any, publish: Callable[..., AsyncResult], args: Any, kwargs: Any,
              options: dict[str, Any]) -> Any:
    """``publish(args, kwargs, **options)`` unless the key's work is done, queued or running
    (module doc). Raises :class:`KeyConflict`; never fails because Redis does."""
    if not sends_deduplicated(task, options) or "retries" in options or task.app.conf.task_always_eager:
        return publish(args, kwargs, **options)
    call_args, call_kwargs = tuple(args or ()), dict(kwargs or {})
    header = (options.get("headers") or {}).get(task.idempotency_header)
    try:
        key, fingerprint = key_and_fingerprint(task, call_args, call_kwargs, header)
    except InvalidKey as exc:  # the worker refuses it with the reason; the send is not lost
        log.warning("no key to check before sending task=%s, publishing: %s", task.name, exc)
        return publish(args, kwargs, **options)
    fixed = bool(options.get("task_id"))  # a handle with this id is already out (chain, group)
    task_id = options.get("task_id") or uuid()
    options["task_id"] = task_id
    try:
        answer = check_send(task.deduplicator, key, task_id, ttl=send_ttl(task) + _postponed(options),
                            fingerprint=fingerprint)
    except (StoreUnavailable, RedisError, OSError) as exc:
        log.warning("Redis unavailable before sending, publishing task=%s id=%s key=%s token=-: %s",
                    task.name, task_id, key, exc)
        return _published(task, publish, args, kwargs, options, key)
    return _act(task, publish, answer, args, kwargs, options, fixed)


def _published(task: Any, publish: Callable[..., AsyncResult], args: Any, kwargs: Any,
               options: dict[str, Any], key: str) -> AsyncResult:
    log.debug("publishing task=%s id=%s key=%s", task.name, options["task_id"], key)
    result = publish(args, kwargs, **options)
    observer.sent("celery", "published")
    return result


def _marked(task: Any, publish: Callable[..., AsyncResult], args: Any, kwargs: Any,
            options: dict[str, Any], key: str) -> AsyncResult:
    """:func:`_published` for a send ``send.lua`` marked: a publish that raises takes its mark back."""
    try:
        return _published(task, publish, args, kwargs, options, key)
    except BaseException:
        _unmark(task, key, options["task_id"])
        raise


def _unmark(task: Any, key: str, task_id: str) -> None:
    try:
        unsend(task.deduplicator, key, task_id)
    except (StoreUnavailable, RedisError, OSError) as exc:
        log.warning("publish failed and Redis unavailable: the send mark of task=%s id=%s key=%s token=- "
                    "answers queued until dedupe_send_ttl: %s", task.name, task_id, key, exc)
    else:
        log.info("publish failed, send mark removed task=%s id=%s key=%s token=-", task.name, task_id, key)


def _act(task: Any, publish: Callable[..., AsyncResult], answer: SendAnswer, args: Any, kwargs: Any,
         options: dict[str, Any], fixed: bool) -> Any:
    """What the send does with ``send.lua``'s answer; ``fixed``: the caller chose the task id."""
    key, state = answer.key, answer.state
    if state is SendState.PUBLISH:
        return _marked(task, publish, args, kwargs, options, key)
    if state is SendState.CONFLICT:
        observer.sent("celery", "conflict")
        log.info("send refused, key used for other arguments task=%s key=%s token=-", task.name, key)
        raise KeyConflict(key)
    chord = bool(options.get("chord"))  # the chord's counter moves only when a worker runs it
    if state is SendState.DONE:
        claim = answer.claim
        assert claim is not None
        if chord or (claim.failed and options.get("link_error")):
            return _published(task, publish, args, kwargs, options, key)  # the worker answers it
        observer.sent("celery", "skipped_done")
        log.info("not sending, done task=%s id=%s key=%s token=%s", task.name, answer.task_id, key, claim.token)
        result = _stored(answer, options["task_id"])
        if fixed:
            _record(task, options, result)
        if result.successful():
            _follow_on(task, result.result, options)
        return result
    if fixed or chord or options.get("chain") or options.get("link") or options.get("link_error"):
        # the handle out there, or the continuation this send carries, needs a run of its own:
        # the worker's claim makes it wait for the running one and answer its result
        return _published(task, publish, args, kwargs, options, key)
    observer.sent("celery", "skipped_queued")
    log.info("not sending, %s task=%s id=%s key=%s token=-", state.name.lower(), task.name, answer.task_id, key)
    return task.AsyncResult(answer.task_id)


def _record(task: Any, options: dict[str, Any], result: EagerResult) -> None:
    """Write the stored outcome to the result backend under the id the caller fixed, so the
    handle it already holds (a chain's or group's frozen result) answers."""
    if options.get("ignore_result"):
        return
    try:
        if result.successful():
            task.backend.mark_as_done(options["task_id"], result.result, request=None)
        else:
            task.backend.mark_as_failure(options["task_id"], result.result)
    except Exception as exc:  # no result backend: nobody can wait on the id anyway
        log.warning("could not record the stored outcome under id=%s key=-: %s", options["task_id"], exc)


def _stored(answer: SendAnswer, own_id: str) -> EagerResult:
    """The stored outcome as a result object that answers at once."""
    assert answer.claim is not None
    task_id = answer.task_id or own_id
    try:
        value = Deduplicator.answer(answer.claim)
    except DedupeError as exc:  # PreviouslyFailed: the stored permanent failure
        return EagerResult(task_id, exc, states.FAILURE)
    return EagerResult(task_id, value, states.SUCCESS)


def _follow_on(task: Any, value: Any, options: dict[str, Any]) -> None:
    """Send what the worker would have sent after the task returned ``value``: the ``link``
    callbacks, then the chain's next step (each checked again if it is an IdempotentTask)."""
    app = task.app
    lineage = {"parent_id": options["task_id"], "root_id": options.get("root_id") or options["task_id"],
               "priority": options.get("priority")}
    links = options.get("link") or []
    for callback in links if isinstance(links, (list, tuple)) else [links]:
        signature(callback, app=app).apply_async((value,), **lineage)
    chain = options.get("chain")
    if chain:
        signature(chain[-1], app=app).apply_async((value,), chain=chain[:-1], **lineage)

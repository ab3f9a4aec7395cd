"""What the RabbitMQ consumer does with a decided message: ack, defer, retry or dead-letter.

:class:`BrokerActions` holds the options and the no-op hooks of
:class:`~dedupe_worker.rabbitmq.DedupeConsumer` that concern these actions; it contains no dedupe
logic (the :class:`~dedupe_worker.Decision` is made before) and never acks a message
before its outcome is stored or its copy confirmed. Its steps are the consumer's port of the
engine's one dispatch (:mod:`dedupe_worker._engine.dispatch`), which logs, counts and calls the
hooks once a step is done.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._engine import ACKED, Acted, Action, Decision, Done, Hooks, Reason, RetryPolicy, Tally, backoff, dispatch, report
from .._messages.deadletter import ATTEMPTS, dead_letter_headers
from .._republish import DEFERRALS, PublishFailed, Republisher, delay_queue, dlq

__all__ = ["BrokerActions", "Item", "Stopping", "answered"]

log = logging.getLogger(__name__)


class Stopping(Exception):
    """Raised instead of running a handler once a stop was requested: the claim is released
    and the message requeued, without counting an attempt."""


@dataclass
class Item:
    queue: str
    message: Any
    key: str | None = None
    fingerprint: Any = None
    call: Callable[[], Any] | None = None
    decision: Decision | None = None
    #: Seconds the outcome is kept (the message's ttl header), ``None`` for ``result_ttl``.
    ttl: float | None = None


def _int_header(message: Any, name: str) -> int:
    raw = (message.headers or {}).get(name)
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    try:
        return max(0, int(raw)) if raw is not None else 0
    except (TypeError, ValueError):
        return 0


def _short(key: str | None) -> str | None:
    """The key as logged: long keys are cut (the full key is in the dead letter's headers)."""
    return key if key is None or len(key) <= 120 else f"{key[:100]}...({len(key)} chars)"


#: A step that could not be carried out: the message was requeued as it came (logged by the step).
NOT_DONE = Acted(Done.NOT_DONE)


def _where(message: Any) -> str:
    return f"delivery_tag={message.delivery_tag}"


def answered(message: Any) -> bool:
    """Whether ``message`` was acked or rejected already (by a handler that should not have)."""
    if message.acknowledged:
        log.warning("message delivery_tag=%s was acked or rejected by its handler; not acking it again",
                    message.delivery_tag)
        return True
    return False


class BrokerActions(Hooks, RetryPolicy):
    """Maps a decision to broker actions; mixed into the consumer. The retry and deferral options
    (``max_attempts``, ``retry_base``, ``retry_cap``, ``defer_base``, ``defer_cap``) and the hooks
    are the ones every integration shares (:class:`~dedupe_worker.ConsumerOptions`,
    :class:`~dedupe_worker.Hooks`)."""

    #: Longest pause before prefetched messages are requeued while Redis is unreachable.
    outage_cap: float = 5.0

    should_stop: bool = False
    _publisher: Republisher | None = None
    _outages: int = 0
    #: The waiting room: un-acked messages whose key is held elsewhere, by delivery tag, with the
    #: time they first waited; the key watcher puts them back in ``_woken`` once it is decided.
    #: Counts of what was done, logged every ``summary_interval`` seconds and at shutdown.
    tally: Tally
    _waiting: dict[Any, float]
    _woken: deque[tuple[str, Any, BaseException | None]]
    dedupe: Any

    def _wait_on_key(self, item: Item, decision: Decision) -> Acted | None:
        """Keep ``item`` un-acked in the waiting room until its key is decided elsewhere (or the
        holder's lease or ``defer_wait`` runs out), instead of a copy to ``<queue>.delay``: it is
        then decided again at once. Not (``None``) when the room is full (half the prefetch) or
        the message has waited ``defer_wait`` already."""
        claim, tag = decision.claim, item.message.delivery_tag
        first = self._waiting.get(tag, time.monotonic())
        room = max(1, self.prefetch_count * len(self.queues) // 2)  # type: ignore[attr-defined]
        left = self.defer_wait - (time.monotonic() - first)
        if (decision.reason is not Reason.IN_PROGRESS or claim is None or left <= 0
                or (tag not in self._waiting and len(self._waiting) >= room)):
            self._waiting.pop(tag, None)
            return None
        self._waiting[tag] = first
        queue, message = item.queue, item.message
        timeout = min(left, decision.retry_after + 0.01)
        self.dedupe.watcher.watch(claim.stem, lambda: self._woken.append((queue, message, None)), timeout)
        log.debug("waiting key=%s token=%s on the key for at most %.2fs", _short(item.key), decision.token, timeout)
        return Acted(Done.DEFERRED, timeout)

    # -- actions ---------------------------------------------------------------------------------

    def _act(self, item: Item, acked: bool = False) -> None:
        """Carry out the decision on ``item`` (``acked``: its ack was already sent) through
        :func:`~dedupe_worker._engine.dispatch.dispatch`: the broker step, then the hooks."""
        decision, message = item.decision, item.message
        assert decision is not None
        if self._waiting and decision.action is not Action.DEFER:  # it leaves the waiting room, if it was there
            self._waiting.pop(message.delivery_tag, None)
        dispatch(_ItemSteps(self, item, acked), self, message, _short(item.key), decision, self.tally)

    def _defer(self, item: Item, decision: Decision) -> Acted:
        waiting = self._wait_on_key(item, decision)
        if waiting is not None:
            return waiting
        deferrals = _int_header(item.message, DEFERRALS) + 1
        delay = self.defer_delay(deferrals, decision.retry_after or None)
        headers = {**item.message.headers, DEFERRALS: str(deferrals)}
        if not self._copy(item, decision, delay_queue(item.queue), headers, delay):
            return NOT_DONE
        return Acted(Done.DEFERRED, delay)

    def _retry(self, item: Item, decision: Decision) -> Acted:
        attempts = _int_header(item.message, ATTEMPTS) + 1
        if attempts >= self.max_attempts:
            return self._dead_letter(item, decision, attempts)
        delay = self.retry_delay(attempts)
        headers = {**item.message.headers, ATTEMPTS: str(attempts)}
        if not self._copy(item, decision, delay_queue(item.queue), headers, delay):
            return NOT_DONE
        log.debug("retry key=%s token=%s is attempt %d/%d", _short(item.key), decision.token, attempts + 1,
                  self.max_attempts)
        return Acted(Done.RETRIED, delay)

    def _dead_letter(self, item: Item, decision: Decision, attempts: int) -> Acted:
        info = item.message.delivery_info or {}
        headers = {k: v for k, v in item.message.headers.items() if k != DEFERRALS}
        headers.update(dead_letter_headers(
            decision, key=item.key, attempts=attempts, original_queue=item.queue,
            original_exchange=info.get("exchange") or "", original_routing_key=info.get("routing_key") or "",
        ))
        if not self._copy(item, decision, dlq(item.queue), headers, None):
            return NOT_DONE
        return Acted(Done.DEAD_LETTERED)

    def _copy(self, item: Item, decision: Decision, queue: str, headers: dict[str, Any],
              expiration: float | None) -> bool:
        """Publish a confirmed copy, then ack the original; on a nack or return, requeue it
        after a pause instead (and redeclare the queues)."""
        assert self._publisher is not None
        try:
            self._publisher.publish(item.message, queue, headers, expiration)
        except PublishFailed as exc:
            log.error("could not copy key=%s token=%s to %s, requeueing: %s", _short(item.key),
                      decision.token, queue, exc)
            self._pause(backoff(1, base=1.0, floor=0.5))
            self._publisher.declare(item.queue)
            if not answered(item.message):
                item.message.requeue()
            return False
        if not answered(item.message):
            item.message.ack()
        return True

    def _requeue_later(self, items: Sequence[Item]) -> None:
        """Redis is unreachable: hold the messages for a backoff pause, then requeue them."""
        first = items[0].decision
        assert first is not None
        delay = min(self.outage_cap, backoff(self._outages, base=0.25, cap=self.outage_cap,
                                             floor=min(first.retry_after, self.outage_cap)))
        log.warning("Redis unavailable (%s); requeueing %d message(s) after %.2fs", first.detail,
                    len(items), delay)
        self._pause(delay)
        for item in items:
            self._waiting.pop(item.message.delivery_tag, None)
            if not answered(item.message):
                item.message.requeue()
        requeued = Acted(Done.DEFERRED, delay)
        for item in items:  # each requeue is done: now its hooks
            assert item.decision is not None
            report(self, item.message, _short(item.key), item.decision, requeued, self.tally, _where)

    def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.should_stop and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.1, left))


class _ItemSteps:
    """The dispatch port of the consumer (:class:`~dedupe_worker._engine.dispatch.Broker`) for one
    prefetched message; ``acked``: the batch's ``ack(multiple)`` acked it already."""

    __slots__ = ("acked", "actions", "item")

    def __init__(self, actions: BrokerActions, item: Item, acked: bool) -> None:
        self.actions = actions
        self.item = item
        self.acked = acked

    def ack(self, message: Any, decision: Decision) -> Acted:
        if not self.acked and not answered(message):
            message.ack()
        return ACKED

    def defer(self, message: Any, decision: Decision) -> Acted:
        return self.actions._defer(self.item, decision)

    def retry(self, message: Any, decision: Decision) -> Acted:
        if isinstance(decision.error, Stopping):  # not an attempt: back to the queue as it came
            if not answered(message):
                message.requeue()
            return NOT_DONE
        return self.actions._retry(self.item, decision)

    def dead_letter(self, message: Any, decision: Decision) -> Acted:
        handler_ran = decision.reason in (Reason.PERMANENT_FAILURE, Reason.UNSERIALIZABLE_RESULT)
        return self.actions._dead_letter(self.item, decision, _int_header(message, ATTEMPTS) + int(handler_ran))

    where = staticmethod(_where)

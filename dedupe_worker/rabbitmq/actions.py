"""What the RabbitMQ consumer does with a decided message: ack, defer, retry or dead-letter.

:class:`BrokerActions` holds the options and the no-op hooks of
:class:`~dedupe_worker.rabbitmq.DedupeConsumer` that concern these actions; it contains no dedupe
logic (the :class:`~dedupe_worker.handling.Decision` is made before) and never acks a message
before its outcome is stored or its copy confirmed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..backoff import backoff
from ..engine import Action, Decision, Hooks, Reason, RetryPolicy
from ..engine.hooks import call_hook
from ..messages.deadletter import ATTEMPTS, dead_letter_headers
from .republish import DEFERRALS, PublishFailed, Republisher, delay_queue, dlq

__all__ = ["BrokerActions", "Item", "Stopping", "settled"]

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


def settled(message: Any) -> bool:
    """Whether ``message`` was acked or rejected already (by a handler that should not have)."""
    if message.acknowledged:
        log.warning("message delivery_tag=%s was settled by its handler; not acking it again",
                    message.delivery_tag)
        return True
    return False


class BrokerActions(Hooks, RetryPolicy):
    """Maps a decision to broker actions; mixed into the consumer. The retry and deferral options
    (``max_attempts``, ``retry_base``, ``retry_cap``, ``defer_base``, ``defer_cap``) and the hooks
    are the ones every integration shares (:class:`~dedupe_worker.engine.RetryPolicy`,
    :class:`~dedupe_worker.engine.Hooks`)."""

    #: Longest pause before prefetched messages are requeued while Redis is unreachable.
    outage_cap: float = 5.0

    should_stop: bool = False
    _publisher: Republisher | None = None
    _outages: int = 0
    #: The waiting room: un-acked messages whose key is held elsewhere, by delivery tag, with the
    #: time they first waited; the key watcher puts them back in ``_woken`` once it is decided.
    _waiting: dict[Any, float]
    _woken: deque[tuple[str, Any, BaseException | None]]
    dedupe: Any

    def _wait_on_key(self, item: Item, decision: Decision) -> bool:
        """Keep ``item`` un-acked in the waiting room until its key is decided elsewhere (or the
        holder's lease or ``defer_wait`` runs out), instead of a copy to ``<queue>.delay``: it is
        then decided again at once. Not when the room is full (half the prefetch) or the message
        has waited ``defer_wait`` already."""
        claim, tag = decision.claim, item.message.delivery_tag
        first = self._waiting.get(tag, time.monotonic())
        room = max(1, self.prefetch_count * len(self.queues) // 2)  # type: ignore[attr-defined]
        left = self.defer_wait - (time.monotonic() - first)
        if (decision.reason is not Reason.IN_PROGRESS or claim is None or left <= 0
                or (tag not in self._waiting and len(self._waiting) >= room)):
            self._waiting.pop(tag, None)
            return False
        self._waiting[tag] = first
        queue, message = item.queue, item.message
        timeout = min(left, decision.retry_after + 0.01)
        self.dedupe.watcher.watch(claim.stem, lambda: self._woken.append((queue, message, None)), timeout)
        log.info("waiting key=%s token=%s reason=%s for at most %.2fs", _short(item.key), decision.token,
                 decision.reason.value, timeout)
        call_hook(self.on_deferred, item.message, decision, timeout)
        return True

    # -- actions ---------------------------------------------------------------------------------

    def _settle(self, item: Item, acked: bool = False) -> None:
        """Carry out the decision on ``item`` (``acked``: its ack was already sent)."""
        decision, message = item.decision, item.message
        assert decision is not None
        action = decision.action
        if self._waiting and action is not Action.DEFER:  # it leaves the waiting room, if it was there
            self._waiting.pop(message.delivery_tag, None)
        if action is Action.ACK:
            if not acked and not settled(message):
                message.ack()
            if log.isEnabledFor(logging.DEBUG):  # its arguments cost more than the check
                log.debug("acked key=%s token=%s reason=%s", _short(item.key), decision.token,
                          decision.reason.value)
            if decision.reason is Reason.APPLIED:
                call_hook(self.on_applied, message, decision)
            else:
                call_hook(self.on_duplicate, message, decision)
        elif action is Action.DEFER:
            self._defer(item, decision)
        elif action is Action.RETRY:
            if isinstance(decision.error, Stopping):
                if not settled(message):
                    message.requeue()
            else:
                self._retry(item, decision)
        else:
            handler_ran = decision.reason in (Reason.PERMANENT_FAILURE, Reason.UNSERIALIZABLE_RESULT)
            self._dead_letter(item, decision, _int_header(message, ATTEMPTS) + int(handler_ran))

    def _defer(self, item: Item, decision: Decision) -> None:
        if self._wait_on_key(item, decision):
            return
        deferrals = _int_header(item.message, DEFERRALS) + 1
        delay = self.defer_delay(deferrals, decision.retry_after or None)
        headers = {**item.message.headers, DEFERRALS: str(deferrals)}
        if not self._copy(item, decision, delay_queue(item.queue), headers, delay):
            return
        log.info("deferred key=%s token=%s reason=%s for %.2fs", _short(item.key), decision.token,
                 decision.reason.value, delay)
        if decision.reason is Reason.LEASE_LOST:
            call_hook(self.on_lease_lost, item.message, decision)
        call_hook(self.on_deferred, item.message, decision, delay)

    def _retry(self, item: Item, decision: Decision) -> None:
        attempts = _int_header(item.message, ATTEMPTS) + 1
        if attempts >= self.max_attempts:
            self._dead_letter(item, decision, attempts)
            return
        delay = self.retry_delay(attempts)
        headers = {**item.message.headers, ATTEMPTS: str(attempts)}
        if self._copy(item, decision, delay_queue(item.queue), headers, delay):
            log.warning("handler failed key=%s token=%s attempt %d/%d, retry in %.2fs: %s", _short(item.key),
                        decision.token, attempts, self.max_attempts, delay, decision.detail)
            call_hook(self.on_deferred, item.message, decision, delay)

    def _dead_letter(self, item: Item, decision: Decision, attempts: int) -> None:
        info = item.message.delivery_info or {}
        headers = {k: v for k, v in item.message.headers.items() if k != DEFERRALS}
        headers.update(dead_letter_headers(
            decision, key=item.key, attempts=attempts, original_queue=item.queue,
            original_exchange=info.get("exchange") or "", original_routing_key=info.get("routing_key") or "",
        ))
        if self._copy(item, decision, dlq(item.queue), headers, None):
            log.error("dead-lettered key=%s token=%s reason=%s attempts=%d: %s", _short(item.key),
                      decision.token, decision.reason.value, attempts, decision.detail)
            call_hook(self.on_dead_letter, item.message, decision)

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
            if not settled(item.message):
                item.message.requeue()
            return False
        if not settled(item.message):
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
            if not settled(item.message):
                item.message.requeue()
            assert item.decision is not None
            log.info("requeued key=%s token=%s reason=store_unavailable", _short(item.key),
                     item.decision.token)
            call_hook(self.on_deferred, item.message, item.decision, delay)

    def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.should_stop and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.1, left))

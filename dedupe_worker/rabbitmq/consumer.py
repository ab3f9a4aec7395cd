"""The deduplicating kombu consumer: claim, run, then ack, defer, retry or dead-letter.

Per message the consumer derives the key as ``key_strategy(from_kombu(message, queue))`` and the
fingerprint as ``fingerprint(envelope)``, asks :func:`~dedupe_worker.handling.decide` (or
:func:`~dedupe_worker.handling.decide_many` for the messages prefetched together, one Redis round
trip for the batch) and maps the verdict to broker actions:

=====================  =========================================================================
verdict                broker action
=====================  =========================================================================
applied, duplicate,    ack
previously_failed
in_progress,           copy to ``<queue>.delay`` with an expiration of at least the other
lease_lost             worker's remaining lease (plus jittered backoff), confirm, ack; the copy
                       comes back to ``<queue>``. Not a failed attempt.
store_unavailable      Redis is down: nothing is run or acked; pause (backoff, capped) and
                       requeue. Consumption resumes by itself when Redis answers again.
handler_error          attempts = ``x-dedupe-attempts`` + 1; below ``max_attempts``: copy to
                       ``<queue>.delay`` with the new count and a backoff, confirm, ack; else
                       dead-letter.
conflict, invalid_key, copy to ``<queue>.dlq`` with :func:`~dedupe_worker.deadletter.
undecodable, ...       dead_letter_headers`, confirm, ack.
=====================  =========================================================================

Crash story: nothing is acked before its outcome is stored in Redis or its copy confirmed, so a
consumer killed at any point leaves its un-acked messages to the broker, which redelivers them;
a claim left behind by the dead consumer answers IN_PROGRESS until its lease runs out, then the
message is claimed and handled again (the handler's half-done side effects are not undone).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..backoff import backoff
from ..deadletter import ATTEMPTS, dead_letter_headers
from ..deduplicator import Deduplicator
from ..envelope import Envelope, from_kombu
from ..errors import UndecodableMessage
from ..extras import require
from ..handling import Action, Decision, Reason, decide, decide_many, poison
from ..keys import RABBITMQ_DEFAULT, KeyStrategy, body_fingerprint
from .republish import DEFERRALS, PublishFailed, Republisher, delay_queue, dlq

require("kombu", "rabbitmq")
from kombu.connection import Connection  # noqa: E402
from kombu.entity import Queue  # noqa: E402
from kombu.mixins import ConsumerMixin  # noqa: E402

__all__ = ["DedupeConsumer", "Handler"]

log = logging.getLogger(__name__)

#: ``handler(body, message)``: the decoded body and the kombu message, as kombu callbacks get them.
Handler = Callable[[Any, Any], Any]


class _Stopping(Exception):
    """Raised instead of running a handler once a stop was requested: the claim is released
    and the message requeued, without counting an attempt."""


@dataclass
class _Item:
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


def _token(decision: Decision) -> int:
    return decision.claim.token if decision.claim is not None else 0


class DedupeConsumer(ConsumerMixin):
    """Consume ``queues`` with ``handler(body, message)``, applying each idempotency key once.

    Guaranteed: a message is acked only after its outcome is stored, a copy of it is confirmed
    in ``<queue>.delay`` or ``<queue>.dlq``, or it is known to be a duplicate; a bad message
    never stops the loop and is never dropped. While a key's outcome lives in Redis its handler
    completes at most once. Not guaranteed: a handler interrupted by a crash, or whose outcome
    could not be stored (Redis died right after it ran), may run again on redelivery.

    Reconnects to RabbitMQ by itself (kombu's ``ConsumerMixin``); un-acked messages are redelivered
    by the broker. Call :meth:`stop` (e.g. from a SIGTERM handler) to finish the message in hand
    and stop; the other prefetched messages are requeued. Uses kombu's py-amqp transport.
    """

    #: basic.qos prefetch count per queue: how many un-acked messages the broker hands us at once.
    prefetch_count: int = 10
    #: Claim the prefetched messages that are ready together in one Redis round trip.
    batch: bool = True
    #: Handler attempts (counted in ``x-dedupe-attempts``) before a failing message is dead-lettered.
    max_attempts: int = 5
    #: Backoff before a failed handler is retried: ``backoff(attempt, base=..., cap=...)`` seconds.
    retry_base: float = 1.0
    retry_cap: float = 60.0
    #: Backoff added to the other worker's remaining lease when a message is deferred.
    defer_base: float = 0.5
    defer_cap: float = 30.0
    #: Longest pause before prefetched messages are requeued while Redis is unreachable.
    outage_cap: float = 5.0
    #: Content types (or kombu serializer names) the body may be decoded from; others are poison.
    accept: Sequence[str] = ("json", "text/plain", "application/octet-stream")

    def __init__(
        self,
        connection: Connection,
        queues: Sequence[Queue | str],
        handler: Handler,
        deduplicator: Deduplicator,
        *,
        key_strategy: KeyStrategy = RABBITMQ_DEFAULT,
        fingerprint: Callable[[Envelope], Any] | None = body_fingerprint,
        **options: Any,
    ) -> None:
        self.connection = connection
        self.queues = [q if isinstance(q, Queue) else Queue(q, durable=True)  # type: ignore[no-untyped-call]
                       for q in queues]
        self.handler = handler
        self.dedupe = deduplicator
        self.key_strategy = key_strategy
        self.fingerprint = fingerprint
        for name, value in options.items():
            if not hasattr(type(self), name) or name.startswith("_"):
                raise TypeError(f"unknown option {name!r}")
            setattr(self, name, value)
        self.should_stop = False
        #: Set while connected with the queues (and their .delay and .dlq) declared and consumed.
        self.ready = threading.Event()
        self._pending: list[tuple[str, Any, BaseException | None]] = []
        self._publisher: Republisher | None = None
        self._outages = 0

    # -- hooks -----------------------------------------------------------------------------------

    def on_applied(self, message: Any, decision: Decision) -> None:
        """Called after a handler ran, its outcome was stored and the message was acked."""

    def on_duplicate(self, message: Any, decision: Decision) -> None:
        """Called after a duplicate (or a copy of a permanently failed key) was acked unhandled."""

    def on_deferred(self, message: Any, decision: Decision, delay: float) -> None:
        """Called after a message was deferred (delayed copy or requeue) for ``delay`` seconds."""

    def on_dead_letter(self, message: Any, decision: Decision) -> None:
        """Called after a copy of a message was confirmed in the dead-letter queue."""

    def on_lease_lost(self, message: Any, decision: Decision) -> None:
        """Called when a handler finished but its lease had been taken over (it is deferred)."""

    # -- the loop --------------------------------------------------------------------------------

    def run(self, _tokens: int = 1, **kwargs: Any) -> None:
        """Consume until :meth:`stop`; reconnects by itself after connection errors."""
        super().run(_tokens, **kwargs)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Release the connection given to the constructor (the deduplicator is the caller's)."""
        self.connection.release()  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        """Finish the message in hand, requeue the rest, then return from :meth:`run`."""
        self.should_stop = True

    def get_consumers(self, consumer_cls: Any, channel: Any) -> list[Any]:
        return [
            consumer_cls(
                queues=[queue], accept=list(self.accept), prefetch_count=self.prefetch_count,
                on_message=lambda message, name=queue.name: self._pending.append((name, message, None)),
                # kombu would log and ack a message it cannot decompress; we dead-letter it.
                on_decode_error=lambda message, exc, name=queue.name: self._pending.append(
                    (name, message, exc)),
            )
            for queue in self.queues
        ]

    def on_consume_ready(self, connection: Any, channel: Any, consumers: Any, **kwargs: Any) -> None:
        self._pending.clear()
        self._publisher = Republisher(connection.channel())
        for queue in self.queues:
            self._publisher.declare(queue.name)
        self.ready.set()
        log.info("consuming %s (prefetch %d)", ", ".join(q.name for q in self.queues), self.prefetch_count)

    def consume(self, limit: int | None = None, timeout: float | None = None,
                safety_interval: float = 1, **kwargs: Any) -> Iterator[None]:
        try:
            with self.consumer_context(**kwargs) as (conn, _channel, _consumers):
                while not self.should_stop:
                    # Deliveries can also arrive while we wait for a publish confirm or a declare.
                    if not self._pending:
                        try:
                            conn.drain_events(timeout=safety_interval)
                        except TimeoutError:
                            conn.heartbeat_check()
                            continue
                    # Whatever else the broker already sent is handled in the same batch.
                    while self.batch and len(self._pending) < self.prefetch_count * len(self.queues):
                        try:
                            conn.drain_events(timeout=0)
                        except TimeoutError:
                            break
                    batch, self._pending = self._pending, []
                    self.handle(batch)
                    yield
        finally:
            self.ready.clear()

    # -- one batch -------------------------------------------------------------------------------

    def handle(self, batch: Sequence[tuple[str, Any, BaseException | None]]) -> None:
        """Decide and settle the messages received together; never raises for bad messages."""
        items = [self._prepare(queue, message, error) for queue, message, error in batch]
        todo = [item for item in items if item.decision is None]
        if len(todo) > 1 and self.batch:
            decisions = decide_many(self.dedupe,
                                    [(i.key or "", i.fingerprint, i.call or _noop) for i in todo])
        else:
            decisions = [decide(self.dedupe, i.key or "", i.call or _noop, fingerprint=i.fingerprint)
                         for i in todo]
        for item, decision in zip(todo, decisions, strict=True):
            item.decision = decision
        unavailable = [i for i in items if i.decision and i.decision.reason is Reason.STORE_UNAVAILABLE]
        self._outages = self._outages + 1 if unavailable else 0
        for item in items:
            if item not in unavailable:
                self._settle(item)
        if unavailable:
            self._requeue_later(unavailable)

    def _prepare(self, queue: str, message: Any, error: BaseException | None) -> _Item:
        item = _Item(queue, message)
        try:
            envelope = from_kombu(message, queue)
            item.key = self.key_strategy(envelope)
            item.fingerprint = self.fingerprint(envelope) if self.fingerprint else None
        except Exception as exc:
            item.decision = poison(exc)
            return item
        try:
            if error is not None:
                raise error
            body = message.decode()
        except Exception as exc:
            item.decision = poison(UndecodableMessage(f"cannot decode body ({message.content_type}): "
                                                      f"{type(exc).__name__}: {exc}"))
            return item

        def call() -> Any:
            if self.should_stop:
                raise _Stopping("consumer is stopping")
            return self.handler(body, message)

        item.call = call
        return item

    def _settle(self, item: _Item) -> None:
        decision, message = item.decision, item.message
        assert decision is not None
        action = decision.action
        if action is Action.ACK:
            message.ack()
            log.debug("acked key=%s token=%s reason=%s", _short(item.key), _token(decision),
                      decision.reason.value)
            if decision.reason is Reason.APPLIED:
                self.on_applied(message, decision)
            else:
                self.on_duplicate(message, decision)
        elif action is Action.DEFER:
            self._defer(item, decision)
        elif action is Action.RETRY:
            if isinstance(decision.error, _Stopping):
                message.requeue()
            else:
                self._retry(item, decision)
        else:
            handler_ran = decision.reason in (Reason.PERMANENT_FAILURE, Reason.UNSERIALIZABLE_RESULT)
            self._dead_letter(item, decision, _int_header(message, ATTEMPTS) + int(handler_ran))

    def _defer(self, item: _Item, decision: Decision) -> None:
        deferrals = _int_header(item.message, DEFERRALS) + 1
        delay = backoff(deferrals, base=self.defer_base, cap=self.defer_cap, floor=decision.retry_after)
        headers = {**item.message.headers, DEFERRALS: str(deferrals)}
        if not self._copy(item, decision, delay_queue(item.queue), headers, delay):
            return
        log.info("deferred key=%s token=%s reason=%s for %.2fs", _short(item.key), _token(decision),
                 decision.reason.value, delay)
        if decision.reason is Reason.LEASE_LOST:
            self.on_lease_lost(item.message, decision)
        self.on_deferred(item.message, decision, delay)

    def _retry(self, item: _Item, decision: Decision) -> None:
        attempts = _int_header(item.message, ATTEMPTS) + 1
        if attempts >= self.max_attempts:
            self._dead_letter(item, decision, attempts)
            return
        delay = backoff(attempts, base=self.retry_base, cap=self.retry_cap)
        headers = {**item.message.headers, ATTEMPTS: str(attempts)}
        if self._copy(item, decision, delay_queue(item.queue), headers, delay):
            log.warning("handler failed key=%s token=%s attempt %d/%d, retry in %.2fs: %s", _short(item.key),
                        _token(decision), attempts, self.max_attempts, delay, decision.detail)

    def _dead_letter(self, item: _Item, decision: Decision, attempts: int) -> None:
        info = item.message.delivery_info or {}
        headers = {k: v for k, v in item.message.headers.items() if k != DEFERRALS}
        headers.update(dead_letter_headers(
            decision, key=item.key, attempts=attempts, original_queue=item.queue,
            original_exchange=info.get("exchange") or "", original_routing_key=info.get("routing_key") or "",
        ))
        if self._copy(item, decision, dlq(item.queue), headers, None):
            log.error("dead-lettered key=%s token=%s reason=%s attempts=%d: %s", _short(item.key),
                      _token(decision),
                      decision.reason.value, attempts, decision.detail)
            self.on_dead_letter(item.message, decision)

    def _copy(self, item: _Item, decision: Decision, queue: str, headers: dict[str, Any],
              expiration: float | None) -> bool:
        """Publish a confirmed copy, then ack the original; on a nack or return, requeue it
        after a pause instead (and redeclare the queues)."""
        assert self._publisher is not None
        try:
            self._publisher.publish(item.message, queue, headers, expiration)
        except PublishFailed as exc:
            log.error("could not copy key=%s token=%s to %s, requeueing: %s", _short(item.key),
                      _token(decision),
                      queue, exc)
            self._pause(backoff(1, base=1.0, floor=0.5))
            self._publisher.declare(item.queue)
            item.message.requeue()
            return False
        item.message.ack()
        return True

    def _requeue_later(self, items: Sequence[_Item]) -> None:
        """Redis is unreachable: hold the messages for a backoff pause, then requeue them."""
        first = items[0].decision
        assert first is not None
        delay = min(self.outage_cap, backoff(self._outages, base=0.25, cap=self.outage_cap,
                                             floor=min(first.retry_after, self.outage_cap)))
        log.warning("Redis unavailable (%s); requeueing %d message(s) after %.2fs", first.detail,
                    len(items), delay)
        self._pause(delay)
        for item in items:
            item.message.requeue()
            assert item.decision is not None
            log.info("requeued key=%s token=%s reason=store_unavailable", _short(item.key),
                     _token(item.decision))
            self.on_deferred(item.message, item.decision, delay)

    def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.should_stop and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.1, left))


def _noop() -> None:
    return None
